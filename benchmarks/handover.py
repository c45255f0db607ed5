"""``make bench`` (hand-over): an idle model's kvcached memory moving to a bursting one.

    python benchmarks/handover.py [--trials 5] [--out bench-results] [--setups broker,static,alone]
                                  [--traces burst,overlap,three,replay]
                                  [--broker-log-level warning] [--keep-logs]

Models share one simulated 80 GiB GPU.  Each is a real process with a real kvcached 0.1.6
``KVCacheManager`` built through kvcached's SGLang integration (only ``kvcached.vmm_ops`` is a
double, which charges mapped pages to the shared device: ``kvcached_broker.tools.kvcached_sim``).
The model is Llama-3.1-8B's KV shape (32 layers, 8 KV heads of 128 fp16 values, 16-token blocks:
2 MiB a block, 128 MiB a kvcached page).  Three set-ups run in the same run, each on a fresh
device with fresh processes, and in each the pools may map 95% of the device together (the
broker's default headroom, kvcached's default ``KVCACHED_GPU_UTILIZATION``).  The set-ups run
side by side, each trial and each trace by every set-up in turn (the order rotating), so all
three meet the same machine load:

* ``broker``: kvcached mode: each pool's memory limit is its broker grant; an ask that does not
  fit waits at the broker while the others give back (their prefix caches evict their oldest
  blocks);
* ``static``: static partitioning: no broker, each pool capped at an equal part of the usable
  memory by kvcached's own ``set_memory_limit`` (what ``kvctl limit`` does);
* ``alone``: kvcached alone (``KVCACHED_BROKER=off``: the pools are ungoverned): first come,
  first served against the device's free memory.

What is measured:

* **the hand-over**, ``--trials`` times (two models): A fills 56 GiB and its requests finish
  into its prefix cache (idle); then B asks for 28 GiB of blocks.  (a) the time from B's first
  ask that did not fit at once (the first broker ask its governor met that was refused or had
  to wait for memory, or, without a broker, the first allocation that missed) to B holding all
  28 GiB, p50/p99; and B's whole burst, from its first allocation; (b) the bytes moved: what A
  unmapped while B burst, and what B took beyond the usable memory that was free when it
  started.  A burst that allocates nothing for 2 s (1 s without a broker, where nothing can
  change) is over, incomplete.  Beside kvcached alone's trial runs the hand-over's oracle, the
  device's floor: A, knowing what B lacks beyond the free memory, gives back that many pages
  of its oldest cache the instant B starts (no broker, no refusal, no protocol), so B's burst
  pays only for pages unmapped beside the pages it maps (the oracle column).
* **demand served over traces** (:data:`TRACES`, ``--traces``): the models follow demand curves
  (GiB of live KV over time) sampled every 50 ms; a sample serves ``min(demand, live)``; served
  is the sum over samples divided by the summed demand (per model and in all).  Two oracles:
  with mapping free, what a policy that knew the trace could serve (at each sample, all the
  demand up to the memory the pools may map together), a figure computed, not run; and the
  oracle on this device, run beside kvcached alone's trace on its rig where the demand always
  fits in the device (``burst``, ``three``): each model, knowing the trace, gives back its
  oldest cached pages the instant another lacks them (:meth:`Trace.lender_gives`), so memory
  moves only as fast as pages unmap and map (the oracle column of each model's row, and the
  line under the trace's).  Under each trace, where the demand went unserved: for the rises
  (a step up of a model's demand) at which kvcached mode lost most, the GiB-seconds each set-up
  left unserved from that rise until the model's next one (:func:`unserved_by_rise`); a
  model's losses over all its rises sum to what it did not serve.

Prints a table with ratios against the baselines measured in the same run, and the targets of
issue 31 as met or not, and writes ``handover.json`` and ``handover.png`` (matplotlib, if
installed) under ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
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
#: The pages kvcached's prealloc thread keeps mapped ahead in every pool (its
#: ``KVCACHED_MIN_RESERVED_PAGES``, 5 by default in 0.1.6; read here as the pool processes'
#: ``vmm_ops`` double reads it, which this driver cannot import: it needs torch).
KVCACHED_RESERVED_PAGES = int(os.environ.get("KVCACHED_MIN_RESERVED_PAGES", "5"))
#: What the pools may map together in every set-up: the broker's default headroom (5%) and
#: kvcached's own (``KVCACHED_GPU_UTILIZATION=0.95``: it maps no page that would leave less free).
USABLE_BYTES = DEVICE_BYTES * 95 // 100
A_FILL_BYTES = 56 * GIB
B_BURST_BYTES = 28 * GIB
#: A burst that allocated nothing for this long is over (incomplete).  The broker's pools retry a
#: refused ask after up to 0.5 s, so they get longer; without a broker a stall is final.
STALL_S = {"broker": 2.0, "static": 1.0, "alone": 1.0}
SAMPLE_S = 0.05
#: Per trace, the rises whose unserved demand the table shows (kvcached mode's largest).
RISES_SHOWN = 5
#: A run's logs (``--keep-logs``): a broker's, and a pool process's stderr.
LOG_PATTERNS = ("*-broker.log", "*.err")
SETUPS = {
    "broker": "kvcached mode (grants + pressure)",
    "static": "static partitioning (equal parts)",
    "alone": "kvcached alone (first come, first served)",
}
KVCACHED_OVERLAY = HERE.parent / ".adapter-envs" / "kvcached-0.1.6"


@dataclass(frozen=True)
class Model:
    """One serving process of a trace: its demand steps ``(from t_s, GiB of live KV)``, the
    static memory it allocates before its pool (weights), and its broker limits."""

    name: str
    steps: tuple[tuple[float, float], ...]
    weights_bytes: int = 0
    min_bytes: int = 0
    weight: float = 1.0

    @property
    def instance(self) -> str:
        return self.name if len(self.name) > 1 else f"model-{self.name.lower()}"

    def demand_gib(self, t_s: float) -> float:
        demand = 0.0
        for at_s, gib in self.steps:
            if at_s > t_s:
                break
            demand = gib
        return demand


@dataclass(frozen=True)
class Trace:
    name: str
    description: str
    models: tuple[Model, ...]
    end_s: float

    @property
    def room_gib(self) -> float:
        """What the pools may map together: the usable memory less the models' static memory."""
        return (USABLE_BYTES - sum(m.weights_bytes for m in self.models)) / GIB

    def oracle(self) -> float:
        """The share of the demand an oracle serves: at each sample all of it, up to what the
        pools may map together (:attr:`room_gib`)."""
        room = self.room_gib
        served = wanted = 0.0
        t = 0.0
        while t <= self.end_s:
            demand = sum(m.demand_gib(t) for m in self.models)
            served += min(demand, room)
            wanted += demand
            t += SAMPLE_S
        return served / wanted if wanted else 1.0

    def rises(self) -> list[tuple[str, float, float, float, float]]:
        """Every step at which a model's demand rises: ``(model, t_s, until_s, from_gib, to_gib)``,
        ``until_s`` the model's next rise (infinity after its last), so a model's rises cover
        its whole trace from its first (before which its demand is 0)."""
        out = []
        for model in self.models:
            before, mine = 0.0, []
            for at_s, gib in model.steps:
                if gib > before:
                    mine.append([model.name, at_s, math.inf, before, gib])
                before = gib
            for rise, following in zip(mine, mine[1:]):
                rise[2] = following[1]
            out += [tuple(r) for r in mine]
        return out

    @property
    def always_fits(self) -> bool:
        """Whether the demand fits in what the pools may map together at every sample: only
        then is the oracle on the device (:meth:`lender_gives`) a floor.  Beyond it, which live
        memory goes unserved is a policy's choice (kvcached alone's is first come, first
        served), not the device's."""
        return self.oracle() >= 1.0 - 1e-9

    def lender_gives(self, room_gib: float | None = None) -> dict[str, list[tuple[float, float]]]:
        """The trace oracle's hand-overs: at each step, what each model gives back (GiB of its
        oldest cached blocks, unmapped at once) so that the models whose demand rises there
        find the memory they lack beyond the free memory and their own cache.

        The oracle knows the trace and nothing else: it keeps every finished request cached (as
        kvcached alone does) until another model lacks the memory, then takes the oldest cache
        on the device first (another model's only), and never maps ahead of demand.  At a step,
        falling models cache first; then each rising model, in the trace's order, uses free
        memory first and its own cache after, and takes the rest from the caches of the models
        not rising at that step.  ``room_gib``: what the models' KV may take together (default:
        :attr:`room_gib`).  Model name -> ``(t_s, GiB)``, in step
        order (only models that give).
        """
        room = self.room_gib if room_gib is None else room_gib
        live = {m.name: 0.0 for m in self.models}
        cache: dict[str, list[list[float]]] = {m.name: [] for m in self.models}  # [t_s cached, GiB], oldest first
        gives: dict[str, list[tuple[float, float]]] = {}
        eps = 1e-9

        def cached(name: str) -> float:
            return sum(gib for _, gib in cache[name])

        def take(chunks: list[list[float]], gib: float) -> float:
            taken = 0.0
            while chunks and taken < gib - eps:
                part = min(chunks[0][1], gib - taken)
                chunks[0][1] -= part
                taken += part
                if chunks[0][1] <= eps:
                    chunks.pop(0)
            return taken

        for t in sorted({at for m in self.models for at, _ in m.steps}):
            want = {m.name: m.demand_gib(t) for m in self.models}
            for name, gib in want.items():
                if gib < live[name]:
                    cache[name].append([t, live[name] - gib])
                    live[name] = gib
            rising = {name for name, gib in want.items() if gib - live[name] > eps}
            for name, gib in want.items():
                need = gib - live[name]
                if need <= eps:
                    continue
                free = room - sum(live.values()) - sum(cached(n) for n in cache)
                lack = max(0.0, need - max(0.0, free) - cached(name))
                while lack > eps:
                    lenders = [n for n in cache if n not in rising and cache[n]]
                    if not lenders:
                        break
                    oldest = min(lenders, key=lambda n: cache[n][0][0])
                    given = take(cache[oldest], lack)
                    lack -= given
                    if given <= eps:
                        continue
                    steps = gives.setdefault(oldest, [])
                    if steps and steps[-1][0] == t:
                        steps[-1] = (t, steps[-1][1] + given)
                    else:
                        steps.append((t, given))
                free = room - sum(live.values()) - sum(cached(n) for n in cache)
                fresh = min(need, max(0.0, free))
                live[name] += fresh + take(cache[name], need - fresh)
        return gives


