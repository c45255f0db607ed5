"""``make bench``: every performance target of the broker, each next to its baseline.

    python benchmarks/suite.py [--quick] [--out bench-results]

Prints one table (figure, value, baseline measured in this run, ratio, target) and writes
``bench-results/bench.json`` and ``bench-results/latency_vs_sessions.png`` (matplotlib).
The kvcached hand-over (benchmarks/handover.py) runs last, with its own table, JSON and PNG;
its headline figures join this table.  It needs torch and kvcached's Python code (``make
bench`` installs them) and is skipped, saying why, without them.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import mmap
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import zmq

sys.path.insert(0, str(Path(__file__).parent))
from harness import (
    broker,
    open_raw_session,
    percentile,
    pipelined_rate,
    raw_router,
    rss_bytes,
    write_json,
)

ROWS: list[dict] = []


def row(figure: str, value: float, unit: str, baseline: float | None = None, target: str = "", note: str = "",
        ratio: float | None = None) -> None:
    """One figure; ``ratio`` defaults to value/baseline (given when it is a median of pairs)."""
    if ratio is None and baseline:
        ratio = value / baseline
    ROWS.append({"figure": figure, "value": value, "unit": unit, "baseline": baseline, "ratio": ratio,
                 "target": target, "note": note})


# ----------------------------------------------------------------------------- round trip
def raw_round_trips(endpoint: str, n: int) -> list[float]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    samples = []
    for i in range(n + n // 10):
        t0 = time.perf_counter()
        sock.send(msgpack.packb({"op": "acquire", "id": i, "session": "x" * 32, "pages": 1}))
        msgpack.unpackb(sock.recv())
        if i >= n // 10:
            samples.append(time.perf_counter() - t0)
    sock.close(0)
    return samples


def client_round_trips(endpoint: str, n: int) -> tuple[list[float], list[float]]:
    from kvcached_broker.client import BrokerClient

    acquire, release = [], []
    with BrokerClient.connect("bench", endpoint=endpoint, credit_pages=0) as client:
        for i in range(n + n // 10):
            t0 = time.perf_counter()
            client.acquire(1)
            t1 = time.perf_counter()
            client.release(1)
            t2 = time.perf_counter()
            if i >= n // 10:
                acquire.append(t1 - t0)
                release.append(t2 - t1)
    return acquire, release


def bench_round_trip(workdir: Path, n: int) -> None:
    # Interleave baseline and broker runs so that drift in machine load hits both alike.
    raw, acq, rel = [], [], []
    with raw_router(workdir) as (raw_endpoint, _), broker(workdir) as (endpoint, _):
        for _ in range(3):
            raw += raw_round_trips(raw_endpoint, n // 3)
            a, r = client_round_trips(endpoint, n // 3)
            acq += a
            rel += r
    base50, base99 = percentile(raw, 0.5), percentile(raw, 0.99)
    both = [a + r for a, r in zip(acq, rel)]
    row("round trip p50: acquire(1)", percentile(acq, 0.5) * 1e6, "us", base50 * 1e6, "<= 1.5x raw")
    row("round trip p50: release(1)", percentile(rel, 0.5) * 1e6, "us", base50 * 1e6, "<= 1.5x raw")
    row("round trip p99: acquire(1)", percentile(acq, 0.99) * 1e6, "us", base99 * 1e6, "<= 2x raw")
    row("round trip p99: release(1)", percentile(rel, 0.99) * 1e6, "us", base99 * 1e6, "<= 2x raw")
    row("acquire(1)+release(1) p50", percentile(both, 0.5) * 1e6, "us", 2 * base50 * 1e6, "<= 1.5x 2 raw",
        note="two round trips against two raw ones")


# ----------------------------------------------------------------------------- capacity
def bench_capacity(workdir: Path, seconds: float) -> None:
    # Alternate short windows, baseline then broker, so drift in machine load hits both alike;
    # the figure is the median window of each and the ratio the median of the paired windows.
    windows = max(3, round(seconds))
    raws, ours = [], []
    with raw_router(workdir) as (raw_endpoint, _), broker(workdir) as (endpoint, _):
        for _ in range(windows):
            raws.append(pipelined_rate(raw_endpoint, processes=4, in_flight_each=8, seconds=1.0, session=False))
            ours.append(pipelined_rate(endpoint, processes=4, in_flight_each=8, seconds=1.0, session=True))
    ratios = sorted(o / r for o, r in zip(ours, raws))
    row("server capacity, 32 in flight", percentile(ours, 0.5), "req/s", percentile(raws, 0.5),
        ">= 30k/s and >= 0.8x raw", ratio=ratios[len(ratios) // 2],
        note=f"4 client processes x 8 in flight, same harness; median of {windows} paired 1 s windows "
             f"(ratios {ratios[0]:.2f}..{ratios[-1]:.2f})")
    with broker(workdir) as (endpoint, _):
        asyncr = asyncio.run(async_rate(endpoint, 32, seconds))
    row("async client, 32 coroutines", asyncr, "req/s", percentile(raws, 0.5), "", note="one AsyncBrokerClient, credit_pages=0")


async def async_rate(endpoint: str, concurrency: int, seconds: float) -> float:
    from kvcached_broker.client import AsyncBrokerClient

    client = await AsyncBrokerClient.connect("async-load", endpoint=endpoint, credit_pages=0)
    done = 0
    end = time.monotonic() + seconds

    async def worker():
        nonlocal done
        while time.monotonic() < end:
            await client.acquire(1)
            await client.release(1)
            done += 2

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return done / seconds


# ----------------------------------------------------------------------------- credit
def kvcached_style_update(path: str) -> None:
    """kvcached's per-update cost: open, flock, mmap, update three int64, unmap, close."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        mem = mmap.mmap(fd, 24)
        total, used, prealloc = struct.unpack_from("qqq", mem, 0)
        struct.pack_into("qqq", mem, 0, total, used + 1, prealloc)
        mem.close()
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def bench_credit(workdir: Path, n: int) -> None:
    from kvcached_broker.client import BrokerClient

    shm = f"/dev/shm/kb-bench-{os.getpid()}"
    with open(shm, "wb") as f:
        f.write(struct.pack("qqq", 1 << 40, 0, 0))
    t0 = time.perf_counter()
    for _ in range(n):
        kvcached_style_update(shm)
    shm_us = (time.perf_counter() - t0) / n * 1e6
    os.unlink(shm)
    with broker(workdir) as (endpoint, _):
        with BrokerClient.connect("credit", endpoint=endpoint) as client:  # the default credit reserve
            t0 = time.perf_counter()
            for _ in range(n):  # steady one-in one-out
                client.acquire(1)
                client.release(1)
            steady_us = (time.perf_counter() - t0) / (2 * n) * 1e6
            t0 = time.perf_counter()
            rounds = max(1, n // 512)
            for _ in range(rounds):  # ramps: 512 pages one at a time, then back one at a time
                for _ in range(512):
                    client.acquire(1)
                for _ in range(512):
                    client.release(1)
            ramp_us = (time.perf_counter() - t0) / (rounds * 1024) * 1e6
    row("per-page cost, steady alloc/free", steady_us, "us", shm_us, "<= kvcached shm+flock",
        note="BrokerClient default credit reserve; baseline: kvcached-style /dev/shm update")
    row("per-page cost, 512-page ramps", ramp_us, "us", shm_us, "<= kvcached shm+flock",
        note="refills and returns in batches")


# ----------------------------------------------------------------------------- scaling
def _hold_sessions(endpoint: str, count: int, ready, stop) -> None:
    socks = []
    for i in range(count):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(endpoint)
        token = open_raw_session(sock, f"idle-{os.getpid()}-{i % 4}")
        sock.send(msgpack.packb({"op": "reserve", "id": 1, "session": token, "pools": {"weights": 1 << 20}}))
        sock.recv()
        socks.append(sock)
    ready.set()
    stop.wait()


def bench_scaling(workdir: Path, n: int) -> dict:
    import multiprocessing as mp

    from kvcached_broker.broker.accounts import DeviceInfo
    from kvcached_broker.broker.ledger import Ledger
    from kvcached_broker.client import BrokerClient
    from kvcached_broker.client.admin import AdminClient

    curve = {"sessions": [], "ledger_ns": [], "round_trip_us": [], "status_ms": [], "rss_mb": []}
    for sessions in (1, 16, 64, 256):
        ledger = Ledger(DeviceInfo(0, "sim", "sim", True), total_bytes=80 << 30, headroom_bytes=0)
        for i in range(sessions):
            ledger.open_session(f"s{i}", instance=f"m{i % 8}", pid=1000 + i, pid_verified=True, tp_rank=0,
                                tp_size=1, page_bytes=2 << 20, now_s=0.0)
        t0 = time.perf_counter()
        for _ in range(n):
            ledger.acquire("s0", 1)
            ledger.release("s0", 1)
        curve["ledger_ns"].append((time.perf_counter() - t0) / (2 * n) * 1e9)
        curve["sessions"].append(sessions)

    ctx = mp.get_context("fork")
    for sessions in (1, 16, 64, 256):
        with broker(workdir) as (endpoint, proc):
            stop = ctx.Event()
            holders = []
            per = 64
            for start in range(0, sessions - 1, per):
                ready = ctx.Event()
                p = ctx.Process(target=_hold_sessions, args=(endpoint, min(per, sessions - 1 - start), ready, stop))
                p.start()
                ready.wait(60)
                holders.append(p)
            with BrokerClient.connect("probe", endpoint=endpoint, credit_pages=0) as client, AdminClient(endpoint) as admin:
                samples = []
                for _ in range(n // 4):
                    t0 = time.perf_counter()
                    client.acquire(1)
                    client.release(1)
                    samples.append((time.perf_counter() - t0) / 2)
                status_samples = []
                for _ in range(50):
                    t0 = time.perf_counter()
                    doc = admin.status()
                    status_samples.append(time.perf_counter() - t0)
                assert sum(len(i["sessions"]) for i in doc["instances"]) == sessions
            curve["round_trip_us"].append(percentile(samples, 0.5) * 1e6)
            curve["status_ms"].append(percentile(status_samples, 0.5) * 1e3)
            curve["rss_mb"].append(rss_bytes(proc.pid) / (1 << 20))
            stop.set()
            for p in holders:
                p.join(10)
    row("ledger acquire+release, 256 sessions", curve["ledger_ns"][-1], "ns", curve["ledger_ns"][0],
        "same as at 1 session", note="in-process ledger; baseline: 1 session")
    row("grant round trip p50, 256 sessions", curve["round_trip_us"][-1], "us", curve["round_trip_us"][0],
        "flat", note="baseline: 1 session")
    row("status p50, 256 sessions", curve["status_ms"][-1], "ms", None, "< 5 ms")
    row("broker RSS, 256 sessions", curve["rss_mb"][-1], "MB", curve["rss_mb"][0], "< 60 MB", note="baseline: 1 session")
    return curve


# ----------------------------------------------------------------------------- reclaim
HOLDER = """
import sys, time
from kvcached_broker.client import BrokerClient
c = BrokerClient.connect("victim", endpoint=sys.argv[1], credit_pages=0)
c.reserve({"weights": 1 << 30}); c.acquire(8)
print("ready", flush=True)
time.sleep(60)
"""


def bench_reclaim(workdir: Path, trials: int) -> None:
    from kvcached_broker.client import protocol as proto

    with broker(workdir) as (endpoint, _):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(endpoint)
        status = proto.encode(proto.Status(id=1))
        latencies = []
        for _ in range(trials):
            holder = subprocess.Popen([sys.executable, "-c", HOLDER, endpoint], stdout=subprocess.PIPE, text=True)
            holder.stdout.readline()
            t0 = time.perf_counter()
            os.kill(holder.pid, signal.SIGKILL)
            while True:
                sock.send(status)
                doc = proto.decode_broker_message(sock.recv()).result
                if doc["reserved_bytes"] == 0:
                    break
            latencies.append(time.perf_counter() - t0)
            holder.wait()
        sock.close(0)
    row("reclaim after SIGKILL, p50", percentile(latencies, 0.5) * 1e3, "ms", None, "<= 10 ms",
        note=f"{trials} trials; includes the status polls that observe it")


# ----------------------------------------------------------------------------- kvcached hand-over
def bench_handover(out: Path, trials: int) -> None:
    """benchmarks/handover.py: its own table and files; the hand-over and demand served join ROWS."""
    import handover

    why = handover.prerequisites()
    if why:
        print(f"hand-over benchmark skipped: {why}")
        return
    table, _ = handover.run(out, trials, list(handover.SETUPS))
    by_key = {r["key"]: r["values"] for r in table}
    handover_s = by_key["handover_p50_s"].get("broker")
    if handover_s is not None:
        row("kvcached hand-over p50", handover_s * 1e3, "ms", None, "<= 100 ms",
            note=f"first ask that did not fit to held: B bursts {handover.B_BURST_BYTES >> 30} GiB while an idle "
                 f"A holds {handover.A_FILL_BYTES >> 30} GiB of cache; see handover.json")
    burst = by_key["burst_p50_s"]
    if burst.get("broker") is not None and burst.get("static"):
        row("kvcached burst p50 vs static", burst["broker"] * 1e3, "ms", burst["static"] * 1e3, "<= 1.2x",
            note="B's 28 GiB burst, start to held; baseline: static partitioning")
    for name in handover.TRACE_NAMES:
        served = by_key.get(f"served:{name}", {})
        if served.get("broker") is None:
            continue
        for base in ("static", "alone"):
            if served.get(base):
                row(f"kvcached served, {name} trace, vs {base}", served["broker"], "%", served[base], "",
                    note=f"all models; baseline: {handover.SETUPS[base]}")


# ----------------------------------------------------------------------------- output
def render() -> str:
    lines = [f"{'figure':<40}{'value':>12}{'baseline':>12}{'ratio':>8}  {'target':<26}note"]
    for r in ROWS:
        base = f"{r['baseline']:.1f}" if r["baseline"] is not None else "-"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        lines.append(f"{r['figure']:<40}{r['value']:>9.1f} {r['unit']:<3}{base:>11}{ratio:>8}  {r['target']:<26}{r['note']}")
    return "\n".join(lines)


def plot(curve: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(curve["sessions"], curve["round_trip_us"], marker="o", label="grant round trip p50 (us)")
    ax1.plot(curve["sessions"], [v / 1000 for v in curve["ledger_ns"]], marker="s", label="ledger op (us)")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("sessions")
    ax1.set_ylabel("microseconds")
    ax1.set_ylim(bottom=0)
    ax1.legend()
    ax1.set_title("latency against sessions")
    ax2.plot(curve["sessions"], curve["status_ms"], marker="o", color="tab:green")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("sessions")
    ax2.set_ylabel("status p50 (ms)")
    ax2.set_ylim(bottom=0)
    ax2.set_title("status against sessions")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--only", default="",
                        help="comma-separated: roundtrip,capacity,credit,scaling,reclaim,handover")
    args = parser.parse_args(argv)
    n = 1500 if args.quick else 6000
    only = set(filter(None, args.only.split(",")))
    workdir = Path(tempfile.mkdtemp(prefix="kb-bench-", dir="/tmp"))
    curve = None
    try:
        if not only or "roundtrip" in only:
            bench_round_trip(workdir, n)
        if not only or "capacity" in only:
            bench_capacity(workdir, 2.0 if args.quick else 5.0)
        if not only or "credit" in only:
            bench_credit(workdir, n * 4)
        if not only or "scaling" in only:
            curve = bench_scaling(workdir, n)
        if not only or "reclaim" in only:
            bench_reclaim(workdir, 10 if args.quick else 30)
        if not only or "handover" in only:
            bench_handover(args.out, 2 if args.quick else 5)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(render())
    meta = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_json(args.out / "bench.json", {"meta": meta, "rows": ROWS, "curve": curve})
    if curve is not None:
        png = args.out / "latency_vs_sessions.png"
        print(f"plot: {png}" if plot(curve, png) else "plot skipped: pip install matplotlib")
    return 0


if __name__ == "__main__":
    sys.exit(main())
