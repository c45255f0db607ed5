#!/usr/bin/env python3
"""Fetch kvcached 0.1.6's Python package for CPU tests: no CUDA build, hash-checked, never committed.

    fetch-kvcached.py [--force] ENVS_DIR

``pip install kvcached`` compiles a CUDA extension and fails on a machine without a GPU
toolchain (even ``pip download`` fails, at the metadata step).  The tests need only its Python
code, with ``kvcached.vmm_ops`` replaced by a test double (tests/kvcached/vmm_ops_double.py).
So this script:

1. reads the package index from pip's own configuration (``PIP_INDEX_URL``, then
   ``pip config list``'s ``index-url``, then the default), trying the extra indexes after it;
2. downloads ``kvcached-0.1.6.tar.gz`` and checks its sha256 against the pin below (a
   mismatch is an error: nothing is unpacked);
3. unpacks only the ``kvcached/`` package (no setup.py, no csrc) into
   ``ENVS_DIR/kvcached-0.1.6/`` with a minimal ``dist-info`` so ``importlib.metadata`` reports
   its version;
4. installs its pure-Python-API dependencies (numpy, posix_ipc, wrapt) at pinned versions
   with ``pip install --no-deps --only-binary=:all: --target`` beside it;
5. writes ``ENVS_DIR/kvcached-0.1.6.env`` (``PYTHONPATH``), as scripts/adapter-envs.sh does
   for the runtime overlays.

Idempotent: a complete overlay (its stamp matches the pins) is left alone in milliseconds.
"""

from __future__ import annotations

import hashlib
import html.parser
import io
import os
import shutil
import ssl
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

NAME = "kvcached"
VERSION = "0.1.6"
SDIST = f"{NAME}-{VERSION}.tar.gz"
SDIST_SHA256 = "4a1a428244b5e3667841e28f03a4a20be7066a21a856b2deaef727e18f845068"
#: kvcached's runtime requirements (numpy>=1.26, posix_ipc>=1.0, wrapt>=1.15), pinned
DEPENDENCY_PINS = ("numpy==2.4.6", "posix_ipc==1.3.2", "wrapt==1.17.3")
DEFAULT_INDEX = "https://pypi.org/simple"
OVERLAY = f"{NAME}-{VERSION}"


def log(message: str) -> None:
    print(f"[fetch-kvcached] {message}", file=sys.stderr)


# ------------------------------------------------------------------ pip's configuration
def pip_config() -> dict[str, str]:
    """``pip config list`` as ``{key: value}`` (keys like ``global.index-url``); {} if it fails."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                             text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    config = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            config[key.strip()] = value.strip().strip("'\"")
    return config


def _setting(config: dict[str, str], option: str) -> str | None:
    """An option as pip resolves it: the environment first, then install., then global. keys."""
    env = os.environ.get("PIP_" + option.upper().replace("-", "_"))
    if env:
        return env
    for scope in (":env:", "install", "global"):
        value = config.get(f"{scope}.{option}")
        if value:
            return value
    return None


def index_urls(config: dict[str, str]) -> list[str]:
    """The index pip would use, then its extra indexes, in order."""
    urls = [_setting(config, "index-url") or DEFAULT_INDEX]
    extra = _setting(config, "extra-index-url") or ""
    urls += [u for u in extra.split() if u]
    return urls


def ssl_context(config: dict[str, str]) -> ssl.SSLContext:
    cafile = _setting(config, "cert")
    return ssl.create_default_context(cafile=cafile if cafile and os.path.exists(cafile) else None)


# ------------------------------------------------------------------ the simple index
class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.hrefs.append(href)


def _read(url: str, context: ssl.SSLContext, timeout_s: float = 120.0) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": "text/html", "User-Agent": "kvcached-broker-fetch"})
    with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
        return response.read()


def sdist_url(index: str, context: ssl.SSLContext) -> str | None:
    """The sdist's URL on ``index`` (a PEP 503 simple index), or None if it is not there."""
    page = index.rstrip("/") + f"/{NAME}/"
    try:
        body = _read(page, context).decode("utf-8", "replace")
    except (OSError, ValueError) as exc:
        log(f"{page}: {exc}")
        return None
    parser = _Links()
    parser.feed(body)
    for href in parser.hrefs:
        url = urllib.parse.urljoin(page, href)
        if urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1] == SDIST:
            return url.split("#", 1)[0]
    return None


def download_sdist(config: dict[str, str]) -> bytes:
    context = ssl_context(config)
    for index in index_urls(config):
        url = sdist_url(index, context)
        if url is None:
            continue
        log(f"downloading {SDIST} from {urllib.parse.urlsplit(url).netloc or url}")
        data = _read(url, context)
        digest = hashlib.sha256(data).hexdigest()
        if digest != SDIST_SHA256:
            raise SystemExit(f"fetch-kvcached: {SDIST} has sha256 {digest}, pinned {SDIST_SHA256}: refusing it")
        return data
    raise SystemExit(f"fetch-kvcached: no index in pip's configuration has {SDIST} ({', '.join(index_urls(config))})")


# ------------------------------------------------------------------ the overlay
def unpack_package(sdist: bytes, target: Path) -> int:
    """Extract ``kvcached-0.1.6/kvcached/**`` (regular files only) under ``target``; the file count."""
    prefix = f"{OVERLAY}/{NAME}/"
    count = 0
    with tarfile.open(fileobj=io.BytesIO(sdist), mode="r:gz") as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.startswith(prefix):
                continue
            relative = Path(member.name[len(OVERLAY) + 1:])
            if relative.is_absolute() or ".." in relative.parts:
                raise SystemExit(f"fetch-kvcached: unsafe path in {SDIST}: {member.name}")
            out = target / relative
            out.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None
            out.write_bytes(source.read())
            count += 1
    dist_info = target / f"{NAME}-{VERSION}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n")
    (dist_info / "INSTALLER").write_text("kvcached-broker/scripts/fetch-kvcached.py\n")
    return count


def install_dependencies(target: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "install", "-q",
                    "--no-deps", "--only-binary=:all:", "--target", str(target), *DEPENDENCY_PINS], check=True)


def stamp() -> str:
    return hashlib.sha256("\n".join([SDIST_SHA256, *DEPENDENCY_PINS]).encode()).hexdigest()


def write_env(envs: Path, target: Path) -> None:
    (envs / f"{OVERLAY}.env").write_text(
        f"# source me; then run the base python (kvcached's Python code; kvcached.vmm_ops is a test double)\n"
        f'export PYTHONPATH="{target}"\n')


def main(argv: list[str]) -> int:
    force = "--force" in argv
    args = [a for a in argv if a != "--force"]
    if len(args) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    envs = Path(args[0]).resolve()
    target = envs / OVERLAY
    complete = target / ".complete"
    if not force and complete.exists() and complete.read_text().strip() == stamp():
        write_env(envs, target)
        log(f"{OVERLAY}: up to date")
        return 0
    sdist = download_sdist(pip_config())
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    files = unpack_package(sdist, target)
    install_dependencies(target)
    write_env(envs, target)
    complete.write_text(stamp() + "\n")
    log(f"{OVERLAY}: {files} files of kvcached's package and {len(DEPENDENCY_PINS)} pinned dependencies in {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
