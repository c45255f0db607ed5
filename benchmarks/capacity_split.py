"""Where the capacity load's time goes: each server's CPU per request beside the raw loop's.

The suite's capacity load (4 client processes x 8 requests in flight, 1-second windows) is
run against four servers, each in its own process, in interleaved rounds so that drift in
machine load hits all alike:

* ``raw``: the suite's raw ROUTER loop (decode, answer, nothing else);
* ``echo``: the broker's shell (``serve --no-state``) with a bare msgpack echo in place of its
  request core (a hello still opens a real session);
* ``core``: the broker, ``--no-state``;
* ``broker``: the broker with its journal, as the suite runs it.

For each it prints the median rate, the median of its ratio to ``raw`` in the same round,
and the CPU per request of the server's main thread and of its ZeroMQ I/O thread (read from
``/proc``).  The client processes are the same in every case, so the differences between the
rows are what each layer adds.

    python benchmarks/capacity_split.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

_ECHO_FLAG = "--serve-with-echo-core"
SERVERS = ["raw", "echo", "core", "broker"]


def _thread_cpu_s(pid: int) -> tuple[float, float]:
    """(main threads, ZeroMQ I/O threads) CPU seconds of process ``pid`` so far."""
    from harness import cpu_s_by_thread

    main = io = 0.0
    for name, cpu_s in cpu_s_by_thread(pid).items():
        if name.startswith("ZMQbg/IO"):
            io += cpu_s
        elif not name.startswith("ZMQbg"):
            main += cpu_s
    return main, io


def _serve_with_echo_core(argv: list[str]) -> int:
    """``kvcached-broker serve`` whose request core answers everything but hello with an echo.

    ``argv`` is the launcher's whole command after this script's flag; the broker's own
    arguments follow its module name."""
    import msgpack

    from kvcached_broker.broker import cli
    from kvcached_broker.broker.server import BrokerServer

    class EchoCore:
        """The server's request core with ``handle`` replaced (a compiled core cannot be patched)."""

        def __init__(self, core):
            self._core = core

        def __getattr__(self, name):
            return getattr(self._core, name)

        def handle(self, rid, peer, body, now):
            message = msgpack.unpackb(body)
            if message.get("op") == "hello":
                return self._core.handle(rid, peer, body, now)
            return msgpack.packb({"type": "reply", "id": message["id"], "ok": True, "result": {"granted": 1}})

    real_init = BrokerServer.__init__

    def init_with_echo(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.core = EchoCore(self.core)

    BrokerServer.__init__ = init_with_echo
    return cli.main(argv[argv.index("kvcached_broker.broker.cli") + 1 :])


def _start(server: str, workdir: Path, stack: ExitStack) -> tuple[str, int, bool]:
    """Start ``server``; returns its endpoint, its pid and whether clients open sessions."""
    from harness import raw_router

    from kvcached_broker.tools.launch import BrokerLauncher

    if server == "raw":
        endpoint, proc = stack.enter_context(raw_router(workdir))
        return endpoint, proc.pid, False
    launcher = BrokerLauncher(
        f"ipc://{workdir}/{server}.sock",
        state_dir=workdir / "state" if server == "broker" else None,
        args=["--log-level", "warning"],
        prefix=[sys.executable, __file__, _ECHO_FLAG] if server == "echo" else (),
    )
    stack.enter_context(launcher)
    assert launcher.proc is not None
    return launcher.endpoint, launcher.proc.pid, True


def main() -> int:
    if sys.argv[1:2] == [_ECHO_FLAG]:
        return _serve_with_echo_core(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from harness import pipelined_rate

    rows: dict[str, list[tuple[float, float, float]]] = {s: [] for s in SERVERS}
    with tempfile.TemporaryDirectory(prefix="kb-capacity-split-") as tmp, ExitStack() as stack:
        servers = {s: _start(s, Path(tmp), stack) for s in SERVERS}
        for _ in range(args.rounds):
            for server, (endpoint, pid, session) in servers.items():
                main_before, io_before = _thread_cpu_s(pid)
                rate = pipelined_rate(endpoint, processes=4, in_flight_each=8, seconds=1.0, session=session)
                main_after, io_after = _thread_cpu_s(pid)
                # Windows are 1 s: CPU per request is CPU over the window's requests.
                rows[server].append((rate, (main_after - main_before) / rate * 1e6, (io_after - io_before) / rate * 1e6))
    print(f"{'server':8s} {'req/s':>8s} {'x raw':>6s} {'main CPU/req':>13s} {'I/O CPU/req':>12s}")
    for server in SERVERS:
        ratio = statistics.median(r[0] / raw[0] for r, raw in zip(rows[server], rows["raw"]))
        print(f"{server:8s} {statistics.median(r[0] for r in rows[server]):8.0f} {ratio:6.2f} "
              f"{statistics.median(r[1] for r in rows[server]):10.2f} us {statistics.median(r[2] for r in rows[server]):9.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
