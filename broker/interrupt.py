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
import time
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
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def trip(self, signum: int = 0, frame: FrameType | None = None) -> None:
        """Set the latch (signal-safe: no lock, no allocation beyond one ``os.write``)."""
        self._tripped = True
        wake_w = self._wake_w
        if wake_w < 0:  # closed: never write to an fd number reused since
            return
        try:
            os.write(wake_w, b"x")
        except OSError:  # the pipe is full: a wake-up is already pending
            pass

    @property
    def wake_fd(self) -> int:
        """The pipe's write end (``signal.set_wakeup_fd``); -1 once closed."""
        return self._wake_w

    def is_set(self) -> bool:
        return self._tripped

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s`` seconds, or until tripped; return :meth:`is_set`.

        A byte in the pipe without a trip (the wake-up fd, for a signal whose handler has not
        run yet or is another's) is drained and the sleep goes on: :meth:`trip` sets the flag
        before it writes, so no trip is lost with it."""
        deadline_s = time.monotonic() + max(0.0, timeout_s)
        while not self._tripped and self._wake_r >= 0:
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                break
            readable, _, _ = select.select([self._wake_r], [], [], left_s)
            if readable and not self._tripped:
                try:
                    os.read(self._wake_r, 512)
                except OSError:  # drained already (it is non-blocking)
                    pass
        return self._tripped

    def close(self) -> None:
        """Close the pipe (once: the fd numbers are forgotten, so a late trip writes nowhere)."""
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)


@contextlib.contextmanager
def stopped_by_interrupt() -> Iterator[InterruptLatch]:
    """A latch Ctrl-C (SIGINT) trips, in place of a ``KeyboardInterrupt`` that could land in the
    middle of a broker round trip or a socket's close and leave the process unable to exit: the
    round in progress finishes (bounded by its timeout), then the caller's loop ends.

    The pipe is also the process's wake-up fd (``signal.set_wakeup_fd``): a SIGINT the kernel
    delivers to another thread still ends the main thread's ``select`` at once, before the
    handler itself runs there.  Both are restored on exit (a handler installed from C, which
    Python cannot restore, becomes the default one).  Outside the main thread (an embedder)
    nothing is installed: Ctrl-C is the caller's.
    """
    latch = InterruptLatch()
    try:
        try:
            previous = signal.signal(signal.SIGINT, latch.trip)
        except ValueError:  # not the main thread
            yield latch
            return
        previous_wake_fd = signal.set_wakeup_fd(latch.wake_fd, warn_on_full_buffer=False)
        try:
            yield latch
        finally:
            signal.set_wakeup_fd(previous_wake_fd)
            signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
    finally:
        latch.close()
