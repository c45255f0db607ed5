"""kvcached mode's broadcast pieces alone: the board's records and lifetime, the worker's map gate,
its grant holder's registration, and EngineCore's board grants.

The gate stands in front of kvcached's listener functions (``map_gate.py``); here the "real"
functions are recorders, so the counting rules are checked without kvcached: a map beyond the
bound is refused whole and maps nothing, unmaps and committed unmaps lower the count and are
never refused, an aborted unmap changes nothing, and nothing is bounded unless an engine governs.
Boards live in a temporary directory; "another process" is a real child process (liveness is a
pid with its start time and PID namespace).  kvcached's modules, where registration reads them,
are stubs.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import textwrap
import threading
from types import ModuleType

import pytest

from kvcached_broker.adapters import patching, process_state, sessions
from kvcached_broker.adapters.kvcached.broadcast import board as board_mod
from kvcached_broker.adapters.kvcached import liveness, runner
from kvcached_broker.adapters.kvcached.broadcast import doorbell, map_gate, worker_grants
from kvcached_broker.adapters.kvcached.broadcast.board_grants import BoardGrants
from kvcached_broker.adapters.kvcached.geometry import PoolGeometry
from kvcached_broker.adapters.kvcached.broadcast.map_gate import MapGate, MapRefused
from kvcached_broker.adapters.worker_identity import WorkerIdentity

GEOMETRY = PoolGeometry(num_layers=4, page_size=2 << 20, num_kv_buffers=2, virtual_pages=64, group_id=0, world_size=2)


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
    me = board_mod.own_identity()
    assert liveness.alive(me) and not liveness.alive(liveness.ProcessIdentity(me.pid, me.start_ticks + 1, me.pidns))
    assert not liveness.alive(liveness.ProcessIdentity(0, 0, me.pidns))


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


def test_wrapping_the_listener_twice_gates_it_once():
    module = ModuleType("tp_ipc_util")
    module._map_to_kv_tensors_with_result = Recorder().map
    real = module._map_to_kv_tensors_with_result
    map_gate.install(module)
    gated = module._map_to_kv_tensors_with_result
    map_gate.install(module)
    assert module._map_to_kv_tensors_with_result is gated and getattr(gated, patching.WRAPPED)
    assert gated.__wrapped__ == real and not hasattr(module, "unmap_from_kv_tensors")  # absent stays absent


# ------------------------------------------------------------------ the board's lifetime
@pytest.fixture
def other_process():
    """A live process other than this one: (its identity fields as a record carries them, end());
    it ends when the test does."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    ticks = None
    while ticks is None:  # /proc/PID/stat exists once the child is forked
        ticks = liveness.start_ticks(child.pid)

    def end() -> None:
        child.stdin.close()
        child.wait(timeout=30)

    yield board_mod.identity_fields(liveness.ProcessIdentity(child.pid, ticks, liveness.pid_namespace())), end
    if child.poll() is None:
        end()


def mine() -> dict[str, int]:
    return board_mod.identity_fields(board_mod.own_identity())


def claim_slot(index: int):
    return lambda b: b.write_slot(index, **mine(), state=board_mod.SLOT_REGISTERED)


def test_a_leaving_process_never_removes_a_board_another_live_process_writes_on(tmp_path, other_process):
    other, end = other_process
    path = str(tmp_path / "kvcached-broker-tp-g0.board")
    joined = board_mod.Board.join(path, claim_slot(0))
    reader = board_mod.Board(path)
    reader.write_slot(1, **other, state=board_mod.SLOT_GOVERNED, granted_pages=7)

    assert joined.leave() is False and os.path.exists(path) and joined.closed
    assert reader.slot(0).pid == 0 and reader.slot(0).state == board_mod.SLOT_EMPTY  # its own record cleared
    assert reader.slot(1).granted_pages == 7  # the other's untouched

    again = board_mod.Board.join(path, claim_slot(0))  # joins the same board while the other runs
    assert reader.same_file() and again.slot(1).granted_pages == 7
    end()
    assert again.leave() is True and not os.path.exists(path)  # the last one out removes it


