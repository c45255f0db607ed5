"""Whether the installed runtimes are releases the adapters support, read before any is imported.

A release outside the supported range (``adapters/support.py``) cannot be patched: its process
would run without the broker.  The version comes from the distribution's metadata
(``importlib.metadata``), so the startup hook (:mod:`.autopatch`) decides at interpreter start,
before the runtime is imported: with ``KVCACHED_REQUIRE=1`` the start stops (status 78, one
line); without it the process says once that it is unprotected, naming the release and the
supported range, and none of that runtime's patches is registered.

Where both serving runtimes are installed and one of them is supported, the other is checked when
it is imported instead: a process that serves with the supported one is not stopped for the other.
kvcached matters only where kvcached mode is on (``ENABLE_KVCACHED``, which kvcached itself reads).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import flags, support
from .patching import PatchError
from .versions import installed


class UnsupportedRelease(PatchError):
    """An installed runtime's release is outside the supported range.  One line."""


@dataclass(frozen=True)
class Finding:
    """An installed release the adapters do not support."""

    runtime: support.Runtime
    version: str

    def reason(self) -> str:
        return (f"{self.runtime.label} {self.version} is not a release kvcached-broker supports "
                f"({self.runtime.name} {self.runtime.supported})")


def finding(name: str) -> Finding | None:
    """The installed release of runtime ``name`` if it is unsupported (and matters), else None."""
    runtime = support.runtime(name)
    version = installed(runtime.name)
    if version is None or runtime.supports(version):
        return None
    if name == "kvcached" and not flags.kvcached_switch():
        return None  # kvcached's own integration is off: its release does not matter
    return Finding(runtime, version)


def at_import(found: Finding) -> bool:
    """True if ``found`` is judged when its runtime is imported, not at interpreter start: the
    other serving runtime is installed too, at a supported release."""
    if found.runtime.name not in support.SERVING:
        return False
    others = [support.runtime(name) for name in support.SERVING if name != found.runtime.name]
    return any(other.supports(installed(other.name)) for other in others)
