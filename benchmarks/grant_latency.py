"""Grant round trip: p50/p99 of ``acquire(1)`` and ``release(1)`` against a raw pyzmq baseline.

Both are measured in this one run on this machine, so the ratio holds on a noisy host:

* baseline: a raw Python DEALER/ROUTER echo of a msgpack map (the transport's floor);
* broker: a real ``kvcached-broker serve --simulate`` process and a ``BrokerClient`` with
  ``credit_pages=0`` (every call is a round trip).

    python benchmarks/grant_latency.py [--n 5000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _raw_router(endpoint: str, ready) -> None:
    import msgpack
    import zmq

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.set()
    while True:
        rid = sock.recv()
        body = msgpack.unpackb(sock.recv())
        if body.get("op") == "stop":
            sock.send(rid, zmq.SNDMORE)
            sock.send(b"")
            return
        reply = msgpack.packb({"type": "reply", "id": body["id"], "ok": True, "result": {"granted": body["pages"]}})
        sock.send(rid, zmq.SNDMORE)
        sock.send(reply)


def raw_baseline(workdir: str, n: int) -> list[float]:
    import msgpack
    import zmq

    endpoint = f"ipc://{workdir}/raw.sock"
    ready = mp.Event()
    proc = mp.Process(target=_raw_router, args=(endpoint, ready), daemon=True)
    proc.start()
    ready.wait(10)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    samples = []
    for i in range(n + n // 10):
        t0 = time.perf_counter()
        sock.send(msgpack.packb({"op": "acquire", "id": i, "session": "x" * 32, "pages": 1}))
        msgpack.unpackb(sock.recv())
        if i >= n // 10:  # warm-up excluded
            samples.append(time.perf_counter() - t0)
    sock.send(msgpack.packb({"op": "stop", "id": 0}))
    sock.recv()
    sock.close()
    proc.join(5)
    return samples


def broker_round_trips(workdir: str, n: int) -> tuple[list[float], list[float]]:
    from kvcached_broker.client import BrokerClient
    from kvcached_broker.client.admin import AdminClient
    from kvcached_broker.client.errors import BrokerUnavailable

    endpoint = f"ipc://{workdir}/gpu0.sock"
    broker = subprocess.Popen(
        [sys.executable, "-m", "kvcached_broker.broker.cli", "serve", "--simulate", "80GiB", "--endpoint", endpoint,
         "--state-dir", f"{workdir}/state", "--log-level", "warning"],
    )
    try:
        for _ in range(200):
            try:
                AdminClient(endpoint, timeout_s=0.5).status()
                break
            except BrokerUnavailable:
                time.sleep(0.05)
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
    finally:
        broker.terminate()
        broker.wait(10)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="kb-bench-", dir="/tmp")
    try:
        raw = raw_baseline(workdir, args.n)
        acquire, release = broker_round_trips(workdir, args.n)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = []
    base50, base99 = percentile(raw, 0.5), percentile(raw, 0.99)
    print(f"{'figure':<34}{'p50 us':>10}{'p99 us':>10}{'p50 ratio':>11}{'p99 ratio':>11}")
    for name, samples in (("raw DEALER/ROUTER msgpack (baseline)", raw), ("broker acquire(1)", acquire),
                          ("broker release(1)", release)):
        p50, p99 = percentile(samples, 0.5), percentile(samples, 0.99)
        rows.append({"figure": name, "p50_us": p50 * 1e6, "p99_us": p99 * 1e6, "p50_ratio": p50 / base50,
                     "p99_ratio": p99 / base99, "n": len(samples), "mean_us": statistics.fmean(samples) * 1e6})
        print(f"{name:<34}{p50 * 1e6:>10.1f}{p99 * 1e6:>10.1f}{p50 / base50:>11.2f}{p99 / base99:>11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": os.uname().nodename, "cpus": os.cpu_count(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
