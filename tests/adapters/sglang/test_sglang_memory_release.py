"""SGLang's release/resume of memory occupation, followed through to the broker.

The methods are the installed release's own (``SchedulerWeightUpdaterManager`` in 0.5.13+,
``SchedulerUpdateWeightsMixin`` in 0.5.12), run with the ``kv_cache`` tag on an object that
holds what they use; only torch_memory_saver, which needs CUDA, is a recorder that says it
is enabled and notes what SGLang paused and resumed.
"""

from __future__ import annotations

import pytest

import sglang_cpu
from helpers import GIB

from kvcached_broker.adapters.sglang import kv_budget
from kvcached_broker.client import BrokerClient


class MemorySaver:
    """torch_memory_saver as SGLang's adapter sees it: enabled, pausing and resuming regions."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.calls: list[tuple[str, str]] = []

    def pause(self, tag: str) -> None:
        self.calls.append(("pause", tag))

    def resume(self, tag: str) -> None:
        self.calls.append(("resume", tag))


def weight_updater(saver: MemorySaver):
    """The object SGLang runs release/resume on, holding only what those methods read."""
    if sglang_cpu.at_least("0.5.13"):
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager as cls
    else:
        from sglang.srt.managers.scheduler_update_weights_mixin import SchedulerUpdateWeightsMixin

        cls = type("Scheduler", (SchedulerUpdateWeightsMixin,), {})
    obj = object.__new__(cls)
    for name, value in {"memory_saver_adapter": saver, "offload_tags": set(), "scheduler": None, "tp_worker": None,
                        "draft_worker": None, "flush_cache": lambda *a, **k: True,
                        "is_fully_idle": lambda *a, **k: True}.items():
        try:
            setattr(obj, name, value)
        except AttributeError:  # a slotted release without that field (0.5.13 has no scheduler)
            pass
    return obj


def kv_request(kind: str):
    from sglang.srt.managers import io_struct

    cls = getattr(io_struct, f"{kind}MemoryOccupationReqInput")
    return cls(tags=["kv_cache"])


def _pools(status):
    return next((i["pools"] for i in status["instances"] if i["name"] == "under-test"), {})


def test_released_kv_memory_is_no_longer_charged_and_comes_back_through_admission(sg_broker):
    pool = sglang_cpu.build_dsv4_pool(full_pages=64, swa_pages=16)
    charged = _pools(sg_broker.status())
    assert charged == sglang_cpu.tensor_bytes_by_pool(pool)
    saver = MemorySaver()
    updater = weight_updater(saver)

    updater.release_memory_occupation(kv_request("Release"))
    assert saver.calls == [("pause", "kv_cache")] and _pools(sg_broker.status()) == {}  # no longer charged

    neighbour = BrokerClient.connect("neighbour", endpoint=sg_broker.endpoint, credit_pages=0)
    try:
        neighbour.reserve({"weights": GIB - sum(charged.values()) // 2})  # takes what was handed back
        with pytest.raises(kv_budget.BrokerBudgetError) as caught:
            updater.resume_memory_occupation(kv_request("Resume"))
        assert sg_broker.endpoint in str(caught.value) and "neighbour" in str(caught.value)
        assert saver.calls == [("pause", "kv_cache")]  # SGLang never mapped memory the broker refused
        assert _pools(sg_broker.status()) == {}
        neighbour.reserve({})
        updater.resume_memory_occupation(kv_request("Resume"))
    finally:
        neighbour.close()
    assert saver.calls[-1] == ("resume", "kv_cache") and _pools(sg_broker.status()) == charged


def test_a_memory_saver_that_releases_nothing_keeps_the_charge(sg_broker):
    pool = sglang_cpu.build_dsv4_pool(full_pages=16, swa_pages=4)
    updater = weight_updater(MemorySaver(enabled=False))  # SGLang's no-op adapter: memory stays mapped
    updater.release_memory_occupation(kv_request("Release"))
    assert _pools(sg_broker.status()) == sglang_cpu.tensor_bytes_by_pool(pool)
    updater.resume_memory_occupation(kv_request("Resume"))
    assert _pools(sg_broker.status()) == sglang_cpu.tensor_bytes_by_pool(pool)
