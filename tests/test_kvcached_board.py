"""kvcached mode's broadcast pieces alone: the board's records and the worker's map gate.

The gate stands in front of kvcached's listener functions (``map_gate.py``); here the "real"
functions are recorders, so the counting rules are checked without kvcached: a map beyond the
bound is refused whole and maps nothing, unmaps and committed unmaps lower the count and are
never refused, an aborted unmap changes nothing, and nothing is bounded unless an engine governs.
"""

from __future__ import annotations

import threading

import pytest

from kvcached_broker.adapters.kvcached import board as board_mod
from kvcached_broker.adapters.kvcached.map_gate import MapGate, MapRefused


@pytest.fixture
def board(tmp_path):
    found = board_mod.Board(str(tmp_path / "pool.board"))
    yield found
    found.close()


def test_records_have_one_writer_each_and_a_snapshot_is_one_instant(board):
    board.write_engine(state=board_mod.ENGINE_GOVERNING, wanted_pages=8, limit_pages=6)
    board.write_slot(1, state=board_mod.SLOT_GOVERNED, granted_pages=8, mapped_pages=5)
    engine, slots = board.snapshot(2)
    assert (engine.state, engine.wanted_pages, engine.limit_pages) == (board_mod.ENGINE_GOVERNING, 8, 6)
    assert slots[0] == board_mod.SlotRecord() and (slots[1].granted_pages, slots[1].mapped_pages) == (8, 5)
    assert engine.seq % 2 == 0 and slots[1].seq % 2 == 0
    with pytest.raises(ValueError):
        board.write_slot(0, wanted_pages=1)  # an engine field is not a slot's


def test_a_reader_never_sees_a_torn_record(board):
    stop = threading.Event()

    def writer():
        n = 0
        while not stop.is_set():
            n += 1
            board.write_slot(0, granted_pages=n, mapped_pages=n)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(2000):
            slot = board.slot(0)
            assert slot.granted_pages == slot.mapped_pages
    finally:
        stop.set()
        thread.join()


def test_liveness_is_a_pid_with_its_start_time(board):
    pid, ticks = board_mod.own_identity()
    assert board_mod.alive(pid, ticks) and not board_mod.alive(pid, ticks + 1) and not board_mod.alive(0, 0)


class Recorder:
    """kvcached's VMM functions as the listener calls them, recording what is mapped."""

    def __init__(self):
        self.mapped: set[int] = set()
        self.prepared: dict[str, list[int]] = {}

    def map(self, offsets, group_id):
        newly = [o for o in offsets if o not in self.mapped]
        self.mapped.update(newly)
        return True, newly

    def unmap(self, offsets, group_id=0):
        self.mapped.difference_update(offsets)
        return True

    def prepare(self, offsets, transaction_id, group_id=0):
        self.prepared[transaction_id] = list(offsets)
        return True

    def commit(self, transaction_id, group_id=0):
        self.mapped.difference_update(self.prepared.pop(transaction_id))
        return True

    def abort(self, transaction_id, group_id=0):
        self.prepared.pop(transaction_id)
        return True


def governed_gate(bound: int) -> MapGate:
    gate = MapGate(0)
    gate.on_change = lambda: None
    gate.engine_governs = lambda: True
    gate.bound_pages = bound
    return gate


def test_a_map_beyond_the_bound_is_refused_whole_and_maps_nothing():
    vmm, gate = Recorder(), governed_gate(3)
    assert gate.map(vmm.map, [0, 1], 0) == (True, [0, 1])
    with pytest.raises(MapRefused) as refused:  # a plain RuntimeError for kvcached: a scheduling miss
        gate.map(vmm.map, [1, 2, 3], 0)
    assert type(refused.value).__mro__[1] is RuntimeError
    assert vmm.mapped == {0, 1} and gate.mapped_pages() == 2 and gate.refused_maps == 1
    assert gate.map(vmm.map, [1, 2], 0) == (True, [2])  # offsets already mapped cost nothing


def test_unmaps_lower_the_count_and_are_never_refused():
    vmm, gate = Recorder(), governed_gate(4)
    gate.map(vmm.map, [0, 1, 2, 3], 0)
    gate.bound_pages = 0  # a bound below what is mapped (a lowered grant) never blocks an unmap
    assert gate.unmap(vmm.unmap, [3], 0) and gate.mapped_pages() == 3
    assert gate.prepare(vmm.prepare, [1, 2], "t1", 0) and gate.mapped_pages() == 3  # still backed
    assert gate.abort(vmm.abort, "t1", 0) and gate.mapped_pages() == 3
    assert gate.prepare(vmm.prepare, [1, 2], "t2", 0) and gate.commit(vmm.commit, "t2", 0)
    assert gate.mapped_pages() == 1 and vmm.mapped == {0}


def test_without_a_governing_engine_or_a_bound_maps_pass_as_kvcached_alone():
    vmm, gate = Recorder(), governed_gate(1)
    gate.engine_governs = lambda: False
    assert gate.map(vmm.map, [0, 1, 2], 0)[0] and gate.mapped_pages() == 3
    gate.engine_governs, gate.bound_pages = (lambda: True), None  # a worker without a broker
    assert gate.map(vmm.map, [3, 4], 0)[0] and gate.mapped_pages() == 5
