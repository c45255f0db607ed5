"""Who this SGLang worker is: its GPU, its tensor-parallel rank, and its rank group.

Each TP rank is its own process on its own GPU and talks to that GPU's broker, so the
identity is read where the worker runs:

* the device from the pool or model runner (``cuda:3``, ``cuda``, ``3``; ``cpu`` in tests,
  which maps to device 0 and reaches its broker through ``KVCACHED_BROKER``);
* the rank and size from SGLang's parallel state (``get_tp_group()``) once it is initialised,
  else rank 0 of 1;
* the min-reduces that KV sizing and kvcached mode's sync points agree on, over SGLang's
  world, TP or attention-TP CPU group, which is a gloo group in every SGLang release this
  adapter supports.

Nothing here imports SGLang or torch at module import; both are looked up when asked.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from .. import worker_identity


@dataclass(frozen=True)
class RankGroup:
    """A process group as the adapter needs it: rank, size and a CPU (gloo) group handle."""

    rank: int
    size: int
    cpu_group: Any = None

    def reduce_min(self, value: int) -> int:
        """The minimum of ``value`` over the group (a collective: every rank must call it)."""
        return self.reduce_min_each([int(value)])[0]

    def reduce_min_each(self, values: list[int]) -> list[int]:
        """The element-wise minimum of ``values`` over the group, in one collective (every rank
        must call it, with a list of the same length)."""
        if self.size <= 1:
            return [int(v) for v in values]
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([int(v) for v in values], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return [int(v) for v in tensor.tolist()]


SINGLE = RankGroup(0, 1, None)


def _parallel_state() -> Any:
    """SGLang's parallel state if SGLang has loaded it (never imported from here)."""
    return sys.modules.get("sglang.srt.distributed.parallel_state")


def _coordinator(name: str) -> Any:
    """SGLang's ``GroupCoordinator`` called ``name`` (``tp_group``, ``world_group``), or None.

    0.5.16+ publish groups in the runtime context (``get_parallel().tp_group``; the
    ``parallel_state`` getters are deprecated aliases); earlier releases keep them in
    ``parallel_state``, initialised or not.
    """
    context = sys.modules.get("sglang.srt.runtime_context")
    get_parallel = getattr(context, "get_parallel", None)
    try:
        if get_parallel is not None:
            return getattr(get_parallel(), name)
        state = _parallel_state()
        if state is None or (name == "tp_group" and not _initialised(state)):
            return None
        return getattr(state, f"get_{name}")()
    except (AssertionError, AttributeError, RuntimeError, ValueError):
        return None  # not initialised: a single-process run (or a test)


def _group(name: str) -> RankGroup:
    coordinator = _coordinator(name)
    if coordinator is None:
        return SINGLE
    size = int(getattr(coordinator, "world_size", 1))
    return RankGroup(int(getattr(coordinator, "rank_in_group", 0)), size, getattr(coordinator, "cpu_group", None))


def tp_group() -> RankGroup:
    """This worker's tensor-parallel group (rank 0 of 1 before SGLang initialises it)."""
    return _group("tp_group")


def world_group() -> RankGroup:
    """SGLang's world group: what its own memory profile min-reduces over."""
    return _group("world_group")


def scheduling_group() -> RankGroup:
    """The ranks that run one scheduler in lockstep: the attention-TP group under DP attention,
    else the TP group (each receives the same requests by a broadcast over its CPU group)."""
    return _group("attn_tp_group") if dp_attention() else tp_group()


def dp_attention() -> bool:
    """True when SGLang runs with DP attention (``attn_dp_enabled``, 0.5.16+; the
    ``dp_attention`` flag before)."""
    context = sys.modules.get("sglang.srt.runtime_context")
    get_parallel = getattr(context, "get_parallel", None)
    try:
        if get_parallel is not None:
            return bool(getattr(get_parallel(), "attn_dp_enabled", False))
        module = sys.modules.get("sglang.srt.layers.dp_attention")
        return bool(module is not None and module.is_dp_attention_enabled())
    except (AssertionError, AttributeError, RuntimeError, ValueError):
        return False


def pipeline_size() -> int:
    """SGLang's pipeline-parallel size (1 before it is initialised)."""
    coordinator = _coordinator("pp_group")
    return int(getattr(coordinator, "world_size", 1)) if coordinator is not None else 1


def _initialised(state: Any) -> bool:
    check = getattr(state, "model_parallel_is_initialized", None)
    try:
        return bool(check()) if check is not None else False
    except (AssertionError, RuntimeError):
        return False


def device_index(device: Any, gpu_id: int | None = None) -> int:
    """The CUDA ordinal a pool or runner lives on; ``cpu`` (CPU tests) is device 0."""
    text = str(device if device is not None else "").strip()
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    if text.isdigit():
        return int(text)
    if gpu_id is not None:
        return int(gpu_id)
    if text == "cuda":
        return _current_cuda_device()
    return 0


def _current_cuda_device() -> int:
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return int(torch.cuda.current_device())
    except RuntimeError:
        pass
    return 0


def identity(device: Any, gpu_id: int | None = None) -> worker_identity.WorkerIdentity:
    """The broker identity of this worker for a pool or runner on ``device``."""
    group = tp_group()
    # The session page is the identity's default: ``paged_allocator`` converts elastic KV pages
    # of any size to it, so one session serves every reporter.
    return worker_identity.WorkerIdentity(
        runtime="sglang",
        device=device_index(device, gpu_id),
        tp_rank=group.rank,
        tp_size=group.size,
    )
