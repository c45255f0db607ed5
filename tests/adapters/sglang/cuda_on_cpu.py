"""Tensors asked for on ``cuda`` are made on the CPU: the simulated GPU's memory, for SGLang code.

kvcached's SGLang classes accept only ``cuda``/``hip`` devices, so the pools and allocators under
test are built on ``cuda:0`` as on a real server.  kvcached's own tensors come from the
``vmm_ops`` double (``meta`` tensors: virtual memory), and the simulated GPU's
``torch.cuda`` facts from ``kvcached_cpu.install``; what is left is SGLang's and kvcached's small
bookkeeping tensors (free lists, index tensors), which this torch function mode places on the CPU
(``device=``, ``.to(...)``, ``.cuda()``, ``pin_memory``).  Nothing else changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _cpu(device: Any) -> Any:
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


class CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        name = getattr(func, "__name__", "")
        if name == "cuda" and args:
            return args[0]
        if name == "to" and args:
            args = tuple(_cpu(a) for a in args)
        return func(*args, **kwargs)


def enter() -> CudaOnCpu:
    """Enter the mode for the rest of this thread's life (a test process's main thread)."""
    mode = CudaOnCpu()
    mode.__enter__()
    return mode
