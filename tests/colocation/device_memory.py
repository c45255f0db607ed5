"""A server's big device tensors as CPU tensors whose pages are never touched.

On a simulated 80 GiB GPU a server builds KV pools of several GiB with its runtime's own
classes, which fill them with ``torch.zeros``.  On a CPU that would take the machine's memory;
a GPU's allocation is what the shared simulated device records (``tools.shared_gpu.Footprint``),
so here a ``torch.zeros`` of at least ``BIG_BYTES`` becomes a ``torch.empty`` of the same shape,
dtype and device: the tensor, its storage and its size are real (the adapters measure them), its
pages are never touched, and the kernel never backs them.  Smaller tensors (index tables, free
lists) stay as the runtime made them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

BIG_BYTES = 16 << 20


def _shape(args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    size = kwargs.get("size", args[0] if len(args) == 1 else args)
    if isinstance(size, int):
        size = (size,)
    try:
        return tuple(int(n) for n in size)
    except TypeError:
        return None


class UntouchedDeviceMemory(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.zeros:
            shape = _shape(args, kwargs)
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            if shape is not None and math.prod(shape) * torch.tensor([], dtype=dtype).element_size() >= BIG_BYTES:
                kwargs.pop("size", None)
                return torch.empty(shape, **kwargs)
        return func(*args, **kwargs)


def enter() -> Any:
    """Enter the mode for the rest of this thread's life (a server's main thread)."""
    mode = UntouchedDeviceMemory()
    mode.__enter__()
    return mode
