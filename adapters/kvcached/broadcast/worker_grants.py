"""A TP worker's own grant for a broadcast-mode pool, held through its own broker session.

In vLLM's TP topology EngineCore owns the kvcached pool and each worker maps its pages (see
:mod:`.map_gate`).  Each worker's memory is its own GPU's, so each worker holds its grant with
its own broker session (``adapters/sessions.py``: one session per device, the one the vLLM adapter
uses for this worker).  :class:`WorkerGrants` is that holder, one per pool group, stepped on the
governors' thread (:mod:`..runner`); EngineCore's :class:`~.board_grants.BoardGrants` talks to it
through the board (:mod:`.board`).

Each step:

* **pressure** from this worker's broker (the client's callback, fanned out by
  :mod:`..pressure`): what is held above both EngineCore's wanted level and what is mapped goes
  back at once; the rest is posted on the board for EngineCore, whose governor gives back
  (lower limit, prefix-cache eviction, a deferred limit) and lowers its wanted level;
* **follow EngineCore**: on a new ask, acquire up to the wanted level (taking no less than the
  ask's floor); release down to ``max(wanted, mapped)``, so a worker gives back only what
  kvcached unmapped here and never drops below what EngineCore may map;
* **publish** what it holds, maps and answered, and ring EngineCore's doorbell.

Invariant, with the gate: ``mapped <= gate bound <= pages the session holds for this pool``.
The gate is bounded from the moment the worker registers (at 0, before kvcached's tensors
exist): a worker that registers after EngineCore started governing maps nothing until its
broker granted it.  A broker that is unreachable, refuses the session or fails while serving
makes the worker unprotected: its gate lets maps through (kvcached alone) and its slot says
so, so EngineCore stops counting it.  Nothing here raises into kvcached's listener or the
runtime.

Registering again (kvcached creating a group's tensors a second time) keeps the holder: its
slot, its grant, its gate's bound and the board EngineCore maps.  A holder leaves the board
when it closes (at exit, or when the process registry resets): its slot cleared, the file
removed only if no other writer runs.
"""

from __future__ import annotations

import threading
from typing import Any

from ....client import BudgetExceeded, SessionEvicted
from ... import announce, process_state, sessions
from ...device_session import DeviceSession
from ...patching import wrap_once
from ...worker_identity import WorkerIdentity
from . import board as board_mod
from .. import identity, kvcached_api, pressure, runner
from . import doorbell, map_gate
from ..geometry import PoolGeometry
from ..display import ZERO_PAGE_POOL
from ..grants import SessionGrants
from ..pool_state import AskBook

log = announce.logger("kvcached_broker.adapters")


class _MappedView:
    """What :func:`pressure.split` reads as a pool's pages in use: this worker's mapped pages."""

    def __init__(self, gate: map_gate.MapGate):
        self._gate = gate

    def get_num_inuse_pages(self) -> int:
        return self._gate.mapped_pages()


