"""The hard bound in a TP worker: kvcached maps no more pages here than this worker was granted.

In broadcast mode (vLLM's EngineCore pool, ``world_size = TP``) EngineCore decides which pages
exist and every TP worker maps them, when EngineCore asks, through kvcached's listener
(``kvcached.tp_ipc_util``).  The listener looks its VMM functions up as module globals at call
time; :func:`install` puts a :class:`MapGate` in front of them:

* ``_map_to_kv_tensors_with_result(offsets, group_id)``: a map that would take this worker's
  mapped pages above its bound raises a plain ``RuntimeError`` at once and maps nothing.  The
  listener answers ``operation_failed``; EngineCore rolls back the ranks that did map and its
  allocation misses (kvcached's ``_alloc`` returns None).  Never ``MapQuarantinedError`` or
  ``StateConsistencyError`` (they fail the pool), and never a wait: the listener is serial and
  EngineCore gives up on a silent worker after 60 s, failing the pool.  A refusal wakes the
  worker's grant holder.
* ``unmap_from_kv_tensors`` (a rollback) and ``commit_unmap_from_kv_tensors`` (a prepared
  unmap) lower the count once kvcached reports them done; ``prepare_`` remembers the offsets by
  transaction id and ``abort_`` forgets them.  Unmaps are never refused.

One offset is one compound page (a kvcached page id).  The bound is ``None`` (maps pass, as
kvcached alone) while no governing engine is on the board or the worker has no broker.

**Invariant:** ``mapped_pages() <= bound`` whenever the bound is set and the engine governs; the
holder (:mod:`.worker_grants`) lowers the bound *before* it releases a grant and raises it only
*after* the broker granted, both under the gate's lock, so what is mapped never exceeds what
this worker's broker session holds.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any, Callable

from ...patching import wrap_once
from ... import announce, process_state
from . import board as board_mod
from .. import runner

log = announce.logger("kvcached_broker.adapters")


class MapRefused(RuntimeError):
    """A broadcast map this worker's grant does not cover (a plain RuntimeError for kvcached)."""


class MapGate:
    """One group's mapped offsets in this worker, and the bound on them."""

    def __init__(self, group_id: int):
        self.group_id = group_id
        self.lock = threading.RLock()
        self._mapped: set[int] = set()
        self._prepared: dict[str, list[int]] = {}
        self.bound_pages: int | None = None  # None: not bounded
        self.refused_maps = 0
        #: ``() -> bool``: whether a governing engine is on the board (bounds apply only then)
        self.engine_governs: Callable[[], bool] = lambda: False
        #: called (under no lock of ours) after a map, refusal or unmap: publishes and wakes
        self.on_change: Callable[[], None] = runner.wake

    def mapped_pages(self) -> int:
        with self.lock:
            return len(self._mapped)

    def effective_bound(self) -> int | None:
        bound = self.bound_pages
        return bound if bound is not None and self.engine_governs() else None

    # ------------------------------------------------------------ the listener's calls
    def map(self, real: Callable[..., tuple[bool, list[int]]], offsets: list[int], group_id: int):
        with self.lock:
            new = len({int(o) for o in offsets} - self._mapped)
            bound = self.effective_bound()
            if bound is not None and new and len(self._mapped) + new > bound:
                self.refused_maps += 1
                refused = (len(self._mapped), new, bound)
            else:
                refused = None
                success, newly = real(offsets, group_id)
                if success:
                    self._mapped.update(int(o) for o in newly)
        self.on_change()
        if refused is not None:
            mapped, new, bound = refused
            raise MapRefused(f"kvcached-broker: this worker's broker grant covers {bound} page(s); "
                             f"{mapped} mapped, {new} more asked (a scheduling miss; more is being asked for)")
        return success, newly

    def unmap(self, real: Callable[..., bool], offsets: list[int], group_id: int) -> bool:
        done = real(offsets, group_id=group_id)
        if done:
            with self.lock:
                self._mapped.difference_update(int(o) for o in offsets)
            self.on_change()
        return done

    def prepare(self, real: Callable[..., bool], offsets: list[int], transaction_id: str, group_id: int) -> bool:
        done = real(offsets, transaction_id, group_id=group_id)
        if done:
            with self.lock:
                if transaction_id not in self._prepared:
                    self._prepared[transaction_id] = [int(o) for o in offsets if int(o) in self._mapped]
        return done

    def commit(self, real: Callable[..., bool], transaction_id: str, group_id: int) -> bool:
        done = real(transaction_id, group_id=group_id)
        if done:
            with self.lock:
                self._mapped.difference_update(self._prepared.pop(transaction_id, ()))
            self.on_change()
        return done

    def abort(self, real: Callable[..., bool], transaction_id: str, group_id: int) -> bool:
        done = real(transaction_id, group_id=group_id)
        if done:
            with self.lock:
                self._prepared.pop(transaction_id, None)
        return done


