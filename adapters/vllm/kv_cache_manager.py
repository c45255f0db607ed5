"""``KVCacheManager.allocate_slots`` on a gated pool: grow, retry, or miss; never raise.

vLLM decides inside ``allocate_slots`` how many blocks a step needs and returns ``None``
when the pool has too few free.  On a gated pool a ``None`` may only mean "not granted yet",
so the patch asks the gate for more (a batch, then doubling) and calls vLLM again, until
the step fits or the brokers refuse.  A refusal stays what vLLM already handles: ``None``,
a scheduling miss.  Calling ``allocate_slots`` again after ``None`` is safe: before
refusing, vLLM only frees blocks outside the attention window, which a repeat leaves alone.
"""

from __future__ import annotations

from typing import Any, Callable

from ..patching import wrap_methods, wrap_once
from .block_pool import gate_of



def wrap_allocate_slots(original: Callable[..., Any]) -> Callable[..., Any]:
    def allocate_slots(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        blocks = original(self, request, num_new_tokens, *args, **kwargs)
        gate = gate_of(getattr(self, "block_pool", None))
        ask_blocks = gate.batch_blocks if gate is not None else 0
        while blocks is None and gate is not None and gate.grow(ask_blocks):
            blocks = original(self, request, num_new_tokens, *args, **kwargs)
            ask_blocks *= 2
        return blocks

    return wrap_once(original, allocate_slots)


def apply_kv_cache_manager(module: Any) -> None:
    wrap_methods(module, "KVCacheManager", {"allocate_slots": wrap_allocate_slots})
