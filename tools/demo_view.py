"""What the demo shows and checks, frame by frame: no I/O (the demo's shell reads, this judges and draws).

A :class:`Frame` is one consistent reading of a shared simulated GPU: the broker's status
document, what the device holds for each process, and each kvcached pool's own figures, all
read with the device's allocation lock held (nothing is mapped, unmapped or allocated while it
is read).  :class:`FrameChecks` holds each frame to what the broker promises:

* **the budget adds up**: ``budget = total - headroom - external``, the instances' charges sum
  to the document's reserved, granted and unreported bytes, and the charges plus what is free
  are exactly the budget: nothing is overcommitted, but for memory the broker charges twice
  for a moment by design, promised and already measured, until its process reports it
  allocated (:class:`Budget`; the frame shows it);
* **the books cover the device**: every server whose start-up the broker admitted (its KV
  cache sized, or its kvcached pool up) uses no more on the device than the broker charges its
  instance;
* **mapped <= granted**: no kvcached pool maps more KV memory than the broker granted it;
* **static stays static**: a server with static pools (the DeepSeek-V4-shaped one) keeps the
  same pools, to the byte, from the frame it is first seen serving on.

:func:`render` draws a frame in at most ``width`` columns (80 to 100 are fine), and
:class:`EventLog` turns what changed between frames into a few lines of events.  All sizes
are bytes; times are seconds since the demo started.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any

from ..client.protocol import RUNTIME_BASE_POOL, RUNTIME_SLACK_POOL

GIB = 1 << 30

#: Bar characters: resident memory, a hold (promised, not allocated yet), and a kvcached pool's
#: KV in use, mapped beyond that, the rest of its limit, and granted beyond its limit.
RESIDENT, HOLD, IN_USE, MAPPED, LIMIT, BEYOND = "=", "h", "#", "+", ".", "-"
INSTANCE_SYMBOLS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
LABEL_COLUMNS = 28  # the longest DeepSeek-V4 pool name, indexer_compress_state_pools


@dataclass(frozen=True)
class Server:
    """A server of the demo: its instance name, its process, and what it is."""

    instance: str
    pid: int
    caption: str  # what it is, in a few words
    elastic: bool  # kvcached mode (elastic KV) rather than static pools


@dataclass(frozen=True)
class KvFigures:
    """A kvcached pool's own figures (its ``/dev/shm`` segment, as ``kvctl list`` shows them)."""

    limit: int
    mapped: int
    in_use: int


@dataclass(frozen=True)
class Frame:
    """One consistent reading (see the module's docstring)."""

    t_s: float
    status: dict[str, Any]
    device: dict[int, int]  # pid -> bytes the process holds on the device
    kv: dict[str, KvFigures]  # instance -> its kvcached pool's figures
    kv_base: dict[str, int]  # instance -> device bytes its process held before its pool mapped a page
    admitted: frozenset[str]  # instances whose start-up the broker admitted (its books cover its usage from then)
    activity: dict[str, str]  # instance -> what it is doing, in the demo's words

    def instance(self, name: str) -> dict[str, Any] | None:
        for inst in self.status["instances"]:
            if inst["name"] == name:
                return inst
        return None

    def charged(self, name: str) -> int:
        inst = self.instance(name)
        return int(inst["charged_bytes"]) if inst else 0

    def granted(self, name: str) -> int:
        inst = self.instance(name)
        return int(inst["granted_bytes"]) if inst else 0

    def phase(self, name: str) -> str:
        inst = self.instance(name)
        phases = {s.get("phase", "") for s in inst["sessions"]} if inst else set()
        return "/".join(sorted(p for p in phases if p))

    def pressure(self, name: str) -> dict[str, int]:
        inst = self.instance(name)
        return dict((inst or {}).get("pressure") or {})


