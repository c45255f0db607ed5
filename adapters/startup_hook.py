"""Whether the ``kvcached_broker_autopatch.pth`` start-up hook ran in this interpreter.

:mod:`.autopatch` records it (:func:`mark_ran`, when the ``.pth`` line calls
``install_from_env``); the ``adapter_active`` line (:mod:`.worker_identity`) shows it.  A module
of its own so that saying it does not import the module that imports every runtime's patches.
"""

from __future__ import annotations

import threading

from . import process_state


class _Ran:
    """Whether the ``.pth`` line ran here (hook wiring: a reset leaves it)."""

    KEPT_ACROSS_RESET = True

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ran = False


def mark_ran() -> bool:
    """Record that the ``.pth`` line ran; True if it had run before (some interpreters process
    site-packages ``.pth`` files twice)."""
    record = process_state.part(_Ran)
    with record.lock:
        ran_before, record.ran = record.ran, True
    return ran_before


def installed() -> bool:
    """True if the ``.pth`` start-up hook ran in this interpreter."""
    return process_state.part(_Ran).ran
