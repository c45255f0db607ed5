"""kvcached mode's files in /dev/shm: this user's own, private, and judged across PID namespaces.

Real processes and files throughout.  "Another user" is a child of this test that dropped to
uid 65534 (nobody) before touching anything (tests run as root here; elsewhere those tests
skip); "another PID namespace" is a process started by util-linux's ``unshare --pid --fork
--mount-proc``, as a container sharing ``/dev/shm`` and the network namespace with the host
(``--ipc=host --network=host``) runs: its pids mean other processes here.  Files live in a
private directory on ``/dev/shm``'s tmpfs made world-writable and sticky like ``/dev/shm``.

What is checked: the board, the segment and its record are refused (one line, never applied,
nothing written) when another user made them, when others may write them, when they are a
symbolic link or a FIFO; the board sweep never removes a board whose writer runs in another
PID namespace, nor judges a pid when ``/proc`` is not its namespace's; doorbells of processes
with the same pid in two PID namespaces do not collide; a cap recorded for a server that is gone
is dropped when the next server attaches, and its segment and record are collected.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from helpers import KvcachedAllocator as Allocator, FixedGrants as Grants, adapter_line

from kvcached_broker.adapters.kvcached.broadcast import board as board_mod
from kvcached_broker.adapters.kvcached import liveness, segment, shm_files
from kvcached_broker.adapters.kvcached.broadcast import board_grants, doorbell
from kvcached_broker.adapters.kvcached.geometry import PoolGeometry
from kvcached_broker.adapters.kvcached.governor import PoolGovernor
from kvcached_broker.adapters.kvcached.policy import Watermarks
from kvcached_broker.adapters.kvcached.shm_files import Policy, UnsafeFile

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
PAGE_BYTES = (2 << 20) * 4 * 2
VIRTUAL_PAGES = 56


def _unshare_works() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


two_namespaces = pytest.mark.skipif(not _unshare_works(), reason="unshare --pid --fork --mount-proc unavailable")


@pytest.fixture
def shm_dir():
    """A directory on /dev/shm's tmpfs, world-writable and sticky as /dev/shm is."""
    path = Path("/dev/shm") / f"kvb-test-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_user(action, uid: int = NOBODY) -> None:
    """Run ``action()`` in a child process running as ``uid`` (another user); raise what it raised."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        outcome = b"ok"
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            action()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            outcome = repr(exc).encode()[:2000]
        os.write(write_end, outcome)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        outcome = f.read().decode()
    os.waitpid(pid, 0)
    assert outcome == "ok", outcome


class Child:
    """A Python process driven by JSON lines (``python -c``), optionally in a new PID namespace."""

    def __init__(self, code: str, *, new_pid_namespace: bool = False, mount_proc: bool = True):
        argv = [sys.executable, "-c", textwrap.dedent(code)]
        if new_pid_namespace:
            argv = ["unshare", "--pid", "--fork", *(["--mount-proc"] if mount_proc else []), "--kill-child", *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the child exited: {self.proc.wait(timeout=30)}\n{self.proc.stderr.read()[-3000:]}"
        return json.loads(line)

    def send(self, **message) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL the Python process (in a new PID namespace: ``unshare``'s child, seen here by its
        pid in this namespace), and return once it is gone (its pidfd readable; bounded for a
        failure only)."""
        inner = self._inner_pids()
        pidfds = [os.pidfd_open(pid) for pid in inner]
        for pid in inner or [self.proc.pid]:
            os.kill(pid, signal.SIGKILL)
        for fd in pidfds:
            select.select([fd], [], [], 30)
            os.close(fd)
        self.proc.wait(timeout=30)

    def _inner_pids(self) -> list[int]:
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                return [int(pid) for pid in f.read().split()]
        except OSError:
            return []

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture
def children():
    started: list[Child] = []

    def start(code: str, **kwargs) -> Child:
        child = Child(code, **kwargs)
        started.append(child)
        return child

    yield start
    for child in started:
        if child.proc.poll() is None:
            child.kill()


