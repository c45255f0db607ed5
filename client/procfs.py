"""The one reader of ``/proc/PID/stat``: whether a process runs, and since when.

A process *runs* while it exists and is neither a zombie nor dead (state ``Z`` or ``X``): a
zombie has exited and its memory, GPU memory included, is freed, though its pid stays taken
until its parent reaps it.  The start time (field 22, clock ticks since boot) tells a process
from a later one that reuses its pid.  The broker (liveness across restarts, the simulated
device's usage files) and the adapters (kvcached's shared-memory records) all read it here.
"""

from __future__ import annotations


def running_start_ticks(pid: int | str) -> int | None:
    """When ``pid`` (or ``"self"``) started, in clock ticks since boot; None if it does not run
    (no such process, ``/proc`` unreadable, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):  # fields[0] is field 3, the state
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None