# ------------------------------------------------------------------ the checks
@dataclass(frozen=True)
class Budget:
    """The budget and what it is made of, as a frame's status says.

    ``counted_twice`` is what the broker charges twice for a moment, by design: memory it
    promised a process (a hold, a granted page not mapped yet) stays charged in full until the
    process reports it allocated, and the device's measurement may show it allocated before
    that report lands (docs/accounting.md: a warm-up's allocations inside the slack hold, "A
    co-located start-up"; a page mapped before its report, or still shown mapped after a report
    that it was unmapped, "Pages mapped on demand").  Per process, ``min(its usage beyond its
    reports, what it was promised)``.  The broker cannot tell that memory from memory the
    process took outside what it was promised, so it charges both, and on a full GPU its charges
    may pass the budget by that much until the report or the next reading."""

    total: int
    headroom: int
    external: int
    budget: int
    charges: dict[str, int]
    free: int
    counted_twice: int

    @classmethod
    def of(cls, status: dict[str, Any]) -> "Budget":
        return cls(int(status["total_bytes"]), int(status["headroom_bytes"]), int(status["external_bytes"]),
                   int(status["budget_bytes"]), {i["name"]: int(i["charged_bytes"]) for i in status["instances"]},
                   int(status["free_bytes"]), _counted_twice(status))

    @property
    def over(self) -> int:
        """How far the charges are past the budget (0 when they are within it)."""
        return max(0, sum(self.charges.values()) - self.budget)

    def problems(self, status: dict[str, Any]) -> list[str]:
        """Why the budget does not add up ([] when it does)."""
        out = []
        if self.budget != self.total - self.headroom - self.external:
            out.append(f"budget {self.budget} != total {self.total} - headroom {self.headroom} "
                       f"- external {self.external}")
        charged = sum(self.charges.values())
        document = int(status["reserved_bytes"]) + int(status["granted_bytes"]) + int(status["unreported_bytes"])
        if charged != document:
            out.append(f"the instances' charges sum to {charged}, the device's reserved + granted + unreported "
                       f"to {document}")
        if charged + self.free - self.over != self.budget:
            out.append(f"charges {charged} + free {self.free} = {charged + self.free} != budget {self.budget}")
        if self.over > self.counted_twice:
            out.append(f"overcommitted: charges {charged} pass the budget {self.budget} by {self.over} bytes, "
                       f"more than the {self.counted_twice} charged twice until allocations are reported")
        return out


def _counted_twice(status: dict[str, Any]) -> int:
    """Bytes charged both as measured and as promised (see :class:`Budget`), summed over processes."""
    by_pid: dict[int, dict[str, int]] = {}
    for inst in status["instances"]:
        for s in inst["sessions"]:
            p = by_pid.setdefault(int(s["pid"]), {"measured": int(s.get("measured_bytes", 0)), "reported": 0,
                                                   "promised": 0})
            held = int(s.get("held_bytes", 0))
            unmapped = int(s.get("unmapped_pages", 0)) * int(s["page_bytes"])
            p["reported"] += int(s["reserved_bytes"]) - held + int(s["granted_pages"]) * int(s["page_bytes"]) - unmapped
            p["promised"] += held + unmapped
    return sum(min(max(0, p["measured"] - p["reported"]), p["promised"]) for p in by_pid.values())


@dataclass
class FrameChecks:
    """Checks every frame; remembers each static server's pools from its first serving frame."""

    servers: list[Server]
    static_pools: dict[str, dict[str, int]] = field(default_factory=dict)
    frames: int = 0
    over_frames: int = 0  # frames whose charges passed the budget by memory charged twice (see Budget)
    max_over_bytes: int = 0

    def check(self, frame: Frame) -> list[str]:
        """What is wrong with ``frame`` ([] when nothing is), one line each."""
        self.frames += 1
        budget = Budget.of(frame.status)
        out = [f"the budget does not add up: {p}" for p in budget.problems(frame.status)]
        if budget.over:
            self.over_frames += 1
            self.max_over_bytes = max(self.max_over_bytes, budget.over)
        for server in self.servers:
            name = server.instance
            used = frame.device.get(server.pid, 0)
            if name in frame.admitted and used > frame.charged(name):
                out.append(f"{name} uses {_gib(used)} on the device, the broker charges it {_gib(frame.charged(name))}")
            if server.elastic and name in frame.kv_base:
                mapped = max(0, used - frame.kv_base[name])
                if mapped > frame.granted(name):
                    out.append(f"{name} maps {_gib(mapped)} of KV, the broker granted it {_gib(frame.granted(name))}")
            if not server.elastic and frame.phase(name) == "serving":
                inst = frame.instance(name)
                pools = dict(inst["pools"]) if inst else {}
                first = self.static_pools.setdefault(name, pools)
                if pools != first:
                    out.append(f"{name}'s static pools changed while serving: {_pool_diff(first, pools)}")
        return out


def _pool_diff(before: dict[str, int], after: dict[str, int]) -> str:
    names = sorted(set(before) | set(after))
    return ", ".join(f"{n} {before.get(n, 0)} -> {after.get(n, 0)}" for n in names if before.get(n) != after.get(n))


