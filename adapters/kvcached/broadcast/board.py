"""The shared board of one broadcast-mode pool: EngineCore and its TP workers, one small file.

vLLM's EngineCore owns a kvcached pool in broadcast mode (``world_size = TP``) whose pages are
mapped in the TP workers.  Each worker holds its own GPU's grant; EngineCore decides the pool's
limit.  They meet on this board: a fixed-size file in ``/dev/shm`` that every process of the
engine maps, named after kvcached's TP socket directory (``kvcached.utils.get_tp_socket_dir()``,
which EngineCore and its workers compute identically), so no IPC of kvcached's is touched.

Layout (little-endian int64 fields): an engine header, then :data:`MAX_SLOTS` worker slots, one
per TP x PP rank (slot ``pp_rank * tp_size + tp_rank``).  **Every field has exactly one writer
process**: the header is EngineCore's, a slot is its worker's.  A writer bumps the record's
sequence number to odd, writes, and bumps it to even (a seqlock); a reader retries a record whose
sequence moved, so it never acts on a torn record.  :meth:`Board.snapshot` reads every record
with every sequence unchanged across the read, so a snapshot is one instant of the whole board.

Units: pool pages (kvcached page ids: one compound page each) unless a name says bytes.

Lifetime.  A process takes part with :meth:`Board.join` and its record, written under the
file's ``flock`` (so a process leaving or sweeping never races it), and stops with
:meth:`Board.leave`: it clears its own records and unlinks the file only if no other writer
still runs (the last one out removes it, never one another live process still maps).  Every
board this process joined is left at exit, and when the process registry resets
(:class:`_Joined`).  A board whose every writer died without leaving (SIGKILL) is removed by
the next :meth:`Board.join` on the host (:func:`sweep`).

Who wrote a record, and whether it still runs: its pid, start time and PID namespace
(:mod:`..liveness`).  A writer in another PID namespace is never judged dead (its pid means
nothing here), so a board with such a writer is never swept from here.

Trust.  The board is this user's own file, mode ``0600`` (or ``0660`` with
``KVCACHED_BROKER_SHM_GROUP``), opened only after :mod:`..shm_files` checked it (owner, mode,
a regular file, no symbolic link); one that fails raises :class:`~..shm_files.UnsafeFile` and
is never mapped, so its values are never applied (the pool then runs as kvcached alone, with one
warning).  Its name carries this user's uid and PID namespace (EngineCore and its workers share
both), so engines of different users or containers sharing ``/dev/shm`` never meet on one board.
Each record publishes its process's doorbell (:mod:`.doorbell`) by its random token.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
import weakref
from dataclasses import dataclass, fields
from typing import Callable

from ... import process_state
from .. import kvcached_api, liveness, shm_files
from . import doorbell
from ..liveness import ProcessIdentity

FIELD = struct.Struct("<q")
RECORD_FIELDS = 16  # every record is 16 int64 fields (128 bytes), the unused ones zero
RECORD_BYTES = RECORD_FIELDS * FIELD.size
MAX_SLOTS = 64
BOARD_BYTES = RECORD_BYTES * (1 + MAX_SLOTS)
SHM_DIR = "/dev/shm"
BOARD_PREFIX = "kvcached-broker-"
BOARD_SUFFIX = ".board"
#: A reader gives up on a record that never stays still this many times (a writer that died
#: between its two sequence bumps); it then returns what it read last, flagged ``torn``.
READ_ATTEMPTS = 1000

# Engine states (header ``state``).
ENGINE_NONE = 0  # no engine pool on this board (yet)
ENGINE_GOVERNING = 1  # the engine's pool follows the workers' grants: gates bound maps
ENGINE_UNGOVERNED = 2  # the engine's pool runs as kvcached alone: gates let maps through

# Worker states (slot ``state``).
SLOT_EMPTY = 0
SLOT_REGISTERED = 1  # tensors created; holds nothing until an engine governs
SLOT_GOVERNED = 2  # holds its grant through its own broker session
SLOT_UNPROTECTED = 3  # no broker: maps as kvcached alone, constrains nobody


@dataclass(frozen=True)
class EngineRecord:
    """The header: what EngineCore asks of every worker."""

    seq: int = 0
    pid: int = 0
    start_ticks: int = 0
    state: int = ENGINE_NONE
    wanted_pages: int = 0  # every worker should hold this many
    floor_pages: int = 0  # ... and a worker that cannot reach ``floor_pages`` gives up the ask
    ask_seq: int = 0  # bumped with every new ask; a worker answers by echoing it
    limit_pages: int = 0  # kvcached's allocator size in EngineCore (what the pool may map)
    expected_slots: int = 0
    pidns: int = 0  # the writer's PID namespace (inode)
    doorbell: int = 0  # the writer's doorbell token (0: none)


@dataclass(frozen=True)
class SlotRecord:
    """One worker's slot: what it holds and maps."""

    seq: int = 0
    pid: int = 0
    start_ticks: int = 0
    state: int = SLOT_EMPTY
    granted_pages: int = 0  # what its broker granted and its gate lets it map
    mapped_pages: int = 0  # offsets its gate let kvcached map and not yet unmap
    answered_seq: int = 0  # the engine ask it has answered last
    pressure_pages_total: int = 0  # cumulative: pages its broker asked back that it could not release alone
    refused_maps: int = 0  # cumulative: broadcast maps its gate refused
    page_bytes: int = 0  # one pool page in this worker (for status)
    pidns: int = 0  # the writer's PID namespace (inode)
    doorbell: int = 0  # the writer's doorbell token (0: none)


