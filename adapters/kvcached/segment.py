"""A pool's ``/dev/shm`` segment, as kvctl and kvtop read and write it.

kvcached keeps ``/dev/shm/<ipc_name>`` = three int64 ``[total_size, used_size,
prealloc_size]`` under ``flock``; ``total_size`` is the pool's limit in bytes (``kvctl limit``
writes it), the other two are what its allocator maps (in use, reserve).  The governor writes
``total_size`` = the broker's limit, so ``kvctl list`` and kvtop show it, and takes any other
value it finds there as an operator's cap.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
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
