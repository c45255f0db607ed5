"""How sessions end, and the processes behind them (no I/O of its own).

Every way a session ends (its worker closed it, its process exited, an operator evicted it,
its process died while the broker was down) goes through :meth:`SessionLifecycle.end`: the
ledger frees what it held, pressure forgets it, limits its own worker asked for leave with
its instance, the table drops it, and its pid stops being watched once no session needs it.

Process checks, kills and pid watches are what a request layer must not do itself; they go
through :class:`ProcessOps`, which the server implements with ``/proc`` and pidfds and a test
can implement with a dict.
"""

from __future__ import annotations

import logging
from typing import Protocol

from .counters import Counters
from .ledger import Ledger
from .policy import PressureBook
from .sessions import Binding, SessionTable

log = logging.getLogger("kvcached_broker")


class ProcessOps(Protocol):
    def start_ticks(self, pid: int) -> int | None:
        """The process's start time (to tell a recycled pid apart), or None if it is gone."""

    def alive(self, pid: int, start_ticks: int | None) -> bool:
        """Whether ``pid`` is still the process that started at ``start_ticks``."""

    def kill(self, pid: int) -> None:
        """SIGKILL ``pid``; raises ``OSError`` if it cannot."""

    def watch(self, pid: int) -> bool:
        """Report ``pid``'s exit from now on (the server calls :meth:`SessionLifecycle.reclaim_pid`);
        False if it has exited already."""

    def unwatch(self, pid: int) -> None: ...


class SessionLifecycle:
    def __init__(self, ledger: Ledger, table: SessionTable, pressure: PressureBook, processes: ProcessOps,
                 counters: Counters):
        self.ledger = ledger
        self.table = table
        self.pressure = pressure
        self.processes = processes
        self.counters = counters

    def watch(self, pid: int) -> None:
        """Watch a verified pid; a process already gone is reclaimed at once."""
        if not self.processes.watch(pid):
            self.reclaim_pid(pid)

    def end(self, binding: Binding, cause: str) -> int:
        """End a session; returns the bytes it freed."""
        ledger = self.ledger
        freed = ledger.sessions[binding.session_id].reported_bytes
        session = ledger.close_session(binding.session_id)
        self.pressure.on_close(binding.session_id)
        limits = ledger.limits.get(session.instance)
        if limits is not None and limits.source == "hello" and session.instance not in ledger.instance_names():
            ledger.forget_limits(session.instance)  # asked for at hello: they leave with the instance
        self.table.remove(binding.session_id)
        if binding.pid_verified and not self.table.count_for_pid(binding.pid):
            self.processes.unwatch(binding.pid)
        self.counters.reclaimed(cause)
        log.info(
            "event=session_end cause=%s session=%s instance=%s pid=%d freed_bytes=%d",
            cause, session.id, session.instance, session.pid, freed,
        )
        return freed

    def reclaim_pid(self, pid: int) -> None:
        """The process exited: end every session it held, in this round."""
        for session_id in self.table.session_ids_of_pid(pid):
            binding = self.table.by_id(session_id)
            if binding is not None:
                self.end(binding, cause="exited")
        self.processes.unwatch(pid)