def _replay_trace() -> Trace:
    """``make replay``'s generated trace (tools/replay.py, seed 7: three Llama-3.1-8B and a
    DeepSeek-V4 with static side pools, floors and weights on one 80 GiB GPU), 120 trace seconds
    replayed ten times faster, as ``make replay`` replays it: each model a kvcached pool here."""
    from kvcached_broker.tools import replay

    lines = replay.generate(seed=7, duration_s=120.0)
    speed = 10.0
    models = []
    for spec in (line for line in lines if line["kind"] == "model"):
        page = spec["page_bytes"]
        steps = tuple((line["t"] / speed, line["pages"] * page / GIB) for line in lines
                      if line["kind"] == "demand" and line["model"] == spec["name"])
        models.append(Model(spec["name"], steps, weights_bytes=sum(spec["pools"].values()),
                            min_bytes=spec["min_bytes"], weight=spec["weight"]))
    return Trace("replay", "make replay's trace: 4 models, floors, static pools (12 s)", tuple(models), 12.0)


#: Live KV demand in GiB, ``(from t_s, GiB)`` steps.  ``burst`` is the hand-over's own: A peaks
#: then idles (its finished requests stay cached) and comes back; B bursts while A idles.  The
#: others have peaks the hand-over does not use: two models that peak twice, partly together,
#: once past what the device holds (``overlap``); three models with staggered peaks, each past
#: its third (``three``); and ``make replay``'s trace (``replay``).
TRACES: dict[str, Trace] = {
    "burst": Trace("burst", "A peaks, idles, comes back; B bursts while A idles", (
        Model("A", ((0.0, 4), (1.0, 56), (5.0, 6), (13.0, 30))),
        Model("B", ((0.0, 4), (6.0, 44), (12.0, 8))),
    ), 16.0),
    "overlap": Trace("overlap", "two models peak twice; the peaks partly overlap", (
        Model("A", ((0.0, 4), (1.0, 44), (4.0, 8), (8.0, 40), (11.0, 6))),
        Model("B", ((0.0, 4), (3.0, 30), (6.0, 6), (9.5, 44), (13.0, 6))),
    ), 16.0),
    "three": Trace("three", "three models, staggered peaks past their thirds", (
        Model("A", ((0.0, 3), (1.0, 40), (4.0, 5), (12.0, 26))),
        Model("B", ((0.0, 3), (3.0, 30), (7.0, 5), (13.0, 22))),
        Model("C", ((0.0, 3), (5.0, 40), (9.0, 4), (14.0, 26))),
    ), 16.0),
}
#: Built on first use (it imports the replay tool).
LAZY_TRACES = {"replay": _replay_trace}
TRACE_NAMES = ("burst", "overlap", "three", "replay")


