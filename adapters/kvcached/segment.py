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
read as this one's.

**Whose files.**  Segment and record are this user's own, mode ``0600`` (or ``0660`` with
``KVCACHED_BROKER_SHM_GROUP``), and opened only after :mod:`.shm_files` checked them (owner,
mode, a regular file, no symbolic link).  The broker's patch makes the segment itself
(:func:`attach`) before kvcached's tracker opens it, so kvcached's ``0666`` never applies; one
kvcached made (``0644`` under the usual umask) is tightened.  A file that fails the check raises
:class:`~.shm_files.UnsafeFile`: its values are never taken (no kvctl cap, nothing shown).

**A cap belongs to the server it was set on.**  Every process with a pool on the segment holds,
from :func:`attach` (before kvcached opens the segment) until its pool shuts down, a shared
open-file-description lock on one byte of the record (:class:`Membership`).  The kernel drops it
when the process dies, however it dies and in whatever PID namespace it runs, so "no process
holds it" is exact where a pid is not.  A pool that attaches to a segment nobody holds (a new
server, the previous one SIGKILLed) starts the record afresh: a cap recorded for the previous
server is dropped.  And :func:`collect` (run by every :func:`attach`) removes the segment and
record of every server of this user that is gone, and the records of segments that are gone
(:func:`forget` removes one at once).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
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
#: ``[magic, st_dev, st_ino, shown, cap (-1: none), seq, attached (1: made by :func:`attach`), 0]``
_RECORD = struct.Struct("=8q")
_MAGIC = 0x6B76625F73656732  # "kvb_seg2"
_NO_CAP = -1
_SIDECAR = ".kvcached-broker"
#: The byte of the record every member holds a shared lock on (beyond the record's data).
_LIVE_BYTE = 4096
_FLOCK = struct.Struct("hhqqi4x")  # struct flock: l_type, l_whence, l_start, l_len, l_pid
#: Opens of a segment removed (or replaced) between open and lock before giving up.
_ATTACH_ATTEMPTS = 8


@dataclass(frozen=True)
class Shared:
    """What the governors of one segment agree the operator wants."""

    cap_bytes: int | None  # an operator's cap (a ``total_size`` no governor wrote); None: none
    seq: int  # changes whenever the cap does (a rewrite of the same cap included)


def sidecar_path(ipc_name: str) -> str:
    """The governors' record beside a segment."""
    return path_of(ipc_name) + _SIDECAR


class Membership:
    """This process's part in a segment: a shared lock on its record's live byte, held until
    :meth:`leave` (the pool shut down) or the process's death, when the kernel drops it.  The
    lock follows the record if it is made again (:meth:`follow`)."""

    def __init__(self, ipc_name: str, fd: int):
        self.ipc_name = ipc_name
        self._fd: int | None = fd
        _hold(fd)

    def follow(self, fd: int) -> None:
        """The record at the path is the file ``fd`` is open on: hold that one's lock if it is
        not the one held."""
        if self._fd is None or os.path.samestat(os.fstat(self._fd), os.fstat(fd)):
            return
        new = os.dup(fd)
        try:
            _hold(new)
        except OSError:
            os.close(new)
            return
        os.close(self._fd)
        self._fd = new

    def leave(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @property
    def left(self) -> bool:
        return self._fd is None


def attach(ipc_name: str, policy: Policy | None = None) -> Membership:
    """Take part in the segment of ``ipc_name``, before kvcached opens it: made (this user's,
    the policy's mode, empty) if absent, the segments of servers that are gone collected first.
    A record that no process holds (a new server) starts afresh: no cap.  Raises
    :class:`~.shm_files.UnsafeFile` if the segment or its record is not this user's own and
    cannot be made again (a world-writable file of ours is made again once nobody holds it)."""
    policy = policy or Policy.from_env()
    path = path_of(ipc_name)
    collect(os.path.dirname(path), policy)
    for _ in range(_ATTACH_ATTEMPTS):
        try:
            seg = shm_files.open_checked(path, policy, create=True)
        except UnsafeFile:
            if not _abandoned(path, path + _SIDECAR, policy):
                raise
            _unlink(path)  # ours, untrustworthy, and nobody's: made again
            continue
        try:
            fcntl.flock(seg.fd, fcntl.LOCK_EX)
            if not _names(path, seg.fd):
                continue  # removed between open and lock: again
            record = _open_record(path + _SIDECAR, policy)
            try:
                if seg.created or record.created or not _held(record.fd) or not _describes(record.fd, seg.st):
                    _reset(record.fd, seg.fd, seg.st)  # a new server: no cap of a previous one
                return Membership(ipc_name, record.fd)
            except BaseException:
                os.close(record.fd)
                raise
        finally:
            os.close(seg.fd)
    raise OSError(f"{path}: removed again and again while attaching")


def exchange(ipc_name: str, show_bytes: int | None = None, *,
             own_start: Callable[[int], bool] | None = None, policy: Policy | None = None,
             member: Membership | None = None) -> Shared | None:
    """Judge the segment's ``total_size`` and, if ``show_bytes`` is given, show it there.

    Under the segment's exclusive lock: a ``total_size`` other than the governors' last write
    is an operator's write and becomes the cap (``own_start``, given by a pool's first call,
    says which values are its own kvcached start-up write, not an operator's; a cap a peer
    took from that write is dropped).  Then ``show_bytes`` is written, and recorded as the
    governors' last write.  None if the segment does not exist.  Raises
    :class:`~.shm_files.UnsafeFile` if the segment or its record is not this user's own
    (nothing is read or written then); ``member``'s lock follows a record made again."""
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
            if member is not None:
                member.follow(record.fd)
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


def collect(directory: str, policy: Policy | None = None) -> list[str]:
    """Remove what servers of this user that are gone left in ``directory``: the record of a
    segment that is gone, and the segment and record of one no process holds (every process
    with a pool on it died: SIGKILL leaves both behind).  Left alone: other users' files, a
    segment in use right now (its ``flock`` held), a record of another kind (an older
    version's), and a segment whose record no :func:`attach` made (a governor built without
    one: nothing says whether its server runs).  A record of an older segment at that path
    goes.  The paths removed."""
    policy = policy or Policy.from_env()
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(directory) if n.endswith(_SIDECAR)]
    except OSError:
        return removed
    for name in names:
        record_path = os.path.join(directory, name)
        segment_path = record_path[:-len(_SIDECAR)]
        if not _own_regular(record_path, policy):
            continue
        if not _own_regular(segment_path, policy):
            if not os.path.lexists(segment_path) and _unlink(record_path):
                removed.append(record_path)
            continue
        removed.extend(_collect_one(segment_path, record_path))
    return removed


