"""Where a GPU's broker listens (the environment contract: docs/design.md).

``KVCACHED_BROKER`` holds an endpoint, or a template with ``{device}`` (the NVML index) or
``{uuid}``.  Unset, the endpoint is ``ipc://RUNDIR/gpu{device}.sock`` where RUNDIR is
``$KVCACHED_BROKER_RUNTIME_DIR``, else ``/run/kvcached`` for root, else
``$XDG_RUNTIME_DIR/kvcached``, else ``/tmp/kvcached-$UID``.  The literal ``off`` disables the
broker.  Everything is read when called, never frozen at import.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping

ENV_ENDPOINT = "KVCACHED_BROKER"
ENV_RUNTIME_DIR = "KVCACHED_BROKER_RUNTIME_DIR"
#: Linux ``sockaddr_un.sun_path`` holds 108 bytes including the terminating NUL.
MAX_IPC_PATH = 107
_TCP_RE = re.compile(r"^tcp://(\[[0-9A-Fa-f:]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})$")


class EndpointError(ValueError):
    """An endpoint or ``KVCACHED_BROKER`` value that cannot be used.  One line."""


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get(ENV_RUNTIME_DIR):
        return Path(env[ENV_RUNTIME_DIR])
    if os.getuid() == 0:
        return Path("/run/kvcached")
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "kvcached"
    return Path(f"/tmp/kvcached-{os.getuid()}")


def default_endpoint(device_index: int, env: Mapping[str, str] | None = None) -> str:
    return f"ipc://{runtime_dir(env)}/gpu{device_index}.sock"


def broker_disabled(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get(ENV_ENDPOINT, "").strip().lower() == "off"


def resolve_endpoint(
    device_index: int,
    *,
    uuid: str | None = None,
    endpoint: str | None = None,
    env: Mapping[str, str] | None = None,
) -> str | None:
    """The endpoint of device ``device_index``'s broker, or None if ``KVCACHED_BROKER=off``.

    An explicit ``endpoint`` wins over the environment.
    """
    env = os.environ if env is None else env
    template = endpoint if endpoint is not None else env.get(ENV_ENDPOINT, "").strip()
    if template.lower() == "off":
        return None
    if not template:
        return validate_endpoint(default_endpoint(device_index, env))
    if "{uuid}" in template and not uuid:
        raise EndpointError(f"{ENV_ENDPOINT}={template!r} needs the GPU UUID, which is not known for device {device_index}")
    try:
        filled = template.format(device=device_index, uuid=uuid or "")
    except (KeyError, IndexError, ValueError) as exc:
        raise EndpointError(f"{ENV_ENDPOINT}={template!r}: only {{device}} and {{uuid}} may be used ({exc})") from None
    return validate_endpoint(filled)


def validate_endpoint(uri: str) -> str:
    """Return ``uri`` if it is a usable ``ipc://ABSPATH`` or ``tcp://HOST:PORT``."""
    if uri.startswith("ipc://"):
        path = uri[len("ipc://") :]
        if not path.startswith("/"):
            raise EndpointError(f"endpoint {uri!r}: an ipc path must be absolute (ipc:///run/kvcached/gpu0.sock)")
        if len(path.encode()) > MAX_IPC_PATH:
            raise EndpointError(f"endpoint {uri!r}: ipc path is longer than {MAX_IPC_PATH} bytes")
        if "\0" in path:
            raise EndpointError(f"endpoint {uri!r}: ipc path contains a NUL byte")
        return uri
    match = _TCP_RE.match(uri)
    if match:
        port = int(match.group(2))
        if not 0 < port < 65536:
            raise EndpointError(f"endpoint {uri!r}: port must be 1-65535")
        return uri
    raise EndpointError(f"endpoint {uri!r}: expected ipc:///ABSOLUTE/PATH.sock or tcp://HOST:PORT")


def ipc_path(uri: str) -> Path | None:
    """The socket path of an ipc endpoint; None for tcp."""
    return Path(uri[len("ipc://") :]) if uri.startswith("ipc://") else None


def tcp_host(uri: str) -> str | None:
    match = _TCP_RE.match(uri)
    return match.group(1).strip("[]") if match else None
