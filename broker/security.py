"""Who may talk to the broker, and where its socket may live.

* The ipc socket lives in a directory the broker creates ``0750`` (group configurable); a
  pre-existing directory must belong to the broker's user (or root), must not be a symlink,
  and must not be world-writable unless it is sticky like ``/tmp``.  The socket is ``0660``.
* A lock file beside the socket (and one in the state directory) makes the broker a
  singleton: a second ``bind`` on an ipc path silently steals it from the first.
* Local peers are identified by the kernel (``SO_PEERCRED``, which ZeroMQ exposes as the
  ``Peer-Address`` property ``localhost:UID:GID:PID``); admin operations are allowed from root,
  the broker's own uid, or members of the admin group.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import ipaddress
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


class SecurityError(RuntimeError):
    """A path or peer the broker refuses to trust.  One line, fit for a CLI."""


class AlreadyRunning(RuntimeError):
    """Another broker holds the lock for this endpoint or state directory."""


@dataclass(frozen=True)
class Peer:
    """Kernel-verified credentials of a connection; ``pid`` 0 means another pid namespace."""

    uid: int | None
    gid: int | None
    pid: int | None
    address: str

    @property
    def pid_known(self) -> bool:
        return bool(self.pid)


def parse_peer_address(address: str | None) -> Peer:
    """Read ZeroMQ's ``Peer-Address``: ``localhost:uid:gid:pid`` over ipc, an IP over tcp."""
    if address and address.startswith("localhost:"):
        parts = address.split(":")
        if len(parts) == 4 and all(p.isdigit() for p in parts[1:]):
            return Peer(int(parts[1]), int(parts[2]), int(parts[3]), address)
    return Peer(None, None, None, address or "")


def is_loopback(host: str) -> bool:
    """``localhost`` or any loopback address (all of 127.0.0.0/8, ``::1``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_group(name_or_gid: str | int | None) -> int | None:
    if name_or_gid is None or name_or_gid == "":
        return None
    if isinstance(name_or_gid, int) or str(name_or_gid).isdigit():
        return int(name_or_gid)
    try:
        return grp.getgrnam(str(name_or_gid)).gr_gid
    except KeyError:
        raise SecurityError(f"no such group {name_or_gid!r}") from None


def supplementary_groups(pid: int) -> set[int]:
    """A process's supplementary groups (SO_PEERCRED carries only the primary gid)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


def is_admin(peer: Peer, admin_gid: int | None) -> bool:
    if peer.uid is None:
        return False  # tcp: no kernel credentials (CURVE authenticates the link, not a user)
    if peer.uid == 0 or peer.uid == os.getuid():
        return True
    if admin_gid is None:
        return False
    if peer.gid == admin_gid:
        return True
    return peer.pid is not None and peer.pid > 0 and admin_gid in supplementary_groups(peer.pid)


def prepare_socket_dir(socket_path: Path, group_gid: int | None) -> None:
    """Create (or vet) the directory that will hold the ipc socket."""
    directory = socket_path.parent
    if not directory.exists() and not directory.is_symlink():
        try:
            directory.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            os.mkdir(directory, 0o750)
        except FileExistsError:
            pass
        except OSError as exc:
            raise SecurityError(f"cannot create socket directory {directory}: {exc.strerror}") from None
        os.chmod(directory, 0o750)
        if group_gid is not None:
            _chown_group(directory, group_gid)
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        raise SecurityError(f"socket directory {directory} is a symlink; refusing it")
    if not stat.S_ISDIR(st.st_mode):
        raise SecurityError(f"socket directory {directory} is not a directory")
    if st.st_uid not in (os.getuid(), 0):
        raise SecurityError(f"socket directory {directory} is owned by uid {st.st_uid}, not by this broker's user")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise SecurityError(f"socket directory {directory} is world-writable without the sticky bit; refusing it")
    _vet_existing_socket(socket_path)


def _vet_existing_socket(socket_path: Path) -> None:
    try:
        st = os.lstat(socket_path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise SecurityError(f"{socket_path} is a symlink; refusing to bind there")
    if not stat.S_ISSOCK(st.st_mode):
        raise SecurityError(f"{socket_path} exists and is not a socket; refusing to replace it")
    if st.st_uid != os.getuid():
        raise SecurityError(f"{socket_path} belongs to uid {st.st_uid}; refusing to replace another user's socket")


def secure_socket_file(socket_path: Path, group_gid: int | None) -> None:
    os.chmod(socket_path, 0o660)
    if group_gid is not None:
        _chown_group(socket_path, group_gid)


def _chown_group(path: Path, gid: int) -> None:
    try:
        os.chown(path, -1, gid)
    except OSError as exc:
        raise SecurityError(f"cannot give {path} to group {gid}: {exc.strerror}") from None


@contextmanager
def socket_umask() -> Iterator[None]:
    """Create the socket 0660 from the start (no window with a looser mode)."""
    old = os.umask(0o117)
    try:
        yield
    finally:
        os.umask(old)


class LockFile:
    """An exclusive ``flock`` held for the broker's lifetime; records the holder's pid."""

    def __init__(self, path: Path, what: str):
        self.path = Path(path)
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise AlreadyRunning(
                    f"another kvcached-broker (pid {holder}) already serves {self.what} (lock {self.path})"
                ) from None
            raise
        try:  # who holds it, for the next broker's message; the lock itself is the flock
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:  # a full disk must not stop a start
            pass
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
