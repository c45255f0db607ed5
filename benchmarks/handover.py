"""``make bench`` (hand-over): an idle model's kvcached memory moving to a bursting one.

    python benchmarks/handover.py [--trials 5] [--out bench-results] [--setups broker,static,alone]

Two models share one simulated 80 GiB GPU.  Each is a real process with a real kvcached 0.1.6
``KVCacheManager`` built through kvcached's SGLang integration (only ``kvcached.vmm_ops`` is a
double, which charges mapped pages to the shared device: ``kvcached_broker.tools.kvcached_sim``).
The model is Llama-3.1-8B's KV shape (32 layers, 8 KV heads of 128 fp16 values, 16-token blocks:
2 MiB a block, 128 MiB a kvcached page).  Three set-ups run in the same run, each on a fresh
device with fresh processes, and in each the pools may map 95% of the device together (the
broker's default headroom, kvcached's default ``KVCACHED_GPU_UTILIZATION``):

* ``broker``: kvcached mode: each pool's memory limit is its broker grant; a refused pool
  puts pressure on the one above its fair share, whose prefix cache evicts its oldest blocks;
* ``static``: static partitioning: no broker, each pool capped at half the usable memory by
  kvcached's own ``set_memory_limit`` (what ``kvctl limit`` does);
* ``alone``: kvcached alone (``KVCACHED_BROKER=off``: the pools are ungoverned): first come,
  first served against the device's free memory.

What is measured:

* **the hand-over**, ``--trials`` times: A fills 56 GiB and its requests finish into its prefix
  cache (idle); then B asks for 28 GiB of blocks.  (a) the time from B's first refused ask (the
  first broker refusal its governor met, or the first allocation that missed, whichever came
  first) to B holding all 28 GiB, p50/p99; and B's whole burst, from its first allocation;
  (b) the bytes moved: what A unmapped while B burst, and what B took beyond the usable memory
  that was free when it started.  A burst that allocates nothing for 2 s (1 s without a
  broker, where nothing can change) is over, incomplete.
* **demand served over a burst trace**: both models follow a demand curve (GiB of live KV over
  time, :data:`TRACE`) sampled every 50 ms; a sample serves ``min(demand, live)``; served is the
  sum over samples divided by the summed demand (per model and in all).

Prints a table with ratios against the baselines measured in the same run, and writes
``handover.json`` and ``handover.png`` (matplotlib, if installed) under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import percentile, write_json  # noqa: E402

GIB = 1 << 30
DEVICE_BYTES = 80 * GIB
LAYERS = 32
VIRTUAL_TOKENS = 1 << 20  # 128 GiB of virtual KV per pool: more than the device
#: What the pools may map together in every set-up: the broker's default headroom (5%) and
#: kvcached's own (``KVCACHED_GPU_UTILIZATION=0.95``: it maps no page that would leave less free).
USABLE_BYTES = DEVICE_BYTES * 95 // 100
A_FILL_BYTES = 56 * GIB
B_BURST_BYTES = 28 * GIB
#: A burst that allocated nothing for this long is over (incomplete).  The broker's pools retry a
#: refused ask after up to 0.5 s, so they get longer; without a broker a stall is final.
STALL_S = {"broker": 2.0, "static": 1.0, "alone": 1.0}
SAMPLE_S = 0.05
#: Live KV demand in GiB, ``(from t_s, GiB)`` steps: A peaks then idles (its finished requests
#: stay cached) and comes back; B bursts while A idles.
TRACE = {
    "A": [(0.0, 4), (1.0, 56), (5.0, 6), (13.0, 30)],
    "B": [(0.0, 4), (6.0, 44), (12.0, 8)],
}
TRACE_END_S = 16.0
SETUPS = {
    "broker": "kvcached mode (grants + pressure)",
    "static": "static partitioning (half each)",
    "alone": "kvcached alone (first come, first served)",
}
KVCACHED_OVERLAY = HERE.parent / ".adapter-envs" / "kvcached-0.1.6"


# ----------------------------------------------------------------------------- a rig
@dataclass
class Rig:
    """One set-up: the shared device's usage directory, a broker (or none), pools A and B."""

    setup: str
    usage: Path
    a: object
    b: object
    block_bytes: int
    broker_endpoint: str | None = None

    def blocks(self, size_bytes: float) -> int:
        return int(size_bytes // self.block_bytes)

    def gib(self, blocks: float) -> float:
        return blocks * self.block_bytes / GIB


@contextmanager
def rig(setup: str, workdir: Path) -> Iterator[Rig]:
    """Start ``setup``'s broker (kvcached mode only) and two pool processes; stop them after."""
    from kvcached_broker.tools.kvcached_sim.pools import PoolProcess
    from kvcached_broker.tools.launch import BrokerLauncher

    usage = workdir / setup / "gpu-usage"
    usage.mkdir(parents=True)
    endpoint = f"ipc://{workdir}/{setup}.sock"
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_BROKER"}
    if setup != "broker":
        env["KVCACHED_BROKER"] = "off"
    launcher = None
    if setup == "broker":
        launcher = BrokerLauncher(endpoint, simulate=f"{DEVICE_BYTES // GIB}GiB", state_dir=workdir / "state",
                                  args=["--headroom", "5%", "--simulate-usage-dir", str(usage), "--log-level", "warning"],
                                  log=workdir / "broker.log")
        launcher.start()
    args = ("--layers", str(LAYERS), "--virtual-tokens", str(VIRTUAL_TOKENS), "--evict", "oldest")
    pools = [PoolProcess.start(endpoint, usage, DEVICE_BYTES, f"model-{name.lower()}", env=env, args=args,
                               stderr=workdir / f"{setup}-{name}.err", wait=False) for name in ("A", "B")]
    try:
        for pool in pools:
            pool.wait_ready()
        a, b = pools
        page_bytes = a.ready["pools"][0]["page_bytes"]
        rig_ = Rig(setup, usage, a, b, page_bytes // a.ready["blocks_per_page"],
                   endpoint if launcher is not None else None)
        if setup == "static":
            for pool in pools:
                pool.request("limit", bytes=static_limit_bytes(page_bytes))
        yield rig_
    finally:
        for pool in pools:
            pool.stop()
        if launcher is not None:
            launcher.stop()


def static_limit_bytes(page_bytes: int) -> int:
    """Half of the usable memory less both pools' zero pages, in whole pages."""
    return (USABLE_BYTES - 2 * page_bytes) // 2 // page_bytes * page_bytes


def device_bytes(pool) -> int:
    return pool.request("status")["device_bytes"]


def free_usable_bytes(usage: Path) -> int:
    """What the pools could still map together: the usable memory less every process's bytes."""
    from kvcached_broker.broker.device import read_shared_usage

    return max(0, USABLE_BYTES - sum(read_shared_usage(usage).values()))


def pressure_on_a(r: Rig) -> dict:
    """The broker's pressure counters for model A (asks, asked_bytes, returned_bytes); {} without a broker."""
    if r.broker_endpoint is None:
        return {}
    from kvcached_broker.client.admin import AdminClient

    with AdminClient(r.broker_endpoint) as admin:
        for inst in admin.status()["instances"]:
            if inst["name"] == "model-a":
                return dict(inst.get("pressure") or {})
    return {}


def reset(r: Rig) -> None:
    """Both pools empty: every block freed, the governors have given back what is idle."""
    for pool in (r.b, r.a):
        pool.request("drop_cache")
        pool.request("free", blocks=1 << 30)
        pool.request("settle")


# ----------------------------------------------------------------------------- the hand-over
def handover_trial(r: Rig) -> dict:
    """A fills 56 GiB and idles (all cached); B bursts 28 GiB.  Times, bytes moved, completion."""
    reset(r)
    a_fill = r.a.request("fill", blocks=r.blocks(A_FILL_BYTES), stall_s=0.5)
    r.a.request("cache", blocks=a_fill["held_blocks"])
    r.a.request("settle")
    a_before, b_before, free_before = device_bytes(r.a), device_bytes(r.b), free_usable_bytes(r.usage)
    pressure_before = pressure_on_a(r)
    want = r.blocks(B_BURST_BYTES)
    burst = r.b.request("fill", blocks=want, timeout_s=60.0, stall_s=STALL_S[r.setup])
    a_after, b_after = device_bytes(r.a), device_bytes(r.b)
    pressure = {k: v - pressure_before.get(k, 0) for k, v in pressure_on_a(r).items() if isinstance(v, int)}
    complete = burst["held_blocks"] >= want
    # Refused: by the broker in kvcached mode (a miss there is only the pool growing); without
    # one, the first allocation that missed.
    refused_at = burst["first_refusal_s"] if r.setup == "broker" else burst["first_miss_s"]
    return {
        "a_cached_gib": r.gib(a_fill["held_blocks"]), "b_held_gib": r.gib(burst["held_blocks"]),
        "complete": complete, "burst_s": burst["elapsed_s"] if complete else None,
        "refused_at_s": refused_at,
        "handover_s": burst["elapsed_s"] - refused_at if complete and refused_at is not None else None,
        "a_released_bytes": max(0, a_before - a_after),
        "taken_beyond_free_bytes": max(0, (b_after - b_before) - free_before),
        "free_before_bytes": free_before, "pressure_on_a": pressure,
    }


# ----------------------------------------------------------------------------- the trace
def schedule_blocks(r: Rig, steps: list[tuple[float, float]]) -> list[list[float]]:
    return [[t, r.blocks(gib * GIB)] for t, gib in steps] + [[TRACE_END_S, r.blocks(steps[-1][1] * GIB)]]


def run_trace(r: Rig) -> dict:
    """Both pools follow :data:`TRACE` at once, from the same instant; served and demand per model."""
    reset(r)
    start_at = time.time() + 0.5
    for pool, name in ((r.a, "A"), (r.b, "B")):
        pool.send("track", schedule=schedule_blocks(r, TRACE[name]), start_at=start_at, sample_s=SAMPLE_S)
    out = {}
    for pool, name in ((r.a, "A"), (r.b, "B")):
        result = pool.receive()
        out[name] = {
            "served_gib_s": r.gib(result["served_block_s"]), "demand_gib_s": r.gib(result["demand_block_s"]),
            "samples": [[t, r.gib(d), r.gib(live), r.gib(cached), dev / GIB] for t, d, live, cached, dev in result["samples"]],
        }
    return out


def served_fraction(trace: dict, names=("A", "B")) -> float:
    return sum(trace[n]["served_gib_s"] for n in names) / sum(trace[n]["demand_gib_s"] for n in names)


# ----------------------------------------------------------------------------- one set-up
def run_setup(setup: str, workdir: Path, trials: int) -> dict:
    started = time.monotonic()
    with rig(setup, workdir) as r:
        results = [handover_trial(r) for _ in range(trials)]
        trace = run_trace(r)
    took = time.monotonic() - started
    print(f"  {SETUPS[setup]}: {trials} trials and the trace in {took:.0f} s", flush=True)
    return {"setup": setup, "label": SETUPS[setup], "trials": results, "trace": trace, "wall_s": took}


def summary(result: dict) -> dict:
    """The figures of one set-up (None where it has none: no refusal, or never completed)."""
    trials = result["trials"]
    done = [t for t in trials if t["complete"]]
    handovers = [t["handover_s"] for t in trials if t["handover_s"] is not None]
    refused = [t["refused_at_s"] for t in trials if t["refused_at_s"] is not None]
    bursts = [t["burst_s"] for t in done]
    return {
        "complete": len(done), "trials": len(trials),
        "b_held_gib_max": max(t["b_held_gib"] for t in trials),
        "burst_p50_s": percentile(bursts, 0.5) if bursts else None,
        "handover_p50_s": percentile(handovers, 0.5) if len(handovers) == len(trials) else None,
        "handover_p99_s": percentile(handovers, 0.99) if len(handovers) == len(trials) else None,
        "refused": sum(t["refused_at_s"] is not None for t in trials),
        "refused_at_p50_s": percentile(refused, 0.5) if len(refused) == len(trials) else None,
        "pressure_asks": sum(t["pressure_on_a"].get("asks", 0) for t in trials) / len(trials) if trials else 0,
        "a_released_gib": sum(t["a_released_bytes"] for t in trials) / len(trials) / GIB,
        "taken_beyond_free_gib": sum(t["taken_beyond_free_bytes"] for t in trials) / len(trials) / GIB,
        "served": served_fraction(result["trace"]),
        "served_a": served_fraction(result["trace"], ("A",)),
        "served_b": served_fraction(result["trace"], ("B",)),
    }


# ----------------------------------------------------------------------------- output
def rows(summaries: dict) -> list[dict]:
    """The table: each figure for every set-up, with broker/static and broker/alone ratios."""
    def why_none(s: dict, key: str) -> str:
        if key.startswith(("handover", "refused")) and s["refused"] == 0:
            return "no refusal"
        if s["complete"] < s["trials"]:
            return f"never ({s['b_held_gib_max']:.1f} of {B_BURST_BYTES / GIB:.0f} GiB)"
        return "-"

    def row(figure: str, key: str, unit: str, scale: float = 1.0, ratios: bool = True) -> dict:
        values = {name: (None if s[key] is None else s[key] * scale) for name, s in summaries.items()}
        shown = {name: _shown(v, unit) if v is not None else why_none(s, key)
                 for (name, s), v in zip(summaries.items(), values.values())}
        return {"figure": figure, "key": key, "unit": unit, "values": values, "shown": shown, "ratios": ratios}

    burst_gib = B_BURST_BYTES / GIB
    return [
        row(f"B's burst ({burst_gib:.0f} GiB), start to held, p50", "burst_p50_s", "s"),
        row("B's first refused ask, from the burst's start, p50", "refused_at_p50_s", "s", ratios=False),
        row("hand-over: B's first refused ask to held, p50", "handover_p50_s", "s", ratios=False),
        row("hand-over: B's first refused ask to held, p99", "handover_p99_s", "s", ratios=False),
        row("bytes A released while B burst (mean)", "a_released_gib", "GiB", ratios=False),
        row("B's burst beyond the free memory (mean)", "taken_beyond_free_gib", "GiB", ratios=False),
        row("broker pressure asks to A per burst (mean)", "pressure_asks", "", ratios=False),
        row("demand served over the trace, both models", "served", "%", 100.0),
        row("demand served over the trace, model A", "served_a", "%", 100.0),
        row("demand served over the trace, model B", "served_b", "%", 100.0),
    ]


def _shown(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.2f} s"
    return f"{value:.1f} {unit}".rstrip()


def ratio(row: dict, base: str) -> str:
    """kvcached mode's value over ``base``'s, as the suite shows them (value / baseline)."""
    ours, theirs = row["values"].get("broker"), row["values"].get(base)
    if not row["ratios"] or ours is None or not theirs:
        return "-"
    return f"{ours / theirs:.2f}"


def render(table: list[dict], setups: list[str]) -> str:
    width = 52
    head = f"{'figure':<{width}}" + "".join(f"{name:>24}" for name in setups)
    if "broker" in setups:
        head += "".join(f"{'vs ' + base:>10}" for base in ("static", "alone") if base in setups)
    lines = [head]
    for r in table:
        line = f"{r['figure']:<{width}}" + "".join(f"{r['shown'][name]:>24}" for name in setups)
        if "broker" in setups:
            line += "".join(f"{ratio(r, base):>10}" for base in ("static", "alone") if base in setups)
        lines.append(line)
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    """One panel per set-up: each model's demand (dashed) and live KV (solid), GiB over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.8), sharey=True, squeeze=False)
    for ax, (setup, result) in zip(axes[0], results.items()):
        for name, color in (("A", "tab:blue"), ("B", "tab:orange")):
            samples = result["trace"][name]["samples"]
            t = [s[0] for s in samples]
            ax.plot(t, [s[1] for s in samples], "--", color=color, linewidth=1, label=f"{name} demand")
            ax.plot(t, [s[2] for s in samples], "-", color=color, linewidth=2, label=f"{name} served (live KV)")
        ax.axhline(USABLE_BYTES / GIB / 2, color="grey", linewidth=0.5)
        ax.set_title(f"{SETUPS[setup]}\nserved {100 * served_fraction(result['trace']):.1f}%", fontsize=9)
        ax.set_xlabel("seconds")
        ax.set_ylim(0, DEVICE_BYTES / GIB)
    axes[0][0].set_ylabel("GiB of KV")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


# ----------------------------------------------------------------------------- entry points
def prerequisites() -> str:
    """'' if the simulation can run here, else why not (torch, kvcached 0.1.6's Python code)."""
    if not os.environ.get("KVCACHED_BROKER_KVCACHED_PATH") and KVCACHED_OVERLAY.exists():
        os.environ["KVCACHED_BROKER_KVCACHED_PATH"] = str(KVCACHED_OVERLAY)
    from kvcached_broker.tools.kvcached_sim import missing

    return missing()


def run(out: Path, trials: int, setups: list[str]) -> tuple[list[dict], dict]:
    """Run every set-up; print the table; write handover.json and handover.png.  (rows, results)."""
    workdir = Path(tempfile.mkdtemp(prefix="kb-handover-", dir="/tmp"))
    results = {}
    try:
        for setup in setups:
            results[setup] = run_setup(setup, workdir, trials)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summaries = {name: summary(result) for name, result in results.items()}
    table = rows(summaries)
    print(render(table, setups))
    meta = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "when": time.strftime("%Y-%m-%d %H:%M:%S"), "device_bytes": DEVICE_BYTES, "layers": LAYERS,
            "a_fill_bytes": A_FILL_BYTES, "b_burst_bytes": B_BURST_BYTES, "trace": TRACE,
            "kv_batch": os.environ.get("KVCACHED_BROKER_KV_BATCH", "512MiB (default)")}
    write_json(out / "handover.json", {"meta": meta, "summaries": summaries, "rows": table, "results": results})
    png = out / "handover.png"
    print(f"plot: {png}" if plot(results, png) else "plot skipped: pip install matplotlib")
    return table, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5, help="hand-over trials per set-up (default 5)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated: " + ",".join(SETUPS))
    args = parser.parse_args(argv)
    why = prerequisites()
    if why:
        print(f"hand-over benchmark skipped: {why}")
        return 2
    setups = [s for s in args.setups.split(",") if s]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        parser.error(f"unknown set-up(s): {', '.join(unknown)}")
    started = time.monotonic()
    run(args.out, args.trials, setups)
    print(f"hand-over benchmark: {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