def write_world_writable(path: Path, data: bytes = b"") -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    os.fchmod(fd, 0o666)
    os.write(fd, data)
    os.close(fd)


# ------------------------------------------------------------------ the files' owner and mode
def test_a_file_of_ours_that_others_may_only_read_is_tightened_and_one_they_may_write_refused(shm_dir):
    readable = shm_dir / "readable"
    readable.write_bytes(b"x")
    readable.chmod(0o644)  # as kvcached makes its segment (0666 less the usual umask)
    opened = shm_files.open_checked(str(readable), Policy(os.geteuid()))
    os.close(opened.fd)
    assert stat.S_IMODE(readable.stat().st_mode) == 0o600

    writable = shm_dir / "writable"
    write_world_writable(writable)
    with pytest.raises(UnsafeFile, match=r"writable by every user \(mode 0666\)"):
        shm_files.open_checked(str(writable), Policy(os.geteuid()))
    made = shm_files.open_checked(str(shm_dir / "made"), Policy(os.geteuid()), create=True)
    os.close(made.fd)
    assert made.created and stat.S_IMODE((shm_dir / "made").stat().st_mode) == 0o600


@as_root
def test_with_a_chosen_group_files_are_0660_in_it_and_only_that_group_may_write(shm_dir, monkeypatch, capsys):
    monkeypatch.setenv(shm_files.GROUP_ENV, str(NOBODY))
    policy = Policy.from_env()
    assert policy == Policy(os.geteuid(), NOBODY)
    made = shm_files.open_checked(str(shm_dir / "made"), policy, create=True)
    os.close(made.fd)
    st = (shm_dir / "made").stat()
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, NOBODY)
    other = shm_dir / "other-group"
    other.write_bytes(b"")
    os.chown(other, -1, NOBODY + 1 if NOBODY + 1 < 2**32 - 1 else 1)
    other.chmod(0o660)
    with pytest.raises(UnsafeFile, match="writable by group"):
        shm_files.open_checked(str(other), policy)
    with pytest.raises(UnsafeFile, match="writable by group"):
        shm_files.open_checked(str(shm_dir / "made"), Policy(os.geteuid()))  # without the group: refused

    monkeypatch.setenv(shm_files.GROUP_ENV, "no-such-group-kvb")
    capsys.readouterr()
    assert Policy.from_env() == Policy(os.geteuid())
    (line,) = capsys.readouterr().err.splitlines()
    assert adapter_line(line, "WARNING", "bad_flag")
    assert line.endswith(
        "event=bad_flag name=KVCACHED_BROKER_SHM_GROUP value='no-such-group-kvb' detail=no_such_group_files_stay_0600")


# ------------------------------------------------------------------ the board
def engine_header(state: int = board_mod.ENGINE_GOVERNING, wanted: int = 0, limit: int = 0) -> bytes:
    values = dict.fromkeys(board_mod.ENGINE_FIELDS, 0)
    values.update(seq=2, pid=1, state=state, wanted_pages=wanted, limit_pages=limit)
    return struct.pack(f"<{len(values)}q", *values.values())


@as_root
def test_a_board_another_user_made_first_is_never_mapped_and_the_pool_runs_without_it(shm_dir, monkeypatch):
    path = shm_dir / "kvcached-broker-squat-g0.board"
    header = engine_header(wanted=0, limit=0)  # "every worker holds nothing, the pool maps nothing"

    def squat() -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        os.fchmod(fd, 0o666)
        os.ftruncate(fd, board_mod.BOARD_BYTES)
        os.pwrite(fd, header, 0)
        os.close(fd)

    as_user(squat)
    with pytest.raises(UnsafeFile, match=r"owned by uid 65534, not this process's uid 0"):
        board_mod.Board.join(str(path), lambda b: b.write_slot(0, **board_mod.identity_fields(board_mod.own_identity())))
    with pytest.raises(UnsafeFile):
        board_mod.Board(str(path))  # not even as a reader

    monkeypatch.setattr(board_mod, "board_path", lambda group_id, socket_dir=None: str(path))
    geometry = PoolGeometry(num_layers=4, page_size=2 << 20, num_kv_buffers=2, virtual_pages=64, world_size=2)
    grants, why = board_grants.open_grants(geometry, real=None)
    assert grants is None and why.startswith(f"board unavailable: {path}: owned by uid 65534")  # kvcached alone
    assert path.read_bytes()[:len(header)] == header and path.stat().st_size == board_mod.BOARD_BYTES  # untouched