def test_the_next_join_sweeps_boards_whose_every_writer_died(tmp_path, other_process):
    other, end = other_process
    dead = board_mod.Board(str(tmp_path / "kvcached-broker-a-g0.board"))
    dead.write_engine(**other, state=board_mod.ENGINE_GOVERNING)
    dead.write_slot(0, **other, state=board_mod.SLOT_GOVERNED)
    live = board_mod.Board(str(tmp_path / "kvcached-broker-b-g0.board"))
    live.write_slot(0, **other, state=board_mod.SLOT_GOVERNED)  # one dies, one runs
    live.write_slot(1, **mine(), state=board_mod.SLOT_GOVERNED)
    unwritten = board_mod.Board(str(tmp_path / "kvcached-broker-c-g0.board"))
    busy = board_mod.Board(str(tmp_path / "kvcached-broker-d-g0.board"))
    busy.write_slot(0, **other, state=board_mod.SLOT_GOVERNED)
    (tmp_path / "unrelated.board").write_bytes(b"")
    end()  # SIGKILL-like: nobody left the boards

    with busy.locked():  # someone joins, leaves or sweeps it right now: not touched
        joined = board_mod.Board.join(str(tmp_path / "kvcached-broker-e-g0.board"), claim_slot(0))

    assert not dead.same_file() and live.same_file() and unwritten.same_file() and busy.same_file()
    assert (tmp_path / "unrelated.board").exists()
    assert board_mod.sweep(str(tmp_path)) == [busy.path]  # once nobody holds it
    joined.leave()
    for board in (dead, live, unwritten, busy):
        board.close()


def test_a_closed_board_reads_empty_and_drops_writes(tmp_path):
    board = board_mod.Board(str(tmp_path / "kvcached-broker-f-g0.board"))
    board.write_slot(0, granted_pages=3)
    board.close()
    board.write_slot(0, granted_pages=4)  # a thread still holding it after its process left
    assert board.slot(0) == board_mod.SlotRecord() and board.snapshot(1) is not None and board.closed


