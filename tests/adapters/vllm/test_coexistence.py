"""Both autopatches on one flag: the broker's vLLM adapter wraps kvcached's, and charges no virtual buffer.

A fresh interpreter with ``ENABLE_KVCACHED=1`` runs the real start-up order (coexistence_probe.py):
kvcached's whole-GPU virtual KV buffers are never charged as ``kv_static``, whichever wrapper
runs first; the broker's sizing cap wraps kvcached's patched ``determine_available_memory``
(capping the virtual size at what the broker could ever give this instance) and takes no hold.
"""

from __future__ import annotations

import pytest
from kvcached_vllm_harness import overlay  # noqa: F401  (autouse: kvcached and vLLM at the overlay's versions)
from kvcached_vllm_harness import gpus, processes  # noqa: F401  (fixtures)
import json
import subprocess
import sys

from tp_harness import GIB, HERE

pytestmark = pytest.mark.runtime("kvcached", "vllm")


def test_kvcached_buffers_are_not_kv_static_and_the_cap_wraps_kvcacheds_sizing(gpus, processes):
    (gpu,) = gpus(1)
    env = processes.env(gpu.endpoint)
    out = subprocess.run([sys.executable, str(HERE / "coexistence_probe.py"), str(gpu.usage), str(80 * GIB)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["hook"]  # the broker's .pth hook ran
    assert probe["outer_is_ours"] and probe["wraps_kvcached"]  # the cap is outside kvcached's profile
    budget = GIB - int(GIB * 0.05)  # the default headroom
    assert 0 < probe["sized_bytes"] <= probe["budget_bytes"] == budget  # 80 GiB virtual, capped at the budget
    assert probe["holds"] == {}  # kvcached maps nothing at sizing time: no sizing hold
    assert probe["virtual_bytes"] > 10 * GIB and probe["virtual_bytes_ours"] > 10 * GIB  # what kv_static would be
    assert "kv_static" not in probe["pools"]