def _collect_one(segment_path: str, record_path: str) -> list[str]:
    try:
        seg_fd = os.open(segment_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return []
    try:
        try:
            fcntl.flock(seg_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return []  # in use right now
        if not _names(segment_path, seg_fd):
            return []
        try:
            rec_fd = os.open(record_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return []
        try:
            values = _values(rec_fd)
            if values is None or values[0] != _MAGIC or _held(rec_fd) or not _names(record_path, rec_fd):
                return []  # not a record of this kind, or its server runs
            if values[1:3] != (os.fstat(seg_fd).st_dev, os.fstat(seg_fd).st_ino):
                return [record_path] if _unlink(record_path) else []  # an older segment's record
            if values[6] != 1:
                return []  # made by a governor that never attached: nobody says whether its server runs
            return [p for p in (segment_path, record_path) if _unlink(p)]
        finally:
            os.close(rec_fd)
    finally:
        os.close(seg_fd)


# ------------------------------------------------------------------ the record's pieces
def _open_record(path: str, policy: Policy) -> shm_files.Opened:
    """The record at ``path``, made if absent; one of ours that others could write is made
    again once nobody holds it."""
    try:
        return shm_files.open_checked(path, policy, create=True)
    except UnsafeFile:
        if not _abandoned(path, path, policy):
            raise
        _unlink(path)
        return shm_files.open_checked(path, policy, create=True)


def _abandoned(path: str, record_path: str, policy: Policy) -> bool:
    """True if ``path`` is a regular file of this user's (so it may be made again) and no process
    holds the record at ``record_path``."""
    if not _own_regular(path, policy):
        return False
    try:
        fd = os.open(record_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        return not _held(fd)
    finally:
        os.close(fd)


def _own_regular(path: str, policy: Policy) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == policy.uid


def _names(path: str, fd: int) -> bool:
    """True while ``path`` names the file ``fd`` is open on."""
    try:
        return os.path.samestat(os.stat(path, follow_symlinks=False), os.fstat(fd))
    except FileNotFoundError:
        return False


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _hold(fd: int) -> None:
    """Take a shared open-file-description lock on the record's live byte (never blocks: a
    member never holds it exclusively)."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, _LIVE_BYTE, 1, 0))


def _held(fd: int) -> bool:
    """True if a process (another open of the file) holds the record's live byte."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, _LIVE_BYTE, 1, 0))
    return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK


def _values(fd: int) -> "tuple[int, ...] | None":
    data = os.pread(fd, _RECORD.size, 0)
    return _RECORD.unpack(data) if len(data) == _RECORD.size else None


def _describes(fd: int, segment: os.stat_result) -> bool:
    """True if the record open on ``fd`` is the one of the segment with status ``segment``."""
    values = _values(fd)
    return values is not None and values[0] == _MAGIC and values[1:3] == (segment.st_dev, segment.st_ino)


def _reset(record_fd: int, segment_fd: int, segment: os.stat_result) -> None:
    """Start the segment's record afresh: what it holds now taken as shown, no cap, a new
    sequence."""
    total = 0
    if os.fstat(segment_fd).st_size >= _FIELDS.size:
        total = _FIELDS.unpack(os.pread(segment_fd, _FIELDS.size, 0))[0]
    seq = int.from_bytes(os.urandom(6), "little")
    os.pwrite(record_fd, _RECORD.pack(_MAGIC, segment.st_dev, segment.st_ino, total, _NO_CAP, seq, 1, 0), 0)


class _Record:
    """The governors' record of one segment (read and written under the segment's lock); closes
    its descriptor on exit."""

    def __init__(self, fd: int, identity: os.stat_result):
        self.fd = fd
        self.identity = identity
        self.shown, self.cap, self.seq, self.attached = 0, _NO_CAP, 0, 0

    def __enter__(self) -> "_Record":
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def load(self, total: int | None) -> bool:
        """Read the record; True if it is this segment's.  Otherwise start afresh: ``total``
        (what the segment holds now) taken as shown, no cap, a new sequence."""
        if _describes(self.fd, self.identity):
            self.shown, self.cap, self.seq, self.attached = _RECORD.unpack(os.pread(self.fd, _RECORD.size, 0))[3:7]
            return True
        self.shown, self.cap, self.seq, self.attached = total or 0, _NO_CAP, int.from_bytes(os.urandom(6), "little"), 0
        return False

    def store(self) -> None:
        os.pwrite(self.fd, _RECORD.pack(_MAGIC, self.identity.st_dev, self.identity.st_ino, self.shown,
                                        self.cap, self.seq, self.attached, 0), 0)
