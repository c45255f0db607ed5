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
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass, fields

FIELD = struct.Struct("<q")
RECORD_FIELDS = 16  # every record is 16 int64 fields (128 bytes), the unused ones zero
RECORD_BYTES = RECORD_FIELDS * FIELD.size
MAX_SLOTS = 64
BOARD_BYTES = RECORD_BYTES * (1 + MAX_SLOTS)
SHM_DIR = "/dev/shm"
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


ENGINE_FIELDS = [f.name for f in fields(EngineRecord)]
SLOT_FIELDS = [f.name for f in fields(SlotRecord)]
assert len(ENGINE_FIELDS) <= RECORD_FIELDS and len(SLOT_FIELDS) <= RECORD_FIELDS


def board_path(group_id: int, socket_dir: str | None = None) -> str:
    """The board of ``group_id``'s pool for this engine instance (kvcached's TP socket dir name)."""
    if socket_dir is None:
        from kvcached.utils import get_tp_socket_dir

        socket_dir = get_tp_socket_dir()
    return os.path.join(SHM_DIR, f"kvcached-broker-{os.path.basename(socket_dir.rstrip('/'))}-g{group_id}.board")


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (``/proc/PID/stat`` field 22), or None if it does not run (or is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2:].split()
    if len(rest) < 20 or rest[0] in (b"Z", b"X"):
        return None
    try:
        return int(rest[19])
    except ValueError:
        return None


def alive(pid: int, ticks: int) -> bool:
    """True if ``pid`` runs and is the process that wrote ``ticks`` (not a later one with its pid)."""
    return pid > 0 and start_ticks(pid) == ticks


def own_identity() -> tuple[int, int]:
    """``(pid, start_ticks)`` of this process, as records carry it."""
    pid = os.getpid()
    return pid, start_ticks(pid) or 0


class Board:
    """One board, mapped in this process.  Writes to one record are serialized in the process."""

    def __init__(self, path: str):
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size < BOARD_BYTES:
                os.ftruncate(fd, BOARD_BYTES)
            self._identity = os.fstat(fd)
            self._mm = mmap.mmap(fd, BOARD_BYTES)
        finally:
            os.close(fd)
        self._write_lock = threading.Lock()

    # ------------------------------------------------------------------ records
    @staticmethod
    def _offset(slot: int | None) -> int:
        if slot is None:
            return 0
        if not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"slot {slot} is outside 0..{MAX_SLOTS - 1}")
        return RECORD_BYTES * (1 + slot)

    def _get(self, base: int, index: int) -> int:
        return FIELD.unpack_from(self._mm, base + index * FIELD.size)[0]

    def _put(self, base: int, index: int, value: int) -> None:
        FIELD.pack_into(self._mm, base + index * FIELD.size, int(value))

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
        """Remove the board's file if it is still the one this process mapped (not a newer board)."""
        try:
            if os.path.samestat(os.stat(self.path), self._identity):
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