class WorkerGrants:
    def __init__(self, board: board_mod.Board, slot: int, who: WorkerIdentity, geometry: PoolGeometry,
                 gate: map_gate.MapGate):
        self.board = board
        self.slot = slot
        self.identity = who
        self.geometry = geometry
        self.gate = gate
        self.real = _MappedView(gate)  # for pressure.split
        self.key = f"kvcached-worker:g{geometry.group_id}:slot{slot}"
        self.grants: SessionGrants | None = None
        self.governed = False  # holding a grant through a broker session
        self.why_ungoverned = "waiting for a governing engine on the board"
        self.closed = False
        self._active = False
        self._answered = 0
        self._pressure_total = 0
        self._published: tuple | None = None
        self.counters = {"grows": 0, "refusals": 0, "pages_granted": 0, "pages_released": 0,
                         "pressure_asks": 0, "pressure_posted": 0}
        self.asks = AskBook(self.counters)  # the only state other threads write
        with gate.lock:  # bounded from registration: nothing is mapped here beyond a grant
            gate.bound_pages = 0
            gate.engine_governs = map_gate.engine_governs(board)
            gate.on_change = self._gate_changed

    # ------------------------------------------------------------ any thread
    def ask_back(self, pages: int, *, soft: bool = False) -> None:
        """This worker's broker wants ``pages`` pool pages back (recorded; the step acts).  ``soft``:
        idle pages only, so only what this worker holds above EngineCore's level and its own maps
        goes back, and nothing is asked of EngineCore (whose prefix cache is not idle memory)."""
        self.asks.ask_back(pages, soft=soft)

    def _gate_changed(self) -> None:
        self.board.write_slot(self.slot, mapped_pages=self.gate.mapped_pages(), refused_maps=self.gate.refused_maps)
        runner.wake()

    # ------------------------------------------------------------ the governors' thread
    def step(self, now_s: float) -> None:
        if self.closed:
            return
        engine = self.board.engine()
        governing = engine.state == board_mod.ENGINE_GOVERNING and board_mod.alive(engine)
        if not self._active:
            if not governing:
                return
            self._activate()
        if not self.governed:
            return
        try:
            if governing:
                self._answer_pressure(engine)
                self._follow(engine)
            else:
                self._release_down_to(0)  # no engine asks for pages: keep only what is mapped
            self._publish(engine)
            if self.grants is not None and self.governed:  # the rest of the grant is promised memory
                self.grants.mapped(self.key, min(self.gate.mapped_pages(), self._bound()))
        except SessionEvicted as exc:
            self._unprotected(f"evicted: {exc}")

    def _activate(self) -> None:
        """A governing engine appeared: open the session, report the zero page, hold nothing yet."""
        self._active = True
        session = sessions.session(self.identity)
        if session is None:
            self._unprotected(f"unprotected ({sessions.unprotected_reason(self.identity) or 'no broker'})")
            return
        self._report_zero_page(session)
        grants, why = SessionGrants.open(self.identity, self.geometry)
        if grants is None:
            self._unprotected(why)
            return
        self.grants = grants
        with self.gate.lock:
            self.gate.bound_pages = 0
        self.governed = True
        self.why_ungoverned = ""
        pressure.enlist(grants.client, self)
        self.board.write_slot(self.slot, state=board_mod.SLOT_GOVERNED, granted_pages=0)
        log.info("event=kvcached_worker_governed pool=%s rank=%d page_bytes=%d", self.key, self.identity.tp_rank,
                 self.geometry.page_bytes)

    def _report_zero_page(self, session: DeviceSession) -> None:
        """kvcached's zero page (one compound page per group, mapped with the tensors) is charged as a
        pool; reported as allocated, so the base pinned with it does not count it twice."""
        try:
            session.report(self.key, {ZERO_PAGE_POOL: self.geometry.page_bytes}, allocated=True)
        except BudgetExceeded as exc:
            log.warning("event=kvcached_zero_page_unreported pool=%s detail=%s (charged as measured usage)",
                        self.key, exc)

    def _answer_pressure(self, engine: board_mod.EngineRecord) -> None:
        asks = self.asks.take()
        asked, soft = asks.pressure_pages, asks.soft_pages
        if soft > 0:
            self._release_down_to(engine.wanted_pages, at_most=soft)
        if asked <= 0:
            return
        released = self._release_down_to(engine.wanted_pages, at_most=asked)
        rest = asked - released
        if rest > 0:  # only EngineCore can free pages it may still map: ask it
            self._pressure_total += rest
            self.counters["pressure_posted"] += rest
            self.board.write_slot(self.slot, pressure_pages_total=self._pressure_total)
            board_mod.ring(engine)

    def _follow(self, engine: board_mod.EngineRecord) -> None:
        if engine.ask_seq != self._answered:
            deficit = engine.wanted_pages - self._bound()
            if deficit > 0:
                self._acquire(deficit, max(0, engine.floor_pages - self._bound()))
            self._answered = engine.ask_seq
        self._release_down_to(engine.wanted_pages)

    def _acquire(self, pages: int, min_pages: int) -> None:
        assert self.grants is not None
        got = self.grants.acquire(pages, min_pages)
        if got is None:
            self._unprotected(sessions.unprotected_reason(self.identity) or "broker unusable while growing")
            return
        if got == 0:
            self.counters["refusals"] += 1
            return
        with self.gate.lock:  # the grant first, the bound after
            self.gate.bound_pages = (self.gate.bound_pages or 0) + got
        self.counters["grows"] += 1
        self.counters["pages_granted"] += got

    def _release_down_to(self, wanted_pages: int, at_most: int | None = None) -> int:
        """Lower the bound to ``max(wanted, mapped)`` (by at most ``at_most``), then release that
        much; the pages released."""
        assert self.grants is not None
        with self.gate.lock:  # the bound first, the grant after: no map can land in between
            bound = self._bound()
            keep = max(wanted_pages, self.gate.mapped_pages())
            surplus = max(0, bound - keep) if at_most is None else max(0, min(at_most, bound - keep))
            if surplus <= 0:
                return 0
            self.gate.bound_pages = bound - surplus
        if not self.grants.release(surplus):
            self._unprotected(sessions.unprotected_reason(self.identity) or "broker unusable while releasing")
            return 0
        self.counters["pages_released"] += surplus
        return surplus

    def _bound(self) -> int:
        return self.gate.bound_pages or 0

    def _publish(self, engine: board_mod.EngineRecord) -> None:
        state = (self._bound(), self._answered)
        if state == self._published:
            return
        self.board.write_slot(self.slot, granted_pages=self._bound(), answered_seq=self._answered,
                              mapped_pages=self.gate.mapped_pages())
        self._published = state
        board_mod.ring(engine)

    def _unprotected(self, why: str) -> None:
        """No broker: the gate lets maps through (kvcached alone) and EngineCore stops counting us."""
        self.governed = False
        self.why_ungoverned = why
        with self.gate.lock:
            self.gate.bound_pages = None
        self.board.write_slot(self.slot, state=board_mod.SLOT_UNPROTECTED)
        board_mod.ring(self.board.engine())
        log.warning("event=kvcached_pool_ungoverned pool=%s reason=%r detail=runs_as_kvcached_alone", self.key, why)

    def close(self) -> None:
        """Stop mapping, give back the grant above what is still mapped, and leave the board.

        What is mapped stays granted: it goes back as the listener unmaps it, or with the
        process when it exits (the broker reclaims a dead process's sessions), never while the
        memory is still in use.  Only through a session still open, never opening one: where a
        reset of the process's state closed the session before this holder, closing it freed
        the whole grant at the broker."""
        if self.closed:
            return
        self.closed = True
        if self.governed and self.grants is not None and self.grants.pages and self._session_open():
            with self.gate.lock:
                mapped = self.gate.mapped_pages()
                self.gate.bound_pages = mapped  # nothing more is mapped from here on
            surplus = self.grants.pages - mapped
            if surplus > 0:
                self.grants.release(surplus)
        self.board.leave()

    def _session_open(self) -> bool:
        """This worker's session is open (never opens one)."""
        return any(str(open_.device) == str(self.identity.device) for open_ in sessions.open_identities())

    def status(self) -> dict[str, Any] | None:
        """None until a governing engine appeared (a worker whose pool maps in-process, as with
        vLLM's UniProcExecutor, registers but never holds anything here)."""
        if not self._active:
            return None
        g = self.geometry
        mapped = self.gate.mapped_pages()
        return {
            "pool": "worker", "key": self.key, "group_id": g.group_id, "slot": self.slot,
            "governed": self.governed, "why_ungoverned": self.why_ungoverned, "page_bytes": g.page_bytes,
            "granted_bytes": g.limit_bytes(self._bound()), "mapped_bytes": g.limit_bytes(mapped),
            "mapped_pages": mapped, "refused_maps": self.gate.refused_maps, "answered_seq": self._answered,
            **self.counters,
        }


