"""What the broker shell's socket set-up costs a ping-pong, before any request logic.

A stripped Python ROUTER that only decodes and answers (the suite's raw loop) is measured
next to the same loop with one of the broker shell's choices added, and with all of them:

* ``opts``: ROUTER_MANDATORY, MAXMSGSIZE, LINGER 0 and the broker's high-water marks;
* ``timeo``: a receive timeout (the shell's blocking ``recv`` wakes for its timers);
* ``frame``: the body received as a ``Frame`` (its properties carry the peer's credentials),
  then ``ZMQ_EVENTS`` asked, as the shell did after every round's first message (it now asks
  only when that round's receive did not wait, or the round before was a batch);
* ``write``: one ``write()`` of a journal record per round;
* ``rawsend``: replies through pyzmq's compiled ``Socket.send``;
* ``inproc``: a second, idle pipe into the ROUTER (the wake-up thread's ``inproc`` DEALER).

Each variant runs in its own process; the rounds interleave the variants so drift in machine
load hits all alike, and the figures are medians over rounds, as ratios to the plain loop
measured in the same round.  Server CPU per request is read from ``/proc`` (every thread of
the server process, its ZeroMQ I/O thread included).

    python benchmarks/shell_costs.py [--rounds 5] [--requests 20000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import msgpack
import zmq
from harness import cpu_s_by_thread

ALL = "opts+timeo+frame+write+rawsend+inproc"
VARIANTS = ["plain", "opts", "timeo", "frame", "write", "rawsend", "inproc", ALL]


def _serve(endpoint: str, ready, variant: str, journal_path: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    if "opts" in variant:
        for option, value in ((zmq.ROUTER_MANDATORY, 1), (zmq.MAXMSGSIZE, 1 << 20), (zmq.LINGER, 0),
                              (zmq.SNDHWM, 100_000), (zmq.RCVHWM, 100_000)):
            sock.setsockopt(option, value)
    if "timeo" in variant:
        sock.setsockopt(zmq.RCVTIMEO, 100)
    sock.bind(endpoint)
    if "inproc" in variant:
        sock.bind("inproc://wakeups")
        waker = ctx.socket(zmq.DEALER)
        waker.connect("inproc://wakeups")
    fd = os.open(journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND) if "write" in variant else None
    raw_send = zmq.backend.Socket.send
    ready.set()
    while True:
        try:
            rid = sock.recv()
        except zmq.Again:
            continue
        if "frame" in variant:
            body = msgpack.unpackb(sock.recv(zmq.NOBLOCK, copy=False).bytes)
            sock.get(zmq.EVENTS)
        else:
            body = msgpack.unpackb(sock.recv())
        if fd is not None:
            os.write(fd, b"r" * 60)
        reply = msgpack.packb({"type": "reply", "id": body["id"], "ok": True, "result": {"granted": 1}})
        if "rawsend" in variant:
            raw_send(sock, rid, zmq.SNDMORE | zmq.NOBLOCK)
            raw_send(sock, reply, zmq.NOBLOCK)
        else:
            sock.send(rid, zmq.SNDMORE)
            sock.send(reply)
        if body.get("op") == "stop":
            return


def _cpu_s(pid: int) -> float:
    return sum(cpu_s_by_thread(pid).values())


def measure(variant: str, requests: int, workdir: str) -> tuple[float, float]:
    """(round trip in µs, server CPU per request in µs) for one variant."""
    endpoint = f"ipc://{workdir}/{variant}.sock"
    ready = mp.Event()
    proc = mp.Process(target=_serve, args=(endpoint, ready, variant, f"{workdir}/{variant}.journal"), daemon=True)
    proc.start()
    ready.wait(10)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    frames = [msgpack.packb({"op": "acquire", "id": i}) for i in range(requests)]
    for frame in frames[:500]:  # connected and warm
        sock.send(frame)
        sock.recv()
    cpu_before, started = _cpu_s(proc.pid), time.perf_counter()
    for frame in frames:
        sock.send(frame)
        sock.recv()
    elapsed, cpu_after = time.perf_counter() - started, _cpu_s(proc.pid)
    sock.send(msgpack.packb({"op": "stop", "id": 0}))
    sock.recv()
    sock.close(0)
    proc.join(5)
    return elapsed / requests * 1e6, (cpu_after - cpu_before) / requests * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="kb-shell-costs-", dir="/tmp")
    rt: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            round_trip_us, cpu_us = measure(variant, args.requests, workdir)
            rt[variant].append(round_trip_us)
            cpu[variant].append(cpu_us)
    print(f"{'variant':40s} {'round trip':>11s} {'x plain':>8s} {'server CPU/req':>15s} {'x plain':>8s}")
    for variant in VARIANTS:
        rt_ratio = statistics.median(r / p for r, p in zip(rt[variant], rt["plain"]))
        cpu_ratio = statistics.median(c / p for c, p in zip(cpu[variant], cpu["plain"]))
        print(f"{variant:40s} {statistics.median(rt[variant]):8.1f} us {rt_ratio:8.2f} "
              f"{statistics.median(cpu[variant]):12.1f} us {cpu_ratio:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
