"""The instance name of this server: ``KVCACHED_BROKER_INSTANCE``, or a default that cannot collide.

A broker merges every session that names the same instance: one cap, one floor, one row in
status.  So every rank of one server must share the name, and two servers never may.  The
old default, ``{runtime}-{pgid}``, broke both ways: every container's launcher has pgid 1,
and servers started with ``&`` from one shell share the shell's process group.

The default is built from what every rank of one server shares and no other live server
can: the rendezvous of its process group (the TCPStore that ``torch.distributed`` ranks
meet at, which SGLang and vLLM both create).  A store's port is bound once per network
namespace, so:

* a store on a routable address names the server alone: ``sglang-29500@10.0.0.1`` (the
  same on every node of a multi-node server);
* a store on a loopback address is scoped to this host's network namespace, by hostname
  and a short hash of the boot id and the namespace inode: ``sglang-29500@node3.6c1f0a``
  (two containers each listening on 127.0.0.1:29500 get different names);
* a process with no process group (a single-process run, a test) falls back to its own
  pid, scoped the same way by pid namespace: ``vllm-pid4242@node3.9e77d2``.

The default is computed once per process, when the first session opens (after the runtime
initialised ``torch.distributed``), and then kept, so the name never changes under a live
session.  :func:`defaulted` says whether the default is in use (the adapters warn once).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import socket
import sys
import threading
from typing import Mapping

from . import process_state
from .flags import FlagError

ENV = "KVCACHED_BROKER_INSTANCE"
_MAX_NAME = 128  # the broker's limit on instance names
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.:@/+-]")
_HOST_CHARS = re.compile(r"[^A-Za-z0-9.-]")



class _Defaults:
    """This process's default instance name per runtime, fixed once computed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.names: dict[str, str] = {}


class InstanceNameError(FlagError):
    """A ``KVCACHED_BROKER_INSTANCE`` the broker would refuse.  One line."""


def explicit(env: Mapping[str, str] | None = None) -> str | None:
    """``KVCACHED_BROKER_INSTANCE`` if set (validated), else None."""
    env = os.environ if env is None else env
    name = env.get(ENV, "").strip()
    if not name:
        return None
    if len(name) > _MAX_NAME or _NAME_CHARS.search(name):
        raise InstanceNameError(
            f"{ENV}={name!r}: use at most {_MAX_NAME} of the characters A-Z a-z 0-9 _ . : @ / + -"
        )
    return name


def defaulted(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return not env.get(ENV, "").strip()


def instance_name(runtime: str, env: Mapping[str, str] | None = None) -> str:
    """The instance name for ``runtime``: the variable, else this process's default."""
    return explicit(env) or default_name(runtime)


def default_name(runtime: str) -> str:
    """The default name of this server (computed on first use, then fixed for the process)."""
    defaults = process_state.part(_Defaults)
    with defaults.lock:
        name = defaults.names.get(runtime)
        if name is None:
            name = defaults.names[runtime] = compose(runtime, rendezvous(), _host_scope)
        return name


def compose(runtime: str, store: tuple[str, int] | None, scope) -> str:
    """``{runtime}-{port}@{host}`` for a routable store, else scoped by ``scope(kind)``."""
    if store is not None:
        host, port = store
        if not _is_local(host):
            return _fit(f"{runtime}-{port}@{_clean_host(host)}")
        return _fit(f"{runtime}-{port}@{scope('net')}")
    return _fit(f"{runtime}-pid{os.getpid()}@{scope('pid')}")


def rendezvous() -> tuple[str, int] | None:
    """``(host, port)`` of the TCPStore this process's default process group met at, if any."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return _from_env()
        store = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        host, port = getattr(store, "host", None), getattr(store, "port", None)
    except (AttributeError, RuntimeError, ValueError):
        return _from_env()
    if host and port:
        return str(host), int(port)
    return _from_env()


def _from_env() -> tuple[str, int] | None:
    """``MASTER_ADDR``/``MASTER_PORT`` (torchrun and ``env://`` launches)."""
    host, port = os.environ.get("MASTER_ADDR", "").strip(), os.environ.get("MASTER_PORT", "").strip()
    return (host, int(port)) if host and port.isdigit() else None


def _is_local(host: str) -> bool:
    if host in ("localhost", "", "0.0.0.0", "::"):
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host == socket.gethostname()  # a hostname: local if it is this host's own
    return address.is_loopback or address.is_unspecified


def _host_scope(kind: str) -> str:
    """``{hostname}.{hash}``: the hash of the boot id and this process's ``kind`` namespace."""
    digest = hashlib.sha1(f"{_read('/proc/sys/kernel/random/boot_id')}|{_namespace(kind)}".encode()).hexdigest()
    return f"{_clean_host(socket.gethostname())}.{digest[:6]}"


def _namespace(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _clean_host(host: str) -> str:
    return _HOST_CHARS.sub("-", host.strip("[]"))[:48] or "host"


def _fit(name: str) -> str:
    return name[:_MAX_NAME]

