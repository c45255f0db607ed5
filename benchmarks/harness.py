"""Shared pieces of the benchmarks: brokers, raw baselines, percentiles.

Every figure is measured next to its baseline in the same run, so a ratio holds on a noisy
machine even when the absolute microseconds move.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import msgpack
import zmq


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_s_by_thread(pid: int) -> dict[str, float]:
    """CPU seconds (user and system) process ``pid`` has used so far, summed by thread name
    (``ZMQbg/IO/0`` is a ZeroMQ I/O thread; the main thread carries the program's name)."""
    tick_s = 1 / os.sysconf("SC_CLK_TCK")
    by_name: dict[str, float] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            text = f.read()
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        by_name[name] = by_name.get(name, 0.0) + (int(fields[11]) + int(fields[12])) * tick_s
    return by_name


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@contextmanager
def broker(workdir: Path, *extra: str, simulate: str = "80GiB") -> Iterator[tuple[str, subprocess.Popen]]:
    """A real ``kvcached-broker serve --simulate`` process, with a checkpoint, like production."""
    from kvcached_broker.tools.launch import BrokerLauncher

    launcher = BrokerLauncher(f"ipc://{workdir}/gpu0.sock", simulate=simulate, state_dir=workdir / "state",
                              args=["--log-level", "warning", *extra])
    with launcher:
        yield launcher.endpoint, launcher.proc


def _raw_router(endpoint: str, ready) -> None:
    """The floor: a Python ROUTER that decodes each request and answers, doing nothing else."""
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.set()
    recv, send, more = sock.recv, sock.send, zmq.SNDMORE
    while True:
        rid = recv()
        body = msgpack.unpackb(recv())
        if body.get("op") == "stop":
            send(rid, more)
            send(b"")
            return
        send(rid, more)
        send(msgpack.packb({"type": "reply", "id": body["id"], "ok": True, "result": {"granted": 1}}))


@contextmanager
def raw_router(workdir: Path) -> Iterator[tuple[str, mp.Process]]:
    """The raw loop in a process of its own: its endpoint and the process (as ``broker``)."""
    endpoint = f"ipc://{workdir}/raw.sock"
    ready = mp.Event()
    proc = mp.Process(target=_raw_router, args=(endpoint, ready), daemon=True)
    proc.start()
    ready.wait(10)
    try:
        yield endpoint, proc
    finally:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send(msgpack.packb({"op": "stop", "id": 0}))
        sock.setsockopt(zmq.RCVTIMEO, 2000)
        try:
            sock.recv()
        except zmq.Again:
            pass
        sock.close()
        proc.join(5)
        if proc.is_alive():
            proc.kill()


def open_raw_session(sock: zmq.Socket, instance: str, page_bytes: int = 2 << 20) -> str:
    """Open a broker session over a raw DEALER socket; returns its token."""
    sock.send(msgpack.packb({"op": "hello", "id": 0, "versions": [1], "instance": instance, "pid": os.getpid(),
                             "page_bytes": page_bytes, "nonce": os.urandom(9).hex()}))
    reply = msgpack.unpackb(sock.recv())
    assert reply["ok"], reply
    return reply["result"]["session"]


def _pipelined_client(endpoint: str, in_flight: int, seconds: float, session: bool, start_at: float, out) -> None:
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(endpoint)
    token = open_raw_session(sock, f"load-{os.getpid()}") if session else "x" * 32
    frames = [
        msgpack.packb({"op": "acquire" if i % 2 == 0 else "release", "id": i + 1, "session": token, "pages": 1})
        for i in range(200_000)
    ]
    while time.time() < start_at:
        time.sleep(0.001)
    sent = done = 0
    # Keep an even number outstanding so releases never outrun their acquires.
    for _ in range(in_flight):
        sock.send(frames[sent])
        sent += 1
    end = time.time() + seconds
    while time.time() < end:
        sock.recv()
        done += 1
        sock.send(frames[sent % len(frames)])
        sent += 1
    for _ in range(sent - done):
        sock.recv()
    out.put(done)


def pipelined_rate(endpoint: str, *, processes: int, in_flight_each: int, seconds: float, session: bool) -> float:
    """Replies per second with ``processes * in_flight_each`` requests in flight."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start_at = time.time() + 0.5
    procs = [ctx.Process(target=_pipelined_client, args=(endpoint, in_flight_each, seconds, session, start_at, out))
             for _ in range(processes)]
    for p in procs:
        p.start()
    total = sum(out.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join(10)
    return total / seconds


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