ENGINE_FIELDS = [f.name for f in fields(EngineRecord)]
SLOT_FIELDS = [f.name for f in fields(SlotRecord)]
assert len(ENGINE_FIELDS) <= RECORD_FIELDS and len(SLOT_FIELDS) <= RECORD_FIELDS


def board_path(group_id: int, socket_dir: str | None = None) -> str:
    """The board of ``group_id``'s pool for this engine instance: kvcached's TP socket dir name,
    with this user's uid and PID namespace (which EngineCore and its workers share)."""
    if socket_dir is None:
        socket_dir = kvcached_api.tp_socket_dir()
    engine = os.path.basename(socket_dir.rstrip('/'))
    name = f"{BOARD_PREFIX}u{os.geteuid()}-n{liveness.pid_namespace()}-{engine}-g{group_id}{BOARD_SUFFIX}"
    return os.path.join(SHM_DIR, name)


def writer(record: "EngineRecord | SlotRecord") -> ProcessIdentity:
    """The process a record names (pid 0: none)."""
    return ProcessIdentity(record.pid, record.start_ticks, record.pidns)


def alive(record: "EngineRecord | SlotRecord") -> bool:
    """True unless the record's writer is known to be gone (see :mod:`..liveness`): a writer in
    another PID namespace counts as running."""
    return liveness.alive(writer(record))


def ring(record: "EngineRecord | SlotRecord") -> None:
    """Wake the record's writer at the doorbell it published (never blocks, never raises)."""
    doorbell.ring(writer(record), record.doorbell)


def own_identity() -> ProcessIdentity:
    """This process, as its records name it."""
    return liveness.own()


def identity_fields(who: ProcessIdentity, doorbell_token: int = 0) -> dict[str, int]:
    """The identity fields of a record ``who`` writes (with its doorbell token)."""
    return {"pid": who.pid, "start_ticks": who.start_ticks, "pidns": who.pidns, "doorbell": doorbell_token}


