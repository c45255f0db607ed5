"""Which broker session a kvcached pool's memory is charged to.

A pool's grant comes from its process's per-device session (``adapters/sessions.py``), so the
governor needs that process's :class:`WorkerIdentity`.  The SGLang and vLLM wiring know it
exactly (the server's TP rank and size, its instance name) and install a resolver with
:func:`set_resolver`; without one, :func:`default_identity` reads what kvcached's own
integration was initialised with (runtime, ``cuda:N``) and the default process group's rank.

A resolver returns None for a pool that should not be governed by this process (for example
vLLM's EngineCore pool, whose pages are mapped in the workers: the TP wiring governs it).
"""

from __future__ import annotations

import sys
from typing import Callable

from .. import process_state
from . import kvcached_api
from ..worker_identity import WorkerIdentity
from .geometry import PoolGeometry

Resolver = Callable[[PoolGeometry], "WorkerIdentity | None"]

_INTEGRATIONS = ("sglang", "vllm")


class _Resolver:
    """The resolver this process's wiring installed (None: :func:`default_identity`).  Wiring,
    installed once by the runtime's patches (:mod:`..sglang.kvcached_sync`), so a reset of the
    registry keeps it; :func:`set_resolver` replaces it."""

    KEPT_ACROSS_RESET = True

    def __init__(self) -> None:
        self.resolver: Resolver | None = None


def set_resolver(resolver: Resolver | None) -> None:
    """Install how pools find their identity (None: :func:`default_identity`)."""
    process_state.part(_Resolver).resolver = resolver


def installed_resolver() -> Resolver | None:
    """The resolver :func:`set_resolver` installed, if any."""
    return process_state.part(_Resolver).resolver


def resolve(geometry: PoolGeometry) -> WorkerIdentity | None:
    return (installed_resolver() or default_identity)(geometry)


def default_identity(geometry: PoolGeometry) -> WorkerIdentity:
    runtime, device = _initialised_integration()
    rank, size = _process_group()
    return WorkerIdentity(runtime, device, tp_rank=rank, tp_size=size)


def _initialised_integration() -> tuple[str, int]:
    """(runtime, device index) of the kvcached integration initialised in this process."""
    for runtime in _INTEGRATIONS:
        device = kvcached_api.initialised_device(runtime)
        if device is not None:
            return runtime, _device_index(device)
    return "kvcached", 0


def _device_index(device: object) -> int:
    text = str(device or "")
    _, _, index = text.partition(":")
    return int(index) if index.isdigit() else 0


def _process_group() -> tuple[int, int]:
    torch = sys.modules.get("torch")
    try:
        dist = torch.distributed if torch is not None else None
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - identity is best effort; a rank-0 view is the fallback
        pass
    return 0, 1
