"""Knowing when a worker process has died.

A pidfd (``pidfd_open(2)``) becomes readable when its process exits and has no pid-reuse
race; the broker's wake-up thread (``wakeups``) waits on them and posts each exit to the
broker's socket, so a SIGKILLed worker's memory is reclaimed in the round after its death.  Across a broker
restart, pids are matched with their start time (``/proc/PID/stat`` field 22) so a recycled
pid is not mistaken for the worker that held the memory.
"""

from __future__ import annotations

import os


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 overall; fields[0] here is field 3
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start_ticks: int | None) -> bool:
    """Is ``pid`` still the process that started at ``start_ticks``?"""
    current = process_start_ticks(pid)
    if current is None:
        return False
    return start_ticks is None or current == start_ticks


class PidWatcher:
    """Holds one pidfd per watched pid; the caller polls the fds :meth:`watch` returns for readability."""

    def __init__(self) -> None:
        self._fd_by_pid: dict[int, int] = {}
        self._pid_by_fd: dict[int, int] = {}

    def watch(self, pid: int) -> int | None:
        """Start watching ``pid``; returns its new fd, or None if already watched.

        Raises ``ProcessLookupError`` if the process is already gone.
        """
        if pid in self._fd_by_pid:
            return None
        fd = os.pidfd_open(pid)
        os.set_inheritable(fd, False)
        self._fd_by_pid[pid] = fd
        self._pid_by_fd[fd] = pid
        return fd

    def unwatch(self, pid: int) -> int | None:
        """Stop watching; returns the fd that was closed (to unregister from a poller)."""
        fd = self._fd_by_pid.pop(pid, None)
        if fd is not None:
            del self._pid_by_fd[fd]
            os.close(fd)
        return fd

    def pid_of(self, fd: int) -> int | None:
        return self._pid_by_fd.get(fd)

    def close(self) -> None:
        for pid in list(self._fd_by_pid):
            self.unwatch(pid)