class Board:
    """One board, mapped in this process.  Writes to one record are serialized in the process.

    ``Board(path)`` maps the file (made if absent) without taking part: a reader.  A process
    that writes records joins with :meth:`join` and stops with :meth:`leave`.  Once closed,
    reads see an empty board and writes are dropped (a thread still holding the board after
    its process left it never touches unmapped memory).
    """

    def __init__(self, path: str, *, create: bool = True, policy: shm_files.Policy | None = None):
        self.path = path
        self._write_lock = threading.Lock()
        self._fd, self._identity = _open_locked(path, create, policy or shm_files.Policy.from_env())
        try:
            if self._identity.st_size < BOARD_BYTES:
                os.ftruncate(self._fd, BOARD_BYTES)
            self._mm: mmap.mmap | None = mmap.mmap(self._fd, BOARD_BYTES)
        except BaseException:
            os.close(self._fd)
            raise
        finally:
            _unlock(self._fd)
        self.joined = False

    # ------------------------------------------------------------------ taking part
    @classmethod
    def join(cls, path: str, claim: Callable[["Board"], None], policy: shm_files.Policy | None = None) -> "Board":
        """Take part in the board at ``path``: ``claim(board)`` writes this process's record under
        the file's lock (no leaver or sweeper can remove the file meanwhile).  Boards left behind
        by processes that all died are swept first.  Raises :class:`~..shm_files.UnsafeFile` for a
        file at ``path`` that is not this user's own private board."""
        policy = policy or shm_files.Policy.from_env()
        sweep(os.path.dirname(path) or ".", policy)
        board = cls(path, policy=policy)
        with board.locked():
            if not board.same_file():  # the last leaver removed it between open and lock: again
                board.close()
                return cls.join(path, claim, policy)
            claim(board)
            board.joined = True
        joined = process_state.part(_Joined)
        with joined.lock:
            joined.boards.add(board)
        return board

    def leave(self) -> bool:
        """Stop taking part: clear this process's records and remove the file if no other writer
        runs (then nobody maps it but stale readers); close.  True if the file was removed."""
        if self._mm is None:
            return False
        removed = False
        with self.locked():
            me = own_identity()
            if writer(self.engine()) == me:
                self.write_engine(**identity_fields(ProcessIdentity(0, 0, 0)), state=ENGINE_NONE, wanted_pages=0,
                                  floor_pages=0, limit_pages=0)
            for index in range(MAX_SLOTS):
                if writer(self.slot(index)) == me:
                    self.write_slot(index, **{name: 0 for name in SLOT_FIELDS if name != "seq"})
            if not self.live_writers() and self.same_file():
                os.unlink(self.path)
                removed = True
        self.joined = False
        joined = process_state.registry().built(_Joined)  # a reset may be leaving it: build none
        if joined is not None:
            with joined.lock:
                joined.boards.discard(self)
        self.close()
        return removed

    def live_writers(self) -> list[int]:
        """Pids of the processes with a record here not known to be gone (the engine's, then
        slots'; a writer in another PID namespace counts as running)."""
        records: list[EngineRecord | SlotRecord] = [self.engine(), *(self.slot(i) for i in range(MAX_SLOTS))]
        return [record.pid for record in records if record.pid > 0 and alive(record)]

    def same_file(self) -> bool:
        """True while ``path`` still names the file this process mapped (not removed, not a newer one)."""
        try:
            return os.path.samestat(os.stat(self.path, follow_symlinks=False), self._identity)
        except FileNotFoundError:
            return False

    class _Locked:
        def __init__(self, board: "Board"):
            self.board = board

        def __enter__(self) -> None:
            if self.board._fd >= 0:
                fcntl.flock(self.board._fd, fcntl.LOCK_EX)

        def __exit__(self, *exc) -> None:
            if self.board._fd >= 0:
                _unlock(self.board._fd)

    def locked(self) -> "Board._Locked":
        """The file's lock (``flock``), held while records are claimed, cleared or swept."""
        return Board._Locked(self)

    # ------------------------------------------------------------------ records
    @staticmethod
    def _offset(slot: int | None) -> int:
        if slot is None:
            return 0
        if not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"slot {slot} is outside 0..{MAX_SLOTS - 1}")
        return RECORD_BYTES * (1 + slot)

    def _get(self, base: int, index: int) -> int:
        mm = self._mm
        if mm is None:
            return 0
        try:
            return FIELD.unpack_from(mm, base + index * FIELD.size)[0]
        except ValueError:  # closed by another thread meanwhile
            return 0

    def _put(self, base: int, index: int, value: int) -> None:
        mm = self._mm
        if mm is None:
            return
        try:
            FIELD.pack_into(mm, base + index * FIELD.size, int(value))
        except ValueError:
            pass
    def _write(self, base: int, names: list[str], changes: dict[str, int]) -> None:
        unknown = set(changes) - set(names) - {"seq"}
        if unknown:
            raise ValueError(f"unknown board fields: {sorted(unknown)}")
        with self._write_lock:
            seq = self._get(base, 0)
            writing = seq + 1 if seq % 2 == 0 else seq + 2  # odd: being written (a new odd value
            self._put(base, 0, writing)                      # even after a writer that died mid-way)
            for name, value in changes.items():
                self._put(base, names.index(name), value)
            self._put(base, 0, writing + 1)  # even again

    def _read(self, base: int, names: list[str]) -> tuple[list[int], bool]:
        values: list[int] = []
        for attempt in range(READ_ATTEMPTS):
            before = self._get(base, 0)
            if before % 2:
                time.sleep(0) if attempt < 100 else time.sleep(0.0001)
                continue
            values = [self._get(base, i) for i in range(len(names))]
            if self._get(base, 0) == before:
                return values, False
        return values or [self._get(base, i) for i in range(len(names))], True

    def write_engine(self, **changes: int) -> None:
        self._write(self._offset(None), ENGINE_FIELDS, changes)

    def write_slot(self, slot: int, **changes: int) -> None:
        self._write(self._offset(slot), SLOT_FIELDS, changes)

    def engine(self) -> EngineRecord:
        values, _ = self._read(self._offset(None), ENGINE_FIELDS)
        return EngineRecord(*values)

    def slot(self, slot: int) -> SlotRecord:
        values, _ = self._read(self._offset(slot), SLOT_FIELDS)
        return SlotRecord(*values)

    def snapshot(self, slots: int, attempts: int = READ_ATTEMPTS) -> "tuple[EngineRecord, list[SlotRecord]] | None":
        """The header and the first ``slots`` slots at one instant (every sequence unchanged across
        the whole read), or None if the board never stood still for ``attempts`` tries."""
        for _ in range(attempts):
            engine = self.engine()
            records = [self.slot(i) for i in range(slots)]
            if engine.seq % 2 == 0 and self._get(0, 0) == engine.seq and all(
                    r.seq % 2 == 0 and self._get(self._offset(i), 0) == r.seq for i, r in enumerate(records)):
                return engine, records
            time.sleep(0)
        return None

    # ------------------------------------------------------------------ lifetime
    def unlink(self) -> None:
        """Remove the board's file if it is still the one this process mapped (not a newer board),
        whoever else maps it; :meth:`leave` is what a taking-part process calls."""
        try:
            if self.same_file():
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap the board and close its file (records untouched); reads then see an empty board."""
        mm, self._mm = self._mm, None
        fd, self._fd = self._fd, -1
        if mm is not None:
            try:
                mm.close()
            except (BufferError, ValueError):
                pass
        if fd >= 0:
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self._mm is None


def _open_locked(path: str, create: bool, policy: shm_files.Policy) -> tuple[int, os.stat_result]:
    """An fd on ``path`` with its ``flock`` held, and the file's identity; the file is the one
    ``path`` names once locked (a file removed between open and lock is opened again).  Only a
    file :mod:`..shm_files` trusts is opened (:class:`~..shm_files.UnsafeFile` otherwise)."""
    while True:
        opened = shm_files.open_checked(path, policy, create=create)
        fd = opened.fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            identity = os.fstat(fd)
            try:
                current = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                current = None
        except BaseException:
            os.close(fd)
            raise
        if current is not None and os.path.samestat(current, identity):
            return fd, identity
        os.close(fd)
        if not create:
            raise FileNotFoundError(path)


def _unlock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass


def sweep(directory: str = SHM_DIR, policy: shm_files.Policy | None = None) -> list[str]:
    """Remove the boards in ``directory`` whose every writer is known dead (SIGKILL: nobody left
    them); the paths removed.  Only this user's own boards (:mod:`..shm_files`) are looked at; a
    board being joined, left or swept by someone else (its lock held) is skipped, and so is one
    no process ever wrote a record on, and one with a writer in another PID namespace."""
    policy = policy or shm_files.Policy.from_env()
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(BOARD_PREFIX) and n.endswith(BOARD_SUFFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = shm_files.open_checked(path, policy, writable=False).fd
        except (shm_files.UnsafeFile, OSError):
            continue  # gone, or not ours to judge
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # in use right now: not stale
            try:
                if (not os.path.samestat(os.stat(path, follow_symlinks=False), os.fstat(fd))
                        or os.fstat(fd).st_size < BOARD_BYTES):
                    continue
            except FileNotFoundError:
                continue
            with mmap.mmap(fd, BOARD_BYTES, prot=mmap.PROT_READ) as mm:
                writers = _writers(mm)
            if writers and all(liveness.judge(who) is False for who in writers):
                os.unlink(path)
                removed.append(path)
        finally:
            os.close(fd)
    return removed


def _writers(mm: mmap.mmap) -> list[ProcessIdentity]:
    """Every process a record names (engine header, then slots)."""
    found = []
    for record in range(1 + MAX_SLOTS):
        base = RECORD_BYTES * record
        names = ENGINE_FIELDS if record == 0 else SLOT_FIELDS
        pid, ticks, pidns = (FIELD.unpack_from(mm, base + names.index(n) * FIELD.size)[0]
                             for n in ("pid", "start_ticks", "pidns"))
        if pid > 0:
            found.append(ProcessIdentity(pid, ticks, pidns))
    return found


# ------------------------------------------------------------------ this process's boards
class _Joined:
    """The boards this process takes part in (weakly: a board nobody holds is gone), every one
    of them left at exit or when the registry resets.  ``lock`` guards ``boards``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.boards: "weakref.WeakSet[Board]" = weakref.WeakSet()

    def leave_all(self) -> None:
        """Leave every board this process still takes part in."""
        with self.lock:
            boards = list(self.boards)
        for board in boards:
            try:
                board.leave()
            except OSError:
                pass

    def at_exit(self) -> None:
        self.leave_all()

    def close(self) -> None:
        self.leave_all()

    def after_fork_in_child(self) -> None:
        """A forked child takes part in nothing its parent joined (its records name the parent)."""
        self.lock = threading.Lock()
        self.boards = weakref.WeakSet()
