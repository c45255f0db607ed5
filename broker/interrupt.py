"""Ctrl-C as a latch a loop polls, for ``status --watch`` and other redraw loops.

A Python signal handler runs in the main thread between two bytecodes, so it must not take a lock
the main thread may be holding at that instant. ``threading.Event`` breaks that rule: ``wait``
holds the event's lock for a few bytecodes around its sleep, and a handler calling ``set`` there
waits on that lock forever (seen once in CI: ``status --watch`` never exited after Ctrl-C).

:class:`InterruptLatch` takes no lock. The handler sets a flag and writes one byte to a pipe;
:meth:`InterruptLatch.wait` sleeps in ``select`` on the pipe's other end, so a signal that lands
at any point of ``wait`` either is seen by the flag's check or wakes the ``select``.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from types import FrameType
from typing import Iterator


class InterruptLatch:
    """Set once by :meth:`trip` (a signal handler, or any thread); never cleared.

    Invariant: after :meth:`trip` returns, :meth:`is_set` is true and every :meth:`wait`, begun
    before or after, returns within one scheduling delay.
    """

    def __init__(self) -> None:
        self._tripped = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def trip(self, signum: int = 0, frame: FrameType | None = None) -> None:
        """Set the latch (signal-safe: no lock, no allocation beyond one ``os.write``)."""
        self._tripped = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # closed, or the pipe is full and a wake-up is already pending
            pass

    def is_set(self) -> bool:
        return self._tripped

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s`` seconds, or until tripped; return :meth:`is_set`."""
        if not self._tripped:
            select.select([self._wake_r], [], [], max(0.0, timeout_s))
        return self._tripped

    def close(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


@contextlib.contextmanager
def stopped_by_interrupt() -> Iterator[InterruptLatch]:
    """A latch Ctrl-C (SIGINT) trips, in place of a ``KeyboardInterrupt`` that could land in the
    middle of a broker round trip or a socket's close and leave the process unable to exit: the
    round in progress finishes (bounded by its timeout), then the caller's loop ends.

    Outside the main thread (an embedder) no handler is installed: Ctrl-C is the caller's.
    """
    latch = InterruptLatch()
    try:
        try:
            previous = signal.signal(signal.SIGINT, latch.trip)
        except ValueError:  # not the main thread
            yield latch
            return
        try:
            yield latch
        finally:
            signal.signal(signal.SIGINT, previous)
    finally:
        latch.close()