# ------------------------------------------------------------------ events
@dataclass
class EventLog:
    """The last few things that happened: the demo's own events and what changed between frames.

    ``lines`` holds the last ``keep`` events, and more while events added since the last
    :meth:`shown` were not on screen yet: a slow machine's frame may come after more than
    ``keep`` events, and a transcript loses none of them."""

    keep: int = 4
    lines: list[str] = field(default_factory=list)
    _last: Frame | None = None
    added: int = 0  # every event ever added
    _shown: int = 0  # events added up to the last frame shown

    def add(self, t_s: float, text: str) -> None:
        self.lines.append(f"{t_s:5.1f} s  {text}")
        self.added += 1
        self._trim()

    def shown(self, added: int) -> None:
        """The first ``added`` events were on screen (a frame rendered then was shown)."""
        self._shown = max(self._shown, added)
        self._trim()

    def _trim(self) -> None:
        del self.lines[:-max(self.keep, self.added - self._shown)]

    def observe(self, frame: Frame, servers: list[Server]) -> None:
        """Add what changed since the previous frame: phases, pressure asks, pages returned."""
        last, self._last = self._last, frame
        if last is None:
            return
        for server in servers:
            name = server.instance
            phase = frame.phase(name)
            if phase and phase != last.phase(name):
                self.add(frame.t_s, f"{name} is {phase}: {_phase_words(frame, name, phase)}")
            before, now = last.pressure(name), frame.pressure(name)
            if now.get("asks", 0) > before.get("asks", 0):
                asked = now.get("asked_bytes", 0) - before.get("asked_bytes", 0)
                self.add(frame.t_s, f"pressure: the broker asks {name} for {_size(asked)} back (ask {now['asks']})")
            returned = now.get("returned_bytes", 0) - before.get("returned_bytes", 0)
            if returned > 0:
                self.add(frame.t_s, f"{name} gives back {_size(returned)}")


def _phase_words(frame: Frame, name: str, phase: str) -> str:
    inst = frame.instance(name) or {}
    holds = inst.get("holds") or {}
    if phase == "sizing":
        return "holds " + ", ".join(f"{h} {_gib(size)}" for h, size in holds.items())
    if phase == "warming":
        side = [p for p in inst.get("pools", {}) if p not in holds and not p.startswith("runtime_")]
        return f"{len(side)} pools reported, its KV hold turned into them in one request"
    if phase == "serving":
        slack = inst.get("pools", {}).get(RUNTIME_SLACK_POOL, 0)
        return f"{RUNTIME_SLACK_POOL} {_gib(slack)} kept; its pools are static from now on"
    return phase


# ------------------------------------------------------------------ drawing
def render(frame: Frame, servers: list[Server], events: EventLog, problems: list[str], *, width: int = 96,
           title: str = "") -> str:
    """The frame in at most ``width`` columns."""
    budget = Budget.of(frame.status)
    bar_chars = max(20, min(50, width - LABEL_COLUMNS - 16))
    scale = Scale(max(1, budget.budget), bar_chars)
    lines = [_fit(title, width - 13).ljust(width - 13) + f"t = {frame.t_s:5.1f} s".rjust(13),
             _fit(f"budget {_gib(budget.budget)} = total {_num(budget.total)} - headroom {_num(budget.headroom)}"
                  f" - external {_num(budget.external)}; bars: {_num(budget.budget / bar_chars)} GiB a character",
                  width)]
    symbols = {s.instance: INSTANCE_SYMBOLS[i % len(INSTANCE_SYMBOLS)] for i, s in enumerate(servers)}
    for server in servers:
        lines += _server_rows(frame, server, symbols[server.instance], scale, width)
    edges, start = [], 0
    for server in servers:
        edges.append((start, budget.charges.get(server.instance, 0), symbols[server.instance]))
        start += budget.charges.get(server.instance, 0)
    others = sum(c for n, c in budget.charges.items() if n not in symbols)
    if others:
        edges.append((start, others, "?"))
    lines.append(_row("all instances", sum(budget.charges.values()), scale.bar(edges)))
    parts = " + ".join(f"{s.instance} {_num(budget.charges.get(s.instance, 0))}" for s in servers)
    verdict = "adds up" if not any(p.startswith("the budget") for p in problems) else "DOES NOT ADD UP"
    twice = f" - {budget.over / GIB:.2f} charged twice" if budget.over else ""
    lines += _wrap(f"{verdict}: budget {_num(budget.budget)} = {parts} + free {_num(budget.free)}{twice} GiB", width)
    if budget.over:
        lines += _wrap("  (memory allocated, its report in flight: the broker charges it measured and promised "
                       "until the report lands)", width)
    lines.append(_fit(f"{RESIDENT} resident  {HOLD} held  | KV (grant): {IN_USE} in use {MAPPED} mapped "
                      f"{LIMIT} to kvcached's limit {BEYOND} beyond", width))
    lines.append("events:")
    lines += [_fit(f"  {line}", width) for line in events.lines] or ["  (none yet)"]
    for problem in problems:
        lines.append(_fit(f"CHECK FAILED: {problem}", width))
    return "\n".join(lines)