# ------------------------------------------------------------------ registration
class _Holders:
    """This process's holders, by pool group; ``lock`` guards ``by_group``.  Every holder gives
    its grant back and leaves its board at exit, or when the process registry resets.

    Built after the boards' part (:class:`.board._Joined`), so that at exit, newest first, the
    holders give back and leave before every board still joined is left."""

    def __init__(self) -> None:
        process_state.part(board_mod._Joined)
        self.lock = threading.Lock()
        self.by_group: dict[int, WorkerGrants] = {}

    def close_all(self) -> None:
        """Every holder gives its grant back and leaves its board."""
        with self.lock:
            holders = list(self.by_group.values())
        for found in holders:
            try:
                found.close()
            except Exception as exc:  # noqa: BLE001 - exiting: what is left goes with the process
                log.warning("event=kvcached_worker_close_failed pool=%s error=%r", found.key, str(exc))

    def at_exit(self) -> None:
        self.close_all()

    def close(self) -> None:
        self.close_all()

    def after_fork_in_child(self) -> None:
        """A forked child holds nothing its parent registered (the grants and slots are the parent's)."""
        self.lock = threading.Lock()
        self.by_group = {}


def register(group_id: int, num_layers: int, num_kv_buffers: int) -> WorkerGrants | None:
    """A worker creates a group's KV tensors: put it on the board (holding nothing until a
    governing engine appears) and gate its listener's maps, bounded at 0 until granted.  A
    group registered already keeps its holder (slot, grant, bound, board).  None outside a
    TP worker."""
    worker_of = kvcached_api.tp_worker()
    if worker_of is None:
        return None
    rank, pp_rank, tp_size = worker_of.tp_rank, worker_of.pp_rank, worker_of.tp_size
    geometry = PoolGeometry(num_layers=int(num_layers), page_size=kvcached_api.page_size(),
                            num_kv_buffers=int(num_kv_buffers),
                            virtual_pages=0, group_id=int(group_id), world_size=tp_size, pp_rank=max(0, pp_rank))
    slot = max(0, pp_rank) * tp_size + rank
    if slot >= board_mod.MAX_SLOTS:
        log.warning("event=kvcached_worker_unboarded slot=%d detail=more_ranks_than_board_slots", slot)
        return None
    who = _identity(geometry, rank, tp_size, worker_of.device)
    if who is None:
        return None
    path = board_mod.board_path(group_id)
    holders = process_state.part(_Holders)
    with holders.lock:
        previous = holders.by_group.get(group_id)
        if previous is not None and not previous.closed and previous.board.path == path and previous.slot == slot:
            if previous.geometry != geometry:
                log.warning("event=kvcached_worker_reregistered group=%d slot=%d detail=geometry_changed_"
                            "holder_kept_in_its_first_geometry", group_id, slot)
            log.info("event=kvcached_worker_reregistered group=%d slot=%d board=%s detail=holder_kept",
                     group_id, slot, path)
            return previous
        if previous is not None:  # another board or slot: the old one is left (removed only if unused)
            del holders.by_group[group_id]
            previous.close()
        fields = board_mod.identity_fields(board_mod.own_identity(), doorbell.start())
        gate = map_gate.gate(group_id)
        with gate.lock:  # bounded before the slot is counted: no map lands unbounded meanwhile
            gate.bound_pages = 0
            board = board_mod.Board.join(path, lambda b: b.write_slot(
                slot, **fields, state=board_mod.SLOT_REGISTERED, granted_pages=0,
                mapped_pages=gate.mapped_pages(), answered_seq=0, pressure_pages_total=0, refused_maps=0,
                page_bytes=geometry.page_bytes))
            holder = holders.by_group[group_id] = WorkerGrants(board, slot, who, geometry, gate)
    board_mod.ring(board.engine())
    runner.enlist(holder)
    log.info("event=kvcached_worker_registered group=%d slot=%d board=%s", group_id, slot, board.path)
    return holder


