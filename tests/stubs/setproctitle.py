"""Import-only stand-in for setproctitle, for CPU tests of SGLang adapters.

SGLang's scheduler module (``sglang.srt.managers.scheduler``, where the adapter hooks the
model-worker start-up) imports it at module level to name its process; the overlays do not
install it.  Setting a process title is a no-op here.
"""


def setproctitle(title: str) -> None:
    """Do nothing (the real one renames the process)."""


def getproctitle() -> str:
    return ""
