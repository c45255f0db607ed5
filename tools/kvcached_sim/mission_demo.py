"""``kvcached-broker demo``: one simulated GPU, a DeepSeek-V4-shaped server beside two elastic ones, live.

A broker on a simulated 80 GiB GPU (its default 5% headroom) and three serving processes, each
taking every byte of its start-up on the shared device as it goes:

* ``dsv4-flash``: a DeepSeek-V4-shaped server (:mod:`..dsv4_server`; not SGLang: the broker
  adapters' own start-up calls, over the client API, with pool sizes from a
  DeepSeek-V4-Flash-like shape).  The operator capped it at 36 GiB.  It loads its weights,
  sizes its KV cache with SGLang's rule (the broker holds the most that fits under the cap,
  and its slack), builds its pools and reports them per pool (SWA, C4, C128, indexer,
  compressor state), warms up, and serves: phases ``sizing``, ``warming``, ``serving`` as
  status shows them.  From then on its pools are static;
* ``llama-a`` and ``llama-b``: Llama-3.1-8B-shaped servers (8 GiB of FP8 weights) each with
  a real kvcached 0.1.6 ``KVCacheManager`` in kvcached mode (only ``kvcached.vmm_ops`` is
  simulated, :mod:`.vmm_ops_double`): their KV memory is what the broker grants them.
  The operator gave ``llama-b`` twice the weight (its fair share is twice the others').
  ``llama-a`` fills 20 GiB of KV and goes idle, its requests kept in its prefix cache; then
  ``llama-b`` bursts.  Past the free memory the broker refuses it and asks ``llama-a`` (above
  its share) for pages back; ``llama-a`` evicts its oldest cached blocks, lowers its limit and
  releases; ``llama-b`` takes them.

Every frame is read with the device's allocation lock held and checked
(:class:`..demo_view.FrameChecks`): the budget adds up, every admitted server uses no more
than it is charged, no kvcached pool maps more than its grant, and the DeepSeek-V4 pools stay
static.  The first failed check stops the demo with exit status 1; otherwise it ends with one
line saying what it checked, and exits 0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from .. import json_lines
from ..demo_view import EventLog, Frame, FrameChecks, KvFigures, Server, render
from .pools import PoolProcess

if TYPE_CHECKING:
    from ...client.admin import AdminClient

GIB = 1 << 30
DEVICE = "80GiB"
DEVICE_BYTES = 80 * GIB
DSV4 = "dsv4-flash"
DSV4_CAP_BYTES = 36 * GIB
DSV4_MEM_FRACTION_STATIC = 0.88  # SGLang's default: keep it with the broker (docs/accounting.md)
B_WEIGHT = 2
DSV4_WEIGHTS_BYTES = 18 * GIB
LLAMA_WEIGHTS_BYTES = 8 * GIB
LAYERS = 32
VIRTUAL_TOKENS = 1 << 20
A_FILL_BYTES = 20 * GIB
B_START_BYTES = 1 * GIB
B_BURST_BYTES = 10 * GIB
FRAME_S = 0.25
PLAIN_FRAME_S = 2.5  # without a terminal, a whole frame at most this often (each is checked all the same)
STEP_S = 0.8  # how long each start-up step stays on screen
MAX_S = 120.0  # the demo's own limit, however slow the machine
TITLE = "kvcached-broker demo: one simulated GPU, three servers"


class Dsv4Process:
    """The DeepSeek-V4-shaped server's process (:mod:`..dsv4_server`), driven line by line."""

    def __init__(self, usage: Path, endpoint: str, env: dict[str, str], stderr: Path):
        with open(stderr, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvcached_broker.tools.dsv4_server", str(usage), str(DEVICE_BYTES), DSV4],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                env={**env, "KVCACHED_BROKER": endpoint})
        self.pid = int(self.receive()["pid"])

    def request(self, op: str, **args) -> dict:
        json_lines.send(self.proc, op, **args)
        answer = self.receive()
        for failure in ("refused", "crashed"):
            if failure in answer:
                raise RuntimeError(f"{DSV4} {op}: {failure}: {answer[failure]}")
        return answer

    def receive(self) -> dict:
        answer = json_lines.receive(self.proc)
        if answer is None:
            raise RuntimeError(f"{DSV4} exited with {json_lines.exit_status(self.proc)}")
        return answer

    def stop(self) -> None:
        json_lines.stop(self.proc)


@dataclass
class Script:
    """The scripted workload, on its own thread; ``activity`` says what each server is doing."""

    dsv4: Dsv4Process
    a: PoolProcess
    b: PoolProcess
    events: EventLog
    clock: "Clock"
    activity: dict = field(default_factory=lambda: {DSV4: "starting", "llama-a": "starting: loading torch and "
                                                    "kvcached", "llama-b": "starting: loading torch and kvcached"})
    admitted: set = field(default_factory=set)
    kv_base: dict = field(default_factory=dict)
    block_bytes: int = 0
    sized: dict = field(default_factory=dict)
    burst: dict = field(default_factory=dict)
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    frames_taken: int = 0  # frames the show read and observed so far
    frame_taken: threading.Condition = field(default_factory=threading.Condition)

    def run(self) -> None:
        try:
            self._start_dsv4()
            self._start_llamas()
            self._hand_over()
        except Exception as exc:  # noqa: BLE001 - shown in the demo's last lines
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()

    def event(self, text: str) -> None:
        self.events.add(self.clock.now(), text)

    def took_frame(self) -> None:
        """The show read and observed a frame (what the script did before it is in it)."""
        with self.frame_taken:
            self.frames_taken += 1
            self.frame_taken.notify_all()

    def _hold(self, seconds: float) -> None:
        """Keep what the script just did on screen: at least ``seconds``, and until a frame read
        wholly after it was observed (on a loaded machine a step can outlast its seconds before
        the show reads a frame; its phase would then never be shown)."""
        with self.frame_taken:
            after = self.frames_taken + 2  # the frame being read now may predate the step
        time.sleep(seconds)
        with self.frame_taken:
            self.frame_taken.wait_for(lambda: self.frames_taken >= after, timeout=MAX_S)

    def _start_dsv4(self) -> None:
        self.activity[DSV4] = f"loading {DSV4_WEIGHTS_BYTES // GIB} GiB of weights (one rank of TP 8)"
        self.dsv4.request("load", weights_bytes=DSV4_WEIGHTS_BYTES)
        self._hold(STEP_S)  # each step stays on screen a moment
        self.activity[DSV4] = f"sizing its KV cache with SGLang's rule (mem_fraction_static {DSV4_MEM_FRACTION_STATIC})"
        self.sized = self.dsv4.request("size", mem_fraction_static=DSV4_MEM_FRACTION_STATIC, max_running_requests=64)
        self.admitted.add(DSV4)
        self.event(f"{DSV4} asks for {_gib(self.sized['asked_kv_bytes'])} of KV (SGLang's rule), "
                   f"{_gib(self.sized['kv_bytes'])} fit its cap")
        self._hold(STEP_S)
        self.activity[DSV4] = "building its DeepSeek-V4 pools in the held memory"
        built = self.dsv4.request("build")
        self.sized["full_tokens"] = built["full_tokens"]
        self._hold(STEP_S)
        self.activity[DSV4] = "capturing CUDA graphs and warming up, in its slack"
        self.dsv4.request("warm_up", graphs_bytes=GIB, activations_bytes=3 * GIB // 2)
        self.activity[DSV4] = (f"serving: {built['full_tokens'] / 1e6:.2f} M tokens of KV in static pools "
                               f"(not elastic: runtime-owned)")

    def _start_llamas(self) -> None:
        for pool in (self.a, self.b):
            ready = pool.wait_ready()
            page_bytes = ready["pools"][0]["page_bytes"]
            self.block_bytes = page_bytes // ready["blocks_per_page"]
            self.kv_base[pool.instance] = _non_kv_bytes(page_bytes)
            self.admitted.add(pool.instance)
            self.activity[pool.instance] = "ready: kvcached mode, its KV limit is what the broker grants"
        self.event("llama-a and llama-b are up: kvcached pools whose limits follow the broker's grants")

    def _hand_over(self) -> None:
        self.activity["llama-b"] = f"serving {B_START_BYTES // GIB} GiB of requests"
        self.b.request("fill", blocks=self.blocks(B_START_BYTES))
        self.activity["llama-a"] = f"busy: filling {A_FILL_BYTES // GIB} GiB of KV cache"
        held = self.a.request("fill", blocks=self.blocks(A_FILL_BYTES), timeout_s=30.0)["held_blocks"]
        self.a.request("cache", blocks=held)
        self.activity["llama-a"] = f"idle: its {self.gib(held):.0f} GiB of finished requests stay in its prefix cache"
        self.event("llama-a is idle, its KV kept as prefix cache")
        self._hold(1.5)  # the idle state stays on screen a moment
        self.activity["llama-b"] = f"bursting to {B_BURST_BYTES // GIB} GiB of KV: past the free memory it is refused"
        self.activity["llama-a"] = "idle, under pressure: evicts its oldest cached blocks, lowers its limit"
        self.event(f"llama-b bursts to {B_BURST_BYTES // GIB} GiB of KV")
        self.burst = self.b.request("fill", blocks=self.blocks(B_BURST_BYTES), timeout_s=45.0, stall_s=3.0)
        self.activity["llama-b"] = f"holds {self.gib(self.burst['held_blocks']):.1f} GiB of KV"
        self.activity["llama-a"] = "idle (what is left of its prefix cache stays)"
        refused = self.burst.get("first_refusal_s")
        self.event(f"llama-b holds {self.gib(self.burst['held_blocks']):.1f} GiB after {self.burst['elapsed_s']:.1f} s"
                   + (f" (first refused at {refused:.1f} s)" if refused is not None else ""))
        self._hold(1.5)

    def blocks(self, size_bytes: int) -> int:
        return size_bytes // self.block_bytes

    def gib(self, blocks: int) -> float:
        return blocks * self.block_bytes / GIB


def _non_kv_bytes(page_bytes: int) -> int:
    """What a Llama process holds besides its KV pages: a context, torch's first segment, its
    weights and kvcached's zero page (one compound page)."""
    from ..shared_gpu import CUDA_CONTEXT_BYTES, TORCH_FIRST_SEGMENT_BYTES

    return CUDA_CONTEXT_BYTES + TORCH_FIRST_SEGMENT_BYTES + LLAMA_WEIGHTS_BYTES + page_bytes


@dataclass
class Clock:
    start_s: float = field(default_factory=time.monotonic)

    def now(self) -> float:
        return time.monotonic() - self.start_s


CAPTIONS = {
    DSV4: "DeepSeek-V4-Flash-like rank, static pools",
    "llama-a": "Llama-3.1-8B-like, kvcached mode",
    "llama-b": "Llama-3.1-8B-like, kvcached mode",
}


def run(seconds: float = 8.0, keep: bool = False, out: TextIO = sys.stdout) -> int:
    """The demo; at least ``seconds`` long (its script takes about fifteen); 0 if every frame passed."""
    from ..launch import BrokerLauncher

    workdir = Path(tempfile.mkdtemp(prefix="kvcached-broker-demo-"))
    usage = workdir / "gpu-usage"
    endpoint = f"ipc://{workdir}/gpu0.sock"
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_BROKER"}
    launcher = BrokerLauncher(endpoint, simulate=DEVICE, state_dir=workdir / "state", log=workdir / "broker.log",
                              args=["--simulate-usage-dir", str(usage), "--log-level", "warning"])
    pools: list = []
    dsv4 = None
    try:
        launcher.start()
        print(f"{TITLE}\nstarting a broker on a simulated {DEVICE} GPU, a DeepSeek-V4-shaped server and two\n"
              f"kvcached 0.1.6 pools, each in its own process (torch and kvcached load in a few seconds)...",
              file=out, flush=True)
        with launcher.admin() as admin:
            admin.limit(DSV4, max_bytes=DSV4_CAP_BYTES)
            admin.limit("llama-b", weight=B_WEIGHT)
            args = ("--layers", str(LAYERS), "--virtual-tokens", str(VIRTUAL_TOKENS), "--evict", "oldest",
                    "--weights-bytes", str(LLAMA_WEIGHTS_BYTES))
            for name in ("llama-a", "llama-b"):
                pools.append(PoolProcess.start(endpoint, usage, DEVICE_BYTES, name, env=env, args=args,
                                               stderr=workdir / f"{name}.err", wait=False))
            dsv4 = Dsv4Process(usage, endpoint, env, workdir / f"{DSV4}.err")
            clock = Clock()
            events = EventLog()
            events.add(0.0, f"the operator caps {DSV4}: kvcached-broker limit {DSV4} --max {DSV4_CAP_BYTES // GIB}GiB")
            events.add(0.0, f"and weights llama-b: kvcached-broker limit llama-b --weight {B_WEIGHT}")
            script = Script(dsv4, pools[0], pools[1], events, clock)
            servers = [Server(DSV4, dsv4.pid, CAPTIONS[DSV4], elastic=False)]
            servers += [Server(p.instance, p.pid, CAPTIONS[p.instance], elastic=True) for p in pools]
            return Show(script, servers, admin, usage, pools, clock, out).run(seconds)
    finally:
        for pool in pools:
            pool.stop()
        if dsv4 is not None:
            dsv4.stop()
        launcher.stop()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


CLEAR_HOME = "\x1b[H\x1b[J"


@dataclass
class Show:
    """Runs the script and reads, checks and draws a frame every FRAME_S until it is done."""

    script: Script
    servers: list[Server]
    admin: AdminClient
    usage: Path
    pools: list
    clock: Clock
    out: TextIO

    def run(self, seconds: float) -> int:
        checks = FrameChecks(self.servers)
        interactive = self.out.isatty()
        columns, rows = shutil.get_terminal_size((96, 40)) if interactive else (96, 0)
        width = max(80, min(100, columns))
        thread = threading.Thread(target=self.script.run, name="demo-script", daemon=True)
        thread.start()
        frames: list[Frame] = []
        last_plain_s = -PLAIN_FRAME_S
        shown_events = 0  # events added up to the last plain frame
        while True:
            frame = self.read_frame()
            frames.append(frame)
            self.script.events.observe(frame, self.servers)
            self.script.took_frame()
            problems = checks.check(frame)
            rendered_events = self.script.events.added
            text = render(frame, self.servers, self.script.events, problems, width=width, title=TITLE)
            finished = (self.script.done.is_set() and frame.t_s >= seconds) or frame.t_s > MAX_S
            if interactive and text.count("\n") + 2 <= rows:  # a shorter terminal gets plain frames
                self.out.write(CLEAR_HOME + text + "\n")
                self.out.flush()
                self.script.events.shown(rendered_events)
            elif (problems or finished or frame.t_s - last_plain_s >= PLAIN_FRAME_S
                  or self.script.events.added - shown_events >= self.script.events.keep - 1):
                # also before the event log scrolls past an event the transcript has not shown
                self.out.write(f"\n{text}\n")
                self.out.flush()
                last_plain_s, shown_events = frame.t_s, rendered_events
                self.script.events.shown(rendered_events)
            if problems:
                print(f"kvcached-broker demo: FAILED at t = {frame.t_s:.1f} s: {problems[0]}", file=sys.stderr)
                self.out.write(f"kvcached-broker demo: FAILED at t = {frame.t_s:.1f} s: {'; '.join(problems)}\n")
                return 1
            if finished:
                break
            time.sleep(FRAME_S)  # the redraw interval of a live view
        thread.join(timeout=5)
        return self.summarize(checks, frames)

    def read_frame(self) -> Frame:
        """Segments, device bytes and the broker's status, with the shared device's allocation lock held."""
        from ...adapters.kvcached import segment
        from ...broker.device import read_shared_usage
        from ..shared_gpu import allocation_lock

        with allocation_lock(self.usage):  # nobody allocates, maps or unmaps now
            device = read_shared_usage(self.usage)
            segments = {pool.instance: segment.read(pool.ipc_name) for pool in self.pools}
            status = self.admin.status()
        admitted = frozenset(self.script.admitted)  # before: kvcached's segment may not show the broker's limit yet
        kv = {name: KvFigures(seg.total_bytes, seg.used_bytes + seg.prealloc_bytes, seg.used_bytes)
              for name, seg in segments.items() if seg is not None and name in admitted}
        return Frame(self.clock.now(), status, device, kv, dict(self.script.kv_base), admitted,
                     dict(self.script.activity))

    def summarize(self, checks: FrameChecks, frames: list[Frame]) -> int:
        """What happened, in a few lines, then the one line of what was checked; 0 unless the script failed."""
        script = self.script
        if not script.done.is_set():
            script.error = f"it did not finish within {MAX_S:.0f} s"
        if script.error:
            print(f"\nkvcached-broker demo: FAILED: the demo's workload failed: {script.error}", file=self.out)
            return 1
        first, last = frames[0], frames[-1]
        lines = ["", "what happened:"]
        pools = (last.instance(DSV4) or {}).get("pools", {})
        side = {k: v for k, v in pools.items() if not k.startswith("runtime_")}
        lines.append(f"  {DSV4}: SGLang's own figure was {_gib(script.sized['asked_kv_bytes'])} of KV; the broker "
                     f"held {_gib(script.sized['kv_bytes'])} under its cap,")
        lines.append(f"    reported in {len(side)} pools ({_gib(sum(side.values()))}), static while it served")
        burst = script.burst
        refused = burst.get("first_refusal_s")
        lines.append(f"  llama-b asked for {B_BURST_BYTES / GIB:.0f} GiB and holds {script.gib(burst['held_blocks']):.1f} "
                     f"GiB after {burst['elapsed_s']:.1f} s" + (f"; first refused at {refused:.1f} s" if refused
                                                                 is not None else " (never refused)"))
        a_peak = max(f.kv["llama-a"].limit for f in frames if "llama-a" in f.kv)
        a_last = last.kv["llama-a"].limit
        asks = last.pressure("llama-a").get("asks", 0) - first.pressure("llama-a").get("asks", 0)
        lines.append(f"  llama-a's kvcached limit went from {a_peak / GIB:.1f} to {a_last / GIB:.1f} GiB under "
                     f"{asks} pressure asks ({_gib(last.pressure('llama-a').get('returned_bytes', 0))} given back)")
        if checks.over_frames:
            over = f"{checks.over_frames} frame" + ("s" if checks.over_frames != 1 else "")
            lines.append(f"  in {over} the broker charged memory twice, allocated and not reported "
                         f"yet (at most {checks.max_over_bytes / (1 << 20):.0f} MiB")
            lines.append("    past the budget): by design, see docs/accounting.md, \"Pages mapped on demand\"")
        lines.append("")
        lines.append(summary_line(checks.frames))
        print("\n".join(lines), file=self.out, flush=True)
        return 0


def _gib(size: float) -> str:
    return f"{size / GIB:.1f} GiB"


def summary_line(frames: int) -> str:
    """The one line the demo ends with when every frame passed its checks (:class:`..demo_view.FrameChecks`)."""
    return (f"demo OK, {frames} frames checked: budget = charges + free, use <= charge, mapped <= grant, "
            f"DSV4 static")
