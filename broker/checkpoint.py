"""Crash-safe state: a snapshot file plus an append-only journal, per device.

The broker must not forget a grant it has answered, or a restarted broker would hand the
same memory out twice.  Writing a whole snapshot per request is too slow for the grant path,
so changes go to a journal first:

* ``gpuN.journal``: records of ``[u32 length][u32 CRC-32 of the payload][MessagePack
  payload]`` (little-endian), each a typed record of ``state_records``.  A poll round appends
  all of its records with one ``write()`` before any reply of that round is sent (group
  commit).  Each record carries a full, absolute value (a session's holdings, a limit), so
  replaying a record twice is harmless, and a session that ends a round where its latest
  record already left it (a page out and back) needs no record at all.
* ``gpuN.snapshot``: ``KVBSNAP2``, the CRC-32 of the payload, then the whole state, written
  to a temporary file and renamed over the old one (atomic on POSIX).  After a snapshot the
  journal is truncated; the snapshot's ``seq`` says which journal records it already
  contains, so a crash between the rename and the truncate replays nothing twice.

No ``fsync``: the state describes GPU memory held by live processes, and neither survives
a reboot.  What must survive is a crash of the broker process, and for that the kernel's page
cache is enough: a completed ``write()`` or ``rename()`` is visible to the next process even
if this one is SIGKILLed a moment later.

What a load makes of damage (every case is one log line from the server, never a crash):

* a record cut short at the journal's end (the broker died inside ``write()``) is dropped:
  it was never answered (``torn_bytes``);
* a record whose checksum or schema fails is skipped and counted (``damaged_records``), and
  the records after it are still read;
* a length frame that cannot be right (zero, absurdly large, or past the end of a file that
  goes on) is damage too: the read resumes at the next frame whose record checks out, and
  what lies between is counted (``damaged_bytes``); zeros or garbage to the end of the file
  are counted the same way;
* a snapshot that fails its checksum or schema is ignored (``snapshot_damage``);
* a snapshot marked stale (``KVBSTALE``: the broker went on serving after a write failed, so
  the state on disk may not cover everything it answered since) is restored, and reported as
  damage (``snapshot_damage``), so that the server holds growth until the workers re-assert;
* a file missing from a directory a broker ran in before (its secret, below, is there): a
  journal (every start creates one), or a snapshot (every start writes one) unless the journal's
  records begin at seq 1, which only follow a first, empty snapshot (``missing``);
* records missing from the journal's sequence (their seqs run on from the snapshot's, one
  by one): a record skipped as damaged, or a snapshot deleted with records after it
  (``lost_records``).

The files must be regular files of this user's, opened without following a symlink and read
no further than their size (at most ``MAX_STATE_FILE_BYTES``): a FIFO, a device, a symlink or
an absurd size is a :class:`CheckpointError` (the broker refuses to start, on one line), never
a read that hangs or runs until memory is gone.

Whatever the damage, the server then treats what it restored as untrusted until the workers
have reconnected and re-asserted what they hold (see ``server``).

* ``gpuN.secret``: 32 random bytes, mode 0600, made at the first start in this directory and
  kept from then on: the key of the session tokens (``tokens``), so that a broker that lost a
  session's record can still verify its token.  A secret that other users could read refuses
  the start (one line); one of the wrong size is replaced (``secret_problem``), and so are the
  tokens it verified.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from .state_records import JournalRecord, Snapshot
from .tokens import SECRET_BYTES

SNAPSHOT_MAGIC = b"KVBSNAP2"
#: Written over ``SNAPSHOT_MAGIC`` in place (no new blocks: it works on a full disk) when a
#: write fails and the broker goes on serving from memory (:meth:`StateStore.mark_stale`).
STALE_MAGIC = b"KVBSTALE"
#: Far more than a journal (compacted at 4 MiB) or a snapshot of 4,096 sessions ever holds.
MAX_STATE_FILE_BYTES = 256 << 20
_TMP_INFIX = ".tmp"
_FRAME = struct.Struct("<II")  # payload length, CRC-32 of the payload
_CRC = struct.Struct("<I")
_MAX_RECORD_BYTES = 16 << 20
_decode_record = msgspec.msgpack.Decoder(JournalRecord).decode
_decode_snapshot = msgspec.msgpack.Decoder(Snapshot).decode


class CheckpointError(RuntimeError):
    """The state directory cannot be used.  One line."""


@dataclass
class LoadedState:
    snapshot: Snapshot | None
    records: list[JournalRecord] = field(default_factory=list)
    torn_bytes: int = 0  # an unanswered record cut short at the end: dropped, harmless
    damaged_records: int = 0  # records whose checksum or schema failed
    damaged_bytes: int = 0  # bytes skipped as damaged (those records, and any unreadable rest)
    snapshot_damage: str | None = None  # why the snapshot was ignored
    missing: list[str] = field(default_factory=list)  # state files a broker that ran here must have left
    lost_records: int = 0  # seqs missing between the snapshot's and the journal's last
    secret: bytes | None = None  # the key of the session tokens (None: none could be kept)
    secret_problem: str | None = None  # why the secret on disk was replaced or could not be written

    @property
    def damaged(self) -> bool:
        """Whether whole records may be gone (a torn tail is not: it was never answered)."""
        return bool(self.damaged_records or self.damaged_bytes or self.snapshot_damage or self.missing
                    or self.lost_records)


class StateStore:
    """Snapshot + journal for one device in ``state_dir``."""

    def __init__(self, state_dir: Path, device_index: int, *, compact_after_bytes: int = 4 << 20):
        self.state_dir = Path(state_dir)
        self.snapshot_path = self.state_dir / f"gpu{device_index}.snapshot"
        self.journal_path = self.state_dir / f"gpu{device_index}.journal"
        self.secret_path = self.state_dir / f"gpu{device_index}.secret"
        self.compact_after_bytes = compact_after_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._journal_fd: int | None = None
        self.journal_bytes = 0
        self.seq = 0  # records appended since the broker started, plus the snapshot's seq

    def open(self) -> LoadedState:
        """Create the directory if needed, remove snapshot temp files a broker that died left,
        read what is there, and open the journal."""
        _ensure_private_dir(self.state_dir)
        self.remove_temp_files()
        ran_here_before = self.secret_path.exists() or self.secret_path.is_symlink()
        secret, problem = self._secret()
        loaded = self._load(ran_here_before)
        loaded.secret, loaded.secret_problem = secret, problem
        self._journal_fd = _open_regular(
            self.journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        if loaded.torn_bytes:
            os.ftruncate(self._journal_fd, os.fstat(self._journal_fd).st_size - loaded.torn_bytes)
        self.journal_bytes = os.fstat(self._journal_fd).st_size
        return loaded

    def append(self, records: list[JournalRecord]) -> None:
        """Append records with one ``write()``; returns once the kernel has them."""
        if not records:
            return
        buffer = bytearray()
        encode_into = self._encoder.encode_into
        crc32 = zlib.crc32
        for record in records:
            self.seq += 1
            record.seq = self.seq
            start = len(buffer)
            payload_at = start + _FRAME.size
            encode_into(record, buffer, payload_at)  # the payload, after room for its frame
            _FRAME.pack_into(buffer, start, len(buffer) - payload_at, crc32(memoryview(buffer)[payload_at:]))
        assert self._journal_fd is not None, "StateStore.open() first"
        view = memoryview(buffer)
        while view:
            written = os.write(self._journal_fd, view)
            view = view[written:]
        self.journal_bytes += len(buffer)

    def needs_compaction(self) -> bool:
        return self.journal_bytes >= self.compact_after_bytes

    def write_snapshot(self, state: Snapshot) -> None:
        """Atomically replace the snapshot with ``state`` and empty the journal.

        Raises ``OSError`` if it cannot (a full disk), leaving no temporary file behind and the
        old snapshot and journal as they were."""
        state.seq = self.seq
        payload = self._encoder.encode(state)
        tmp = self.snapshot_path.with_name(f"{self.snapshot_path.name}{_TMP_INFIX}{os.getpid()}")
        _unlink_quietly(tmp)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                data = SNAPSHOT_MAGIC + _CRC.pack(zlib.crc32(payload)) + payload
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, self.snapshot_path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        if self._journal_fd is not None:
            os.ftruncate(self._journal_fd, 0)
        self.journal_bytes = 0

    def mark_stale(self) -> bool:
        """Mark the snapshot as no longer covering what the broker answers: its magic is
        overwritten in place, which needs no new block, so this works on a full disk (on a
        copy-on-write file system it may not).  True if a snapshot was marked."""
        try:
            fd = os.open(self.snapshot_path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            return os.pwrite(fd, STALE_MAGIC, 0) == len(STALE_MAGIC)
        except OSError:
            return False
        finally:
            os.close(fd)

    def remove_temp_files(self) -> int:
        """Remove this device's snapshot temp files (a broker killed inside a snapshot, or an
        old version that left one on a failed write); the caller holds the state lock."""
        prefixes = (self.snapshot_path.name + _TMP_INFIX, self.secret_path.name + _TMP_INFIX)
        removed = 0
        for entry in os.scandir(self.state_dir):
            if entry.name.startswith(prefixes) and not entry.is_dir(follow_symlinks=False):
                removed += _unlink_quietly(Path(entry.path))
        return removed

    def _secret(self) -> tuple[bytes | None, str | None]:
        """The secret on disk, made if there is none: ``(secret, problem)``."""
        path = self.secret_path
        try:
            fd = _open_regular(path, os.O_RDONLY)
        except FileNotFoundError:
            return self._new_secret(None)
        try:
            mode = os.fstat(fd).st_mode
            if mode & 0o077:
                raise CheckpointError(
                    f"{path} can be read by other users (mode {stat.S_IMODE(mode):04o}); it keys the session "
                    "tokens: chmod 600 it, or remove it (tokens issued before then are no longer verified)")
            data = os.read(fd, SECRET_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) != SECRET_BYTES:
            return self._new_secret(f"the secret held {len(data)} bytes, not {SECRET_BYTES}: replaced")
        return data, None

    def _new_secret(self, problem: str | None) -> tuple[bytes | None, str | None]:
        """A new secret, written 0600 under a temporary name and renamed into place."""
        secret = os.urandom(SECRET_BYTES)
        tmp = self.secret_path.with_name(f"{self.secret_path.name}{_TMP_INFIX}{os.getpid()}")
        _unlink_quietly(tmp)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                if os.write(fd, secret) != SECRET_BYTES:
                    raise OSError(errno.ENOSPC, "short write")
            finally:
                os.close(fd)
            os.replace(tmp, self.secret_path)
        except OSError as exc:
            _unlink_quietly(tmp)
            why = f"cannot write {self.secret_path.name} ({exc.strerror or exc}): tokens issued now verify only until a restart"
            return secret, why if problem is None else f"{problem}; {why}"
        return secret, problem

    def close(self) -> None:
        if self._journal_fd is not None:
            os.close(self._journal_fd)
            self._journal_fd = None

    def _load(self, ran_here_before: bool) -> LoadedState:
        loaded = LoadedState(snapshot=None)
        snapshot = _read_regular(self.snapshot_path)
        if snapshot is not None:
            loaded.snapshot, loaded.snapshot_damage = _read_snapshot(snapshot)
        snapshot_seq = loaded.snapshot.seq if loaded.snapshot else 0
        journal = _read_regular(self.journal_path)
        if journal is not None:
            self._read_journal(journal, snapshot_seq, loaded)
        last_seq = max([snapshot_seq] + [r.seq for r in loaded.records])
        loaded.lost_records = last_seq - snapshot_seq - len(loaded.records)
        if ran_here_before and snapshot is None and not loaded.records:
            loaded.missing.append(self.snapshot_path.name)
        if ran_here_before and journal is None:
            loaded.missing.append(self.journal_path.name)
        self.seq = last_seq
        return loaded

    @staticmethod
    def _read_journal(data: bytes, snapshot_seq: int, loaded: LoadedState) -> None:
        offset = 0
        while offset < len(data):
            if offset + _FRAME.size > len(data):
                loaded.torn_bytes = len(data) - offset
                return
            length, crc = _FRAME.unpack_from(data, offset)
            payload_at = offset + _FRAME.size
            end = payload_at + length
            if length > _MAX_RECORD_BYTES or length == 0 or end > len(data):
                resume_at = _next_good_frame(data, offset + 1)
                if resume_at is not None:  # a damaged frame, with good records after it
                    loaded.damaged_records += 1
                    loaded.damaged_bytes += resume_at - offset
                    offset = resume_at
                    continue
                if end > len(data) and 0 < length <= _MAX_RECORD_BYTES:
                    loaded.torn_bytes = len(data) - offset  # the last write, cut short
                else:
                    loaded.damaged_bytes += len(data) - offset  # zeros or garbage to the end
                return
            payload = data[payload_at:end]
            offset = end
            record = _checked_record(payload, crc)
            if record is None:
                loaded.damaged_records += 1
                loaded.damaged_bytes += _FRAME.size + length
            elif record.seq > snapshot_seq:
                loaded.records.append(record)


def _next_good_frame(data: bytes, start: int) -> int | None:
    """The offset of the next frame at or after ``start`` whose record checks out, if any."""
    for offset in range(start, len(data) - _FRAME.size):
        length, crc = _FRAME.unpack_from(data, offset)
        end = offset + _FRAME.size + length
        if 0 < length <= _MAX_RECORD_BYTES and end <= len(data) and _checked_record(data[offset + _FRAME.size:end], crc):
            return offset
    return None


def _checked_record(payload: bytes, crc: int) -> JournalRecord | None:
    if zlib.crc32(payload) != crc:
        return None
    try:
        return _decode_record(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def _read_snapshot(data: bytes) -> tuple[Snapshot | None, str | None]:
    """The snapshot in ``data`` (None if it cannot be used), and why it cannot be trusted."""
    head = len(SNAPSHOT_MAGIC) + _CRC.size
    stale = data.startswith(STALE_MAGIC)
    if not (data.startswith(SNAPSHOT_MAGIC) or stale) or len(data) < head:
        return None, "not a kvcached-broker snapshot of this format"
    (crc,) = _CRC.unpack_from(data, len(SNAPSHOT_MAGIC))
    payload = data[head:]
    if zlib.crc32(payload) != crc:
        return None, "checksum mismatch"
    try:
        snapshot = _decode_snapshot(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        return None, f"invalid content ({exc})"
    if stale:
        return snapshot, "stale: the broker served on after a state write failed"
    return snapshot, None


def _open_regular(path: Path, flags: int) -> int:
    """``os.open`` that refuses a symlink and anything but a regular file of this user's
    (``FileNotFoundError`` passes through for a file that is not there)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"{path} is a symbolic link; the state files must be regular files") from None
        raise CheckpointError(f"cannot open {path}: {exc.strerror}") from None
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = f"{path} is not a regular file ({_kind(st.st_mode)}); refusing to use it as state"
    elif st.st_uid != os.getuid():
        problem = f"{path} is owned by uid {st.st_uid}, not by this broker (uid {os.getuid()})"
    elif st.st_size > MAX_STATE_FILE_BYTES:
        problem = f"{path} holds {st.st_size} bytes, more than a state file can ({MAX_STATE_FILE_BYTES})"
    if problem is not None:
        os.close(fd)
        raise CheckpointError(problem)
    return fd


def _read_regular(path: Path) -> bytes | None:
    """The whole of a state file (None if there is none), read no further than its size."""
    try:
        fd = _open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        chunks = []
        left = size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _unlink_quietly(path: Path) -> int:
    try:
        os.unlink(path)
        return 1
    except OSError:
        return 0


def _ensure_private_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create state directory {path}: {exc.strerror}") from None
    st = path.lstat()
    if not path.is_dir() or path.is_symlink():
        raise CheckpointError(f"state directory {path} is not a directory")
    if st.st_uid != os.getuid():
        raise CheckpointError(f"state directory {path} is owned by uid {st.st_uid}, not by this broker (uid {os.getuid()})")
    if st.st_mode & 0o002:
        raise CheckpointError(f"state directory {path} is world-writable; refusing to keep state there")
