"""Crash-safe state: a snapshot file plus an append-only journal, per device.

The broker must not forget a grant it has answered, or a restarted broker would hand the
same memory out twice.  Writing a whole snapshot per request is too slow for the grant path,
so changes go to a journal first:

* ``gpuN.journal``: records of ``[u32 little-endian length][MessagePack map]``.  A poll round
  appends all of its records with one ``write()`` before any reply of that round is sent
  (group commit).  Each record carries a full, absolute value (a session's holdings, a
  limit), so replaying a record twice is harmless, and a session that ends a round where
  its latest record already left it (a page out and back) needs no record at all.
* ``gpuN.snapshot``: the whole state, written to a temporary file and renamed over the old
  one (atomic on POSIX).  After a snapshot the journal is truncated; the snapshot's ``seq``
  says which journal records it already contains, so a crash between the rename and the
  truncate replays nothing twice.

No ``fsync``: the state describes GPU memory held by live processes, and neither survives
a reboot.  What must survive is a crash of the broker process, and for that the kernel's page
cache is enough: a completed ``write()`` or ``rename()`` is visible to the next process even
if this one is SIGKILLed a moment later.  A torn record at the journal's tail (the broker died
inside ``write()``) was never answered and is dropped on load.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

SNAPSHOT_FORMAT = 1
_LENGTH = struct.Struct("<I")
_MAX_RECORD_BYTES = 16 << 20


class CheckpointError(RuntimeError):
    """The state directory cannot be used or its files cannot be read."""


@dataclass
class LoadedState:
    snapshot: dict[str, Any] | None
    records: list[dict[str, Any]] = field(default_factory=list)
    torn_bytes: int = 0


class StateStore:
    """Snapshot + journal for one device in ``state_dir``."""

    def __init__(self, state_dir: Path, device_index: int, *, compact_after_bytes: int = 4 << 20):
        self.state_dir = Path(state_dir)
        self.snapshot_path = self.state_dir / f"gpu{device_index}.snapshot"
        self.journal_path = self.state_dir / f"gpu{device_index}.journal"
        self.compact_after_bytes = compact_after_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._journal_fd: int | None = None
        self.journal_bytes = 0
        self.seq = 0  # records appended since the broker started, plus the snapshot's seq

    def open(self) -> LoadedState:
        """Create the directory if needed, read what is there, and open the journal."""
        _ensure_private_dir(self.state_dir)
        loaded = self._load()
        self._journal_fd = os.open(self.journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        if loaded.torn_bytes:
            os.ftruncate(self._journal_fd, os.fstat(self._journal_fd).st_size - loaded.torn_bytes)
        self.journal_bytes = os.fstat(self._journal_fd).st_size
        return loaded

    def append(self, records: list[dict[str, Any]]) -> None:
        """Append records with one ``write()``; returns once the kernel has them."""
        if not records:
            return
        buffer = bytearray()
        encode_into = self._encoder.encode_into
        for record in records:
            self.seq += 1
            record["seq"] = self.seq
            start = len(buffer)
            encode_into(record, buffer, start + _LENGTH.size)  # the payload, after room for its length
            _LENGTH.pack_into(buffer, start, len(buffer) - start - _LENGTH.size)
        assert self._journal_fd is not None, "StateStore.open() first"
        view = memoryview(buffer)
        while view:
            written = os.write(self._journal_fd, view)
            view = view[written:]
        self.journal_bytes += len(buffer)

    def needs_compaction(self) -> bool:
        return self.journal_bytes >= self.compact_after_bytes

    def write_snapshot(self, state: dict[str, Any]) -> None:
        """Atomically replace the snapshot with ``state`` and empty the journal."""
        state = {**state, "format": SNAPSHOT_FORMAT, "seq": self.seq}
        tmp = self.snapshot_path.with_name(self.snapshot_path.name + f".tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, self._encoder.encode(state))
        finally:
            os.close(fd)
        os.replace(tmp, self.snapshot_path)
        if self._journal_fd is not None:
            os.ftruncate(self._journal_fd, 0)
        self.journal_bytes = 0

    def close(self) -> None:
        if self._journal_fd is not None:
            os.close(self._journal_fd)
            self._journal_fd = None

    def _load(self) -> LoadedState:
        snapshot = None
        if self.snapshot_path.exists():
            try:
                snapshot = msgspec.msgpack.decode(self.snapshot_path.read_bytes())
            except msgspec.DecodeError as exc:
                raise CheckpointError(f"cannot read snapshot {self.snapshot_path}: {exc}") from None
            if not isinstance(snapshot, dict) or snapshot.get("format") != SNAPSHOT_FORMAT:
                raise CheckpointError(f"snapshot {self.snapshot_path} has an unknown format")
        snapshot_seq = int(snapshot.get("seq", 0)) if snapshot else 0
        records, torn = [], 0
        if self.journal_path.exists():
            data = self.journal_path.read_bytes()
            offset = 0
            while offset < len(data):
                if offset + _LENGTH.size > len(data):
                    break
                (length,) = _LENGTH.unpack_from(data, offset)
                end = offset + _LENGTH.size + length
                if length > _MAX_RECORD_BYTES or end > len(data):
                    break
                try:
                    record = msgspec.msgpack.decode(data[offset + _LENGTH.size : end])
                except msgspec.DecodeError:
                    break
                offset = end
                if isinstance(record, dict) and int(record.get("seq", 0)) > snapshot_seq:
                    records.append(record)
            torn = len(data) - offset
        self.seq = max([snapshot_seq] + [int(r["seq"]) for r in records])
        return LoadedState(snapshot=snapshot, records=records, torn_bytes=torn)


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
