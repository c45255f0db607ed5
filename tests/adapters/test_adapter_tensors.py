"""Tensor memory (adapters/tensors.py): a storage shared by views is counted once."""

from __future__ import annotations

import pytest


def test_tensor_storage_is_counted_once():
    torch = pytest.importorskip("torch")
    from kvcached_broker.adapters.tensors import storage_bytes

    base = torch.zeros(1024, dtype=torch.float32)
    view = base[:10]
    other = torch.zeros(10, dtype=torch.int8)
    assert storage_bytes([base, view, {"x": other, "y": None}, (base,)]) == 4096 + 10

