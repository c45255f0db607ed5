"""The SGLang patch set (filled in by the SGLang adapter modules)."""

from __future__ import annotations

from .. import flags
from ..patching import Patch, PatchError

PATCHES: list[Patch] = []


def check_flags() -> None:
    if flags.dsv4_kv_pool_bridge():
        raise PatchError(
            "KVCACHED_SGLANG_DSV4_KV_POOL_BRIDGE=1 is not supported: bridging a DeepSeek-V4 pool into elastic "
            "management is future work; unset it (the V4 pools stay runtime-owned and are reported as reservations)"
        )
