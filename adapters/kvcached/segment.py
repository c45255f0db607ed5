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

**Whose files.**  Segment and record are this user's own, mode ``0600`` (or ``0660`` with
``KVCACHED_BROKER_SHM_GROUP``), and opened only after :mod:`.shm_files` checked them (owner,
mode, a regular file, no symbolic link); a segment kvcached made (``0666`` less the umask:
``0644``) is tightened.  A file that fails the check raises :class:`~.shm_files.UnsafeFile`:
its values are never taken (no kvctl cap, nothing shown).

"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from . import shm_files
from .shm_files import Policy, UnsafeFile

_FIELDS = struct.Struct("=qqq")
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class SegmentInfo:
    total_bytes: int  # the limit
    used_bytes: int  # mapped, in use
    prealloc_bytes: int  # mapped, the prealloc reserve


def path_of(ipc_name: str) -> str:
    return ipc_name if ipc_name.startswith("/") else os.path.join(SHM_DIR, ipc_name)


def read(ipc_name: str, policy: Policy | None = None) -> SegmentInfo | None:
    """The segment's fields; None if it does not exist (or is too short).  Raises
    :class:`~.shm_files.UnsafeFile` for a segment that is not this user's own."""
    try:
        fd = shm_files.open_checked(path_of(ipc_name), policy or Policy.from_env(), writable=False).fd
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size < _FIELDS.size:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        with mmap.mmap(fd, _FIELDS.size, access=mmap.ACCESS_READ) as mm:
            return SegmentInfo(*_FIELDS.unpack(mm[:_FIELDS.size]))
    finally:
        os.close(fd)


def write_limit(ipc_name: str, total_bytes: int, policy: Policy | None = None) -> bool:
    """Set ``total_size`` (leaving the usage fields to kvcached); False if there is no segment.
    Raises :class:`~.shm_files.UnsafeFile` for a segment that is not this user's own."""
    try:
        fd = shm_files.open_checked(path_of(ipc_name), policy or Policy.from_env()).fd
    except FileNotFoundError:
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
_MAGIC = 0x6B76625F73656732  # "kvb_seg2"
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
             own_start: Callable[[int], bool] | None = None, policy: Policy | None = None) -> Shared | None:
    """Judge the segment's ``total_size`` and, if ``show_bytes`` is given, show it there.

    Under the segment's exclusive lock: a ``total_size`` other than the governors' last write
    is an operator's write and becomes the cap (``own_start``, given by a pool's first call,
    says which values are its own kvcached start-up write, not an operator's; a cap a peer
    took from that write is dropped).  Then ``show_bytes`` is written, and recorded as the
    governors' last write.  None if the segment does not exist.  Raises
    :class:`~.shm_files.UnsafeFile` if the segment or its record is not this user's own
    (nothing is read or written then)."""
    policy = policy or Policy.from_env()
    try:
        seg = shm_files.open_checked(path_of(ipc_name), policy)
    except FileNotFoundError:
        return None
    fd = seg.fd
    try:
        identity = seg.st
        if identity.st_size < _FIELDS.size:
            return None
        fcntl.flock(fd, fcntl.LOCK_EX)
        with _Record(_open_record(sidecar_path(ipc_name), policy).fd, identity) as record, \
                mmap.mmap(fd, _FIELDS.size) as mm:
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
        current = os.stat(path_of(ipc_name), follow_symlinks=False)
    except OSError:
        current = None
    if current is not None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return
        try:
            if _describes(fd, current):
                return  # the segment is there, and this is its record
        finally:
            os.close(fd)
    _unlink(path)


# ------------------------------------------------------------------ the record's pieces
def _open_record(path: str, policy: Policy) -> shm_files.Opened:
    """The record at ``path``, made if absent (the records of segments that are gone are
    collected then)."""
    opened = shm_files.open_checked(path, policy, create=True)
    if opened.created:
        _collect(os.path.dirname(path), policy)
    return opened


def _collect(directory: str, policy: Policy) -> None:
    """Remove this user's records of segments that are gone (a process killed before its governor
    closed leaves its record behind)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        if name.endswith(_SIDECAR) and not os.path.lexists(path[:-len(_SIDECAR)]):
            try:
                if os.lstat(path).st_uid == policy.uid:
                    os.unlink(path)
            except OSError:
                pass


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _values(fd: int) -> "tuple[int, ...] | None":
    data = os.pread(fd, _RECORD.size, 0)
    return _RECORD.unpack(data) if len(data) == _RECORD.size else None


def _describes(fd: int, segment: os.stat_result) -> bool:
    """True if the record open on ``fd`` is the one of the segment with status ``segment``."""
    values = _values(fd)
    return values is not None and values[0] == _MAGIC and values[1:3] == (segment.st_dev, segment.st_ino)


class _Record:
    """The governors' record of one segment (read and written under the segment's lock); closes
    its descriptor on exit."""

    def __init__(self, fd: int, identity: os.stat_result):
        self.fd = fd
        self.identity = identity
        self.shown, self.cap, self.seq = 0, _NO_CAP, 0

    def __enter__(self) -> "_Record":
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def load(self, total: int | None) -> bool:
        """Read the record; True if it is this segment's.  Otherwise start afresh: ``total``
        (what the segment holds now) taken as shown, no cap, a new sequence."""
        if _describes(self.fd, self.identity):
            self.shown, self.cap, self.seq = _RECORD.unpack(os.pread(self.fd, _RECORD.size, 0))[3:6]
            return True
        self.shown, self.cap, self.seq = total or 0, _NO_CAP, int.from_bytes(os.urandom(6), "little")
        return False

    def store(self) -> None:
        os.pwrite(self.fd, _RECORD.pack(_MAGIC, self.identity.st_dev, self.identity.st_ino, self.shown,
                                        self.cap, self.seq, 0, 0), 0)