def holder(group_id: int) -> WorkerGrants | None:
    holders = process_state.part(_Holders)
    with holders.lock:
        return holders.by_group.get(group_id)


def _identity(geometry: PoolGeometry, rank: int, tp_size: int, device: Any) -> WorkerIdentity | None:
    """The identity whose session pays: the resolver's if one is installed, else this worker's
    vLLM identity (device, TP rank and size), the one the vLLM adapter uses."""
    if identity.installed_resolver() is not None:
        return identity.resolve(geometry)
    return WorkerIdentity("vllm", identity._device_index(device), tp_rank=rank, tp_size=tp_size)


def wrap_create_kv_tensors(real):
    """``kvcached.integration.vllm.interfaces.create_kv_tensors``: register (the gate bounded at 0)
    before the tensors exist, so EngineCore cannot map here before the gate counts and bounds it."""
    def create_kv_tensors(size, dtype_size, dev_str, num_layers, num_kv_buffers=2, group_id=0, **kwargs):
        try:
            register(group_id, num_layers, num_kv_buffers)
        except Exception as exc:  # noqa: BLE001 - a worker that cannot register runs as kvcached alone
            log.warning("event=kvcached_worker_unregistered group=%d error=%r detail=runs_as_kvcached_alone",
                        group_id, str(exc))
        return real(size, dtype_size, dev_str, num_layers, num_kv_buffers=num_kv_buffers, group_id=group_id,
                    **kwargs)

    return wrap_once(real, create_kv_tensors)


def patch_vllm_interfaces(module) -> None:
    """Register a TP worker on the board when kvcached creates its KV tensors (vLLM integration)."""
    module.create_kv_tensors = wrap_create_kv_tensors(module.create_kv_tensors)
