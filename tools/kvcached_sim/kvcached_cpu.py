"""Run kvcached 0.1.6's real Python code on a CPU: only ``kvcached.vmm_ops`` is replaced.

:func:`install` must run before anything imports ``kvcached.kv_cache_manager``: it sets
``KVCACHED_IPC_NAME`` (kvcached computes its segment and socket names at import), puts
:mod:`.vmm_ops_double` in ``sys.modules["kvcached.vmm_ops"]``, points it at a shared simulated
GPU, and patches the five ``torch.cuda`` functions kvcached's integrations call
(``is_available``, ``get_device_properties``, ``set_device``, ``current_device``,
``mem_get_info``) to describe that GPU.  Nothing else is patched.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class _DeviceProperties:
    name: str
    total_memory: int
    major: int = 9
    minor: int = 0
    multi_processor_count: int = 132


def install(usage_dir: Path, total_bytes: int, ipc_name: str, *, setattr_=setattr):
    """Install the double on the shared GPU at ``usage_dir``; returns the ``SharedGpu``.

    ``setattr_`` is how ``torch.cuda`` is patched (pytest's ``monkeypatch.setattr`` in a test
    process, so the patches are undone; plain ``setattr`` in a worker process).
    """
    os.environ["KVCACHED_IPC_NAME"] = ipc_name
    import torch

    from ..shared_gpu import SharedGpu
    from . import vmm_ops_double

    assert "kvcached.kv_cache_manager" not in sys.modules or sys.modules.get("kvcached.vmm_ops") is vmm_ops_double, \
        "install() must run before kvcached.kv_cache_manager is imported"
    gpu = SharedGpu(usage_dir, total_bytes)
    vmm_ops_double.configure(gpu)
    sys.modules["kvcached.vmm_ops"] = vmm_ops_double
    import kvcached

    kvcached.vmm_ops = vmm_ops_double
    properties = _DeviceProperties("simulated shared GPU", total_bytes)
    setattr_(torch.cuda, "is_available", lambda: True)
    setattr_(torch.cuda, "get_device_properties", lambda device=None: properties)
    setattr_(torch.cuda, "set_device", lambda device: None)
    setattr_(torch.cuda, "current_device", lambda: 0)
    setattr_(torch.cuda, "mem_get_info", lambda device=None: vmm_ops_double.mem_get_info())
    return gpu

