"""EngineCore: its announce line, and in kvcached mode the prefix-cache eviction hook.

EngineCore opens no broker session (its workers hold the memory, each with its own GPU's
broker).  Once ``EngineCore.__init__`` built the scheduler, this patch:

* registers the prefix-cache eviction hook (:mod:`.prefix_eviction`) when the scheduler's pool
  is kvcached's ``ElasticBlockPool`` (kvcached mode; its pool is governed by
  ``adapters/kvcached``: in-process for TP = 1, through the workers' board for TP > 1);
* prints the process's one ``adapter_active`` line, ``role=engine_core`` (or
  ``engine_core_kvcached`` when the hook is attached).
"""

from __future__ import annotations

from typing import Any, Callable

from .. import worker_identity
from ..patching import wrap_methods, wrap_once
from . import prefix_eviction


def wrap_engine_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        hook = prefix_eviction.attach(self)
        worker_identity.announce_process("vllm", "engine_core" if hook is None else "engine_core_kvcached")

    return wrap_once(original, __init__)


def apply_engine_core(module: Any) -> None:
    wrap_methods(module, "EngineCore", {"__init__": wrap_engine_init})
