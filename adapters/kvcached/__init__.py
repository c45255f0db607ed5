"""kvcached mode: kvcached 0.1.6's elastic KV pools whose memory is the broker's grant.

With ``ENABLE_KVCACHED=1`` and kvcached installed, every ``KVCacheManager`` kvcached builds is
governed (:mod:`.patches`): its memory limit follows what its process's broker session
granted, it grows ahead of need, gives back idle memory, answers broker pressure, and treats a
``kvctl limit`` as an operator cap.  See adapters/kvcached/README.md.

The wiring for SGLang and vLLM uses:

* :func:`identity.set_resolver` to say which session (rank, instance) a pool belongs to;
* :func:`register_eviction_hook` to let pressure evict the prefix cache's unused blocks;
* :func:`status` for what each pool holds, maps and why it could not give back.
"""

from __future__ import annotations

from typing import Any

from . import identity, runner
from .eviction import EvictionHook, register_eviction_hook

__all__ = ["EvictionHook", "identity", "register_eviction_hook", "status"]


def status() -> list[dict[str, Any]]:
    """Every governed pool of this process (``PoolGovernor.status()``), and each TP worker's grant
    for a broadcast-mode pool once an engine governs it (``WorkerGrants.status()``)."""
    return [found for found in (governor.status() for governor in runner.governors()) if found is not None]
