"""EngineCore's grants for a broadcast-mode pool: what every TP worker was granted, via the board.

vLLM's EngineCore pool (``world_size = TP``) maps its pages in the TP workers, and each worker
holds its own GPU's grant (:mod:`.worker_grants`), bounded where the pages are mapped
(:mod:`.map_gate`).  EngineCore's :class:`~..governor.PoolGovernor` governs the pool with a
:class:`BoardGrants` in place of a session's grants (the interface of :mod:`..grants`):

* :attr:`pages` is the least any counted worker holds, at most the level EngineCore wants: the
  pool's limit is never above it, so ``available_size()`` / ``get_num_free_blocks()`` never
  promise a page some worker was not granted;
* :meth:`acquire` raises the wanted level, rings the workers and waits, bounded
  (:data:`ANSWER_WAIT_S`) and woken by their doorbells, until every counted worker answered;
  it takes the agreed level (the least any got) and lowers ``wanted`` to it, so the workers
  that got more give the surplus back;
* :meth:`release` lowers the wanted level (the workers release down to ``max(wanted, mapped)``,
  only what kvcached unmapped); :meth:`poll` returns the pressure the workers posted (the most
  any one asked: a page id given back frees it on every worker), or, if more, how far the
  limit stands above :attr:`pages` (a worker counted with less than the limit: one that
  registered late, at 0 until its broker grants it more), asked once per drop, so the governor
  lowers the limit through its give-back path (free pages, the prefix cache, a deferred limit);
* :meth:`report` only publishes the limit (the governor reports after a round that changed it):
  EngineCore maps nothing, the workers report; :meth:`forget`
  (the pool shut down) sets the wanted level to 0 and leaves the board.

EngineCore leaves the board (:meth:`.board.Board.leave`: its record cleared, the file removed
if no worker still runs) when its pool shuts down, when it finds no worker to count (the pool
then runs as kvcached alone), and at exit.

A worker is *counted* while its slot is registered or governed and its process runs.  An
unprotected worker (no broker) constrains nobody; when no worker is left to count, the pool is
unprotected too (``acquire`` returns None and the governor lets it run as kvcached alone).

Before the first grant the pool's allocator is born at the agreed level, 0 if none yet:
kvcached's null-block wait then polls its own counters without IPC, where a broadcast map the
gates refuse would be retried every 10 ms.

Invariant: ``limit_pages`` published <= ``wanted`` <= every counted worker's grant, except a
worker that was refused, which bounds :attr:`pages` and so the limit, and a worker counted with
less than the limit (registered late): until the governor's give-back brought the limit down to
it (:meth:`poll`), the limit is above that worker's grant, and its gate refuses the maps beyond it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ... import announce
from . import board as board_mod
from . import doorbell
from ..geometry import PoolGeometry

log = announce.logger("kvcached_broker.adapters")

#: How long EngineCore waits for its workers to register, and to answer an ask.
REGISTER_WAIT_S = 30.0
ANSWER_WAIT_S = 10.0
#: A waiter also looks at the board this often, in case a doorbell ring was lost.
RECHECK_S = 0.05
PP_SIZE_ENV = "KVCACHED_PP_SIZE"


def expected_slots(geometry: PoolGeometry) -> int:
    """TP x PP ranks the pool broadcasts to (``pp_rank < 0``: every PP stage, as kvcached does)."""
    stages = max(1, int(os.environ.get(PP_SIZE_ENV, "1") or "1")) if geometry.pp_rank < 0 else geometry.pp_rank + 1
    return max(1, geometry.world_size) * stages


class BoardGrants:
    """The :class:`~..grants.Grants` of a pool whose pages are mapped in its TP workers."""

    maps_here = False  # the workers map, and report what they map and hold idle
    ratio = 1  # pool pages: the board's pressure asks are in pool pages

    def __init__(self, board: board_mod.Board, geometry: PoolGeometry, slots: int, real: Any):
        self.board = board
        self.geometry = geometry
        self.slots = slots
        self.real = real  # kvcached's PageAllocator: its size is the limit published
        self.wanted = 0
        self._ask_seq = board.engine().ask_seq
        self._pressure_seen: dict[int, int] = {}  # slot -> its pressure total when last polled
        self._published: tuple | None = None
        self._shortfall_asked: int | None = None  # pages the limit was last asked down to (a worker below it)
        self._sized = False  # kvcached's allocator was sized to the first grant (nothing maps before)

    # ------------------------------------------------------------ opening
    @classmethod
    def open(cls, geometry: PoolGeometry, real: Any) -> "tuple[BoardGrants | None, str]":
        """The pool's board grants once its workers registered, or (None, why not)."""
        slots = expected_slots(geometry)
        if slots > board_mod.MAX_SLOTS:
            return None, f"{slots} ranks, more than the board's {board_mod.MAX_SLOTS} slots"
        fields = board_mod.identity_fields(board_mod.own_identity(), doorbell.start())
        board = board_mod.Board.join(board_mod.board_path(geometry.group_id), lambda b: b.write_engine(
            **fields, state=board_mod.ENGINE_NONE, wanted_pages=0, floor_pages=0, limit_pages=0,
            expected_slots=slots))
        grants = cls(board, geometry, slots, real)
        registered = grants._wait_for(lambda: grants._registered() >= slots, REGISTER_WAIT_S)
        if not grants._counted() and not grants._unprotected_slots():
            board.leave()
            return None, f"no TP worker registered on the board within {REGISTER_WAIT_S:g}s"
        if not registered:
            log.warning("event=kvcached_board_partial registered=%d expected=%d detail=governing_with_those_registered",
                        grants._registered(), slots)
        grants._pressure_seen = {i: s.pressure_pages_total for i, s in grants._live_slots()}
        board.write_engine(state=board_mod.ENGINE_GOVERNING)
        grants._ring_workers()
        return grants, ""

    # ------------------------------------------------------------ the grants interface
    @property
    def pages(self) -> int:
        held = self._counted_grants()
        return min([self.wanted, *held]) if held else 0

    def acquire(self, pages: int, min_pages: int, *, wait_s: float | None = None) -> int | None:
        """Raise every worker to ``pages`` more (no fewer than ``min_pages`` more); the pages every
        counted worker now holds above the old level (0: refused); None if none is counted.
        (``wait_s`` is not used: each worker asks its own broker, within ``ANSWER_WAIT_S``.)"""
        if not self._counted():
            self._unprotected()
            return None
        old = self.pages
        self._ask_seq += 1
        seq = self._ask_seq
        self.wanted = old + pages
        self._publish(floor_pages=old + min_pages, ask_seq=seq)
        self._wait_for(lambda: self._answered(seq), ANSWER_WAIT_S)
        if not self._counted():
            self._unprotected()
            return None
        agreed = self.pages
        got = agreed - old if agreed - old >= min_pages else 0
        self.wanted = old + got  # the workers that got more give it back
        self._publish()
        return got

    def sized(self) -> None:
        """The governor sized kvcached's allocator to the first grant: its size is the limit from now on
        (before, kvcached's allocator has its whole virtual size, and maps nothing)."""
        self._sized = True
        self._publish()

    def _unprotected(self) -> None:
        """No worker holds a grant any more (none has a broker): the pool runs as kvcached alone
        (for good: its governor stops), so EngineCore leaves the board."""
        self.board.write_engine(state=board_mod.ENGINE_UNGOVERNED)
        self._ring_workers()
        self.board.leave()

    def lost(self) -> str | None:
        """Never here: a pool with no counted worker left finds out in :meth:`acquire`."""
        return None

    def mapped(self, key: str, pages: int) -> None:
        """The workers report what they map."""

    def idle(self, key: str, pages: int) -> None:
        """The workers report what they hold idle."""

    def uncharged_pages(self) -> int:
        """EngineCore holds no session pages: each worker's own client books its shortfalls."""
        return 0

    def unasked_shortfall(self) -> int:
        return 0

    def release(self, pages: int, *, mapped: int | None = None, key: str | None = None) -> bool:
        """Lower the wanted level by ``pages`` below what every worker holds (they release it);
        the workers report what they map themselves."""
        self.wanted = max(0, self.pages - pages)
        self._publish()
        return True

    def report(self, key: str, pools: dict[str, int], *, usage: dict[str, int] | None = None,
               allocated: bool = True) -> bool:
        """The workers report what they map (their zero pages included); the governor reports after
        every round that changed its limit, so the limit is published here, without waiting a round."""
        self._publish()
        return True

    def forget_report(self, key: str) -> None:
        """Nothing is reported under a key here (the workers report their own zero pages): the board
        stays as it is when the pool takes another name."""

    def forget(self, key: str) -> None:
        """The pool shut down: the workers keep only what is mapped, and the board goes."""
        self.wanted = 0
        self._publish()
        self.board.write_engine(state=board_mod.ENGINE_NONE)
        self._ring_workers()
        self.board.leave()

    def poll(self) -> int:
        """Pool pages to give back now: the most any worker's broker asked back since the last call,
        or, if more, the limit's height above :attr:`pages` (a counted worker granted less)."""
        self._publish()  # the limit as it stands now (a deferred limit may have finished)
        asked = 0
        for index, slot in self._live_slots():
            seen = self._pressure_seen.setdefault(index, slot.pressure_pages_total)  # new: from now on
            asked = max(asked, slot.pressure_pages_total - seen)
            self._pressure_seen[index] = slot.pressure_pages_total
        return max(0, asked, self._shortfall())

    def _shortfall(self) -> int:
        """How far the limit stands above what every counted worker holds, once per drop of
        :attr:`pages` (the governor's give-back then runs to completion or defers; asking again
        for the same level would only stack deferred limits)."""
        if not self._sized:
            return 0
        pages = self.pages
        above = int(self.real.get_num_total_pages()) - pages
        if above <= 0:
            self._shortfall_asked = None
            return 0
        if self._shortfall_asked is not None and pages >= self._shortfall_asked:
            return 0
        self._shortfall_asked = pages
        log.info("event=kvcached_board_shortfall limit_pages=%d worker_pages=%d detail=lowering_the_limit",
                 pages + above, pages)
        return above

    # ------------------------------------------------------------ the board
    def _publish(self, **extra: int) -> None:
        """The limit (kvcached's allocator size) with the wanted level, in one record write (the
        wanted level is lowered only after the limit fell below it); rings the workers on a change."""
        limit = int(self.real.get_num_total_pages()) if self._sized else 0
        record = (limit, self.wanted, tuple(sorted(extra.items())))
        if record == self._published:
            return
        self.board.write_engine(limit_pages=record[0], wanted_pages=self.wanted, **extra)
        self._published = record
        self._ring_workers()

    def _ring_workers(self) -> None:
        for _, slot in self._live_slots():
            board_mod.ring(slot)

    def _live_slots(self) -> list[tuple[int, board_mod.SlotRecord]]:
        found = []
        for index in range(self.slots):
            slot = self.board.slot(index)
            if slot.state != board_mod.SLOT_EMPTY and board_mod.alive(slot):
                found.append((index, slot))
        return found

    def _counted(self) -> list[board_mod.SlotRecord]:
        return [s for _, s in self._live_slots() if s.state in (board_mod.SLOT_REGISTERED, board_mod.SLOT_GOVERNED)]

    def _counted_grants(self) -> list[int]:
        return [s.granted_pages if s.state == board_mod.SLOT_GOVERNED else 0 for s in self._counted()]

    def _unprotected_slots(self) -> int:
        return sum(1 for _, s in self._live_slots() if s.state == board_mod.SLOT_UNPROTECTED)

    def _registered(self) -> int:
        return len(self._live_slots())

    def _answered(self, seq: int) -> bool:
        return all(s.state == board_mod.SLOT_GOVERNED and s.answered_seq >= seq for s in self._counted())

    def _wait_for(self, condition, timeout_s: float) -> bool:
        """Wait until ``condition()``, woken by doorbell rings (and every :data:`RECHECK_S`)."""
        deadline = time.monotonic() + timeout_s
        seen = doorbell.rings()
        while not condition():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            seen = doorbell.wait(seen, min(left, RECHECK_S))
            if seen < 0:  # a reset stopped the doorbell: the process is shutting its state down
                return False
        return True

    def status(self) -> dict[str, Any]:
        snapshot = self.board.snapshot(self.slots)
        slots = [] if snapshot is None else [
            {"slot": i, "state": s.state, "granted_pages": s.granted_pages, "mapped_pages": s.mapped_pages,
             "refused_maps": s.refused_maps} for i, s in enumerate(snapshot[1])]
        return {"board": self.board.path, "wanted_pages": self.wanted, "slots": slots}


def open_grants(geometry: PoolGeometry, real: Any) -> "tuple[BoardGrants | None, str]":
    """What :func:`..patches.new_governor` calls for a broadcast-mode pool."""
    try:
        return BoardGrants.open(geometry, real)
    except Exception as exc:  # noqa: BLE001 - a board that cannot be opened leaves the pool to kvcached alone
        return None, f"board unavailable: {exc}"
