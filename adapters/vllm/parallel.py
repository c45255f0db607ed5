"""Where this vLLM worker sits: its GPU and its tensor-parallel rank.

Read from vLLM when asked (its parallel state exists only after the worker initialised
it); outside a distributed worker (tests, a single-GPU run) this is rank 0 of 1.
"""

from __future__ import annotations

from typing import Any

from ..worker_identity import WorkerIdentity

RUNTIME = "vllm"


def device_index(device: Any) -> int:
    """The CUDA ordinal of ``device`` (a torch.device, ``"cuda:1"`` or an int); CPU is 0."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        return int(device.rsplit(":", 1)[1]) if ":" in device else 0
    index = getattr(device, "index", None)
    if index is not None:
        return int(index)
    text = str(device)
    return int(text.rsplit(":", 1)[1]) if ":" in text else 0


def tp_coordinates() -> tuple[int, int]:
    """``(tp_rank, tp_size)`` from vLLM's TP group, or ``(0, 1)`` before it exists."""
    group = _tp_group()
    if group is None:
        return 0, 1
    return int(group.rank_in_group), int(group.world_size)


def identity(device: Any) -> WorkerIdentity:
    rank, size = tp_coordinates()
    return WorkerIdentity(RUNTIME, device_index(device), tp_rank=rank, tp_size=size)


def _tp_group() -> Any:
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return None
    try:
        if not parallel_state.model_parallel_is_initialized():
            return None
        return parallel_state.get_tp_group()
    except (AssertionError, AttributeError, RuntimeError):
        return None