def trace_named(name: str) -> Trace:
    if name not in TRACES:
        TRACES[name] = LAZY_TRACES[name]()
    return TRACES[name]


# ----------------------------------------------------------------------------- a rig
@dataclass
class Rig:
    """One set-up: the shared device's usage directory, a broker (or none), one pool per model."""

    setup: str
    usage: Path
    pools: list
    models: tuple[Model, ...]
    block_bytes: int
    broker_endpoint: str | None = None

    @property
    def a(self):
        return self.pools[0]

    @property
    def b(self):
        return self.pools[1]

    def blocks(self, size_bytes: float) -> int:
        return int(size_bytes // self.block_bytes)

    def gib(self, blocks: float) -> float:
        return blocks * self.block_bytes / GIB


@contextmanager
def rig(setup: str, workdir: Path, models: tuple[Model, ...], broker_log_level: str = "warning") -> Iterator[Rig]:
    """Start ``setup``'s broker (kvcached mode only, with the models' limits, logging at
    ``broker_log_level``) and one pool process per model (after its static memory); stop them
    after.  Their logs are ``workdir``'s ``*-broker.log`` and ``*.err`` files."""
    from kvcached_broker.client.admin import AdminClient
    from kvcached_broker.tools.kvcached_sim.pools import PoolProcess
    from kvcached_broker.tools.launch import BrokerLauncher

    tag = f"{setup}-{len(models)}-{len(list(workdir.iterdir()))}"
    usage = workdir / tag / "gpu-usage"
    usage.mkdir(parents=True)
    endpoint = f"ipc://{workdir}/{tag}.sock"
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_BROKER"}
    if setup != "broker":
        env["KVCACHED_BROKER"] = "off"
    launcher = None
    if setup == "broker":
        launcher = BrokerLauncher(endpoint, simulate=f"{DEVICE_BYTES // GIB}GiB", state_dir=workdir / tag / "state",
                                  args=["--headroom", "5%", "--simulate-usage-dir", str(usage), "--log-level", broker_log_level],
                                  log=workdir / f"{tag}-broker.log")
        launcher.start()
        limited = [m for m in models if m.min_bytes or m.weight != 1.0]
        if limited:
            with AdminClient(endpoint) as admin:
                for m in limited:
                    admin.limit(m.instance, min_bytes=m.min_bytes, weight=m.weight)
    base = ("--layers", str(LAYERS), "--virtual-tokens", str(VIRTUAL_TOKENS), "--evict", "oldest")
    pools = [PoolProcess.start(endpoint, usage, DEVICE_BYTES, m.instance, env=env, wait=False,
                               args=base + (("--weights-bytes", str(m.weights_bytes)) if m.weights_bytes else ()),
                               stderr=workdir / f"{tag}-{m.name}.err") for m in models]
    try:
        for pool in pools:
            pool.wait_ready()
        page_bytes = pools[0].ready["pools"][0]["page_bytes"]
        rig_ = Rig(setup, usage, pools, models, page_bytes // pools[0].ready["blocks_per_page"],
                   endpoint if launcher is not None else None)
        if setup == "static":
            for pool in pools:
                pool.request("limit", bytes=static_limit_bytes(page_bytes, models))
        yield rig_
    finally:
        for pool in pools:
            pool.stop()
        if launcher is not None:
            launcher.stop()


def static_limit_bytes(page_bytes: int, models: tuple[Model, ...]) -> int:
    """An equal part of the usable memory less the models' static memory and every pool's zero
    page, in whole pages."""
    n = len(models)
    room = USABLE_BYTES - sum(m.weights_bytes for m in models) - n * page_bytes
    return room // n // page_bytes * page_bytes


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
            if inst["name"] == r.models[0].instance:
                return dict(inst.get("pressure") or {})
    return {}


def reset(r: Rig) -> None:
    """Every pool empty: every block freed, the governors have given back what is idle."""
    for pool in reversed(r.pools):
        pool.request("drop_cache")
        pool.request("free", blocks=1 << 30)
        pool.request("settle")


# ----------------------------------------------------------------------------- the hand-over
def a_fills_and_idles(r: Rig) -> dict:
    """Every pool empty, then A fills 56 GiB and its requests finish into its prefix cache (the
    governors settled after): A's fill's reply."""
    reset(r)
    a_fill = r.a.request("fill", blocks=r.blocks(A_FILL_BYTES), stall_s=STALL_S[r.setup])
    r.a.request("cache", blocks=a_fill["held_blocks"])
    r.a.request("settle")
    return a_fill


def handover_trial(r: Rig) -> dict:
    """A fills 56 GiB and idles (all cached); B bursts 28 GiB.  Times, bytes moved, completion."""
    a_fill = a_fills_and_idles(r)
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
    handover = burst["elapsed_s"] - refused_at if complete and refused_at is not None else None
    # What of the hand-over B spent mapping (kvcached's alloc, on the simulated device): the rest
    # is protocol (broker round trips, waiting for A's pages, the engine's retries).
    mapping = (burst.get("after_refusal") or {}).get("alloc", {}).get("s", 0.0)
    return {
        "a_cached_gib": r.gib(a_fill["held_blocks"]), "b_held_gib": r.gib(burst["held_blocks"]),
        "complete": complete, "burst_s": burst["elapsed_s"] if complete else None,
        "refused_at_s": refused_at, "handover_s": handover,
        "handover_mapping_s": mapping if handover is not None else None,
        "handover_protocol_s": max(0.0, handover - mapping) if handover is not None else None,
        "a_released_bytes": max(0, a_before - a_after),
        "taken_beyond_free_bytes": max(0, (b_after - b_before) - free_before),
        "free_before_bytes": free_before, "pressure_on_a": pressure,
    }


def oracle_handover_trial(r: Rig) -> dict:
    """The hand-over's floor on this device: as :func:`handover_trial`, on kvcached alone's rig,
    but A, knowing what B lacks, gives it back the instant B starts (its oldest cached blocks
    freed, its limit lowered and its reserve trimmed, which unmaps them) while B bursts: no
    broker, no refusal, no retry but the engine's own step; only pages unmapped beside pages
    mapped."""
    a_fills_and_idles(r)
    a_before, free_before = device_bytes(r.a), free_usable_bytes(r.usage)
    capacity_bytes = r.a.request("status")["limit"]["current_capacity_bytes"]
    blocks_per_page = r.a.ready["blocks_per_page"]
    page_bytes = r.block_bytes * blocks_per_page
    lack_pages = max(0, -(-(B_BURST_BYTES - free_before) // page_bytes))
    want = r.blocks(B_BURST_BYTES)
    r.b.send("fill", blocks=want, timeout_s=60.0, stall_s=STALL_S[r.setup])
    r.a.send("give", blocks=lack_pages * blocks_per_page, page_bytes=page_bytes)
    r.a.receive()
    burst = r.b.receive()
    a_after = device_bytes(r.a)
    r.a.request("limit", bytes=capacity_bytes)  # kvcached alone's pool again, for the next trial
    complete = burst["held_blocks"] >= want
    return {"complete": complete, "burst_s": burst["elapsed_s"] if complete else None,
            "b_held_gib": r.gib(burst["held_blocks"]), "a_released_bytes": max(0, a_before - a_after),
            "lacked_bytes": lack_pages * page_bytes}


# ----------------------------------------------------------------------------- the traces
def schedule_blocks(r: Rig, model: Model, end_s: float) -> list[list[float]]:
    return [[t, r.blocks(gib * GIB)] for t, gib in model.steps] + [[end_s, r.blocks(model.steps[-1][1] * GIB)]]


def run_trace(r: Rig, trace: Trace, gives: dict[str, list[list[float]]] | None = None) -> dict:
    """Every model follows its demand at once, from the same instant; served and demand per model.
    ``gives``: model name -> the pool's ``[t_s, blocks, page_bytes]`` hand-overs (the oracle's)."""
    reset(r)
    start_at = time.time() + 0.5
    for pool, model in zip(r.pools, trace.models):
        pool.send("track", schedule=schedule_blocks(r, model, trace.end_s), start_at=start_at, sample_s=SAMPLE_S,
                  gives=(gives or {}).get(model.name, []))
    out = {}
    for pool, model in zip(r.pools, trace.models):
        result = pool.receive()
        out[model.name] = {
            "served_gib_s": r.gib(result["served_block_s"]), "demand_gib_s": r.gib(result["demand_block_s"]),
            "samples": [[t, r.gib(d), r.gib(live), r.gib(cached), dev / GIB] for t, d, live, cached, dev in result["samples"]],
        }
    return out


def oracle_trace(r: Rig, trace: Trace) -> dict:
    """The trace's oracle on this device, on kvcached alone's rig: each model gives back, at the
    instant another lacks it, what :meth:`Trace.lender_gives` says (its oldest cached blocks,
    in whole pages, unmapped at once); nothing else differs from kvcached alone.  What it
    serves is the floor mapping sets: memory moves only by pages unmapped and mapped."""
    blocks_per_page = r.a.ready["blocks_per_page"]
    page_bytes = r.block_bytes * blocks_per_page
    # What the KV may take: each pool also maps its zero page and kvcached's reserve.
    kept_bytes = len(trace.models) * (1 + KVCACHED_RESERVED_PAGES) * page_bytes
    gives = {name: [[t, pages * blocks_per_page, page_bytes] for t, gib in steps
                    if (pages := math.ceil(gib * GIB / page_bytes - 1e-9)) > 0]
             for name, steps in trace.lender_gives(trace.room_gib - kept_bytes / GIB).items()}
    return run_trace(r, trace, gives)


def served_fraction(trace: dict, names=None) -> float:
    names = list(trace) if names is None else names
    return sum(trace[n]["served_gib_s"] for n in names) / sum(trace[n]["demand_gib_s"] for n in names)


def unserved_by_rise(trace: Trace, run: dict) -> dict[tuple[str, float], float]:
    """For each rising step of :meth:`Trace.rises`, the demand ``run`` (one set-up's run of the
    trace: per model, samples ``[t_s, demand GiB, live GiB, ...]``) left unserved from that step
    until the model's next rise, in GiB-seconds (each sample counts ``SAMPLE_S``, as served
    does).  What a model did not serve is the sum over its rises, so they say where it was
    lost: a climb on free memory, a hand-over, a return to its own cache."""
    lost = {}
    for name, at_s, end_s, _, _ in trace.rises():
        samples = run[name]["samples"]
        lost[(name, at_s)] = SAMPLE_S * sum(max(0.0, demand - live) for t, demand, live, *_ in samples
                                            if at_s <= t < end_s)
    return lost


def unserved_key(trace: str, model: str, at_s: float) -> str:
    """How a rise is named in the summaries (after ``unserved:`` or ``oracle_unserved:``)."""
    return f"{trace}:{model}@{at_s:g}"


# ----------------------------------------------------------------------------- one set-up
def run_setups(setups: list[str], workdir: Path, trials: int, traces: list[str],
               broker_log_level: str = "warning") -> dict[str, dict]:
    """The hand-over trials, then every trace, each set-up's run beside the others': one rig
    (fresh device and processes) per set-up and set of models, all started together, and each
    trial or trace run by every set-up in turn (the order rotating), so that all three meet the
    same machine load.  Set-up -> its trials, traces and the seconds they took."""
    results = {setup: {"setup": setup, "label": SETUPS[setup], "trials": [], "oracle_trials": [], "traces": {},
                       "oracle_traces": {}, "wall_s": 0.0}
               for setup in setups}
    groups: dict[tuple[Model, ...], list[str]] = {}
    two = TRACES["burst"].models
    if trials:
        groups[two] = []
    for name in traces:
        groups.setdefault(trace_named(name).models, []).append(name)
    turn = 0
    for models, names in groups.items():
        with ExitStack() as stack:
            rigs = {setup: stack.enter_context(rig(setup, workdir, models, broker_log_level)) for setup in setups}
            steps = [None] * (trials if models == two else 0) + list(names)  # None: a hand-over trial
            for step in steps:
                for setup in setups[turn % len(setups):] + setups[:turn % len(setups)]:
                    started = time.monotonic()
                    if step is None:
                        results[setup]["trials"].append(handover_trial(rigs[setup]))
                    else:
                        results[setup]["traces"][step] = run_trace(rigs[setup], trace_named(step))
                    results[setup]["wall_s"] += time.monotonic() - started
                    if setup != "alone":
                        continue
                    # The floor, on the rig with no limits (its time is not kvcached alone's).
                    if step is None:
                        results[setup]["oracle_trials"].append(oracle_handover_trial(rigs[setup]))
                    elif trace_named(step).always_fits:
                        results[setup]["oracle_traces"][step] = oracle_trace(rigs[setup], trace_named(step))
                turn += 1
    for setup in setups:
        result = results[setup]
        print(f"  {SETUPS[setup]}: {trials} trials and {len(result['traces'])} trace(s) in {result['wall_s']:.0f} s",
              flush=True)
    return results


def paired_burst_ratio(results: dict[str, dict], ours: str = "broker", key: str = "trials") -> float | None:
    """p50 over trials of a burst (kvcached mode's, or the oracle's: ``ours``'s ``key``) over
    static partitioning's in the same turn (a turn's trials run one after another, so under
    about the same load; the oracle's right after kvcached alone's); None unless both
    completed every trial."""
    if ours not in results or "static" not in results:
        return None
    pairs = list(zip(results[ours][key], results["static"]["trials"]))
    if not pairs or any(b["burst_s"] is None or not s["burst_s"] for b, s in pairs):
        return None
    return percentile([b["burst_s"] / s["burst_s"] for b, s in pairs], 0.5)


def summary(result: dict) -> dict:
    """The figures of one set-up (None where it has none: no refusal, or never completed)."""
    trials = result["trials"]
    done = [t for t in trials if t["complete"]]
    handovers = [t["handover_s"] for t in trials if t["handover_s"] is not None]
    refused = [t["refused_at_s"] for t in trials if t["refused_at_s"] is not None]
    bursts = [t["burst_s"] for t in done]
    # Protocol time over every trial (all complete), a trial that never waited spending none.
    waited = [t for t in done if t.get("handover_protocol_s") is not None]
    protocol = [t["handover_protocol_s"] if t.get("handover_protocol_s") is not None else 0.0 for t in done]
    protocol_ok = bool(waited) and len(done) == len(trials)
    mapping = [t["handover_mapping_s"] for t in waited]
    out = {
        "complete": len(done), "trials": len(trials),
        "b_held_gib_max": max((t["b_held_gib"] for t in trials), default=0.0),
        "burst_p50_s": percentile(bursts, 0.5) if bursts else None,
        "handover_p50_s": percentile(handovers, 0.5) if handovers and len(done) == len(trials) else None,
        "handover_p99_s": percentile(handovers, 0.99) if handovers and len(done) == len(trials) else None,
        "handovers": len(handovers),
        "handover_mapping_p50_s": percentile(mapping, 0.5) if mapping else None,
        "protocol_p50_s": percentile(protocol, 0.5) if protocol_ok else None,
        "protocol_p99_s": percentile(protocol, 0.99) if protocol_ok else None,
        "refused": sum(t["refused_at_s"] is not None for t in trials),
        "refused_at_p50_s": percentile(refused, 0.5) if refused else None,
        "pressure_asks": sum(t["pressure_on_a"].get("asks", 0) for t in trials) / len(trials) if trials else 0,
        "a_released_gib": sum(t["a_released_bytes"] for t in trials) / len(trials) / GIB if trials else 0,
        "taken_beyond_free_gib": sum(t["taken_beyond_free_bytes"] for t in trials) / len(trials) / GIB if trials else 0,
    }
    oracle = result.get("oracle_trials") or []
    if oracle:
        bursts = [t["burst_s"] for t in oracle if t["complete"]]
        out["oracle_burst_p50_s"] = percentile(bursts, 0.5) if len(bursts) == len(oracle) else None
        out["oracle_released_gib"] = sum(t["a_released_bytes"] for t in oracle) / len(oracle) / GIB
    for name, run in result["traces"].items():
        out[f"served:{name}"] = served_fraction(run)
        for model in trace_named(name).models:
            out[f"served:{name}:{model.name}"] = served_fraction(run, [model.name])
    for prefix, runs in (("unserved", result["traces"]), ("oracle_unserved", result.get("oracle_traces") or {})):
        for name, run in runs.items():
            for (model, at_s), gib_s in unserved_by_rise(trace_named(name), run).items():
                out[f"{prefix}:{unserved_key(name, model, at_s)}"] = gib_s
    for name, run in (result.get("oracle_traces") or {}).items():
        out[f"oracle_served:{name}"] = served_fraction(run)
        for model in trace_named(name).models:
            out[f"oracle_served:{name}:{model.name}"] = served_fraction(run, [model.name])
    return out


# ----------------------------------------------------------------------------- output
def rows(summaries: dict, traces: list[str]) -> list[dict]:
    """The table: each figure for every set-up, with broker/static and broker/alone ratios."""
    def why_none(s: dict, key: str) -> str:
        if key not in s:
            return "-"
        if key.startswith(("handover", "refused", "protocol")) and s["refused"] == 0 and s["trials"]:
            return "no refusal"
        if s["complete"] < s["trials"]:
            return f"never ({s['b_held_gib_max']:.1f} of {B_BURST_BYTES / GIB:.0f} GiB)"
        return "-"

    def row(figure: str, key: str, unit: str, scale: float = 1.0, ratios: bool = True,
            oracle: float | None = None) -> dict:
        """``oracle``: the oracle's figure, in the row's unit (None: it has none)."""
        values = {name: (None if s.get(key) is None else s[key] * scale) for name, s in summaries.items()}
        shown = {name: _shown(v, unit) if v is not None else why_none(s, key)
                 for (name, s), v in zip(summaries.items(), values.values())}
        return {"figure": figure, "key": key, "unit": unit, "values": values, "shown": shown, "ratios": ratios,
                "oracle": oracle}

    burst_gib = B_BURST_BYTES / GIB
    table = []
    floor = summaries.get("alone", {})
    if any(s["trials"] for s in summaries.values()):
        table += [
            row(f"B's burst ({burst_gib:.0f} GiB), start to held, p50", "burst_p50_s", "s",
                oracle=floor.get("oracle_burst_p50_s")),
            row("  over static's in the same turn, p50 of the trials' ratios", "burst_vs_static_paired", "x",
                ratios=False, oracle=floor.get("oracle_vs_static_paired")),
            row("B's first ask that did not fit, from the burst's start, p50", "refused_at_p50_s", "s", ratios=False),
            row("hand-over: B's first ask that did not fit to held, p50", "handover_p50_s", "s", ratios=False),
            row("hand-over: B's first ask that did not fit to held, p99", "handover_p99_s", "s", ratios=False),
            row("  of which B mapping what it got (kvcached's alloc), p50", "handover_mapping_p50_s", "s", ratios=False),
            row("hand-over protocol time (the rest; 0 if none waited), p50", "protocol_p50_s", "s", ratios=False),
            row("hand-over protocol time (0 if none waited), p99", "protocol_p99_s", "s", ratios=False),
            row("trials in which B's ask did not fit at once", "handovers", "", ratios=False),
            row("bytes A released while B burst (mean)", "a_released_gib", "GiB", ratios=False,
                oracle=floor.get("oracle_released_gib")),
            row("B's burst beyond the free memory (mean)", "taken_beyond_free_gib", "GiB", ratios=False),
            row("broker pressure asks to A per burst (mean)", "pressure_asks", "", ratios=False),
        ]
    for name in traces:
        trace = trace_named(name)
        table.append(row(f"demand served, {name} trace, all models (oracle: mapping free)", f"served:{name}", "%",
                         100.0, oracle=100.0 * trace.oracle()))
        measured = floor.get(f"oracle_served:{name}")
        if measured is not None:
            table.append(row("  the oracle on this device (mapping paid), all models", "", "%", ratios=False,
                             oracle=100.0 * measured))
        for model in trace.models:
            model_floor = floor.get(f"oracle_served:{name}:{model.name}")
            table.append(row(f"demand served, {name} trace, {model.instance}", f"served:{name}:{model.name}", "%",
                             100.0, oracle=None if model_floor is None else 100.0 * model_floor))
        instances = {m.name: m.instance for m in trace.models}
        for model, at_s, _, from_gib, to_gib in largest_losses(summaries, name, RISES_SHOWN):
            key = f"unserved:{unserved_key(name, model, at_s)}"
            table.append(row(f"  GiB*s unserved: {instances[model]} rising {from_gib:.4g}->{to_gib:.4g} GiB at {at_s:g} s",
                             key, "", ratios=False, oracle=floor.get(f"oracle_{key}")))
    return table


def largest_losses(summaries: dict, name: str, count: int) -> list[tuple[str, float, float, float, float]]:
    """The ``count`` rises of trace ``name`` at which kvcached mode (or, where it did not run the
    trace, the first set-up that did) left the most demand unserved, largest first."""
    rises = trace_named(name).rises()
    for setup in sorted(summaries, key=lambda s: s != "broker"):
        lost = {r: summaries[setup].get(f"unserved:{unserved_key(name, r[0], r[1])}") for r in rises}
        if any(v is not None for v in lost.values()):
            return sorted((r for r in rises if lost[r] is not None), key=lambda r: -lost[r])[:count]
    return []


def checks(summaries: dict, traces: list[str]) -> list[dict]:
    """Issue 31's targets, each met or not (only where every set-up it compares ran)."""
    out: list[dict] = []
    broker, static, alone = (summaries.get(k) for k in ("broker", "static", "alone"))
    if broker is None:
        return out
    if static is not None and broker.get("burst_p50_s") and static.get("burst_p50_s"):
        ratio = broker["burst_p50_s"] / static["burst_p50_s"]
        paired = broker.get("burst_vs_static_paired")
        shown = f"{ratio:.2f}x" + ("" if paired is None else f" (trial by trial: {paired:.2f}x)")
        floor = (alone or {}).get("oracle_burst_p50_s")
        if floor:
            floor_paired = alone.get("oracle_vs_static_paired")
            shown += (f"; the oracle's, the device's floor: {floor / static['burst_p50_s']:.2f}x"
                      + ("" if floor_paired is None else f" (trial by trial: {floor_paired:.2f}x)"))
        out.append({"target": "B's burst p50 <= 1.2x static's", "value": shown, "met": ratio <= 1.2})
    if broker.get("trials"):
        p50 = broker.get("protocol_p50_s")
        no_wait = broker["refused"] == 0 and broker["complete"] == broker["trials"]
        out.append({"target": "hand-over protocol time p50 <= 100 ms",
                    "value": "no ask waited" if no_wait else ("-" if p50 is None else f"{p50 * 1e3:.0f} ms"),
                    "met": no_wait or (p50 is not None and p50 <= 0.1)})
    for name in traces:
        trace = trace_named(name)
        total = broker.get(f"served:{name}")
        if total is None:
            continue
        target_all = min(0.97, trace.oracle())
        measured = (alone or {}).get(f"oracle_served:{name}")
        out.append({"target": f"{name}: all models >= {100 * target_all:.1f}%"
                              + (" (the oracle's)" if target_all < 0.97 else ""),
                    "value": f"{100 * total:.1f}%" + ("" if measured is None else
                                                      f"; the oracle on this device {100 * measured:.1f}%"),
                    "met": total >= target_all - 1e-9})
        for model in trace.models:
            key = f"served:{name}:{model.name}"
            ours = broker[key]
            best = max((s[key] for s in (static, alone) if s is not None and s.get(key) is not None), default=0.0)
            floor = max(best, 0.95 if trace.oracle() >= 0.97 else 0.0)
            measured = (alone or {}).get(f"oracle_served:{name}:{model.name}")
            out.append({"target": f"{name}: {model.instance} >= max(best alternative, 95%)"
                                  if trace.oracle() >= 0.97 else f"{name}: {model.instance} >= best alternative",
                        "value": f"{100 * ours:.1f}% (best alternative {100 * best:.1f}%"
                                 + ("" if measured is None else f"; the oracle on this device {100 * measured:.1f}%")
                                 + ")",
                        "met": ours >= floor - 1e-9})
    return out


def _shown(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:.1f} {unit}".rstrip()


def ratio(row: dict, base: str) -> str:
    """kvcached mode's value over ``base``'s, as the suite shows them (value / baseline)."""
    ours, theirs = row["values"].get("broker"), row["values"].get(base)
    if not row["ratios"] or ours is None or not theirs:
        return "-"
    return f"{ours / theirs:.2f}"


def render(table: list[dict], setups: list[str], met: list[dict] | None = None) -> str:
    width = 60
    head = f"{'figure':<{width}}" + "".join(f"{name:>24}" for name in setups) + f"{'oracle':>9}"
    if "broker" in setups:
        head += "".join(f"{'vs ' + base:>10}" for base in ("static", "alone") if base in setups)
    lines = [head]
    for r in table:
        oracle = _shown(r["oracle"], r["unit"]) if r.get("oracle") is not None else "-"
        line = f"{r['figure']:<{width}}" + "".join(f"{r['shown'][name]:>24}" for name in setups) + f"{oracle:>9}"
        if "broker" in setups:
            line += "".join(f"{ratio(r, base):>10}" for base in ("static", "alone") if base in setups)
        lines.append(line)
    if met:
        lines.append("")
        lines.append("issue 31's targets (kvcached mode):")
        lines += [f"  [{'met' if c['met'] else 'NOT met'}] {c['target']}: {c['value']}" for c in met]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    """One panel per set-up and trace: each model's demand (dashed) and live KV (solid), GiB over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [n for n in TRACE_NAMES if any(n in r["traces"] for r in results.values())]
    if not names:
        return False
    fig, axes = plt.subplots(len(names), len(results), figsize=(5 * len(results), 3.4 * len(names)),
                             sharey=True, squeeze=False)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for row_axes, name in zip(axes, names):
        for ax, (setup, result) in zip(row_axes, results.items()):
            run = result["traces"].get(name)
            if run is None:
                continue
            for model, color in zip(run, colors):
                samples = run[model]["samples"]
                t = [s[0] for s in samples]
                ax.plot(t, [s[1] for s in samples], "--", color=color, linewidth=1, label=f"{model} demand")
                ax.plot(t, [s[2] for s in samples], "-", color=color, linewidth=2, label=f"{model} served")
            ax.set_title(f"{name}: {SETUPS[setup]}\nserved {100 * served_fraction(run):.1f}%", fontsize=9)
            ax.set_xlabel("seconds")
            ax.set_ylim(0, DEVICE_BYTES / GIB)
        row_axes[0].set_ylabel("GiB of KV")
        row_axes[0].legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return True


# ----------------------------------------------------------------------------- entry points
def prerequisites() -> str:
    """'' if the simulation can run here, else why not (torch, kvcached 0.1.6's Python code)."""
    if not os.environ.get("KVCACHED_BROKER_KVCACHED_PATH") and KVCACHED_OVERLAY.exists():
        os.environ["KVCACHED_BROKER_KVCACHED_PATH"] = str(KVCACHED_OVERLAY)
    from kvcached_broker.tools.kvcached_sim import missing

    return missing()


def run(out: Path, trials: int, setups: list[str], traces: list[str] | None = None, *,
        broker_log_level: str = "warning", keep_logs: bool = False) -> tuple[list[dict], dict]:
    """Run every set-up; print the table; write handover.json and handover.png.  (rows, results).
    ``keep_logs``: the brokers' and pool processes' logs are copied under ``out/logs`` (the
    brokers log at ``broker_log_level``; ``info`` names every pressure ask, its kind and size)."""
    traces = list(TRACE_NAMES) if traces is None else traces
    workdir = Path(tempfile.mkdtemp(prefix="kb-handover-", dir="/tmp"))
    results = {}
    load_before = os.getloadavg()
    try:
        results = run_setups(setups, workdir, trials, traces, broker_log_level)
    finally:
        try:
            if keep_logs:
                print(f"logs: {copy_logs(workdir, out / 'logs')}")
        except OSError as exc:  # the logs are a help; the results still get written
            print(f"logs not kept: {exc}")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    summaries = {name: summary(result) for name, result in results.items()}
    if "broker" in summaries:
        summaries["broker"]["burst_vs_static_paired"] = paired_burst_ratio(results)
    if "alone" in summaries:
        summaries["alone"]["oracle_vs_static_paired"] = paired_burst_ratio(results, "alone", "oracle_trials")
    table = rows(summaries, traces)
    met = checks(summaries, traces)
    print(render(table, setups, met))
    load_after = os.getloadavg()
    print(f"machine load (1-minute average) before and after: {load_before[0]:.1f}, {load_after[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    meta = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "when": time.strftime("%Y-%m-%d %H:%M:%S"), "device_bytes": DEVICE_BYTES, "layers": LAYERS,
            "a_fill_bytes": A_FILL_BYTES, "b_burst_bytes": B_BURST_BYTES, "load_before": load_before,
            "load_after": load_after, "traces": {n: {"oracle": trace_named(n).oracle(),
                                                    "models": {m.name: m.steps for m in trace_named(n).models}}
                                                for n in traces},
            "kv_batch": os.environ.get("KVCACHED_BROKER_KV_BATCH", "512MiB (default)")}
    write_json(out / "handover.json", {"meta": meta, "summaries": summaries, "rows": table, "checks": met,
                                       "results": results})
    png = out / "handover.png"
    print(f"plot: {png}" if plot(results, png) else "plot skipped: pip install matplotlib")
    return table, results


def copy_logs(workdir: Path, dest: Path) -> Path:
    """Copy every rig's logs (a broker's ``*-broker.log``, a pool process's ``*.err``, named after
    its set-up, model count, rig and model) from ``workdir`` to ``dest``, after removing the logs
    an earlier run left there (only those: anything else in ``dest`` stays); ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for pattern in LOG_PATTERNS:  # (no file matches two patterns)
        for old in dest.glob(pattern):
            if old.is_file():
                old.unlink()
        for log in sorted(workdir.glob(pattern)):
            if log.is_file():
                shutil.copy2(log, dest / log.name)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5, help="hand-over trials per set-up (default 5; 0: none)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated: " + ",".join(SETUPS))
    parser.add_argument("--traces", default=",".join(TRACE_NAMES),
                        help="comma-separated demand traces: " + ",".join(TRACE_NAMES) + " (default all; '' none)")
    from kvcached_broker.broker.config import LOG_LEVELS

    parser.add_argument("--broker-log-level", default="warning", choices=LOG_LEVELS, metavar="LEVEL",
                        help="the brokers' log level (default warning; info logs every pressure ask): "
                             + ", ".join(LOG_LEVELS))
    parser.add_argument("--keep-logs", action="store_true",
                        help="copy the brokers' and pool processes' logs under OUT/logs")
    args = parser.parse_args(argv)
    setups = [s for s in args.setups.split(",") if s]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        parser.error(f"unknown set-up(s): {', '.join(unknown)}")
    traces = [t for t in args.traces.split(",") if t]
    unknown = [t for t in traces if t not in TRACE_NAMES]
    if unknown:
        parser.error(f"unknown trace(s): {', '.join(unknown)} (known: {', '.join(TRACE_NAMES)})")
    if args.trials < 0:
        parser.error("--trials must be 0 or more")
    why = prerequisites()
    if why:
        print(f"hand-over benchmark skipped: {why}")
        return 2
    started = time.monotonic()
    run(args.out, args.trials, setups, traces, broker_log_level=args.broker_log_level, keep_logs=args.keep_logs)
    print(f"hand-over benchmark: {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
