"""A pool's ``/dev/shm`` segment, as kvctl and kvtop read and write it.

kvcached keeps ``/dev/shm/<ipc_name>`` = three int64 ``[total_size, used_size,
prealloc_size]`` under ``flock``; ``total_size`` is the pool's limit in bytes (``kvctl limit``
writes it), the other two are what its allocator maps (in use, reserve).  The governor writes
``total_size`` = the broker's limit, so ``kvctl list`` and kvtop show it, and takes a value
that no governor wrote there as an operator's cap.

**One segment, several pools.**  kvcached names a segment per process group (``<ipc>`` or
``<ipc>_g<group>``, ``<ipc>`` from ``KVCACHED_IPC_NAME`` or ``kvcached_<engine>_<pgid>``), so
every TP rank of an SGLang server shares one, and so can pools of unrelated servers started in
one process group.  A governor cannot tell its peers' writes from an operator's by comparing
with its own last write, so the governors of a segment keep a small record beside it,
``<segment>.kvcached-broker`` (:func:`exchange`; not 24 bytes, so ``kvctl list`` ignores it):
the last ``total_size`` any governor wrote, the operator's cap, and a sequence number that
changes with the cap.  Every governor's read and write goes through :func:`exchange`, under
the segment's own exclusive ``flock`` (the one kvctl and kvcached take), so a value that is
neither a governor's last write nor the joining pool's own start-up value (kvcached writes the
pool's whole size at creation) is an operator's write: the cap of every pool on the segment.
The record names the segment's inode, so one left behind by a segment since removed is never
read as this one's; the records of segments that are gone are removed whenever a record is
created (:func:`forget` removes one at once).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

_FIELDS = struct.Struct("=qqq")
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class SegmentInfo:
    total_bytes: int  # the limit
    used_bytes: int  # mapped, in use
    prealloc_bytes: int  # mapped, the prealloc reserve


def path_of(ipc_name: str) -> str:
    return ipc_name if ipc_name.startswith("/") else os.path.join(SHM_DIR, ipc_name)


def read(ipc_name: str) -> SegmentInfo | None:
    """The segment's fields; None if it does not exist (or is too short)."""
    try:
        fd = os.open(path_of(ipc_name), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size < _FIELDS.size:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        with mmap.mmap(fd, _FIELDS.size, access=mmap.ACCESS_READ) as mm:
            return SegmentInfo(*_FIELDS.unpack(mm[:_FIELDS.size]))
    finally:
        os.close(fd)


def write_limit(ipc_name: str, total_bytes: int) -> bool:
    """Set ``total_size`` (leaving the usage fields to kvcached); False if there is no segment."""
    try:
        fd = os.open(path_of(ipc_name), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size < _FIELDS.size:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX)
        with mmap.mmap(fd, _FIELDS.size) as mm:
            _, used, prealloc = _FIELDS.unpack(mm[:_FIELDS.size])
            mm[:_FIELDS.size] = _FIELDS.pack(total_bytes, used, prealloc)
        return True
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- shared segments
#: ``[magic, st_dev, st_ino, shown, cap (-1: none), seq, 0, 0]``
_RECORD = struct.Struct("=8q")
_MAGIC = 0x6B76625F73656731  # "kvb_seg1"
_NO_CAP = -1
_SIDECAR = ".kvcached-broker"


@dataclass(frozen=True)
class Shared:
    """What the governors of one segment agree the operator wants."""

    cap_bytes: int | None  # an operator's cap (a ``total_size`` no governor wrote); None: none
    seq: int  # changes whenever the cap does (a rewrite of the same cap included)


def sidecar_path(ipc_name: str) -> str:
    """The governors' record beside a segment."""
    return path_of(ipc_name) + _SIDECAR


def exchange(ipc_name: str, show_bytes: int | None = None, *,
             own_start: Callable[[int], bool] | None = None) -> Shared | None:
    """Judge the segment's ``total_size`` and, if ``show_bytes`` is given, show it there.

    Under the segment's exclusive lock: a ``total_size`` other than the governors' last write
    is an operator's write and becomes the cap (``own_start``, given by a pool's first call,
    says which values are its own kvcached start-up write, not an operator's; a cap a peer
    took from that write is dropped).  Then ``show_bytes`` is written, and recorded as the
    governors' last write.  None if the segment does not exist."""
    try:
        fd = os.open(path_of(ipc_name), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        identity = os.fstat(fd)
        if identity.st_size < _FIELDS.size:
            return None
        fcntl.flock(fd, fcntl.LOCK_EX)
        with mmap.mmap(fd, _FIELDS.size) as mm, _Record(ipc_name, identity) as record:
            total, used, prealloc = _FIELDS.unpack(mm[:_FIELDS.size])
            record.load(total)
            if total != record.shown:
                if not (own_start is not None and own_start(total)):
                    record.cap, record.seq = total, record.seq + 1  # an operator's write
                record.shown = total
            if own_start is not None and record.cap != _NO_CAP and own_start(record.cap):
                record.cap, record.seq = _NO_CAP, record.seq + 1  # a peer took our start-up write for a cap
            if show_bytes is not None and show_bytes != total:
                mm[:_FIELDS.size] = _FIELDS.pack(show_bytes, used, prealloc)
                record.shown = show_bytes
            record.store()
            return Shared(None if record.cap == _NO_CAP else record.cap, record.seq)
    finally:
        os.close(fd)


def forget(ipc_name: str) -> None:
    """Remove the governors' record of a segment that is gone (or was replaced)."""
    path = sidecar_path(ipc_name)
    try:
        current = os.stat(path_of(ipc_name))
    except OSError:
        current = None
    if current is not None:
        try:
            with open(path, "rb") as f:
                values = _RECORD.unpack(f.read(_RECORD.size))
        except (OSError, struct.error):
            return
        if values[0] == _MAGIC and values[1:3] == (current.st_dev, current.st_ino):
            return  # the segment is there, and this is its record
    try:
        os.unlink(path)
    except OSError:
        pass


def _collect(directory: str) -> None:
    """Remove the records of segments that are gone (a process killed before its governor
    closed leaves its record behind); run when a record is created, so they never pile up."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.endswith(_SIDECAR) and not os.path.exists(os.path.join(directory, name[:-len(_SIDECAR)])):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


class _Record:
    """The governors' record of one segment (read and written under the segment's lock)."""

    def __init__(self, ipc_name: str, identity: os.stat_result | None):
        self.path = sidecar_path(ipc_name)
        self.identity = identity
        self.shown, self.cap, self.seq = 0, _NO_CAP, 0
        self.fd: int | None = None

    def __enter__(self) -> "_Record":
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                pass
            return self
        except OSError:  # no record can be kept: nothing is judged, the limit is shown all the same
            return self
        try:
            os.fchmod(self.fd, 0o666)  # the governors of every server on this segment keep it
        except OSError:
            pass
        _collect(os.path.dirname(self.path))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def load(self, total: int | None) -> bool:
        """Read the record; True if it is this segment's.  Otherwise start afresh: ``total``
        (what the segment holds now) taken as shown, no cap, a new sequence."""
        values = None
        if self.fd is not None and self.identity is not None:
            data = os.pread(self.fd, _RECORD.size, 0)
            if len(data) == _RECORD.size:
                values = _RECORD.unpack(data)
        if values is not None and values[0] == _MAGIC and values[1:3] == (self.identity.st_dev, self.identity.st_ino):
            self.shown, self.cap, self.seq = values[3:6]
            return True
        self.shown, self.cap, self.seq = total or 0, _NO_CAP, int.from_bytes(os.urandom(6), "little")
        return False

    def store(self) -> None:
        if self.fd is not None and self.identity is not None:
            os.pwrite(self.fd, _RECORD.pack(_MAGIC, self.identity.st_dev, self.identity.st_ino, self.shown,
                                            self.cap, self.seq, 0, 0), 0)