@pytest.mark.parametrize("kind", ["world-writable", "symlink", "fifo"])
def test_a_board_that_is_not_a_private_regular_file_is_refused_and_nothing_is_written(shm_dir, kind):
    path = shm_dir / "kvcached-broker-odd-g0.board"
    target = shm_dir / "precious"
    target.write_bytes(b"precious")
    if kind == "world-writable":
        write_world_writable(path, engine_header())
    elif kind == "symlink":
        path.symlink_to(target)
    else:
        os.mkfifo(path)
    reason = {"world-writable": "writable by every user", "symlink": "a symbolic link",
              "fifo": r"not a regular file \(a FIFO\)"}[kind]
    with pytest.raises(UnsafeFile, match=reason):
        board_mod.Board(str(path))
    assert target.read_bytes() == b"precious"


def test_the_sweep_skips_a_fifo_named_as_a_board_without_blocking(shm_dir, children):
    os.mkfifo(shm_dir / "kvcached-broker-fifo-g0.board")  # a read-only open of a FIFO waits for a writer
    child = children(f"""
        import json
        from kvcached_broker.adapters.kvcached.broadcast import board
        print(json.dumps(board.sweep({str(shm_dir)!r})), flush=True)
    """)
    assert child.receive() == []
    assert child.proc.wait(timeout=60) == 0  # bounds a failure only


@two_namespaces
def test_a_board_whose_writer_runs_in_another_pid_namespace_is_never_swept(shm_dir, children):
    path = shm_dir / "kvcached-broker-container-g0.board"
    writer = children(f"""
        import json, os, sys
        from kvcached_broker.adapters.kvcached.broadcast import board as b
        me = b.own_identity()
        board = b.Board.join({str(path)!r}, lambda x: x.write_engine(**b.identity_fields(me), state=b.ENGINE_GOVERNING))
        print(json.dumps({{"pid": me.pid, "pidns": me.pidns}}), flush=True)
        sys.stdin.read()
    """, new_pid_namespace=True)
    there = writer.receive()
    assert there["pid"] == 1 and there["pidns"] != liveness.pid_namespace()  # pid 1 here is another process
    dead = board_mod.Board(str(shm_dir / "kvcached-broker-here-g0.board"))  # a writer of this namespace, gone
    dead.write_engine(**board_mod.identity_fields(liveness.ProcessIdentity(2**22 + 1, 1, liveness.pid_namespace())))
    assert board_mod.sweep(str(shm_dir)) == [dead.path]
    assert path.exists()
    assert board_mod.Board(str(path)).engine().state == board_mod.ENGINE_GOVERNING
    writer.end()  # it leaves at exit: the last one out removes the board
    assert not path.exists()
    dead.close()


