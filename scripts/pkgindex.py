"""Download one pinned file from the package index in pip's configuration (standard library only).

Shared by scripts/fetch-kvcached.py and scripts/upstream-tests.py, which fetch sdists that pip
itself cannot install here (kvcached's builds a CUDA extension; vLLM's carries the tests the
wheels leave out).  The index is the one pip would use: ``PIP_INDEX_URL``, then ``pip config
list``'s ``index-url``, then the default; the extra indexes are tried after it.  A download
whose sha256 is not the pin is refused.
"""

from __future__ import annotations

import hashlib
import html.parser
import os
import ssl
import subprocess
import sys
import urllib.parse
import urllib.request

DEFAULT_INDEX = "https://pypi.org/simple"


class FetchError(RuntimeError):
    """The file is in no configured index, cannot be read, or is not the pinned one."""


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


def setting(config: dict[str, str], option: str) -> str | None:
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
    urls = [setting(config, "index-url") or DEFAULT_INDEX]
    extra = setting(config, "extra-index-url") or ""
    urls += [u for u in extra.split() if u]
    return urls


def ssl_context(config: dict[str, str]) -> ssl.SSLContext:
    cafile = setting(config, "cert")
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


def read(url: str, context: ssl.SSLContext, timeout_s: float = 120.0) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": "text/html", "User-Agent": "kvcached-broker-fetch"})
    with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
        return response.read()


def file_url(index: str, project: str, filename: str, context: ssl.SSLContext) -> str | None:
    """``filename``'s URL on ``index`` (a PEP 503 simple index), or None if it is not there;
    FetchError if the index cannot be read."""
    page = index.rstrip("/") + f"/{project}/"
    try:
        body = read(page, context).decode("utf-8", "replace")
    except (OSError, ValueError) as exc:
        raise FetchError(f"{page}: {exc}") from exc
    parser = _Links()
    parser.feed(body)
    for href in parser.hrefs:
        url = urllib.parse.urljoin(page, href)
        if urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1] == filename:
            return url.split("#", 1)[0]
    return None


def download(project: str, filename: str, sha256: str, config: dict[str, str] | None = None,
             log=lambda message: None) -> bytes:
    """``filename`` of ``project`` from the first configured index that has it, checked against
    ``sha256``; raises FetchError (one line) if no index has it, it cannot be read, or its hash differs."""
    data = download_unpinned(project, filename, config, log=log)
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise FetchError(f"{filename} has sha256 {digest}, pinned {sha256}: refusing it")
    return data


def download_unpinned(project: str, filename: str, config: dict[str, str] | None = None,
                      log=lambda message: None) -> bytes:
    """``filename`` of ``project`` from the first configured index that has it, *unchecked*: only
    for files that are read, never installed or run (scripts/canary.py parses the newest release's
    source with ``ast``, a release no pin can name in advance), or checked by :func:`download`.
    FetchError (one line) if no index has it or it cannot be read."""
    config = pip_config() if config is None else config
    context = ssl_context(config)
    indexes = index_urls(config)
    unread = []
    for index in indexes:
        try:
            url = file_url(index, project, filename, context)
        except FetchError as exc:
            unread.append(str(exc))
            continue
        if url is None:
            continue
        log(f"downloading {filename} from {urllib.parse.urlsplit(url).netloc or url}")
        try:
            return read(url, context, timeout_s=600.0)
        except (OSError, ValueError) as exc:
            raise FetchError(f"cannot download {url}: {exc}") from exc
    why = f"; unreadable: {'; '.join(unread)}" if unread else ""
    raise FetchError(f"no index in pip's configuration has {filename} (tried {', '.join(indexes)}{why})")
