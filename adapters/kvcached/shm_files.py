"""The adapters' files in ``/dev/shm``: made private, and opened only if they are this user's own.

``/dev/shm`` is writable by every local user (and shared by containers run with
``--ipc=host``), and kvcached mode acts on what three kinds of file there say: kvcached's
segment (``<ipc_name>``: an operator's cap), the governors' record beside it
(``<segment>.kvcached-broker``) and a broadcast pool's board (``kvcached-broker-*.board``: the
limit and wanted level every TP worker follows).  So, for every one of them:

* **Created** with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (never through a link, never someone
  else's file), mode ``0600``; or ``0660`` with the group named by ``KVCACHED_BROKER_SHM_GROUP``
  (a group name or gid: for an operator's ``kvctl`` and kvtop running as another user in that
  group), which the process must be able to give its files (a member of it, or root).
* **Opened** with ``O_NOFOLLOW | O_NONBLOCK`` (a symbolic link is refused, a FIFO never blocks
  the open) and used only if :meth:`Policy.check` finds a regular file owned by this process's
  effective uid that no other user may write: group write only with the chosen group, never
  world write.  A file of ours that others may only read is tightened to the policy's mode
  (kvcached creates its segment ``0666`` less the umask: ``0644`` under the usual ``022``).
* Anything else raises :class:`UnsafeFile`, whose message is one line.  Its values are never
  applied: the caller runs without it (see each module for what that means).

A file that another user could write once cannot be trusted afterwards (a descriptor opened
while it was writable stays writable), which is why a world-writable file of our own is refused
rather than tightened.
"""

from __future__ import annotations

import errno
import grp
import os
import stat
from dataclasses import dataclass
from typing import Mapping

from .. import announce

log = announce.logger("kvcached_broker.adapters")

GROUP_ENV = "KVCACHED_BROKER_SHM_GROUP"
_OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
_GROUP_NAME_MAX = 256


class UnsafeFile(Exception):
    """A file in ``/dev/shm`` this process must not trust (its message is one line)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class Policy:
    """Who may own and write the adapters' shared-memory files: ``uid`` alone (mode ``0600``),
    or ``uid`` and the members of ``gid`` (mode ``0660``, group ``gid``)."""

    uid: int
    gid: int | None = None

    @property
    def mode(self) -> int:
        return 0o660 if self.gid is not None else 0o600

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Policy":
        """This process's policy: its effective uid, and ``KVCACHED_BROKER_SHM_GROUP`` if set
        and valid (a value that names no group is logged on one line and left out: ``0600``)."""
        env = os.environ if environ is None else environ
        raw = env.get(GROUP_ENV, "").strip()
        uid = os.geteuid()
        if not raw:
            return cls(uid)
        gid = _group_id(raw)
        if gid is None:
            log.warning("event=bad_flag name=%s value=%r detail=no_such_group_files_stay_0600", GROUP_ENV,
                        raw[:_GROUP_NAME_MAX])
            return cls(uid)
        return cls(uid, gid)

    def check(self, st: os.stat_result) -> "str | None":
        """Why a file with this status must not be trusted, or None; a file the caller may only
        use after :meth:`tighten` is trusted."""
        if not stat.S_ISREG(st.st_mode):
            return f"not a regular file ({_kind(st.st_mode)})"
        if st.st_uid != self.uid:
            return f"owned by uid {st.st_uid}, not this process's uid {self.uid} (another user's file)"
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o002:
            return f"writable by every user (mode {mode:04o})"
        if mode & 0o020 and not self._group_ok(st):
            return (f"writable by group {st.st_gid} (mode {mode:04o}); a group may write only where "
                    f"{GROUP_ENV} names it")
        return None

    def tightened(self, st: os.stat_result) -> int | None:
        """The mode a trusted file should have, if not the one it has (read or special bits
        beyond the policy's dropped); None if it is right."""
        mode = stat.S_IMODE(st.st_mode)
        allowed = 0o660 if self._group_ok(st) else 0o600
        return None if mode & ~allowed == 0 else mode & allowed

    def _group_ok(self, st: os.stat_result) -> bool:
        return self.gid is not None and st.st_gid == self.gid


@dataclass
class Opened:
    """An open, checked file: its descriptor (the caller closes it), its status, and whether
    this call created it."""

    fd: int
    st: os.stat_result
    created: bool


def open_checked(path: str, policy: Policy, *, create: bool = False, writable: bool = True) -> Opened:
    """``path`` opened as described in the module docstring.  With ``create``, made (empty,
    the policy's mode) if absent.  Raises :class:`UnsafeFile` for a file that must not be
    trusted, ``FileNotFoundError`` if absent and not created, ``OSError`` otherwise."""
    flags = _OPEN_FLAGS | (os.O_RDWR if writable or create else os.O_RDONLY)
    if create:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            try:
                _own(fd, policy)
                return Opened(fd, os.fstat(fd), True)
            except BaseException:
                os.close(fd)
                raise
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(path, "a symbolic link") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise UnsafeFile(path, f"not open to this user ({exc.strerror}): another user's file") from None
        raise
    try:
        st = os.fstat(fd)
        reason = policy.check(st)
        if reason is not None:
            raise UnsafeFile(path, reason)
        mode = policy.tightened(st)
        if mode is not None:
            os.fchmod(fd, mode)
            st = os.fstat(fd)
        return Opened(fd, st, False)
    except BaseException:
        os.close(fd)
        raise


def _own(fd: int, policy: Policy) -> None:
    """A file this process just made: the policy's group and mode (``0600`` if the group cannot
    be given: one warning line)."""
    if policy.gid is not None:
        try:
            os.fchown(fd, -1, policy.gid)
        except OSError as exc:
            log.warning("event=kvcached_shm_group_unset gid=%d error=%r detail=file_kept_0600", policy.gid,
                        exc.strerror)
            os.fchmod(fd, 0o600)
            return
    os.fchmod(fd, policy.mode)


def _group_id(raw: str) -> int | None:
    if len(raw) > _GROUP_NAME_MAX or "\0" in raw:
        return None
    if raw.isdigit():
        gid = int(raw)
        return gid if gid < 2**32 - 1 else None
    try:
        return grp.getgrnam(raw).gr_gid
    except (KeyError, OSError, ValueError):
        return None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"mode {mode:o}"
