"""Knowing when a worker process has died.

A pidfd (``pidfd_open(2)``) becomes readable when its process exits and has no pid-reuse
race; the broker's wake-up thread (``wakeups``) waits on them and posts each exit to the
broker's socket, so a SIGKILLed worker's memory is reclaimed in the round after its death.  Across a broker
restart, pids are matched with their start time (``client.procfs``) so a recycled pid is not mistaken
for the worker that held the memory, and a zombie counts as gone: its memory is freed.
"""

from __future__ import annotations

import os

from ..client.procfs import running_start_ticks as process_start_ticks


def process_alive(pid: int, start_ticks: int | None) -> bool:
    """Is ``pid`` still the process that started at ``start_ticks`` (running: not a zombie)?"""
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