def test_a_forked_child_does_not_keep_its_parents_doorbell():
    code = textwrap.dedent("""
        import os, sys
        from kvcached_broker.adapters.kvcached import liveness
        from kvcached_broker.adapters.kvcached.broadcast import doorbell
        token = doorbell.start()
        assert token
        name = "@" + doorbell.address(liveness.own(), token)[1:]
        inode = next(line.split()[6] for line in open("/proc/net/unix") if line.split()[-1] == name)
        child = os.fork()
        if child == 0:
            held = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    held.append(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    pass
            os._exit(3 if f"socket:[{inode}]" in held else 0)
        sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


# ------------------------------------------------------------------ the worker's grant holder
def test_a_worker_bounds_its_maps_from_registration_before_any_grant(tmp_path):
    board = board_mod.Board(str(tmp_path / "kvcached-broker-g-g0.board"))
    board.write_engine(**mine(), state=board_mod.ENGINE_GOVERNING)  # EngineCore governs
    gate, vmm = MapGate(0), Recorder()
    worker_grants.WorkerGrants(board, 1, WorkerIdentity("vllm", 0, tp_rank=1, tp_size=2), GEOMETRY, gate)
    with pytest.raises(MapRefused):
        gate.map(vmm.map, [0], 0)  # registered, no broker session yet: at its grant, 0
    assert vmm.mapped == set() and board.slot(1).refused_maps == 1
    board.close()


class KvcachedStubs:
    """What registration reads of kvcached in a TP worker: its listener, its vLLM integration's
    state, PAGE_SIZE and the TP socket directory."""

    def __init__(self, monkeypatch, tmp_path):
        listener = ModuleType("kvcached.tp_ipc_util")
        listener._listeners = {(1, 0): object()}  # TP rank 1, PP rank 0
        interfaces = ModuleType("kvcached.integration.vllm.interfaces")
        interfaces._is_worker, interfaces._world_size, interfaces._kvcached_device = True, 2, "cuda:0"
        utils = ModuleType("kvcached.utils")
        utils.PAGE_SIZE = 2 << 20
        utils.get_tp_socket_dir = lambda: str(tmp_path / "kvcached-tp-stub")
        for name, module in (("kvcached", ModuleType("kvcached")), ("kvcached.utils", utils),
                             ("kvcached.tp_ipc_util", listener),
                             ("kvcached.integration.vllm.interfaces", interfaces)):
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr(board_mod, "SHM_DIR", str(tmp_path))
        process_state.forget(worker_grants._Holders)  # this test's holders and gates start empty
        process_state.forget(map_gate._Gates)


def test_registering_again_keeps_the_holder_its_slot_and_the_board(monkeypatch, tmp_path):
    KvcachedStubs(monkeypatch, tmp_path)
    first = worker_grants.register(0, 4, 2)
    try:
        board = first.board
        first.gate.bound_pages = 6  # as if granted 6 pages
        board.write_slot(first.slot, state=board_mod.SLOT_GOVERNED, granted_pages=6)
        handlers = atexit._ncallbacks()

        again = worker_grants.register(0, 4, 2)  # kvcached creates group 0's tensors a second time

        assert again is first and not first.closed and first.board is board and board.same_file()
        assert first.gate.bound_pages == 6 and board.slot(1).granted_pages == 6
        assert board.slot(1).state == board_mod.SLOT_GOVERNED and atexit._ncallbacks() == handlers
    finally:
        first.close()
    assert not os.path.exists(board.path)  # nobody else on it: the last one out removed it


def _abstract_names() -> set[str]:
    """The abstract Unix socket names bound on this host now, as /proc/net/unix shows them."""
    with open("/proc/net/unix") as table:
        return {line.split()[-1] for line in table if line.split()[-1].startswith("@")}


def test_a_reset_gives_back_leaves_and_ends_what_registration_started(monkeypatch, tmp_path):
    """What a TP worker's registration started (its holder on the board, the doorbell's socket and
    thread, the governors' thread) is closed by a reset of the process registry, as at exit."""
    KvcachedStubs(monkeypatch, tmp_path)
    holder = worker_grants.register(0, 4, 2)
    assert holder is not None and runner.settle(1)
    board, token = holder.board, doorbell.token()
    bell = "@" + doorbell.address(liveness.own(), token)[1:]
    assert token and bell in _abstract_names() and os.path.exists(board.path)
    governors = process_state.registry().built(runner._Runner).thread
    serving = process_state.registry().built(doorbell._Doorbell).thread
    assert governors.is_alive() and serving.is_alive()

    process_state.reset()

    assert holder.closed and board.closed and not os.path.exists(board.path)  # left: nobody else on it
    assert worker_grants.holder(0) is None and runner.governors() == []
    assert not governors.is_alive() and not serving.is_alive()
    assert bell not in _abstract_names() and doorbell.token() == 0  # the name is free: the next start binds anew


def _governed_holder(monkeypatch, tmp_path) -> worker_grants.WorkerGrants:
    """A registered TP worker holding 2 pool pages from the broker, as its governing engine asked."""
    KvcachedStubs(monkeypatch, tmp_path)
    holder = worker_grants.register(0, 4, 2)
    board = holder.board
    board.write_engine(**mine(), state=board_mod.ENGINE_GOVERNING, wanted_pages=2, ask_seq=1)
    runner.wake()
    for _ in range(100):  # rounds of the governors' thread (each an event), until the grant is in
        if board.slot(1).granted_pages == 2:
            break
        assert runner.settle(1)
    assert holder.governed and holder.grants.pages == 2 and board.slot(1).granted_pages == 2
    assert sessions.open_identities() == [holder.identity]
    return holder


def test_closing_the_holders_alone_gives_the_grant_back_through_the_open_session(
        adapter_broker, monkeypatch, tmp_path):
    holder = _governed_holder(monkeypatch, tmp_path)
    granted = [session["granted_bytes"] for inst in adapter_broker.status()["instances"] for session in inst["sessions"]]
    assert granted == [2 * holder.geometry.page_bytes]

    process_state.forget(worker_grants._Holders)  # as at exit: the sessions stay open

    assert holder.closed and holder.grants.pages == 0 and not os.path.exists(holder.board.path)
    assert sessions.open_identities() == [holder.identity]
    granted = [session["granted_bytes"] for inst in adapter_broker.status()["instances"] for session in inst["sessions"]]
    assert granted == [0]


def test_a_reset_frees_a_governed_workers_grant_with_its_session_and_opens_no_other(
        adapter_broker, monkeypatch, tmp_path):
    """A holder holding a real grant when the worker resets: the reset closes the session, which
    frees the grant with it, and the holder's close leaves the board without a broker call (one
    would open a new session after the reset, or find none and turn the device unprotected)."""
    holder = _governed_holder(monkeypatch, tmp_path)
    board = holder.board

    process_state.reset()

    assert holder.closed and not os.path.exists(board.path)
    assert sessions.open_identities() == [] and sessions.unprotected_reason(holder.identity) is None
    assert [inst["sessions"] for inst in adapter_broker.status()["instances"]] in ([], [[]])


def test_at_exit_the_holders_leave_before_the_boards_still_joined():
    """The holders' part is built after the boards' part, so at exit (newest first) each holder
    gives its grant back and leaves before the boards left over are left (the order the exit
    handlers had when each module registered its own)."""
    code = textwrap.dedent("""
        from kvcached_broker.adapters import process_state
        from kvcached_broker.adapters.kvcached.broadcast import board, worker_grants
        worker_grants._Holders.close_all = lambda self: print("holders", flush=True)
        board._Joined.leave_all = lambda self: print("boards", flush=True)
        process_state.part(worker_grants._Holders)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["holders", "boards"]


def test_a_worker_registers_before_kvcached_creates_its_tensors(monkeypatch):
    order = []
    module = ModuleType("interfaces")
    module.create_kv_tensors = lambda *args, **kwargs: order.append("tensors") or ["kv"]
    monkeypatch.setattr(worker_grants, "register", lambda *args: order.append("registered"))
    worker_grants.patch_vllm_interfaces(module)
    wrapped = module.create_kv_tensors
    worker_grants.patch_vllm_interfaces(module)
    assert module.create_kv_tensors is wrapped and getattr(wrapped, patching.WRAPPED)  # wrapped once
    assert module.create_kv_tensors(1, 2, "cuda:0", 4) == ["kv"] and order == ["registered", "tensors"]


# ------------------------------------------------------------------ EngineCore's board grants
class Allocator:
    """kvcached's PageAllocator as BoardGrants reads it: its size is the pool's limit."""

    def __init__(self, pages: int):
        self.pages = pages

    def get_num_total_pages(self) -> int:
        return self.pages


def test_engine_core_gives_back_when_a_counted_worker_holds_less_than_its_limit(tmp_path):
    board = board_mod.Board(str(tmp_path / "kvcached-broker-h-g0.board"))
    board.write_engine(**mine(), state=board_mod.ENGINE_GOVERNING)
    board.write_slot(0, **mine(), state=board_mod.SLOT_GOVERNED, granted_pages=10)
    real = Allocator(10)
    grants = BoardGrants(board, GEOMETRY, 2, real)
    grants.wanted = 10
    grants.sized()
    assert grants.pages == 10 and grants.poll() == 0

    board.write_slot(1, **mine(), state=board_mod.SLOT_REGISTERED)  # a worker registers late
    assert grants.pages == 0 and grants.poll() == 10  # the limit comes down through the give-back
    real.pages = 1  # the governor lowered it to its floor (kvcached's null block)
    assert grants.poll() == 0  # asked once for this level: no deferred limit stacked on another

    board.write_slot(1, state=board_mod.SLOT_GOVERNED, granted_pages=6)  # its broker granted it 6
    real.pages = 6
    assert grants.poll() == 0
    board.write_slot(1, granted_pages=4)  # below the limit again
    assert grants.poll() == 2 and board.engine().limit_pages == 6
    board.close()


class HeldGrants:
    """A worker's broker grant as the holder uses it: pool pages held, and what went back."""

    def __init__(self, pages: int):
        self.pages, self.ratio, self.released = pages, 1, []

    def release(self, pages: int) -> bool:
        self.pages -= pages
        self.released.append(pages)
        return True


def test_a_workers_soft_ask_gives_back_only_idle_grant_and_never_posts_to_engine_core(tmp_path):
    from kvcached_broker.adapters.kvcached import pressure

    board = board_mod.Board(str(tmp_path / "kvcached-broker-s-g0.board"))
    board.write_engine(**mine(), state=board_mod.ENGINE_GOVERNING, wanted_pages=6)
    gate = MapGate(0)
    holder = worker_grants.WorkerGrants(board, 1, WorkerIdentity("vllm", 0, tp_rank=1, tp_size=2), GEOMETRY, gate)
    holder.grants, holder.governed, gate.bound_pages = HeldGrants(10), True, 10

    assert pressure.split([holder], 8, soft=True) == {holder: 8}  # the broker's soft ask
    holder._answer_pressure(board.engine())
    assert holder.grants.released == [4] and gate.bound_pages == 6  # only above what EngineCore wants
    assert board.slot(1).pressure_pages_total == 0  # nothing in use is asked of EngineCore

    pressure.split([holder], 3)  # a hard ask: what no idle page covers goes to EngineCore
    holder._answer_pressure(board.engine())
    assert holder.grants.released == [4] and board.slot(1).pressure_pages_total == 3
    board.close()


def test_a_pool_that_takes_its_name_keeps_its_board_only_its_shutdown_ends_it(tmp_path):
    """The governor moves its zero page to the pool's new key with ``forget_report(old)``: board
    grants report nothing per key, so the board and the workers' level stay; ``forget`` (the pool
    shut down) ends them.  (The merge of the zero-page move called ``forget`` here: the engine's
    board went at vLLM's block pool naming, and every TP broadcast fill stopped at its first grant.)"""
    board = board_mod.Board(str(tmp_path / "kvcached-broker-n-g0.board"))
    board.write_engine(**mine(), state=board_mod.ENGINE_GOVERNING)
    board.write_slot(0, **mine(), state=board_mod.SLOT_GOVERNED, granted_pages=10)
    grants = BoardGrants(board, GEOMETRY, 1, Allocator(10))
    grants.wanted = 10
    grants.sized()
    grants.forget_report("kvcached:g0:1")
    assert board.engine().state == board_mod.ENGINE_GOVERNING and board.engine().wanted_pages == 10
    assert grants.pages == 10 and grants.poll() == 0
    grants.forget("kvcached:block_pool:g0:1")
    assert board.engine().state == board_mod.ENGINE_NONE
