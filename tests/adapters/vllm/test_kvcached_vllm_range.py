"""The table's kvcached mode range for vLLM is kvcached's own: kvcached 0.1.6 refuses, in its
patched ``EngineCore.__init__``, every vLLM from 0.29 outside its Model Runner V2 window."""

from __future__ import annotations

import pytest
from kvcached_vllm_harness import overlay  # noqa: F401  (autouse: kvcached and vLLM at the overlay's versions)
from kvcached_broker.adapters import support
from kvcached_broker.adapters.versions import parse

pytestmark = pytest.mark.runtime("kvcached", "vllm")


def test_the_tables_kvcached_mode_range_is_the_one_kvcached_serves():
    from kvcached.integration.version_utils import VersionRange
    from kvcached.integration.vllm.patches import VLLM_ALL_RANGE, VLLM_MRV2_RANGE

    mode = support.VLLM.kvcached_mode
    assert mode is not None
    assert VersionRange(VLLM_ALL_RANGE).contains(mode.minimum)
    newest = max(support.VLLM.kvcached_overlays, key=parse)
    assert VersionRange(VLLM_MRV2_RANGE).contains(newest)  # the highest tested is one kvcached runs
    assert not VersionRange(VLLM_MRV2_RANGE).contains(f"{mode.below}.0")  # past the range kvcached refuses
