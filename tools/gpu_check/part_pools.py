"""Part: kvcached mode with kvcached's own allocator, two pools under the broker, and the hand-over.

Two pool processes, each one real kvcached 0.1.6 ``KVCacheManager`` built through kvcached's
SGLang integration with the broker's kvcached patch (Llama-3.1-8B's KV shape: 32 layers, 128
MiB pages): on a GPU with kvcached's CUDA extension (:mod:`.pool_gpu`), simulated with its test
double (``tools/kvcached_sim``).  A third process that reports nothing takes all but
``ROOM_BYTES`` of what the broker could grant, so the pools compete for 16 GiB.  Then, ``TRIALS``
times: A fills 10 GiB and goes idle (its blocks stay in its prefix cache), B bursts 8 GiB and
gets what is missing from A through the broker's pressure.  A trial in which B's burst fitted in
what was free once A filled took none of A's room: it is noted, with A's fill, both charges and
B's grant, and run again (at most ``TRIAL_REDOS`` reruns in all, each only with a trial's time
left; a trial kept that way fails the check).

Measured: each hand-over (B's first refused ask to B holding everything), split into B's broker
round trips (``acquire``), B's allocations (kvcached's ``alloc``, which maps pages itself only
when its reserve is empty; what its prealloc thread maps in the background is not in it: the
runner sets the pages moved against the driver's cost per page, from part vmm_pages, for that),
A's releases and frees (its unmapping), and the rest (waiting); and what a pool process costs
on the device besides its pages.

Checked at every sample (every ``SAMPLE_S``, from the pools' start on), with the broker's status
read just before and just after the device: what kvcached has mapped (its ``/dev/shm`` segment:
in use plus reserve) is at most what the broker granted the process; and what the device
measures the process using is at most what the broker charges it from its reports (its pools,
the runtime base it pinned, its pages).  A device reading above the charge for less than
``NVML_GRACE_S`` is counted but not a violation on a GPU (NVML may trail an unmap: part
broker_nvml measures by how much); the simulated device has no lag and is read with its
allocation lock held, so there any excess is a violation.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import ExitStack
from typing import Any

from ...client.protocol import RUNTIME_BASE_POOL
from ...client.units import format_bytes
from .context import PartContext
from .devices import GIB, Device
from .measure import charged_by_pid, granted_by_pid, instance, percentile, session_of, wait_for
from .record import Skip
from .workers import start_workers

LAYERS = 32
VIRTUAL_TOKENS = 1 << 19  # 64 GiB of virtual KV per pool
ROOM_BYTES = 16 * GIB
A_FILL_BYTES = 10 * GIB
#: The ballast allocates in CUDA's 2 MiB allocation granules.
CUDA_GRANULE_BYTES = 2 << 20
B_BURST_BYTES = 8 * GIB
TRIALS = 3
TRIAL_RESERVE_S = 40.0  # a trial is not started with less time than this left
#: Reruns, at most, of trials in which B's burst fitted in what was free once A filled (the set-up
#: missed, as when A's fill ended short behind B's idle grant), over the whole part.
TRIAL_REDOS = 2
SAMPLE_S = 0.02
NVML_GRACE_S = 0.2
POOLS = ("a", "b")
#: What each trial shows of itself (the JSON keeps these; the spans of every kind are in the p50s).
TRIAL_FIGURES = ("complete", "handover_s", "burst_s", "a_unmapped_bytes", "b_acquire_s", "b_acquire_calls",
                 "b_alloc_s", "b_alloc_calls", "b_waiting_s", "a_release_s", "a_free_s", "a_filled_bytes",
                 "free_before_bytes", "a_charged_before_bytes", "b_charged_before_bytes", "b_granted_before_bytes",
                 "b_held_bytes")


def run(ctx: PartContext) -> None:
    rec = ctx.record
    env = pool_env(ctx)
    rec.figures(layers=LAYERS, room_bytes_target=ROOM_BYTES, a_fill_bytes=A_FILL_BYTES, b_burst_bytes=B_BURST_BYTES)
    with ExitStack() as stack:
        broker = stack.enter_context(ctx.device.broker("broker"))
        sampler = Sampler(ctx.device, broker.endpoint, grace_s=0.0 if ctx.device.simulated else NVML_GRACE_S)
        stack.enter_context(sampler)
        pools = start_pools(ctx, broker.endpoint, env, sampler, stack)
        a, b = pools["a"], pools["b"]
        page_bytes = a.ready["pools"][0]["page_bytes"]
        block_bytes = page_bytes // a.ready["blocks_per_page"]
        describe_pool(ctx, broker, a, page_bytes)
        squeeze(ctx, broker, stack)
        trials: list[dict[str, Any]] = []
        redone = 0
        while len(trials) < TRIALS:
            if ctx.left_s() < TRIAL_RESERVE_S:
                rec.note(f"trial {len(trials) + 1} not started: {ctx.left_s():.0f} s left")
                break
            t = trial(ctx, broker, a, b, block_bytes)
            if not took_a_room(t) and redone < TRIAL_REDOS and ctx.left_s() >= TRIAL_RESERVE_S:
                redone += 1
                rec.note(f"trial {len(trials) + 1} run again (rerun {redone} of at most {TRIAL_REDOS}): "
                         f"{missed_set_up(t)}")
                continue
            trials.append(t)
            rec.figure("trials_run", len(trials))
        rec.figure("trials_redone", redone)
        summarise(ctx, trials)
    sampler.record(rec)


def pool_env(ctx: PartContext) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ENABLE_KVCACHED", "KVCACHED_AUTOPATCH", "KVCACHED_REQUIRE")}
    if ctx.device.simulated:
        from ..kvcached_sim import missing

        why = missing()
        if why:
            raise Skip(why)
        return env
    if ctx.kvcached_path is None:
        raise Skip("kvcached 0.1.6 was not built with its CUDA extension in this run")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ctx.kvcached_path), env.get("PYTHONPATH", "")) if p)
    return env


def start_pools(ctx: PartContext, endpoint: str, env: dict[str, str], sampler: "Sampler", stack: ExitStack) -> dict:
    from ..kvcached_sim.pools import MODULE, PoolProcess

    module = MODULE if ctx.device.simulated else "kvcached_broker.tools.gpu_check.pool_gpu"
    args = ("--layers", str(LAYERS), "--virtual-tokens", str(VIRTUAL_TOKENS), "--evict", "oldest")
    started = time.monotonic()
    pools = {}
    for name in POOLS:
        pool = PoolProcess.start(endpoint, ctx.device.usage_dir, ctx.device.total_bytes(), f"pool-{name}", env=env,
                                 args=args, stderr=ctx.workdir / f"pool-{name}.err", wait=False, module=module)
        stack.callback(pool.stop)
        pools[name] = pool
    for pool in pools.values():
        ready = pool.wait_ready()
        sampler.watch(pool.pid, ready["pools"][0]["ipc_name"] if ready.get("pools") else None)
    ctx.record.figure("pool_start_s", time.monotonic() - started)
    return pools


def describe_pool(ctx: PartContext, broker, pool, page_bytes: int) -> None:
    """What one started pool process reports and uses, before it holds any block."""
    rec = ctx.record
    session = session_of(broker.status(), pool.instance)
    status = pool.request("status")
    rec.figures(pool_page_bytes=page_bytes, pool_device_bytes=status["device_bytes"],
                pool_mapped_bytes=status["pools"][0]["mapped_bytes"], pool_granted_bytes=status["pools"][0]["granted_bytes"],
                pool_runtime_base_bytes=None if session is None else session["pools"].get(RUNTIME_BASE_POOL, 0),
                pool_reported_bytes=(session or {}).get("reserved_bytes"))
    governed = bool(status["pools"][0].get("governed"))
    rec.check("the pool is governed by the broker", governed, str(status["pools"][0].get("why_ungoverned") or ""))


def squeeze(ctx: PartContext, broker, stack: ExitStack) -> None:
    """A process the broker does not know takes all but ROOM_BYTES of what the broker could grant."""
    (ballast,) = start_workers(ctx.device, ["ballast"])
    stack.callback(ballast.stop)
    ballast.request("context")
    before = broker.status()
    size = max(0, before["free_bytes"] - ROOM_BYTES) // CUDA_GRANULE_BYTES * CUDA_GRANULE_BYTES
    if size:
        ballast.request("alloc", bytes=size, timeout_s=120)
    seen = wait_for(lambda: broker.status()["external_bytes"] >= before["external_bytes"] + size // 2, timeout_s=10.0)
    after = broker.status()
    ctx.record.figures(ballast_bytes=size, ballast_seen_s=seen, room_bytes=after["free_bytes"],
                       external_bytes=after["external_bytes"], budget_bytes=after["budget_bytes"])


def reset(pools) -> None:
    for pool in pools:
        pool.request("drop_cache")
        pool.request("free", blocks=1 << 30)
        pool.request("settle")


def trial(ctx: PartContext, broker, a, b, block_bytes: int) -> dict[str, Any]:
    """A fills and idles, B bursts: the hand-over's time and where it went."""
    reset((b, a))
    # A may first have to get B's freed pages back from the broker (B keeps them granted until
    # asked): its fill waits for that as B's burst does, or it ends short and leaves B room to spare
    a_fill = a.request("fill", blocks=A_FILL_BYTES // block_bytes, stall_s=2.0, timeout_s=60.0)
    # what was free and what A mapped once A filled: the broker's watermarks may take A's idle
    # cache back between here and B's burst, ahead of B's asks, and that is the hand-over too
    a_before = a.pool()
    before = broker.status()
    charged_before = {name: (instance(before, pool.instance) or {}).get("charged_bytes")
                      for name, pool in (("a", a), ("b", b))}
    b_granted_before = (session_of(before, b.instance) or {}).get("granted_bytes")
    a.request("cache", blocks=a_fill["held_blocks"])
    a.request("settle")
    asked_before = (instance(before, a.instance) or {}).get("pressure") or {}
    want = B_BURST_BYTES // block_bytes
    burst = b.request("fill", blocks=want, timeout_s=60.0, stall_s=2.0)
    a_after = a.pool()
    asked_after = (instance(broker.status(), a.instance) or {}).get("pressure") or {}
    refused_at = burst["refused_at"]
    complete = burst["held_blocks"] >= want
    # why a burst ended short, in the governor's own words (its limit, grant, deferred limit)
    b_stuck = None if complete else stuck_pool(b.request("status")["pools"][0])
    b_spans = burst["after_refusal"] or {}
    a_spans = a.request("spans", start=refused_at, end=burst["done_at"]) if refused_at is not None else {}
    b_asked_after = bool((b_spans.get("acquire") or {}).get("calls"))
    # A hand-over is B's first ask that did not fit to its burst held; an ask ahead of need that
    # was refused while B finished within what it held (nothing asked after it) is none.
    handover = burst["done_at"] - refused_at if complete and refused_at is not None and b_asked_after else None
    out = {
        "complete": complete, "b_held_bytes": burst["held_blocks"] * block_bytes,
        "free_before_bytes": before["free_bytes"],
        "a_charged_before_bytes": charged_before["a"], "b_charged_before_bytes": charged_before["b"],
        "b_granted_before_bytes": b_granted_before,
        "a_filled_bytes": a_fill["held_blocks"] * block_bytes,
        "burst_s": burst["elapsed_s"], "refused_at_s": burst["first_refusal_s"], "handover_s": handover,
        "a_unmapped_bytes": max(0, a_before["mapped_bytes"] - a_after["mapped_bytes"]),
        "pressure_asks": asked_after.get("asks", 0) - asked_before.get("asks", 0),
        "b_stuck": b_stuck,
    }
    for who, spans in (("b", b_spans), ("a", a_spans)):
        for kind in ("acquire", "release", "alloc", "free"):
            entry = spans.get(kind, {"s": 0.0, "calls": 0})
            out[f"{who}_{kind}_s"] = entry["s"]
            out[f"{who}_{kind}_calls"] = entry["calls"]
    if handover is not None:
        out["b_waiting_s"] = max(0.0, handover - out["b_acquire_s"] - out["b_alloc_s"])
    return out


def stuck_pool(pool: dict[str, Any]) -> str:
    """A pool's state where a burst ended short: what the governor holds and waits on."""
    def size(key: str) -> str:
        return format_bytes(pool.get(key))  # (None: 'none')
    return (f"limit {size('limit_bytes')}, granted {size('granted_bytes')}, mapped {size('mapped_bytes')} "
            f"({pool.get('inuse_pages')} pages in use, {pool.get('reserve_pages')} in kvcached's reserve), "
            f"deferred limit {size('pending_limit_bytes')}, blocked {pool.get('blocked')!r}")


def took_a_room(t: dict[str, Any]) -> bool:
    """B's burst held more than was free once A filled: some of it had to be A's."""
    return t["b_held_bytes"] > t["free_before_bytes"]


def missed_set_up(t: dict[str, Any]) -> str:
    """Why a trial measured no hand-over, in the figures that say which side missed."""
    def size(value: int | None) -> str:
        return "?" if value is None else format_bytes(value)
    return (f"B's burst ({size(t['b_held_bytes'])}) fitted in what was free once A filled "
            f"({size(t['free_before_bytes'])}; A filled {size(t['a_filled_bytes'])}, "
            f"charged A {size(t['a_charged_before_bytes'])}, B {size(t['b_charged_before_bytes'])}, "
            f"B granted {size(t.get('b_granted_before_bytes'))})")


def summarise(ctx: PartContext, trials: list[dict[str, Any]]) -> None:
    rec = ctx.record
    rec.figures(trials=len(trials), trials_complete=sum(t["complete"] for t in trials))
    for i, t in enumerate(trials, 1):
        rec.figures(**{f"trial{i}_{k}": t.get(k) for k in TRIAL_FIGURES})
    for key in ("handover_s", "burst_s", "refused_at_s", "b_acquire_s", "b_alloc_s", "b_waiting_s", "a_release_s",
                "a_free_s", "a_unmapped_bytes", "pressure_asks"):
        values: list[float] = [t[key] for t in trials if t.get(key) is not None]
        stem = key[:-2] if key.endswith("_s") else key
        unit = "_s" if key.endswith("_s") else ""
        rec.figures(**{f"{stem}_p50{unit}": percentile(values, 0.5), f"{stem}_max{unit}": max(values) if values else None})
    if trials:
        short = [f"; trial {i}: B held {format_bytes(t['b_held_bytes'])} after {t['burst_s']:.2f} s, {t.get('b_stuck')}"
                 for i, t in enumerate(trials, 1) if not t["complete"]]
        rec.check("every burst got all it asked for", not short,
                  f"{sum(t['complete'] for t in trials)} of {len(trials)} complete" + "".join(short))
        # the room was A's: B holds more than was free once A filled (B need not have waited
        # for it: the broker's watermarks and pressure may take A's cache back before B's ask)
        missed = [f"trial {i}: {missed_set_up(t)}" for i, t in enumerate(trials, 1) if not took_a_room(t)]
        rec.check("each burst took more than was free (the room was A's)", not missed,
                  f"{len(trials) - len(missed)} of {len(trials)}" + "".join(f"; {m}" for m in missed))
        rec.figures(handovers=sum(t["handover_s"] is not None for t in trials))
    else:
        rec.check("at least one trial ran", False, "no time left for a trial")


class Sampler:
    """Checks mapped <= granted and device <= charged for every watched pool process, in a thread."""

    def __init__(self, device: Device, endpoint: str, *, grace_s: float):
        self.device = device
        self.endpoint = endpoint
        self.grace_s = grace_s
        self.pools: dict[int, str | None] = {}  # pid -> its kvcached segment (None: not known yet)
        self.samples = 0
        self.kvcached_violations: list[str] = []
        self.device_violations: list[str] = []
        self.device_excess_samples = 0  # samples with a device reading above the charge, lasting or not
        self.device_excess_max_bytes = 0
        self.device_excess_longest_s = 0.0
        self.peak_mapped_bytes = 0
        self.errors: list[str] = []
        self._excess_since: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-check-sampler", daemon=True)

    def watch(self, pid: int, ipc_name: str | None) -> None:
        self.pools[pid] = ipc_name

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        from ...client.admin import AdminClient

        probe = self.device.probe()
        with AdminClient(self.endpoint, timeout_s=5.0) as admin:
            while not self._stop.is_set():
                try:
                    self.sample(admin, probe)
                except Exception as exc:  # noqa: BLE001 - a failed sample is reported, never silent
                    if len(self.errors) < 5:
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                self._stop.wait(SAMPLE_S)

    def sample(self, admin, probe) -> None:
        from ...adapters.kvcached import segment

        pools = dict(self.pools)
        if not pools:
            return
        with self.device.quiesced():
            before = admin.status()
            reading = probe.read()
            segments = {pid: segment.read(ipc) if ipc else None for pid, ipc in pools.items()}
            after = admin.status()
        now = time.monotonic()
        self.samples += 1
        granted = _max_of(granted_by_pid(before), granted_by_pid(after))
        charged = _max_of(charged_by_pid(before), charged_by_pid(after))
        for pid in pools:
            seg = segments[pid]
            if seg is not None:
                mapped = seg.used_bytes + seg.prealloc_bytes
                self.peak_mapped_bytes = max(self.peak_mapped_bytes, mapped)
                if mapped > granted.get(pid, 0) and len(self.kvcached_violations) < 20:
                    self.kvcached_violations.append(f"pid {pid}: kvcached maps {mapped}, granted {granted.get(pid, 0)}")
            used = reading.process_bytes.get(pid, 0)
            if pid in charged and used > charged[pid]:
                self.device_excess_samples += 1
                self.device_excess_max_bytes = max(self.device_excess_max_bytes, used - charged[pid])
                since = self._excess_since.setdefault(pid, now)
                self.device_excess_longest_s = max(self.device_excess_longest_s, now - since)
                if now - since >= self.grace_s and len(self.device_violations) < 20:
                    self.device_violations.append(f"pid {pid}: device {used}, charged {charged[pid]} "
                                                  f"(for {now - since:.3f} s)")
            else:
                self._excess_since.pop(pid, None)

    def record(self, rec) -> None:
        rec.figures(samples=self.samples, peak_mapped_bytes=self.peak_mapped_bytes,
                    device_excess_samples=self.device_excess_samples,
                    device_excess_max_bytes=self.device_excess_max_bytes,
                    device_excess_longest_s=self.device_excess_longest_s, sampler_errors=len(self.errors))
        for error in self.errors:
            rec.note(f"sampler: {error}")
        rec.check("the sampler read the broker and the device throughout", self.samples >= 20 and not self.errors,
                  f"{self.samples} samples, {len(self.errors)} failed")
        rec.check("mapped <= granted at every sample (kvcached's count)", not self.kvcached_violations,
                  "; ".join(self.kvcached_violations[:3]))
        lasting = f" for {self.grace_s:g} s or more" if self.grace_s else ""
        rec.check(f"the device never measured a pool above its charge{lasting}", not self.device_violations,
                  "; ".join(self.device_violations[:3]))


def _max_of(first: dict[int, int], second: dict[int, int]) -> dict[int, int]:
    return {pid: max(first.get(pid, 0), second.get(pid, 0)) for pid in set(first) | set(second)}
