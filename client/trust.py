"""Whether the socket at an ipc endpoint can only be the broker's (checked around each hello).

The broker refuses to serve from a path that another user could have prepared (see
``broker.security``); a client makes the same checks before it trusts what answers there,
because on a machine without ``XDG_RUNTIME_DIR`` any local user can create
``/tmp/kvcached-UID`` first and listen in the broker's place:

* the socket's directory is a real directory (not a symlink), owned by a trusted user, and
  not world-writable unless it is sticky;
* the socket, where it exists, is a socket (not a symlink), owned by a trusted user.

Before a hello the path may not exist yet (the client then waits for the broker); once
something has answered, it must exist and pass every check, or the client refuses it: a
directory created after the first check, by anyone, is checked before anything it says is
trusted (:func:`endpoint_guard`).

Trusted users are root, this process's own user, and the user named by
``KVCACHED_BROKER_UID`` (a uid or a user name) for a broker that runs as a service user of
its own.  tcp endpoints are not checked here: CURVE authenticates the broker's key.
"""

from __future__ import annotations

import os
import pwd
import stat
from typing import Callable, Mapping

from .endpoint import EndpointError, ipc_path
from .errors import UntrustedEndpoint

ENV_BROKER_UID = "KVCACHED_BROKER_UID"


def trusted_uids(env: Mapping[str, str] | None = None) -> set[int]:
    env = os.environ if env is None else env
    uids = {0, os.getuid()}
    named = env.get(ENV_BROKER_UID, "").strip()
    if named:
        uids.add(_uid_of(named))
    return uids


def _uid_of(named: str) -> int:
    if named.isdigit():
        return int(named)
    try:
        return pwd.getpwnam(named).pw_uid
    except KeyError:
        raise EndpointError(f"{ENV_BROKER_UID}={named!r}: no such user") from None


def endpoint_guard(uri: str, close: Callable[[], None]) -> Callable[[bool], None]:
    """The check a client makes around each hello: ``guard(answered)``.

    Before the hello (``answered=False``) it refuses what is visibly not the broker's; after
    its reply (``answered=True``) the socket must exist and pass every check.  A refusal calls
    ``close`` (the connection is dropped) and raises :class:`UntrustedEndpoint`.
    """

    def guard(answered: bool) -> None:
        try:
            check_endpoint(uri, require_socket=answered)
        except UntrustedEndpoint:
            close()
            raise

    return guard


def check_endpoint(uri: str, env: Mapping[str, str] | None = None, *, require_socket: bool = False) -> None:
    """Raise :class:`UntrustedEndpoint` if the broker's ipc socket could be someone else's.

    ``require_socket``: something has answered there, so a socket or directory that is missing
    or cannot be read is refused too: what answered cannot be shown to be the broker's.
    """
    path = ipc_path(uri)
    if path is None:
        return
    trusted = trusted_uids(env)
    directory = path.parent
    try:
        st = os.lstat(directory)
    except (FileNotFoundError, PermissionError) as exc:
        if require_socket:
            _refuse(uri, f"{directory} cannot be checked ({exc.strerror})")
        return  # nothing listens there yet (the check after the reply decides), or the connection fails clearly
    if stat.S_ISLNK(st.st_mode):
        _refuse(uri, f"{directory} is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        _refuse(uri, f"{directory} is not a directory")
    if st.st_uid not in trusted:
        _refuse(uri, f"{directory} is owned by uid {st.st_uid}, {_who(trusted)}")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        _refuse(uri, f"{directory} is world-writable")
    try:
        sock = os.lstat(path)
    except (FileNotFoundError, PermissionError) as exc:
        if require_socket:
            _refuse(uri, f"{path} cannot be checked ({exc.strerror})")
        return
    if stat.S_ISLNK(sock.st_mode):
        _refuse(uri, f"{path} is a symlink")
    if not stat.S_ISSOCK(sock.st_mode):
        _refuse(uri, f"{path} is not a socket")
    if sock.st_uid not in trusted:
        _refuse(uri, f"{path} is owned by uid {sock.st_uid}, {_who(trusted)}")


def _who(trusted: set[int]) -> str:
    others = sorted(trusted - {0})
    names = "root" + "".join(f" or uid {uid}" for uid in others)
    return f"not {names} (name a broker's own user in {ENV_BROKER_UID})"


def _refuse(uri: str, why: str) -> None:
    raise UntrustedEndpoint(f"refusing the kvcached-broker endpoint {uri}: {why}", details={"endpoint": uri})
