"""The canary (scripts/canary.py, ``make canary``): each patch target looked up statically in a release.

The releases here are archives built from the overlays' installed trees (``.adapter-envs``): the
releases the suite runs against, which the canary must find compatible, and the same with a
target removed or its signature changed, which it must not.  Nothing is imported from them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from kvcached_broker.adapters import support

ROOT = Path(__file__).resolve().parents[1]
ENVS = ROOT / ".adapter-envs"
CANARY = ROOT / "scripts" / "canary.py"
NEWEST = {name: runtime.tested()[-1] for name, runtime in support.RUNTIMES.items()}


def _tree(name: str) -> Path:
    path = ENVS / f"{name}-{NEWEST[name]}"
    if not path.is_dir():
        if os.environ.get("KVCACHED_BROKER_TEST_RUNTIME"):
            pytest.fail(f"{path} is missing: run `make adapter-envs`")
        pytest.skip(f"the {path.name} overlay is not built (make adapter-envs)")
    return path


def _archive(name: str, version: str, out: Path, edits: dict[str, tuple[str, str]] | None = None) -> Path:
    """``name``'s package from its overlay as a wheel (kvcached: as its sdist), with ``edits``
    (path -> (old, new)) applied to the source."""
    tree, edits = _tree(name), edits or {}
    files = {str(p.relative_to(tree)): p for p in (tree / name).rglob("*.py")}
    if name == "kvcached":
        path = out / f"{name}-{version}.tar.gz"
        with tarfile.open(path, "w:gz") as archive:
            for relative, source in files.items():
                archive.add(source, arcname=f"{name}-{version}/{relative}")
        assert not edits
        return path
    path = out / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for relative, source in files.items():
            text = source.read_text(errors="replace")
            if relative in edits:
                old, new = edits.pop(relative)
                assert old in text, (relative, old)
                text = text.replace(old, new)
            archive.writestr(relative, text)
    assert not edits, f"no such files: {sorted(edits)}"
    return path


def _canary(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CANARY), *args], capture_output=True, text=True, timeout=300,
                          env=env)


def _rows(stdout: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in stdout.splitlines()[1:] if not line.startswith(" ")}


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("releases")
    for name in support.RUNTIMES:
        _archive(name, NEWEST[name], out)
    return out


def test_the_releases_the_suite_tests_have_every_target(releases):
    out = _canary("--archives", str(releases))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = _rows(out.stdout)
    for name in support.RUNTIMES:
        assert rows[name][1] == NEWEST[name] and rows[name][3] == "yes" and rows[name][-1] == "supported", out.stdout
        done, total = rows[name][4].split("/")
        assert done == total and int(total) > 0


def test_a_newer_release_that_lost_targets_is_named_with_what_it_lacks(releases, tmp_path):
    """A vLLM past the range whose Worker lost ``extend_kv_cache`` and whose cache's ``commit`` takes
    another parameter: the table says it is not covered and incompatible, each lost target on a
    line of its own; ``--report`` says the same and exits 0."""
    newer = f"{support.VLLM.supported.below}.1"
    for path in releases.iterdir():
        if not path.name.startswith("vllm-"):
            (tmp_path / path.name).symlink_to(path)
    _archive("vllm", newer, tmp_path, edits={
        "vllm/v1/worker/gpu_worker.py": ("    def extend_kv_cache(self, num_blocks: int)",
                                         "    def extend_kv_cache_now(self, num_blocks: int)"),
        "vllm/v1/worker/extensible_kv_cache.py": ("    def commit(\n        self, num_blocks: int,",
                                                  "    def commit(\n        self, blocks: int,"),
    })
    out = _canary("--archives", str(tmp_path))
    assert out.returncode == 1, out.stdout + out.stderr
    row = _rows(out.stdout)["vllm"]
    assert row[1] == newer and row[3] == "NO" and "INCOMPATIBLE:" in row
    lost = [line for line in out.stdout.splitlines() if line.startswith(f"  vllm {newer}:")]
    assert len(lost) == 2, out.stdout
    assert any("vllm_kv_extensible_final" in line and "Worker has no extend_kv_cache of its own" in line
               for line in lost)
    assert any("ExtensibleKVCache.commit(self, blocks" in line and "expected (self, num_blocks" in line for line in lost)
    assert _rows(out.stdout)["sglang"][-1] == "supported"
    reported = _canary("--report", "--archives", str(tmp_path))
    assert reported.returncode == 0 and reported.stdout == out.stdout


def test_an_unreachable_index_is_reported_and_never_fails_the_report(tmp_path):
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
           "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": ""}
    out = _canary("--report", "--dir", str(tmp_path / "canary"), env=env)
    assert out.returncode == 0, out.stderr
    rows = _rows(out.stdout)
    assert all("not checked:" in " ".join(rows[name]) for name in support.RUNTIMES), out.stdout
    assert _canary("--dir", str(tmp_path / "canary"), env=env).returncode == 1


def _checker(tmp_path: Path, files: dict[str, str]):
    sys.path.insert(0, str(CANARY.parent))
    try:
        import canary
    finally:
        sys.path.remove(str(CANARY.parent))
    path = tmp_path / "rt-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return canary.Checker({"rt": canary.Release("rt", "1.0", path)})


def test_the_static_lookup_follows_imports_and_refuses_inherited_methods(tmp_path):
    checker = _checker(tmp_path, {
        "rt/__init__.py": "",
        "rt/base.py": "class Base:\n    def run(self, level=1):\n        pass\n",
        "rt/worker.py": ("from .base import Base\nfrom rt.util import alloc as allocate\n"
                         "class Worker(Base):\n    def sleep(self, level: int = 1):\n        pass\n"),
        "rt/util.py": "def alloc(config, device, *rest):\n    return None\n",
        "rt/pkg/__init__.py": "from .impl import Pool\n",
        "rt/pkg/impl.py": "class Pool:\n    def free(self, ids):\n        pass\n",
    })
    assert checker.check("rt.worker", "Worker.sleep", ("self", "level")) == ""
    assert checker.check("rt.worker", "Worker.sleep", ("self", "tags")) == \
        "Worker.sleep(self, level): expected (self, tags, ...)"
    assert checker.check("rt.worker", "Worker.run", ("self",)) == "Worker has no run of its own (inherited)"
    assert checker.check("rt.worker", "allocate", ("config", "device")) == ""  # imported under another name
    assert checker.check("rt.pkg", "Pool.free", ("self", "ids")) == ""  # a package re-exporting its class
    assert checker.check("rt.worker", "Gone.run", ()) == "no class Gone"
    assert checker.check("rt.missing", "f", ()) == "module missing"
