"""kvcached-broker daemon: one per GPU, owning that GPU's memory budget."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvcached-broker")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"


def request_core_build() -> str:
    """``compiled`` when the request core runs as C extensions (built with mypyc when installed
    with ``KVCACHED_BROKER_COMPILE=1``; docs/design.md), else ``interpreted``."""
    from importlib.machinery import EXTENSION_SUFFIXES

    from . import request_core

    return "compiled" if request_core.__file__.endswith(tuple(EXTENSION_SUFFIXES)) else "interpreted"