# ------------------------------------------------------------------ this process's gates
class _Gates:
    """This process's gates, by pool group (one each, replaced only by a reset of the process's
    state, which ends the worker's governing: tests, a worker shutting down); ``lock`` guards
    ``by_group``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_group: dict[int, MapGate] = {}


def gate(group_id: int) -> MapGate:
    """This process's gate for ``group_id`` (made on first use, unbounded)."""
    gates = process_state.part(_Gates)
    with gates.lock:
        found = gates.by_group.get(group_id)
        if found is None:
            found = gates.by_group[group_id] = MapGate(group_id)
        return found


def existing(group_id: int) -> MapGate | None:
    gates = process_state.part(_Gates)
    with gates.lock:
        return gates.by_group.get(group_id)


# ------------------------------------------------------------------ the patch
def _gated_map(real):
    def _map_to_kv_tensors_with_result(offsets: list[int], group_id: int) -> tuple[bool, list[int]]:
        found = existing(group_id)
        return real(offsets, group_id) if found is None else found.map(real, offsets, group_id)
    return _map_to_kv_tensors_with_result


def _gated_unmap(real):
    def unmap_from_kv_tensors(offsets: list[int], group_id: int = 0) -> bool:
        found = existing(group_id)
        return real(offsets, group_id=group_id) if found is None else found.unmap(real, offsets, group_id)
    return unmap_from_kv_tensors


def _gated_prepare(real):
    def prepare_unmap_from_kv_tensors(offsets: list[int], transaction_id: str, group_id: int = 0) -> bool:
        found = existing(group_id)
        if found is None:
            return real(offsets, transaction_id, group_id=group_id)
        return found.prepare(real, offsets, transaction_id, group_id)
    return prepare_unmap_from_kv_tensors


def _gated_transaction(real, method: str):
    def transaction(transaction_id: str, group_id: int = 0) -> bool:
        found = existing(group_id)
        if found is None:
            return real(transaction_id, group_id=group_id)
        return getattr(found, method)(real, transaction_id, group_id)
    return transaction


_WRAPPERS: dict[str, Callable[[Any], Any]] = {
    "_map_to_kv_tensors_with_result": _gated_map,
    "unmap_from_kv_tensors": _gated_unmap,
    "prepare_unmap_from_kv_tensors": _gated_prepare,
    "commit_unmap_from_kv_tensors": lambda real: _gated_transaction(real, "commit"),
    "abort_unmap_from_kv_tensors": lambda real: _gated_transaction(real, "abort"),
}


def install(module: ModuleType) -> None:
    """Gate ``kvcached.tp_ipc_util``'s listener functions (once: ``wrap_once``; absent ones stay absent)."""
    for name, wrap in _WRAPPERS.items():
        real = getattr(module, name, None)
        if real is not None:
            setattr(module, name, wrap_once(real, wrap(real)))


def engine_governs(board: "board_mod.Board") -> Callable[[], bool]:
    """A gate's ``engine_governs``: the board's engine governs and is the process that said so."""
    def governs() -> bool:
        engine = board.engine()
        return engine.state == board_mod.ENGINE_GOVERNING and board_mod.alive(engine)
    return governs
