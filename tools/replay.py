"""``kvcached-broker replay``: replay a bursty multi-model KV trace under three policies.

Each model is a real client process and the broker a real ``serve --simulate`` process.  The
same trace runs once per policy:

* ``static``: equal partitioning; every model is capped at its reservations plus an equal
  slice of the elastic space (what MPS-style static caps give).
* ``fcfs``: first come, first served up to the budget, no limits.  Models keep freed pages as
  cache for ``cache_s`` (as a radix/prefix cache does) and nobody asks for them back.
* ``policy``: floors + weights + pressure.  Each model has a floor and a weight from the trace;
  when one below its share is refused, the broker asks those above theirs, and the models give
  back their cached pages.

For each model it reports the page-seconds of demand asked for and served, and how often and
for how long it was short.  A trace is JSON lines::

    {"kind": "gpu", "total_bytes": 85899345920, "headroom": "5%", "duration_s": 120}
    {"kind": "model", "name": "llama-a", "page_bytes": 67108864, "pools": {"weights": 17179869184},
     "min_bytes": 19327352832, "weight": 1.0, "cache_s": 15}
    {"kind": "demand", "t": 12.5, "model": "llama-a", "pages": 180}

``--generate OUT`` writes kvcached's shape of workload: three Llama-3.1-8B with intermittent
peaks on one 80 GiB GPU, plus one DeepSeek-V4 instance with static side pools.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from bisect import bisect_right
from pathlib import Path
from typing import Any

from ..broker.config import DEFAULT_HEADROOM

GIB = 1 << 30
MIB = 1 << 20
POLICIES = ("static", "fcfs", "policy")


class TraceError(ValueError):
    """A trace line that cannot be used.  One line, naming the line number."""


# --------------------------------------------------------------------------- trace
def generate(seed: int = 7, duration_s: float = 120.0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    page = 64 * MIB
    lines: list[dict[str, Any]] = [{"kind": "gpu", "total_bytes": 80 * GIB, "headroom": DEFAULT_HEADROOM, "duration_s": duration_s}]
    llama_pools = {"weights": 16 * GIB, "activations": GIB // 2}
    for name in ("llama-a", "llama-b", "llama-c"):
        lines.append({"kind": "model", "name": name, "page_bytes": page, "pools": llama_pools,
                      "min_bytes": int(18.5 * GIB), "weight": 1.0, "cache_s": 20})
    dsv4_pools = {"weights": 4 * GIB, "swa_kv_pool": 2 * GIB, "c4_kv_pool": int(2.5 * GIB), "c128_kv_pool": GIB // 4,
                  "c4_indexer_kv_pool": GIB, "compress_state_pools": GIB // 2}
    lines.append({"kind": "model", "name": "deepseek-v4", "page_bytes": page, "pools": dsv4_pools,
                  "min_bytes": 12 * GIB, "weight": 1.0, "cache_s": 20})
    step = 0.5
    for name in ("llama-a", "llama-b", "llama-c", "deepseek-v4"):
        base = (GIB // 2) // page if name != "deepseek-v4" else GIB // page
        peaks = []
        t = rng.uniform(0, 20)
        while t < duration_s:  # intermittent peaks, one model at a time mostly
            length = rng.uniform(8, 18)
            height = rng.uniform(8, 13) * GIB // page if name != "deepseek-v4" else rng.uniform(2, 3) * GIB // page
            peaks.append((t, t + length, height))
            t += length + rng.expovariate(1 / 35)
        for i in range(int(duration_s / step)):
            now = i * step
            pages = base + sum(h * math.sin(math.pi * (now - a) / (b - a)) ** 0.5 for a, b, h in peaks if a <= now < b)
            lines.append({"kind": "demand", "t": round(now, 3), "model": name, "pages": int(pages)})
    return lines


def load(path: Path) -> dict[str, Any]:
    gpu: dict[str, Any] | None = None
    models: dict[str, dict[str, Any]] = {}
    demand: dict[str, list[tuple[float, int]]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            kind = record["kind"]
            if kind == "gpu":
                gpu = {"total_bytes": int(record["total_bytes"]), "headroom": str(record.get("headroom", DEFAULT_HEADROOM)),
                       "duration_s": float(record["duration_s"])}
            elif kind == "model":
                name = str(record["name"])
                models[name] = {"name": name, "page_bytes": int(record["page_bytes"]),
                                "pools": {str(k): int(v) for k, v in record.get("pools", {}).items()},
                                "min_bytes": int(record.get("min_bytes", 0)), "weight": float(record.get("weight", 1)),
                                "cache_s": float(record.get("cache_s", 0))}
                demand[name] = []
            elif kind == "demand":
                demand[str(record["model"])].append((float(record["t"]), int(record["pages"])))
            else:
                raise TraceError(f"unknown kind {kind!r}")
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{path}:{number}: {type(exc).__name__}: {exc}") from None
    if gpu is None or not models:
        raise TraceError(f"{path}: needs one gpu line and at least one model line")
    for points in demand.values():
        points.sort()
    return {"gpu": gpu, "models": models, "demand": demand}


# --------------------------------------------------------------------------- worker
def _demand_at(points: list[tuple[float, int]], t: float) -> int:
    i = bisect_right(points, (t, float("inf"))) - 1
    return points[i][1] if i >= 0 else 0


def run_worker(trace_path: str, model: str, policy: str, endpoint: str, speed: float) -> dict:
    """One model: connect and reserve, say ``ready``, then replay from the start time the
    runner sends once every model is ready (so a slow start-up costs no trace time)."""
    from ..client import BrokerClient

    trace = load(Path(trace_path))
    spec = trace["models"][model]
    points = trace["demand"][model]
    duration = trace["gpu"]["duration_s"]
    tick = 0.05  # wall seconds
    client = BrokerClient.connect(model, endpoint=endpoint, page_bytes=spec["page_bytes"], credit_pages=0)
    client.reserve(spec["pools"])
    cached: list[float] = []  # trace time at which each cached page was freed, oldest first
    state = {"demand": 0}

    def give_back(pages: int) -> int:
        spare = min(pages, len(cached))
        if spare:
            client.release(spare)
            del cached[:spare]
        return spare

    if policy == "policy":
        client.on_pressure(give_back)
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    asked = served = 0.0
    short_since: float | None = None
    episodes, short_s = 0, 0.0
    while time.time() < start_at:
        time.sleep(0.005)
    last = 0.0
    while True:
        t = (time.time() - start_at) * speed
        if t >= duration:
            break
        want = _demand_at(points, t)
        state["demand"] = want
        in_use = client.held_pages - len(cached)
        if want > in_use:  # reuse cache first, then ask the broker
            reuse = min(len(cached), want - in_use)
            del cached[len(cached) - reuse:]
            in_use += reuse
            if want > in_use:
                in_use += client.acquire(want - in_use, min_pages=1)
        elif want < in_use:
            cached.extend([t] * (in_use - want))
            in_use = want
        while cached and t - cached[0] > spec["cache_s"]:  # the cache ages out by itself
            client.release(1)
            cached.pop(0)
        dt = t - last
        last = t
        asked += want * dt
        served += min(in_use, want) * dt
        if in_use < want:
            if short_since is None:
                short_since, episodes = t, episodes + 1
        elif short_since is not None:
            short_s += t - short_since
            short_since = None
        time.sleep(tick)
    if short_since is not None:
        short_s += last - short_since
    client.close()
    page_gib = spec["page_bytes"] / GIB
    return {"model": model, "policy": policy, "asked_gib_s": asked * page_gib, "served_gib_s": served * page_gib,
            "refusals": episodes, "refused_s": short_s, "pressure": len(client.pressure_log)}


# --------------------------------------------------------------------------- driver
def run_policy(trace: dict[str, Any], trace_path: Path, policy: str, speed: float, workdir: Path) -> list[dict]:
    from .launch import BrokerLauncher

    gpu = trace["gpu"]
    launcher = BrokerLauncher(f"ipc://{workdir}/{policy}.sock", simulate=str(gpu["total_bytes"]),
                              args=["--headroom", gpu["headroom"], "--log-level", "warning"])
    workers: list[subprocess.Popen] = []
    with launcher, launcher.admin() as admin:
        budget = admin.status()["budget_bytes"]
        models = trace["models"]
        if policy == "static":
            reserved = sum(sum(m["pools"].values()) for m in models.values())
            slice_bytes = (budget - reserved) // len(models)
            for m in models.values():
                admin.limit(m["name"], max_bytes=sum(m["pools"].values()) + slice_bytes)
        elif policy == "policy":
            for m in models.values():
                admin.limit(m["name"], min_bytes=m["min_bytes"], weight=m["weight"])
        try:
            for name in models:
                workers.append(subprocess.Popen(
                    [sys.executable, "-m", "kvcached_broker.tools.replay", "--worker", str(trace_path), name, policy,
                     launcher.endpoint, repr(speed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            for w in workers:
                assert w.stdin is not None and w.stdout is not None  # pipes: Popen(stdin=PIPE, stdout=PIPE)
                if w.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"replay worker exited with {w.wait()} before it was ready")
            start_at = time.time() + 0.1
            for w in workers:
                assert w.stdin is not None
                w.stdin.write(f"{start_at!r}\n")
                w.stdin.flush()
            results = []
            for w in workers:
                out, _ = w.communicate(timeout=gpu["duration_s"] / speed + 60)
                if w.returncode != 0:
                    raise RuntimeError(f"replay worker exited with {w.returncode}")
                results.append(json.loads(out.strip().splitlines()[-1]))
            return results
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()


def render(results: list[dict]) -> str:
    lines = [f"{'policy':<8}{'model':<14}{'asked GiB*s':>13}{'served GiB*s':>14}{'served':>8}{'short':>7}{'short s':>9}"]
    for policy in POLICIES:
        rows = [r for r in results if r["policy"] == policy]
        if not rows:
            continue
        for r in rows:
            pct = 100 * r["served_gib_s"] / r["asked_gib_s"] if r["asked_gib_s"] else 100.0
            lines.append(f"{policy:<8}{r['model']:<14}{r['asked_gib_s']:>13.0f}{r['served_gib_s']:>14.0f}"
                         f"{pct:>7.1f}%{r['refusals']:>7}{r['refused_s']:>9.1f}")
        asked = sum(r["asked_gib_s"] for r in rows)
        served = sum(r["served_gib_s"] for r in rows)
        worst = min((100 * r["served_gib_s"] / r["asked_gib_s"] for r in rows if r["asked_gib_s"]), default=100.0)
        lines.append(f"{policy:<8}{'(all)':<14}{asked:>13.0f}{served:>14.0f}{100 * served / max(asked, 1e-9):>7.1f}%"
                     f"{sum(r['refusals'] for r in rows):>7}{sum(r['refused_s'] for r in rows):>9.1f}"
                     f"   worst model {worst:.1f}%")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = sorted({r["model"] for r in results})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(POLICIES)
    for i, policy in enumerate(POLICIES):
        rows = {r["model"]: r for r in results if r["policy"] == policy}
        values = [100 * rows[m]["served_gib_s"] / rows[m]["asked_gib_s"] if m in rows and rows[m]["asked_gib_s"] else 0
                  for m in models]
        ax.bar([x + i * width for x in range(len(models))], values, width, label=policy)
    ax.set_xticks([x + width for x in range(len(models))], models)
    ax.set_ylabel("demand served (% of page-seconds)")
    ax.set_ylim(0, 105)
    ax.legend(loc="lower right")
    ax.set_title("KV demand served per model, by arbitration policy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def build_parser() -> argparse.ArgumentParser:
    """``kvcached-broker replay``'s options (the CLI hands the command its own parser)."""
    parser = argparse.ArgumentParser(prog="kvcached-broker replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="?", type=Path, metavar="TRACE", help="TRACE.jsonl to replay")
    parser.add_argument("--generate", type=Path, metavar="OUT", help="write a generated trace to OUT and exit")
    parser.add_argument("--seed", type=int, default=7, metavar="N", help="the generated trace's seed (default 7)")
    parser.add_argument("--duration", type=float, default=120.0, metavar="SECONDS",
                        help="generated trace length in trace seconds (default 120)")
    parser.add_argument("--speed", type=float, default=10.0, metavar="X", help="trace seconds per wall second (default 10)")
    parser.add_argument("--policies", default=",".join(POLICIES), metavar="LIST",
                        help="comma-separated subset of static,fcfs,policy (default all)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the results here")
    parser.add_argument("--plot", type=Path, metavar="FILE", help="write a PNG plot here (needs matplotlib)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.generate:
        args.generate.write_text("\n".join(json.dumps(line) for line in generate(args.seed, args.duration)) + "\n")
        print(f"wrote {args.generate}")
        return 0
    if args.trace is None:
        parser.error("give a TRACE.jsonl, or --generate OUT")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or any(p not in POLICIES for p in policies):
        parser.error(f"--policies must be a subset of {','.join(POLICIES)}")
    if not args.speed > 0:
        parser.error("--speed must be positive")
    try:
        trace = load(args.trace)
    except (OSError, TraceError) as exc:
        print(f"kvcached-broker replay: {exc}", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="kb-replay-", dir="/tmp") as workdir:
        for policy in policies:
            print(f"replaying under {policy} ...", file=sys.stderr, flush=True)
            results += run_policy(trace, args.trace, policy, args.speed, Path(workdir))
    print(render(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        print(f"plot: {args.plot}" if plot(results, args.plot) else "plot skipped: pip install matplotlib")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, trace_path, model, policy, endpoint, speed = sys.argv
        print(json.dumps(run_worker(trace_path, model, policy, endpoint, float(speed))), flush=True)
        sys.exit(0)
    sys.exit(main())
