#!/usr/bin/env python3
"""Fetch kvcached 0.1.6's Python package for CPU tests: no CUDA build, hash-checked, never committed.

    fetch-kvcached.py [--force] ENVS_DIR

``pip install kvcached`` compiles a CUDA extension and fails on a machine without a GPU
toolchain (even ``pip download`` fails, at the metadata step).  The tests need only its Python
code, with ``kvcached.vmm_ops`` replaced by a test double (tools/kvcached_sim/vmm_ops_double.py).
So this script:

1. reads the package index from pip's own configuration (``PIP_INDEX_URL``, then
   ``pip config list``'s ``index-url``, then the default), trying the extra indexes after it
   (scripts/pkgindex.py, shared with scripts/upstream-tests.py);
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
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pkgindex  # scripts/pkgindex.py: the index in pip's configuration, download, sha256

NAME = "kvcached"
VERSION = "0.1.6"
SDIST = f"{NAME}-{VERSION}.tar.gz"
SDIST_SHA256 = "4a1a428244b5e3667841e28f03a4a20be7066a21a856b2deaef727e18f845068"
#: kvcached's runtime requirements (numpy>=1.26, posix_ipc>=1.0, wrapt>=1.15), pinned
DEPENDENCY_PINS = ("numpy==2.4.6", "posix_ipc==1.3.2", "wrapt==1.17.3")
OVERLAY = f"{NAME}-{VERSION}"


def log(message: str) -> None:
    print(f"[fetch-kvcached] {message}", file=sys.stderr)


def download_sdist() -> bytes:
    try:
        return pkgindex.download(NAME, SDIST, SDIST_SHA256, log=log)
    except pkgindex.FetchError as exc:
        raise SystemExit(f"fetch-kvcached: {exc}") from None


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
    sdist = download_sdist()
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
