"""``kvcached-broker demo`` as ``make demo`` runs it: the kvcached hand-over, live.

kvcached 0.1.6's Python code is found only through ``KVCACHED_BROKER_KVCACHED_PATH`` (the
overlay ``scripts/fetch-kvcached.py`` unpacks; not on ``PYTHONPATH``), as the Makefile's demo
target sets it; torch comes from the environment.  The demo exits 0, shows the hand-over (not the
three-worker fallback), and its last frame, read under the device's allocation lock, says that
both pools map at most what the broker granted them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import python_env

from kvcached_broker.tools import kvcached_sim

ROOT = Path(__file__).resolve().parents[2]


def test_make_demo_shows_the_handover_and_its_last_frame_keeps_mapped_within_granted():
    env = python_env()
    env.pop("PYTHONPATH", None)  # kvcached only where make demo points
    env.pop("KVCACHED_BROKER_DEMO", None)
    env[kvcached_sim.PATH_ENV] = str(ROOT / kvcached_sim.OVERLAY)
    executable = Path(sys.executable).parent / "kvcached-broker"
    command = [str(executable)] if executable.exists() else [sys.executable, "-m", "kvcached_broker.broker.cli"]

    out = subprocess.run([*command, "demo", "--seconds", "1"], capture_output=True, text=True, env=env,
                         timeout=240)

    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    assert "starting two kvcached 0.1.6 pools" in out.stdout and "three co-located workers" not in out.stdout
    verdicts = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("mapped <= granted:")]
    assert verdicts and verdicts[-1] == "mapped <= granted: yes, both pools", out.stdout[-3000:]
    assert "llama-b asked for 28 GiB" in out.stdout  # the burst ran to its end
