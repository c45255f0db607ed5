"""Which physical GPU a worker means (see docs/accounting.md).

A worker names its device by CUDA ordinal (``cuda:1``), but brokers are per physical GPU and
``{device}`` in ``KVCACHED_BROKER`` is the NVML index.  The two differ: CUDA numbers devices
fastest-first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, NVML numbers them in PCI order, and
``CUDA_VISIBLE_DEVICES`` may hold indices, UUIDs or MIG ids.  So a UUID is the only reliable
name, and this module finds one where it can:

1. from torch, if the process has already imported torch and initialised CUDA (this module
   never imports torch itself, and never initialises CUDA);
2. from ``CUDA_VISIBLE_DEVICES`` (UUID and MIG entries through NVML, index entries as is);
3. else the ordinal is taken as the NVML index.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping


class DeviceResolutionError(ValueError):
    """The worker's device cannot be mapped to a physical GPU.  One line."""


@dataclass(frozen=True)
class PhysicalDevice:
    index: int  # NVML index: what {device} means
    uuid: str | None  # "GPU-..." when known; the broker refuses a worker whose UUID is not its GPU's
    source: str  # how it was found: "torch", "CUDA_VISIBLE_DEVICES", "ordinal"


def resolve_device(ordinal: int | str, env: Mapping[str, str] | None = None) -> PhysicalDevice:
    """Map a CUDA ordinal (``1``, ``"cuda:1"``) seen by this process to a physical GPU."""
    env = os.environ if env is None else env
    index = _parse_ordinal(ordinal)
    uuid = _uuid_from_torch(index)
    if uuid:
        nvml_index = _nvml_index_of(uuid)
        if nvml_index is not None:
            return PhysicalDevice(nvml_index, uuid, "torch")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() != "":
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if index >= len(entries):
            raise DeviceResolutionError(
                f"device {index} is not visible: CUDA_VISIBLE_DEVICES={visible!r} lists {len(entries)} device(s)"
            )
        entry = entries[index]
        if entry.lstrip("-").isdigit():
            if int(entry) < 0:
                raise DeviceResolutionError(f"CUDA_VISIBLE_DEVICES={visible!r} hides every device")
            return PhysicalDevice(int(entry), uuid, "CUDA_VISIBLE_DEVICES")
        found = _nvml_lookup(entry)
        if found is None:
            raise DeviceResolutionError(
                f"CUDA_VISIBLE_DEVICES entry {entry!r} is a UUID or MIG id, and NVML cannot resolve it on this machine"
            )
        return PhysicalDevice(found[0], found[1], "CUDA_VISIBLE_DEVICES")
    return PhysicalDevice(index, uuid, "ordinal")


def _parse_ordinal(ordinal: int | str) -> int:
    if isinstance(ordinal, bool):
        raise DeviceResolutionError(f"device must be an int or 'cuda:N', got {ordinal!r}")
    if isinstance(ordinal, int):
        value = ordinal
    else:
        text = str(ordinal).strip()
        if text.startswith("cuda:"):
            text = text[len("cuda:") :]
        if not text.isdigit():
            raise DeviceResolutionError(f"device must be an int or 'cuda:N', got {ordinal!r}")
        value = int(text)
    if value < 0:
        raise DeviceResolutionError(f"device must be non-negative, got {ordinal!r}")
    return value


def _uuid_from_torch(ordinal: int) -> str | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        uuid = str(torch.cuda.get_device_properties(ordinal).uuid)
    except Exception:  # noqa: BLE001 - torch cannot say: resolve without it
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _nvml() -> Any:
    """The initialised ``pynvml`` module (untyped: read as Any), or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no usable NVML: resolve without it
        return None


def _nvml_index_of(uuid: str) -> int | None:
    found = _nvml_lookup(uuid)
    return found[0] if found else None


def _nvml_lookup(entry: str) -> tuple[int, str] | None:
    """``(nvml_index, gpu_uuid)`` for a GPU UUID (or unique prefix) or a MIG UUID."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        count = nvml.nvmlDeviceGetCount()
        if entry.startswith("MIG-"):
            mig = nvml.nvmlDeviceGetHandleByUUID(entry)
            parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
            return int(nvml.nvmlDeviceGetIndex(parent)), _text(nvml.nvmlDeviceGetUUID(parent))
        matches = []
        for index in range(count):
            uuid = _text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index)))
            if uuid == entry or uuid.startswith(entry if entry.startswith("GPU-") else "GPU-" + entry):
                matches.append((index, uuid))
        return matches[0] if len(matches) == 1 else None
    except Exception:  # noqa: BLE001 - NVML cannot resolve it: the caller says why
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