@two_namespaces
def test_without_its_own_proc_a_process_judges_no_pid_and_sweeps_nothing(shm_dir, children):
    """A process moved into a new PID namespace without mounting /proc reads the parent's
    /proc: a pid of its namespace would be looked up among the parent's processes there."""
    child = children(f"""
        import json
        from kvcached_broker.adapters.kvcached import liveness
        from kvcached_broker.adapters.kvcached.broadcast import board
        here = liveness.pid_namespace()
        stale = board.Board({str(shm_dir / "kvcached-broker-p-g0.board")!r})
        stale.write_engine(**board.identity_fields(liveness.ProcessIdentity(2, 12345, here)))
        print(json.dumps({{"proc_ours": liveness.proc_is_this_namespaces(),
                           "judged": liveness.judge(liveness.ProcessIdentity(2, 12345, here)),
                           "swept": board.sweep({str(shm_dir)!r})}}), flush=True)
    """, new_pid_namespace=True, mount_proc=False)
    assert child.receive() == {"proc_ours": False, "judged": None, "swept": []}
    assert (shm_dir / "kvcached-broker-p-g0.board").exists()


def test_the_board_is_named_for_this_user_and_pid_namespace(monkeypatch):
    path = board_mod.board_path(3, "/tmp/kvcached-tp-kvcached_engine_1-0123abcd")
    assert os.path.basename(path) == (f"kvcached-broker-u{os.geteuid()}-n{liveness.pid_namespace()}-"
                                      "kvcached-tp-kvcached_engine_1-0123abcd-g3.board")


# ------------------------------------------------------------------ doorbells
@two_namespaces
def test_doorbells_of_processes_with_the_same_pid_in_two_pid_namespaces_never_collide(children):
    code = """
        import json, sys
        from kvcached_broker.adapters.kvcached import liveness
        from kvcached_broker.adapters.kvcached.broadcast import doorbell
        me, token = liveness.own(), doorbell.start()
        seen = doorbell.rings()
        print(json.dumps({"pid": me.pid, "pidns": me.pidns, "token": token}), flush=True)
        for line in sys.stdin:
            seen = doorbell.wait(seen, 60.0)
            print(json.dumps({"rings": seen}), flush=True)
    """
    a, b = children(code, new_pid_namespace=True), children(code, new_pid_namespace=True)
    first, second = a.receive(), b.receive()
    assert first["pid"] == second["pid"] == 1 and first["pidns"] != second["pidns"]
    assert first["token"] and second["token"]  # both bound (a name of the pid alone: the second could not)
    for child, bell in ((a, first), (b, second)):
        child.send(op="wait")
        doorbell.ring(liveness.ProcessIdentity(bell["pid"], 0, bell["pidns"]), bell["token"])
        assert child.receive() == {"rings": 1}  # woken by the ring at its own published name
    with open("/proc/net/unix") as f:
        bound = {line.split()[-1] for line in f if "kvcached-broker-doorbell-" in line}
    assert {"@" + doorbell.address(liveness.ProcessIdentity(1, 0, x["pidns"]), x["token"])[1:]
            for x in (first, second)} <= bound


# ------------------------------------------------------------------ the segment and its record
def governor(ipc_name: str, pages: int = 8) -> PoolGovernor:
    geometry = PoolGeometry(num_layers=4, page_size=2 << 20, num_kv_buffers=2, virtual_pages=VIRTUAL_PAGES,
                            ipc_name=ipc_name)
    return PoolGovernor(geometry, Allocator(pages), Grants(), Watermarks.for_page_bytes(PAGE_BYTES, 64 << 20))


def kvctl_round(*governors: PoolGovernor) -> None:
    for g in governors:
        g._read_operator_cap()
        g._write_segment()


def kvcached_start(ipc_name: str, pages: int = VIRTUAL_PAGES) -> None:
    """What kvcached's tracker writes when it creates a pool: its whole size, nothing in use."""
    fd = os.open(segment.path_of(ipc_name), os.O_RDWR | os.O_CREAT, 0o666)
    os.ftruncate(fd, 24)
    os.pwrite(fd, struct.pack("=qqq", pages * PAGE_BYTES, 0, 0), 0)
    os.close(fd)


def record_bytes(segment_path: str, cap_bytes: int) -> bytes:
    st = os.stat(segment_path)
    return struct.pack("=8q", 0x6B76625F73656732, st.st_dev, st.st_ino, 8 * PAGE_BYTES, cap_bytes, 7, 0, 0)


