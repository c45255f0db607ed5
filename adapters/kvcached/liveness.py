"""Which process wrote a shared record, and whether it still runs, across PID namespaces.

A record in ``/dev/shm`` names its writer by :class:`ProcessIdentity`: its pid, its start time
(``/proc/PID/stat`` field 22, clock ticks since boot) and the inode of its PID namespace
(``/proc/self/ns/pid``).  ``/dev/shm`` may be shared by processes of different PID namespaces
(containers run with ``--ipc=host``), where the same pid names different processes, so a pid
is judged here only when it means something here:

* :func:`judge` says True (it runs: that pid runs *and* started at that time, so a recycled pid is
  not it), False (it is gone), or None: it cannot tell, because the writer's PID namespace is not
  this process's, or because ``/proc`` is not this namespace's (a process moved into a new PID
  namespace without its own ``/proc`` mount reads the parent's);
* :func:`alive` is "not known to be gone": a record is cleaned up only when its writer is
  known dead, never because its pid means nothing here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...client.procfs import running_start_ticks


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_ticks: int
    pidns: int  # inode of the writer's PID namespace (0: unknown)


def start_ticks(pid: int | str) -> int | None:
    """When ``pid`` (or ``"self"``) started; None if it does not run (``client.procfs``)."""
    return running_start_ticks(pid)


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 if ``/proc`` cannot say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def proc_is_this_namespaces() -> bool:
    """True if ``/proc`` shows this PID namespace (``/proc/self`` is this process's own pid)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def own() -> ProcessIdentity:
    """This process, as its records name it."""
    return ProcessIdentity(os.getpid(), start_ticks("self") or 0, pid_namespace())


def judge(who: ProcessIdentity) -> bool | None:
    """True if ``who`` runs, False if it is gone, None if that cannot be told from here."""
    if who.pid <= 0:
        return False
    if who.pidns == 0 or who.pidns != pid_namespace() or not proc_is_this_namespaces():
        return None
    return start_ticks(who.pid) == who.start_ticks


def alive(who: ProcessIdentity) -> bool:
    """True unless ``who`` is known to be gone (an empty record, pid 0, is gone)."""
    return judge(who) is not False
