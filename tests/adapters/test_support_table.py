"""The table of supported releases (adapters/support.py) and everything that must agree with it.

Adding a release is a change to the table and to the pins; this file fails until the scripts'
pins, the upstream manifest, the kvcached fetch, the extra in pyproject.toml and the READMEs'
support tables say the same.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached_broker.adapters import support
from kvcached_broker.adapters.kvcached import patches as kvcached_patches
from kvcached_broker.adapters.sglang import patches as sglang_patches
from kvcached_broker.adapters.vllm import patches as vllm_patches
from kvcached_broker.adapters.versions import parse

ROOT = Path(__file__).resolve().parents[2]
ENVS_SCRIPT = (ROOT / "scripts" / "adapter-envs.sh").read_text()
PATCHES = {"sglang": sglang_patches, "vllm": vllm_patches, "kvcached": kvcached_patches}


def _pins() -> dict[str, list[str]]:
    """``PINS_<name>`` blocks of scripts/adapter-envs.sh: overlay-ish name -> its pins."""
    return {name: [line for line in body.splitlines() if line.strip()]
            for name, body in re.findall(r'^PINS_(\w+)="\n(.*?)"$', ENVS_SCRIPT, re.S | re.M)}


def _var(overlay: str) -> str:
    return re.sub(r"[.-]", "_", overlay)


def test_every_overlay_has_its_pins_and_every_pin_list_an_overlay():
    pins = _pins()
    serving = [o for o in support.overlays() if o.runtime in support.SERVING]
    for overlay in serving:
        assert _var(overlay.name) in pins, f"scripts/adapter-envs.sh has no PINS_{_var(overlay.name)}"
        assert pins[_var(overlay.name)][0] == f"{overlay.runtime}=={overlay.version}", overlay.name
    assert set(pins) - {"common"} == {_var(o.name) for o in serving}


def test_the_scripts_read_the_overlays_from_the_table():
    def ask(*args: str) -> str:
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / "support.py"), *args], capture_output=True,
                             text=True, check=True)
        return out.stdout.strip()

    assert ask("overlays").split() == [o.name for o in support.overlays() if o.runtime in support.SERVING]
    assert ask("test-overlays").split() == support.test_overlays()
    assert ask("newest-overlays").split() == support.newest_overlays()
    assert ask("matrix-overlays").split() == support.matrix_overlays()
    assert ask("newest-serving").split() == support.newest_serving_overlays()
    assert set(support.newest_serving_overlays()) == set(ask("newest-overlays").split()) & set(ask("overlays").split())
    assert ask("kvcached-overlay") == support.KVCACHED.overlays[0].name
    assert ask("range", "vllm") == str(support.VLLM.supported)
    for name in [o.name for o in support.overlays()] + support.kvcached_mode_overlays():
        for path in ask("suite", name).split():
            assert (ROOT / path).exists(), f"{name}'s suite names {path}, which is not there"
    failed = subprocess.run([sys.executable, str(ROOT / "scripts" / "support.py"), "suite", "vllm-0.0.1"],
                            capture_output=True, text=True)
    assert failed.returncode == 2 and failed.stderr.count("\n") == 1 and "vllm-0.0.1" in failed.stderr


def test_the_kvcached_fetch_and_extra_are_the_tables():
    (overlay,) = support.KVCACHED.overlays
    assert re.search(rf'^VERSION = "{re.escape(overlay.version)}"$', (ROOT / "scripts" / "fetch-kvcached.py").read_text(),
                     re.M)
    extra = re.search(r'^kvcached = \["kvcached(.*?)"\]$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert extra and extra.group(1) == str(support.KVCACHED.supported)


def test_every_upstream_pin_has_tests_in_the_manifest_and_every_manifest_overlay_a_source():
    manifest = (ROOT / "tests" / "adapters" / "upstream" / "MANIFEST.tsv").read_text().splitlines()
    rows = [line.split("\t") for line in manifest if line.strip() and not line.startswith("#")]
    github = {row[1] for row in rows if row[0] == "source"}
    pinned = {o.name for o in support.overlays() if o.upstream is not None}
    for name in pinned:
        assert any(row[0] == "test" and row[1] == name for row in rows), f"{name} has an upstream pin but no tests"
        assert re.fullmatch(r"[0-9a-f]{64}", support.find_overlay(name).upstream.sha256)
    assert {row[1] for row in rows} <= pinned | github
    assert not any(row[0] == "source" and row[2] == "index" for row in rows)  # those are the table's


def test_the_patches_gate_on_the_table():
    for name, module in PATCHES.items():
        runtime = support.runtime(name)
        for patch in getattr(module, "ALL_PATCHES", module.PATCHES):
            assert patch.distribution == name
            assert patch.minimum is not None and patch.below is not None
            assert runtime.supported.minimum <= patch.minimum or patch.since is not None, patch.name
            if patch.until is None:
                assert patch.below == runtime.supported.below, patch.name
            for gate in (patch.since, patch.until):
                assert gate is None or gate in runtime.gates.values(), f"{patch.name}: {gate} is not a gate of the table"
    for overlay in support.overlays():
        if overlay.runtime in support.SERVING:
            assert support.runtime(overlay.runtime).supports(overlay.version), f"{overlay.name} is outside the range"
            assert PATCHES[overlay.runtime].patches_for(overlay.version)


def test_vllms_kvcached_mode_is_tested_at_the_lowest_and_highest_release_it_covers():
    """kvcached mode's range lies inside the supported one; its overlays are runtime overlays
    inside it, among them its first release and the newest tested release it covers (kvcached
    0.1.6 has two vLLM layouts: its V1 runner's and Model Runner V2's)."""
    runtime = support.VLLM
    mode = runtime.kvcached_mode
    assert mode is not None and runtime.kvcached_overlays
    assert runtime.supports(mode.minimum) and parse(mode.below) <= parse(runtime.supported.below)
    covered = [v for v in runtime.tested() if v in mode]
    assert all(v in covered for v in runtime.kvcached_overlays), runtime.kvcached_overlays
    assert mode.minimum in runtime.kvcached_overlays
    assert max(covered, key=parse) in runtime.kvcached_overlays
    assert set(runtime.kvcached_suites) <= set(runtime.kvcached_overlays)


def _readme_rows(text: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for line in text.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip().strip("|").split("|")]]}


def test_the_readme_support_table_is_the_tables():
    rows = _readme_rows((ROOT / "README.md").read_text())
    for runtime in (support.SGLANG, support.VLLM):
        row = rows.get(runtime.label)
        assert row is not None, f"README.md's support table has no {runtime.label} row"
        supported, tested, kvcached_mode = row[0], row[1], row[2]
        assert supported == f"`{runtime.supported}`", runtime.label
        assert tested == ", ".join(runtime.tested()), runtime.label
        assert kvcached_mode == f"`{runtime.kvcached_mode}`: {', '.join(runtime.kvcached_overlays)}", runtime.label
    assert f"kvcached (`{support.KVCACHED.supported}`" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("runtime", [support.SGLANG, support.VLLM])
def test_each_adapter_readme_states_the_tables_range_and_releases(runtime):
    text = (ROOT / "adapters" / runtime.name / "README.md").read_text()
    stated = re.search(rf"\*\*Supported {runtime.label}: `([^`]+)`\*\*, tested on (.*?)\s+against", text, re.S)
    assert stated, f"adapters/{runtime.name}/README.md does not state its supported range"
    assert stated.group(1) == str(runtime.supported)
    assert re.split(r",\s*|\s+and\s+", stated.group(2).strip()) == runtime.tested()


def test_each_row_lists_its_releases_oldest_first_so_make_test_runs_the_newest():
    """``make test`` runs each runtime's last overlay only (``newest_overlays``): that must be its
    newest release, inside the supported range; ``make test-matrix`` runs the rest."""
    for row in support.RUNTIMES.values():
        versions = [o.version for o in row.overlays]
        assert versions == sorted(versions, key=parse), f"{row.name}'s overlays are not oldest first"
        assert row.supports(versions[-1])
    assert support.newest_overlays() == [row.overlays[-1].name for row in support.RUNTIMES.values()]
    both = support.newest_overlays() + support.matrix_overlays()
    assert sorted(both) == sorted(support.test_overlays())  # together, each overlay once
