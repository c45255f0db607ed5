"""The adapters' flags (adapters/flags.py): read from the environment when asked, validated, and
a flag for future work refused clearly."""

from __future__ import annotations

import pytest

from kvcached_broker.adapters import flags
from kvcached_broker.adapters.patching import PatchError


def test_flags_read_the_environment_when_asked():
    assert flags.enabled({"ENABLE_KVCACHED": "1"}) and flags.autopatch({"ENABLE_KVCACHED": "true"})
    assert flags.autopatch({"KVCACHED_AUTOPATCH": "yes"}) and not flags.autopatch({})
    assert flags.dsv4_runtime_reservation({}) is True and flags.dsv4_kv_pool_bridge({}) is False
    assert flags.dsv4_runtime_reservation({"KVCACHED_SGLANG_DSV4_RUNTIME_RESERVATION": "0"}) is False
    with pytest.raises(flags.FlagError, match="KVCACHED_REQUIRE"):
        flags.require({"KVCACHED_REQUIRE": "maybe"})
    with pytest.raises(flags.FlagError, match="KVCACHED_SGLANG_DSV4_KV_POOL_BRIDGE='sometimes'"):
        flags.validate({"KVCACHED_SGLANG_DSV4_KV_POOL_BRIDGE": "sometimes"})
    flags.validate({"ENABLE_KVCACHED": "on", "KVCACHED_REQUIRE": "0"})


def test_kv_pool_bridge_flag_is_refused_clearly(monkeypatch):
    from kvcached_broker.adapters import autopatch

    monkeypatch.setenv("KVCACHED_SGLANG_DSV4_KV_POOL_BRIDGE", "1")
    with pytest.raises(PatchError, match="future work"):
        autopatch.apply(["sglang"])