@as_root
def test_the_record_is_private_and_one_another_user_made_is_never_applied(shm_dir, capsys):
    name = str(shm_dir / "kvcached_engine_7")
    kvcached_start(name)  # 0644: kvcached's 0666 less the umask
    g = governor(name)
    kvctl_round(g, g)
    record = segment.sidecar_path(name)
    assert stat.S_IMODE(os.stat(record).st_mode) == 0o600 and stat.S_IMODE(os.stat(name).st_mode) == 0o600

    def write_a_cap() -> None:
        os.open(record, os.O_RDWR)

    with pytest.raises(AssertionError, match="PermissionError"):
        as_user(write_a_cap)  # another user cannot open it to write a cap

    os.unlink(record)  # ... so make it first: a record naming this segment, with a cap of 0
    forged = record_bytes(name, 0)
    as_user(lambda: write_world_writable(Path(record), forged))
    capsys.readouterr()
    other = governor(name)
    for _ in range(3):
        kvctl_round(g, other)
    assert g.operator_cap_pages is None and other.operator_cap_pages is None
    assert Path(record).read_bytes() == forged  # never written
    assert g.resize_target(0) == -1 and g.kvctl.unsafe.endswith("(another user's file)")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "kvcached_shm_unsafe" in line]
    assert all(adapter_line(line, "WARNING", "kvcached_shm_unsafe") for line in warnings)
    assert len(warnings) == 2 and "owned by uid 65534" in warnings[0]  # one line per pool


@as_root
def test_a_segment_another_user_made_is_never_read_for_a_cap_nor_written(shm_dir):
    name = str(shm_dir / "kvcached_engine_8")
    as_user(lambda: write_world_writable(Path(name), struct.pack("=qqq", 0, 0, 0)))  # "cap 0"
    with pytest.raises(UnsafeFile, match="owned by uid 65534"):
        segment.attach(name)
    g = governor(name)
    kvctl_round(g, g)
    assert g.operator_cap_pages is None and g.kvctl.unsafe
    assert Path(name).read_bytes() == struct.pack("=qqq", 0, 0, 0)
    assert not os.path.exists(segment.sidecar_path(name))


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_segment_or_record_that_is_a_symlink_or_a_fifo_is_refused(shm_dir, kind):
    name = str(shm_dir / "kvcached_engine_9")
    target = shm_dir / "precious"
    target.write_bytes(b"precious" * 4)
    for odd in (name, segment.sidecar_path(name)):
        if kind == "symlink":
            os.symlink(target, odd)
        else:
            os.mkfifo(odd)
        if odd == segment.sidecar_path(name):
            kvcached_start(name)
        with pytest.raises(UnsafeFile, match="a symbolic link" if kind == "symlink" else "a FIFO"):
            segment.exchange(name, 8 * PAGE_BYTES)
        os.unlink(odd)
    assert target.read_bytes() == b"precious" * 4


def test_a_world_writable_record_of_ours_is_made_again_unless_a_live_process_holds_it(shm_dir, children):
    name = str(shm_dir / "kvcached_engine_10")
    segment.attach(name).leave()
    kvcached_start(name)
    record = Path(segment.sidecar_path(name))
    record.unlink()
    write_world_writable(record, record_bytes(name, 2 * PAGE_BYTES))  # others may have written that cap
    member = segment.attach(name)  # nobody holds it: made again, private, with no cap
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    g = governor(name)
    kvctl_round(g, g)
    assert g.operator_cap_pages is None

    record.chmod(0o666)  # while a process holds it: not trusted, not replaced
    with pytest.raises(UnsafeFile, match="writable by every user"):
        segment.attach(name)
    member.leave()


