"""The Ctrl-C latch of ``status --watch``: a handler landing anywhere in a wait ends it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

from kvcached_broker.broker.interrupt import InterruptLatch, stopped_by_interrupt

# Runs in a child, so that a handler that deadlocks hangs the child, not the test run. A Python
# signal handler runs between two bytecodes of the main thread; the tracer calls the installed
# SIGINT handler at the n-th line or bytecode executed inside ``wait`` (in any frame it calls),
# for every n the wait has, which is where a real Ctrl-C can land (CPython 3.12 gives a tracer
# no bytecode events: lines only there). Those after the sleep are reached only once it times
# out, so the waits are short; the old ``threading.Event`` hung for good at those inside its lock.
CHILD = textwrap.dedent("""
    import signal, sys
    from kvcached_broker.broker.interrupt import stopped_by_interrupt

    def lines_in_wait(stop, fire_at):
        seen = 0
        def local(frame, event, arg):
            nonlocal seen
            frame.f_trace_opcodes = True
            if event in ("line", "opcode"):
                seen += 1
                if seen == fire_at:
                    signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)
            return local
        def every_opcode(frame, event, arg):
            frame.f_trace_opcodes = True
            return local
        sys.settrace(every_opcode)
        try:
            woke = stop.wait(0 if fire_at == 0 else 0.2)
        finally:
            sys.settrace(None)
        return seen, woke

    with stopped_by_interrupt() as stop:
        total, woke = lines_in_wait(stop, 0)
    assert total >= 1 and not woke, (total, woke)
    for n in range(1, total + 1):
        with stopped_by_interrupt() as stop:
            _, woke = lines_in_wait(stop, n)
        assert woke and stop.is_set(), n
    print("steps", total)
""")


def test_a_handler_landing_at_any_line_of_a_wait_never_hangs_it_and_is_seen():
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", CHILD],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"a handler inside wait() hung it; where:\n{err[-4000:]}") from None
    assert proc.returncode == 0, err
    assert out.startswith("steps "), out


def test_a_trip_from_another_thread_wakes_a_wait_in_progress():
    latch = InterruptLatch()
    try:
        waiting = threading.Event()
        tripper = threading.Thread(target=lambda: (waiting.wait(), latch.trip()))
        tripper.start()
        waiting.set()
        assert latch.wait(60) is True  # the trip, not the timeout (that would return False)
        tripper.join()
        assert latch.is_set() and latch.wait(60) is True  # stays set
    finally:
        latch.close()


def test_a_real_sigint_ends_a_wait_and_a_late_trip_writes_nowhere():
    with stopped_by_interrupt() as stop:
        killer = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT))
        killer.start()
        assert stop.wait(60) is True  # the handler ran: no KeyboardInterrupt, no timeout
        killer.join()
    assert stop.wake_fd == -1
    stop.trip()  # after close: nothing is written to an fd number reused since
    stop.close()  # and a second close closes nothing


def test_a_wake_up_byte_without_a_trip_does_not_end_the_wait():
    """The pipe is the wake-up fd: a byte there for another signal is drained, and the wait goes
    on until the trip (it would spin, redrawing at once, if the byte stayed)."""
    latch = InterruptLatch()
    try:
        os.write(latch.wake_fd, b"\x0f")
        assert latch.wait(0.05) is False
        tripper = threading.Thread(target=latch.trip)
        tripper.start()
        assert latch.wait(60) is True
        tripper.join()
    finally:
        latch.close()


def test_the_previous_sigint_handler_and_wake_up_fd_are_restored():
    before = signal.getsignal(signal.SIGINT)
    before_fd = signal.set_wakeup_fd(-1)  # (only set_wakeup_fd reads it: set it back at once)
    signal.set_wakeup_fd(before_fd)
    with stopped_by_interrupt() as stop:
        assert signal.getsignal(signal.SIGINT) == stop.trip
        assert signal.set_wakeup_fd(stop.wake_fd) == stop.wake_fd
    assert signal.getsignal(signal.SIGINT) is before
    assert signal.set_wakeup_fd(before_fd) == before_fd


def test_outside_the_main_thread_no_handler_is_installed():
    seen: list[object] = []

    def body() -> None:
        with stopped_by_interrupt() as stop:
            seen.append(signal.getsignal(signal.SIGINT))
            stop.trip()
            seen.append(stop.wait(600))

    before = signal.getsignal(signal.SIGINT)
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [before, True]
