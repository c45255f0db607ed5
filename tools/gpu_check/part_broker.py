"""Part: a broker on the device, against what the device and torch say.

Three worker processes allocate known amounts (1, 2 and 3 GiB): two report exactly what they
allocated to the broker (``weights``), the third reports nothing.  Then, side by side:

* each process as the device measures it (NVML's per-process figure), as torch counts it
  (allocated, and reserved by its caching allocator) and as the broker charges it
  (measured, reported, unreported);
* the broker's ``external`` against what the device says the unknown process uses, and what
  the device counts as used that no process accounts for (the driver's own reserve);
* the runtime base a reporter pins (``measured_base``): what it uses beyond what it reported;
* how long the device's figures trail an allocation and a free (the poll the broker makes,
  repeated until the figure moves), and how long the broker's own view trails one.

The simulation assumes a process uses exactly what it allocated and that the device shows it
at the first read; a GPU adds a context and the allocator's rounding, and NVML may trail.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Callable

from ...client.protocol import RUNTIME_BASE_POOL
from .context import PartContext
from .devices import GIB, MIB, PROBE_INTERVAL_S
from .measure import instance, session_of, spread, wait_for
from .workers import start_workers

SIZES = {"a": 1 * GIB, "b": 2 * GIB, "quiet": 3 * GIB}
INSTANCES = {"a": "gpucheck-a", "b": "gpucheck-b"}
LAG_BYTES = 256 * MIB
LAG_TRIALS = 8
BROKER_LAG_TRIALS = 4
#: The broker's figures and a reading taken here are of different instants; memory that does
#: not move between them must agree to within this (a GPU's figures can move by a page or two).
TOLERANCE_BYTES = 4 * MIB


def run(ctx: PartContext) -> None:
    rec = ctx.record
    rec.assume(nvml_per_process=True, nvml_lists_worker_pids=True, device_unattributed_bytes=0,
               a_overhead_bytes=0, b_overhead_bytes=0, quiet_overhead_bytes=0,
               a_unreported_bytes=0, b_unreported_bytes=0,
               nvml_alloc_process_reads_max=1, nvml_free_process_reads_max=1)
    rec.note(f"the broker reads the device every {PROBE_INTERVAL_S:g} s: the simulation lets its view of a "
             f"process trail by up to that (broker_alloc_seen_*_s)")
    with ExitStack() as stack:
        broker = stack.enter_context(ctx.device.broker("broker"))
        workers = start_workers(ctx.device, ["a", "b", "quiet"])
        for w in workers:
            stack.callback(w.stop)
        by_name = {w.name: w for w in workers}
        for name, w in by_name.items():
            w.request("context")
            w.request("alloc", bytes=SIZES[name])
        for name, inst in INSTANCES.items():
            by_name[name].request("report", endpoint=broker.endpoint, instance=inst, pools={"weights": SIZES[name]})

        def broker_saw_all() -> bool:
            status = broker.status()
            sessions = [session_of(status, inst) for inst in INSTANCES.values()]
            return (all(s is not None and s["measured_bytes"] >= SIZES[n] for s, n in zip(sessions, INSTANCES))
                    and status["external_bytes"] >= SIZES["quiet"])

        saw = wait_for(broker_saw_all, timeout_s=10.0)
        rec.figure("broker_saw_workers_s", saw)
        if saw is None:
            rec.note("the broker did not measure both reporters and the quiet process within 10 s")
        snapshot(ctx, broker, by_name)
        pin_base(ctx, broker, by_name["a"])
        device_lag(ctx, by_name["b"])
        broker_lag(ctx, broker, by_name["a"])


def snapshot(ctx: PartContext, broker, workers: dict) -> None:
    """Every process as the device, torch and the broker see it, with the memory standing still."""
    rec = ctx.record
    reading = ctx.device.probe().read()
    status = broker.status()
    pids = {name: w.pid for name, w in workers.items()}
    listed = all(pid in reading.process_bytes for pid in pids.values())
    rec.figures(nvml_per_process=reading.per_process, nvml_lists_worker_pids=listed,
                device_total_bytes=reading.total_bytes, device_used_bytes=reading.used_bytes,
                broker_total_bytes=status["total_bytes"], broker_headroom_bytes=status["headroom_bytes"],
                broker_budget_bytes=status["budget_bytes"], broker_external_bytes=status["external_bytes"],
                broker_unreported_bytes=status["unreported_bytes"])
    if not listed:
        rec.note(f"the device lists pids {sorted(reading.process_bytes)}; the workers are {sorted(pids.values())} "
                 f"(another pid namespace?): the broker then counts every worker as external")
    rec.check("the device lists every worker process by its pid", listed,
              f"listed: {sorted(reading.process_bytes)}, workers: {sorted(pids.values())}")
    device_bytes = {name: reading.process_bytes.get(pid, 0) for name, pid in pids.items()}
    for name, w in workers.items():
        own = w.request("own")
        rec.figures(**{f"{name}_device_bytes": device_bytes[name], f"{name}_torch_allocated_bytes": own["allocated_bytes"],
                       f"{name}_torch_reserved_bytes": own["reserved_bytes"],
                       f"{name}_overhead_bytes": device_bytes[name] - own["reserved_bytes"]})
    for name, inst_name in INSTANCES.items():
        session = session_of(status, inst_name)
        inst = instance(status, inst_name)
        if session is None or inst is None:
            rec.check(f"the broker has {inst_name}'s session", False, "no session in status")
            continue
        reported = session["reserved_bytes"] + session["granted_bytes"]
        rec.figures(**{f"{name}_broker_measured_bytes": session["measured_bytes"],
                       f"{name}_broker_reported_bytes": reported,
                       f"{name}_unreported_bytes": inst["unreported_bytes"]})
        rec.check(f"the broker measures {name} as the device does", _close(session["measured_bytes"], device_bytes[name]),
                  f"broker {session['measured_bytes']}, device {device_bytes[name]}")
        expected = max(0, device_bytes[name] - reported)
        rec.check(f"{name}'s unreported bytes are what the device measures beyond its report",
                  _close(inst["unreported_bytes"], expected), f"broker {inst['unreported_bytes']}, device - report {expected}")
    others = (reading.used_bytes or 0) - device_bytes["a"] - device_bytes["b"]
    rec.figures(external_expected_bytes=others,
                device_unattributed_bytes=(reading.used_bytes or 0) - sum(reading.process_bytes.values()))
    rec.check("the process that reports nothing counts as external",
              status["external_bytes"] >= device_bytes["quiet"] - TOLERANCE_BYTES and _close(status["external_bytes"], others),
              f"external {status['external_bytes']}, quiet process {device_bytes['quiet']}, "
              f"device used less the reporters {others}")


def pin_base(ctx: PartContext, broker, worker) -> None:
    """The reporter pins its runtime base: what it uses beyond its report is charged from then on."""
    rec = ctx.record
    pools = worker.request("report", endpoint=broker.endpoint, instance=INSTANCES["a"], pools={"weights": SIZES["a"]},
                           measured_base=True)["pools"]
    rec.figure("a_runtime_base_bytes", pools.get(RUNTIME_BASE_POOL, 0))
    inst = instance(broker.status(), INSTANCES["a"])
    unreported = inst["unreported_bytes"] if inst else None
    rec.figure("a_unreported_after_pin_bytes", unreported)
    rec.check("after pinning its base a reporter has nothing unreported", unreported == 0, f"unreported {unreported}")


def device_lag(ctx: PartContext, worker) -> None:
    """How long the device's per-process and device-wide figures trail an allocation and a free."""
    rec = ctx.record
    lag = worker.request("lag", timeout_s=LAG_TRIALS * 10.0, bytes=LAG_BYTES, trials=LAG_TRIALS, wait_s=2.0)
    rec.figures(nvml_lag_bytes=LAG_BYTES, nvml_lag_trials=LAG_TRIALS)
    for key in ("alloc_process", "alloc_device", "free_process", "free_device"):
        rec.figures(**spread(f"nvml_{key}_seen", lag[f"{key}_s"]))
        reads = [r for r in lag[f"{key}_reads"] if r is not None]
        rec.figure(f"nvml_{key}_reads_max", max(reads) if reads else None)
    rec.figures(**spread("nvml_read", lag["read_s"]))


def broker_lag(ctx: PartContext, broker, worker) -> None:
    """How long after an allocation returns the broker's status shows it (its probe interval,
    plus the device's own lag)."""
    def measured_bytes() -> int:
        session = session_of(broker.status(), INSTANCES["a"])
        if session is None:  # the part fails, rather than measure a lag against nothing
            raise RuntimeError(f"{INSTANCES['a']} has no session at the broker")
        return int(session["measured_bytes"])

    def reached(target_bytes: int) -> Callable[[], bool]:
        return lambda: measured_bytes() >= target_bytes

    seen: list[float | None] = []
    for _ in range(BROKER_LAG_TRIALS):
        before = measured_bytes()
        worker.request("alloc", bytes=LAG_BYTES)  # returns once the memory is allocated: the wait starts there
        seen.append(wait_for(reached(before + LAG_BYTES // 2), timeout_s=5 * PROBE_INTERVAL_S + 2.0))
    ctx.record.figures(**spread("broker_alloc_seen", seen))


def _close(a: int, b: int) -> bool:
    return abs(a - b) <= TOLERANCE_BYTES