def attach_and_cap(name: str, cap_pages: int) -> str:
    """A server's pool in a child: attaches to ``name``'s segment, kvcached writes its start-up
    size, the governor shows its limit, then an operator's kvctl cap is taken."""
    return f"""
        import json, os, struct, sys
        from kvcached_broker.adapters.kvcached import segment
        name = {name!r}
        member = segment.attach(name)
        fd = os.open(name, os.O_RDWR)
        os.ftruncate(fd, 24)
        os.pwrite(fd, struct.pack("=qqq", {VIRTUAL_PAGES * PAGE_BYTES}, 0, 0), 0)
        os.close(fd)
        own = lambda total: total == {VIRTUAL_PAGES * PAGE_BYTES}
        segment.exchange(name, {8 * PAGE_BYTES}, own_start=own, member=member)
        segment.write_limit(name, {cap_pages * PAGE_BYTES})  # kvctl limit
        shared = segment.exchange(name, member=member)
        print(json.dumps({{"cap": shared.cap_bytes}}), flush=True)
        sys.stdin.read()
    """


def test_a_cap_belongs_to_the_server_it_was_set_on(shm_dir, children):
    name = str(shm_dir / "kvcached_engine_11")
    server = children(attach_and_cap(name, 5))
    assert server.receive() == {"cap": 5 * PAGE_BYTES}
    rank = governor(name)  # another pool of the same (running) server joins: the cap is its too
    rank.kvctl.member = segment.attach(name)
    kvcached_start(name)
    kvctl_round(rank, rank)
    assert rank.operator_cap_pages == 5
    rank.kvctl.member.leave()

    server.kill()  # SIGKILL: segment, record and cap stay behind
    assert os.path.exists(name) and os.path.exists(segment.sidecar_path(name))
    nxt = governor(name)  # the next server, same KVCACHED_IPC_NAME
    nxt.kvctl.member = segment.attach(name)
    kvcached_start(name)
    kvctl_round(nxt, nxt)
    assert nxt.operator_cap_pages is None and nxt.pages().ceiling == VIRTUAL_PAGES
    assert segment.read(name).total_bytes == 8 * PAGE_BYTES
    nxt.kvctl.member.leave()


def test_the_segment_and_record_of_a_sigkilled_server_are_collected(shm_dir, children):
    gone, running = str(shm_dir / "kvcached_engine_12"), str(shm_dir / "kvcached_engine_13")
    dead_server, live_server = children(attach_and_cap(gone, 5)), children(attach_and_cap(running, 6))
    dead_server.receive(), live_server.receive()
    dead_server.kill()
    orphan = shm_dir / "kvcached_engine_14.kvcached-broker"  # a record whose segment is gone
    orphan.write_bytes(b"")
    orphan.chmod(0o600)
    unattached = str(shm_dir / "kvcached_engine_17")  # a governor that never attached: liveness unknown
    kvcached_start(unattached)
    kvctl_round(governor(unattached))
    member = segment.attach(str(shm_dir / "kvcached_engine_15"))  # the next pool to start on the host
    assert not os.path.exists(gone) and not os.path.exists(segment.sidecar_path(gone)) and not orphan.exists()
    for kept in (running, unattached):
        assert os.path.exists(kept) and os.path.exists(segment.sidecar_path(kept))
    member.leave()


@two_namespaces
def test_a_segment_used_from_another_pid_namespace_is_collected_only_once_that_server_died(shm_dir, children):
    name = str(shm_dir / "kvcached_engine_16")
    server = children(attach_and_cap(name, 4), new_pid_namespace=True)
    assert server.receive() == {"cap": 4 * PAGE_BYTES}
    assert segment.collect(str(shm_dir)) == []  # its pid means nothing here; its lock does
    rank = governor(name)
    rank.kvctl.member = segment.attach(name)
    kvcached_start(name)
    kvctl_round(rank, rank)
    assert rank.operator_cap_pages == 4  # the same server's cap, across namespaces
    rank.kvctl.member.leave()
    server.kill()
    assert sorted(segment.collect(str(shm_dir))) == sorted([name, segment.sidecar_path(name)])
