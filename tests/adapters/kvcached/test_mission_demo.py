"""``kvcached-broker demo`` as ``make demo`` runs it, without a terminal: the whole mission, checked.

kvcached 0.1.6's Python code is found only through ``KVCACHED_BROKER_KVCACHED_PATH`` (the
overlay ``scripts/fetch-kvcached.py`` unpacks; not on ``PYTHONPATH``), as the Makefile's demo
target sets it; torch comes from the environment.  The demo must exit 0 with nothing on stderr,
end with its one line of what it checked, print plain frames of at most 100 columns, and every
frame's budget line must add up again from the figures it prints.  Its story must have
happened: the DeepSeek-V4-shaped server went through ``sizing``, ``warming`` and ``serving``
with its side pools shown per pool, and the broker pressed the idle kvcached pool for the
bursting one.
"""

from __future__ import annotations

import pytest
import re
import subprocess
import sys
from pathlib import Path

from helpers import python_env

from kvcached_broker.tools import kvcached_sim
from kvcached_broker.tools.dsv4_shape import POOLS
from kvcached_broker.tools.kvcached_sim.mission_demo import B_BURST_BYTES, GIB

pytestmark = pytest.mark.runtime("kvcached")

ROOT = Path(__file__).resolve().parents[3]
BUDGET_LINE = re.compile(r"^adds up: budget (?P<budget>[\d.]+) = (?P<parts>.*?) \+ free (?P<free>[\d.]+)"
                         r"(?: - (?P<twice>[\d.]+) charged twice)? GiB$")


def _budget_lines(stdout: str) -> list[str]:
    """Each frame's budget line, joined again where it wrapped."""
    lines, current = [], None
    for line in stdout.splitlines():
        if line.startswith(("adds up: budget", "DOES NOT ADD UP")):
            current = line
        elif current is not None and line.startswith("    ") and "GiB" not in current:
            current += " " + line.strip()
        else:
            if current is not None:
                lines.append(current)
            current = None
    return lines


def test_make_demo_shows_the_mission_and_every_frame_adds_up():
    env = python_env()
    env.pop("PYTHONPATH", None)  # kvcached only where make demo points
    env.pop("KVCACHED_BROKER_DEMO", None)
    env[kvcached_sim.PATH_ENV] = str(ROOT / kvcached_sim.OVERLAY)
    executable = Path(sys.executable).parent / "kvcached-broker"
    command = [str(executable)] if executable.exists() else [sys.executable, "-m", "kvcached_broker.broker.cli"]

    out = subprocess.run([*command, "demo", "--seconds", "1"], capture_output=True, text=True, env=env,
                         timeout=300)

    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    assert out.stderr == "", out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert re.fullmatch(r"demo OK, \d+ frames checked: budget = charges \+ free, use <= charge, "
                        r"mapped <= grant, DSV4 static", lines[-1]), lines[-5:]
    assert max(map(len, lines)) <= 100
    assert "three co-located workers" not in out.stdout and "CHECK FAILED" not in out.stdout

    budgets = _budget_lines(out.stdout)
    assert len(budgets) >= 3, out.stdout[-3000:]
    for line in budgets:
        match = BUDGET_LINE.match(line)
        assert match, line
        charges = [float(part.rsplit(" ", 1)[1]) for part in match["parts"].split(" + ")]
        assert len(charges) == 3, line
        twice = float(match["twice"] or 0)
        # each figure is rounded to 0.1 GiB (0.01 for what is charged twice)
        assert abs(sum(charges) + float(match["free"]) - twice - float(match["budget"])) <= 0.05 * 4 + 0.005, line

    for phase in ("sizing", "warming", "serving"):
        assert f"dsv4-flash is {phase}:" in out.stdout
    for pool in POOLS:
        assert re.search(rf"^  {pool} +[\d.]+ GiB \|", out.stdout, re.M), pool
    assert re.search(r"pressure: the broker asks llama-a for .* back", out.stdout)
    burst = B_BURST_BYTES // GIB
    assert f"llama-b asked for {burst} GiB and holds {burst}.0 GiB" in out.stdout  # the burst ran to its end