def _server_rows(frame: Frame, server: Server, symbol: str, scale: "Scale", width: int) -> list[str]:
    name = server.instance
    inst = frame.instance(name)
    phase = frame.phase(name) or ("starting" if inst is None else "")
    head = f"[{symbol}] {name}: {server.caption}"
    tail = f"{phase + '  ' if phase else ''}charged {_gib(frame.charged(name))}"
    rows = [_fit(head, width - len(tail) - 1).ljust(width - len(tail)) + tail]
    if inst is None:
        rows.append(_fit(f"    {frame.activity.get(name, 'starting')}", width))
        return rows
    start = 0
    holds = inst.get("holds") or {}
    for pool, size in sorted(inst["pools"].items(), key=lambda item: _pool_rank(item[0], holds)):
        rows.append(_row(pool, size, scale.bar([(start, size, HOLD if pool in holds else RESIDENT)])))
        start += size
    if inst.get("unreported_bytes"):
        size = inst["unreported_bytes"]
        rows.append(_row("measured, not reported yet", size, scale.bar([(start, size, RESIDENT)])))
        start += size
    kv = frame.kv.get(name)
    if server.elastic and kv is not None:
        granted = frame.granted(name)
        reserve_mapped = max(0, kv.mapped - kv.in_use)
        rest_of_limit = max(0, kv.limit - kv.mapped)
        beyond = max(0, granted - max(kv.limit, kv.mapped))
        edges, at = [], start
        for size, char in ((kv.in_use, IN_USE), (reserve_mapped, MAPPED), (rest_of_limit, LIMIT), (beyond, BEYOND)):
            edges.append((at, size, char))
            at += size
        rows.append(_row(f"KV: limit {_num(kv.limit)}, mapped {_num(kv.mapped)}", granted, scale.bar(edges)))
    activity = frame.activity.get(name)
    if activity:
        rows.append(_fit(f"    {activity}", width))
    return rows


#: Pools in the order a server builds them: its base, its KV pools (DeepSeek-V4's side pools in
#: SGLang's order), what it keeps beside them; holds last.
POOL_ORDER = (RUNTIME_BASE_POOL, "weights", "kv_static", "swa_kv_pool", "c4_kv_pool", "c128_kv_pool",
              "c4_indexer_kv_pool", "compress_state_pools", "indexer_compress_state_pools", RUNTIME_SLACK_POOL)


def _pool_rank(pool: str, holds: dict[str, int]) -> tuple[int, int, str]:
    known = POOL_ORDER.index(pool) if pool in POOL_ORDER else len(POOL_ORDER)
    return (pool in holds, known, pool)


@dataclass(frozen=True)
class Scale:
    """Bytes to characters: ``chars`` characters are ``budget_bytes``."""

    budget_bytes: int
    chars: int

    def bar(self, segments: list[tuple[int, int, str]]) -> str:
        """``|...|`` with each ``(start, size, char)`` drawn where it lies (a nonzero size shows at
        least one character; a segment past the budget is cut at the bar's end)."""
        cells = [" "] * self.chars
        for start, size, char in segments:
            if size <= 0:
                continue
            first = min(self.chars - 1, round(start * self.chars / self.budget_bytes))
            last = max(first + 1, round((start + size) * self.chars / self.budget_bytes))
            for i in range(first, min(self.chars, last)):
                cells[i] = char
        return "|" + "".join(cells) + "|"


def _row(label: str, size: int, bar: str) -> str:
    return f"  {_fit(label, LABEL_COLUMNS):<{LABEL_COLUMNS}}{_gib(size):>10} {bar}"


def _wrap(text: str, width: int) -> list[str]:
    """``text`` on as many lines as it needs, the later ones indented."""
    return textwrap.wrap(text, width, subsequent_indent="    ", break_on_hyphens=False) or [""]


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "~"


def _gib(size: float) -> str:
    return f"{size / GIB:.1f} GiB"


def _num(size: float) -> str:
    return f"{size / GIB:.1f}"


def _size(size: float) -> str:
    """GiB with one decimal, or MiB below a GiB."""
    return _gib(size) if size >= GIB else f"{size / (1 << 20):.0f} MiB"
