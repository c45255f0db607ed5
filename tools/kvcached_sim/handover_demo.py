"""``kvcached-broker demo`` with kvcached: an idle model's KV memory flowing to a bursting one, live.

A broker on a simulated 80 GiB GPU (default 5% headroom) and two serving processes, ``llama-a``
and ``llama-b``, each with a real kvcached 0.1.6 ``KVCacheManager`` (Llama-3.1-8B's KV shape;
only ``kvcached.vmm_ops`` is simulated, :mod:`.vmm_ops_double`) in kvcached mode: each pool's
memory limit is what the broker granted it.  The script:

1. ``llama-a`` fills 56 GiB of KV, then its requests finish and stay in its prefix cache: idle;
2. ``llama-b`` bursts to 28 GiB.  Past the free memory the broker refuses it and asks
   ``llama-a`` (above its fair share) for pages back; ``llama-a`` evicts its oldest cached
   blocks, lowers its limit, and releases; ``llama-b`` takes them.

Each frame shows, per pool, kvcached's own figures from its ``/dev/shm`` segment (the limit,
what is mapped, what is in use, as ``kvctl list`` and kvtop show them) beside what the broker
granted the process and the pressure it put on it.  Each frame is read with the shared
device's allocation lock held, so nothing is mapped or unmapped while it is read, and checks
that each process's mapped pages are within its grant.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1 << 30
DEVICE = "80GiB"
DEVICE_BYTES = 80 * GIB
LAYERS = 32
VIRTUAL_TOKENS = 1 << 20
A_FILL_BYTES = 56 * GIB
B_BURST_BYTES = 28 * GIB
FRAME_S = 0.25
BAR_CHARS = 56
MAX_S = 90.0  # the script's own limit, however slow the machine


@dataclass
class Script:
    """The scripted workload, run on its own thread; ``phase`` says what is happening now."""

    a: object
    b: object
    block_bytes: int
    phase: dict = field(default_factory=lambda: {"llama-a": "starting", "llama-b": "starting"})
    burst: dict = field(default_factory=dict)
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    started_s: float = 0.0

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - shown in the demo's last lines
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()

    def _run(self) -> None:
        self.started_s = time.monotonic()
        self.phase["llama-b"] = "a few GiB of requests"
        self.b.request("fill", blocks=self.blocks(2 * GIB))
        self.phase["llama-a"] = f"busy: filling {A_FILL_BYTES // GIB} GiB of KV cache"
        held = self.a.request("fill", blocks=self.blocks(A_FILL_BYTES), timeout_s=30.0)["held_blocks"]
        self.a.request("cache", blocks=held)
        self.phase["llama-a"] = f"idle: its {self.gib(held):.0f} GiB of finished requests stay in its prefix cache"
        time.sleep(1.5)
        self.phase["llama-b"] = (f"bursting to {B_BURST_BYTES // GIB} GiB: past the free memory the broker "
                                 f"refuses it and asks llama-a for pages back")
        self.phase["llama-a"] = "idle; under pressure: evicts its oldest cached blocks, lowers its limit, releases"
        self.burst = self.b.request("fill", blocks=self.blocks(B_BURST_BYTES), timeout_s=45.0, stall_s=3.0)
        self.phase["llama-b"] = f"holds {self.gib(self.burst['held_blocks']):.1f} GiB"
        self.phase["llama-a"] = "idle (what is left of its prefix cache stays)"
        time.sleep(1.5)

    def blocks(self, size_bytes: int) -> int:
        return size_bytes // self.block_bytes

    def gib(self, blocks: int) -> float:
        return blocks * self.block_bytes / GIB


@dataclass
class Frame:
    """One consistent reading: per pool kvcached's segment and the broker's grant (bytes)."""

    t_s: float
    pools: dict  # name -> {limit, mapped, inuse, granted, device, asks, returned}
    budget_bytes: int
    violations: list


def run(seconds: float = 8.0, keep: bool = False, out=sys.stdout) -> int:
    """The live hand-over; at least ``seconds`` long (the script takes about ten); exits 0."""
    from ..launch import BrokerLauncher
    from .pools import PoolProcess

    workdir = Path(tempfile.mkdtemp(prefix="kvcached-broker-demo-"))
    usage = workdir / "gpu-usage"
    endpoint = f"ipc://{workdir}/gpu0.sock"
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_BROKER"}
    launcher = BrokerLauncher(endpoint, simulate=DEVICE, state_dir=workdir / "state", log=workdir / "broker.log",
                              args=["--simulate-usage-dir", str(usage), "--log-level", "warning"])
    pools: list = []
    try:
        launcher.start()
        print("kvcached-broker demo: starting two kvcached 0.1.6 pools, each in its own process "
              "(torch and kvcached's Python code load in a few seconds)...", file=out, flush=True)
        args = ("--layers", str(LAYERS), "--virtual-tokens", str(VIRTUAL_TOKENS), "--evict", "oldest")
        for name in ("llama-a", "llama-b"):
            pools.append(PoolProcess.start(endpoint, usage, DEVICE_BYTES, name, env=env, args=args,
                                           stderr=workdir / f"{name}.err", wait=False))
        for pool in pools:
            pool.wait_ready()
        a, b = pools
        ready = a.ready
        script = Script(a, b, ready["pools"][0]["page_bytes"] // ready["blocks_per_page"])
        with launcher.admin() as admin:
            frames = show(script, admin, usage, pools, seconds, out)
        return summarize(script, frames, out)
    finally:
        for pool in pools:
            pool.stop()
        launcher.stop()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def show(script: Script, admin, usage: Path, pools: list, seconds: float, out) -> list[Frame]:
    """Run the script and redraw a frame every FRAME_S until it is done and ``seconds`` passed."""
    thread = threading.Thread(target=script.run, name="demo-script", daemon=True)
    start = time.monotonic()
    thread.start()
    interactive = out.isatty()
    frames: list[Frame] = []
    last_line_s = -1.0
    while True:
        now = time.monotonic() - start
        frame = read_frame(now, admin, usage, pools)
        frames.append(frame)
        if interactive:
            out.write(CLEAR_HOME + render(frame, script) + "\n")
            out.flush()
        elif now - last_line_s >= 1.0:
            out.write(render_line(frame, script) + "\n")
            out.flush()
            last_line_s = now
        if (script.done.is_set() and now >= seconds) or now > MAX_S:
            break
        time.sleep(FRAME_S)
    thread.join(timeout=5)
    if not interactive:
        out.write(render(frames[-1], script) + "\n")
    return frames


CLEAR_HOME = "\x1b[H\x1b[J"


def read_frame(t_s: float, admin, usage: Path, pools: list) -> Frame:
    """Segments, device bytes and the broker's status, with the shared device's allocation lock held."""
    from ...adapters.kvcached import segment
    from ...broker.device import read_shared_usage
    from ..shared_gpu import allocation_lock

    with allocation_lock(usage):  # nobody maps or unmaps now
        device = read_shared_usage(usage)
        segments = {pool.instance: segment.read(pool.ipc_name) for pool in pools}
        status = admin.status()
    figures, violations = {}, []
    for pool in pools:
        seg = segments[pool.instance]
        granted, asks, returned = broker_view(status, pool.instance)
        zero_page = pool.ready["pools"][0]["page_bytes"]
        mapped_device = max(0, device.get(pool.pid, 0) - zero_page)
        figures[pool.instance] = {
            "limit": seg.total_bytes if seg else 0, "inuse": seg.used_bytes if seg else 0,
            "mapped": (seg.used_bytes + seg.prealloc_bytes) if seg else 0, "granted": granted,
            "device": device.get(pool.pid, 0), "asks": asks, "returned": returned,
        }
        if mapped_device > granted:
            violations.append(f"{pool.instance}: {mapped_device / GIB:.2f} GiB mapped, {granted / GIB:.2f} GiB granted")
    return Frame(t_s, figures, status["budget_bytes"], violations)


def broker_view(status: dict, instance: str) -> tuple[int, int, int]:
    """(bytes granted to the instance's sessions, pressure asks to it, bytes it returned)."""
    for inst in status["instances"]:
        if inst["name"] == instance:
            granted = sum(s["granted_pages"] * s["page_bytes"] for s in inst["sessions"])
            pressure = inst.get("pressure") or {}
            return granted, int(pressure.get("asks", 0)), int(pressure.get("returned_bytes", 0))
    return 0, 0, 0


# ------------------------------------------------------------------ drawing
def render(frame: Frame, script: Script) -> str:
    budget = frame.budget_bytes
    lines = [
        f"kvcached-broker demo: an idle model's KV memory flows to a bursting one          t = {frame.t_s:4.1f} s",
        f"simulated {DEVICE} GPU, budget {budget / GIB:.1f} GiB; two real kvcached 0.1.6 pools (Llama-3.1-8B "
        f"KV shape), each in its own process",
        "",
    ]
    lines += [f"  {name}: {script.phase[name]}" for name in frame.pools]
    lines += ["", f"  {'':<9}{'kvcached: limit':>16}{'mapped':>10}{'in use':>10}{'broker: granted':>17}"
                  f"{'pressure asks':>15}{'returned':>10}"]
    for name, p in frame.pools.items():
        lines.append(f"  {name:<9}{_gib(p['limit']):>16}{_gib(p['mapped']):>10}{_gib(p['inuse']):>10}"
                     f"{_gib(p['granted']):>17}{p['asks']:>15}{_gib(p['returned']):>10}")
    lines.append("")
    for name, p in frame.pools.items():
        lines.append(f"  {name:<9}|{bar(p, budget)}|")
    used = sum(p["device"] for p in frame.pools.values())
    lines.append(f"  {'device':<9}|{bar_of([(used, '#')], budget)}| {used / GIB:.1f} of {budget / GIB:.1f} GiB")
    lines.append("            in use #   reserve +   up to kvcached's limit .   granted beyond it -")
    lines.append("  mapped <= granted: " + ("yes, both pools" if not frame.violations else "; ".join(frame.violations)))
    return "\n".join(lines)


def render_line(frame: Frame, script: Script) -> str:
    """One line per second when the output is not a terminal."""
    parts = [f"t={frame.t_s:4.1f}s"]
    for name, p in frame.pools.items():
        parts.append(f"{name} limit {p['limit'] / GIB:5.1f} mapped {p['mapped'] / GIB:5.1f} "
                     f"in use {p['inuse'] / GIB:5.1f} granted {p['granted'] / GIB:5.1f} GiB")
    return " | ".join(parts)


def bar(p: dict, budget: int) -> str:
    """In use, reserve, the rest of the limit, and any grant beyond the limit, to scale."""
    reserve = max(0, p["mapped"] - p["inuse"])
    rest_of_limit = max(0, p["limit"] - p["mapped"])
    beyond = max(0, p["granted"] - max(p["limit"], p["mapped"]))
    return bar_of([(p["inuse"], "#"), (reserve, "+"), (rest_of_limit, "."), (beyond, "-")], budget)


def bar_of(parts: list[tuple[int, str]], budget: int) -> str:
    text = ""
    edge = 0
    for size, char in parts:
        edge += size
        text += char * max(0, round(edge * BAR_CHARS / max(1, budget)) - len(text))
    return text[:BAR_CHARS].ljust(BAR_CHARS)


def _gib(size: int) -> str:
    return f"{size / GIB:.1f} GiB"


# ------------------------------------------------------------------ the last lines
def summarize(script: Script, frames: list[Frame], out) -> int:
    """What happened, in a few lines; 0 unless the script failed."""
    if script.error:
        print(f"\nthe demo's workload failed: {script.error}", file=out)
        return 1
    first, last = frames[0], frames[-1]
    burst = script.burst
    a_peak = max(f.pools["llama-a"]["limit"] for f in frames)
    a_last = last.pools["llama-a"]["limit"]
    bad = sum(1 for f in frames if f.violations)
    lines = ["", "what happened:"]
    if burst:
        held = script.gib(burst["held_blocks"])
        refused = burst.get("first_refusal_s")
        lines.append(f"  llama-b asked for {B_BURST_BYTES / GIB:.0f} GiB and holds {held:.1f} GiB after "
                     f"{burst['elapsed_s']:.1f} s" + (f"; the broker first refused it at {refused:.1f} s" if refused
                                                      is not None else " (never refused)"))
    lines.append(f"  llama-a's limit went from {a_peak / GIB:.1f} to {a_last / GIB:.1f} GiB under "
                 f"{last.pools['llama-a']['asks'] - first.pools['llama-a']['asks']} pressure asks "
                 f"(the broker counts {last.pools['llama-a']['returned'] / GIB:.1f} GiB returned)")
    lines.append(f"  mapped <= granted for both pools in {len(frames) - bad} of {len(frames)} frames, "
                 f"each read with the device's allocation lock held")
    print("\n".join(lines), file=out, flush=True)
    return 0
