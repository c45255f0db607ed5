"""The GPU check (scripts/gpu-check): its simulated run, its parts' checks, its carried files.

The simulated run is the command CI runs: every part, on the simulated device, as real
processes (brokers, workers, kvcached pools) over real sockets.  The GPU side that needs no GPU
is tested too: the ctypes calls of the VMM part against a stand-in libcuda built here, a part
that fails or outlives its limit, and the carried files' manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import GIB, MIB, wait_for

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check"
sys.path.insert(0, str(ROOT / "scripts"))
import gpucheck_carried as carried  # noqa: E402

from kvcached_broker.tools.gpu_check import parts as parts_mod  # noqa: E402
from kvcached_broker.tools.gpu_check import report, runner  # noqa: E402
from kvcached_broker.tools.gpu_check.record import STATUSES  # noqa: E402


def run_script(*args: str, env: dict | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout_s,
                          env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def simulated():
    """One ``scripts/gpu-check --simulate`` run: (exit status, its JSON, its output folder)."""
    out = Path(tempfile.mkdtemp(prefix="kb-gc-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "KVCACHED_BROKER")}
    done = run_script("--simulate", "--out", str(out), env=env)
    doc = json.loads((out / "gpu-check.json").read_text()) if (out / "gpu-check.json").exists() else None
    yield done, doc, out
    shutil.rmtree(out, ignore_errors=True)


def part(doc: dict, name: str) -> dict:
    found = doc["parts"][name]
    assert found["status"] != "error", found.get("why")
    return found


def failed_checks(p: dict) -> list[dict]:
    return [c for c in p["checks"] if not c["ok"]]


# ----------------------------------------------------------------------------- the simulated run
def test_the_simulated_run_passes_and_writes_the_json_the_summary_and_the_logs(simulated):
    done, doc, out = simulated
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert doc["schema"] == report.SCHEMA and doc["mode"] == "simulate" and doc["ok"] is True
    assert list(doc["parts"]) == [p.name for p in parts_mod.registered()]
    for name, p in doc["parts"].items():
        assert p["status"] in STATUSES, name
        assert set(p) >= {"title", "status", "why", "wall_s", "limit_s", "figures", "assumed", "checks", "notes"}
        assert all(set(c) == {"name", "ok", "detail"} for c in p["checks"]), name
        assert 0 < p["limit_s"] <= doc["budget_s"]
    assert doc["wall_s"] < doc["budget_s"]
    text = (out / "gpu-check.txt").read_text()
    assert text.startswith("kvcached-broker GPU check: simulate run") and "[ok] broker_nvml" in text
    assert "no GPU run to compare with" in text  # none is kept in docs/gpu-check yet
    assert (out / "gpu-check-logs.tar.gz").stat().st_size > 0


def test_on_the_simulated_device_the_broker_measures_charges_and_counts_as_the_device_does(simulated):
    p = part(simulated[1], "broker_nvml")
    assert p["status"] == "ok", failed_checks(p)
    f = p["figures"]
    assert f["a_broker_measured_bytes"] == f["a_device_bytes"] == 1 * GIB
    assert f["b_broker_measured_bytes"] == f["b_device_bytes"] == 2 * GIB
    assert f["broker_external_bytes"] == f["quiet_device_bytes"] == 3 * GIB  # the process that reports nothing
    assert f["a_unreported_bytes"] == f["a_unreported_after_pin_bytes"] == 0
    # The simulated device shows an allocation at the first read; the broker's view trails by its probe.
    assert f["nvml_alloc_process_reads_max"] == f["nvml_free_process_reads_max"] == 1
    assert f["broker_alloc_seen_missing"] == 0
    assert {c["name"] for c in p["checks"]} >= {"the simulated device gives a_overhead_bytes as the check assumes"}


def test_the_simulated_device_charges_a_process_for_nothing_but_its_allocations(simulated):
    p = part(simulated[1], "process_cost")
    assert p["status"] == "ok", failed_checks(p)
    f = p["figures"]
    assert f["context_bytes"] == f["matmul_bytes"] == f["nccl_bytes"] == f["after_free_bytes"] == 0
    assert f["first_alloc_device_bytes"] == 1 and f["alloc_1gib_bytes"] == GIB
    assert p["assumed"]["context_bytes"] == 0  # what a GPU run is compared against


def test_a_full_simulated_device_refuses_the_page_after_the_room_left(simulated):
    p = part(simulated[1], "vmm_pages")
    assert p["status"] == "ok", failed_checks(p)
    f = p["figures"]
    assert f["oom_pages_created"] == 256 * MIB // (2 * MIB)  # the room left beside the ballast, then nothing
    assert "out of memory" in f["oom_error"]
    assert f["create_per_page_p50_s"] is not None and f["map_per_page_p50_s"] is None  # mapping is not modelled


def test_two_kvcached_pools_hand_over_with_mapped_within_granted_at_every_sample(simulated):
    p = simulated[1]["parts"]["kvcached_pools"]
    if p["status"] == "skipped":
        pytest.skip(f"kvcached pools not runnable here: {p['why']}")
    assert p["status"] == "ok", (p.get("why"), failed_checks(p))
    f = p["figures"]
    assert f["samples"] >= 20 and f["sampler_errors"] == 0
    assert f["device_excess_samples"] == 0  # exact on the simulated device: read under its allocation lock
    assert f["peak_mapped_bytes"] >= f["a_fill_bytes"]  # the samples saw A full
    assert f["trials"] >= 1 and f["trials_complete"] == f["trials"]
    assert f["a_unmapped_bytes_p50"] > 0  # A gave B pages through the broker
    for i in range(1, f["trials"] + 1):
        assert f[f"trial{i}_b_held_bytes"] > f[f"trial{i}_free_before_bytes"]  # more than was free once A filled: A's room
        if f[f"trial{i}_handover_s"] is None:
            continue  # B's asks all fitted at once (the broker freed A's cache ahead of them), or
            # the one that did not was ahead of need and B finished within what it held
        # The hand-over's time, split: B's grants after its first ask that did not fit, B's
        # allocations, A's releases.
        assert f[f"trial{i}_b_acquire_calls"] >= 1 and f[f"trial{i}_b_alloc_calls"] >= 1
        assert (f[f"trial{i}_b_acquire_s"] + f[f"trial{i}_b_alloc_s"] + f[f"trial{i}_b_waiting_s"]
                >= f[f"trial{i}_handover_s"] - 1e-6)
    assert (f["handover_p50_s"] is None) == (f["handovers"] == 0)
    names = {c["name"]: c["ok"] for c in p["checks"]}
    assert names["mapped <= granted at every sample (kvcached's count)"] is True
    pages = simulated[1]["parts"]["vmm_pages"]["figures"]
    derived = simulated[1]["derived"]  # the hand-over against the per-page cost of the pages it moved
    assert derived["handover_pages_moved"] == f["a_unmapped_bytes_p50"] // pages["page_bytes"]
    assert derived["handover_floor_s"] > 0


def test_a_pools_trial_whose_burst_fitted_in_free_memory_says_which_side_missed():
    from kvcached_broker.tools.gpu_check.part_pools import missed_set_up, took_a_room

    trial = {"b_held_bytes": 8 * GIB, "free_before_bytes": 8 * GIB, "a_filled_bytes": 17 * GIB // 2,
             "a_charged_before_bytes": 9 * GIB, "b_charged_before_bytes": None}
    assert not took_a_room(trial)  # all of B's burst was free: no hand-over was measured
    assert took_a_room({**trial, "free_before_bytes": 8 * GIB - 1})
    assert missed_set_up(trial) == ("B's burst (8.00 GiB) fitted in what was free once A filled (8.00 GiB; "
                                    "A filled 8.50 GiB, charged A 9.00 GiB, B ?, B granted ?)")


def test_the_co_located_start_serves_every_server_without_an_out_of_memory_error(simulated):
    p = simulated[1]["parts"]["colocated_start"]
    assert p["status"] == "ok", p
    f = p["figures"]
    assert f["crashed_servers"] == 0 and f["uncovered_samples"] == 0 and f["over_total_samples"] == 0
    assert f["samples"] >= 3 and f["overcommitted_at_end"] is False
    assert all(f[f"{name}_event"] == "serving" for name in ("sglang-dsv4", "vllm-qwen", "sglang-llama"))
    checks = {c["name"]: c["ok"] for c in p["checks"]}
    assert checks["every_serving_process_covered_at_every_sample"] and checks["no_server_met_out_of_memory"]


# ----------------------------------------------------------------------------- the runner
def test_a_part_that_cannot_run_is_an_error_and_the_next_part_still_runs(tmp_path):
    args = runner.parse_args(["--mode", "simulate", "--out", str(tmp_path / "out"), "--budget-s", "120"])
    run = runner.Run(args)
    bogus = parts_mod.Part("no_such_part", "a part its process cannot find", 30.0, lambda ctx: None)
    try:
        doc = run.execute([bogus, parts_mod.by_name(["vmm_pages"])[0]])
    finally:
        run.close()
    assert doc["parts"]["no_such_part"]["status"] == "error"
    assert "unknown part" in doc["parts"]["no_such_part"]["log_tail"]
    assert doc["parts"]["vmm_pages"]["status"] in ("ok", "skipped")
    assert doc["ok"] is False


def test_a_part_past_its_limit_is_stopped(tmp_path):
    assert runner.run_limited(["sleep", "600"], tmp_path / "part.log", limit_s=1.0) is True


def test_what_a_part_leaves_running_is_stopped_with_it(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess; p = subprocess.Popen(['sleep', '600']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid))")  # then exits, leaving its child behind
    assert runner.run_limited([sys.executable, "-c", script], tmp_path / "part.log", limit_s=60.0) is False
    wait_for(lambda: not _running(int(pid_file.read_text())), what="the part's child to be stopped too")


def test_with_too_little_budget_left_a_part_is_skipped_not_started(tmp_path):
    args = runner.parse_args(["--mode", "simulate", "--out", str(tmp_path), "--budget-s", "12"])
    run = runner.Run(args)
    try:
        doc = run.execute(parts_mod.by_name(["broker_nvml"]))
    finally:
        run.close()
    assert doc["parts"]["broker_nvml"]["status"] == "skipped"
    assert doc["parts"]["broker_nvml"]["why"].startswith("out of time")


def test_an_unknown_part_name_is_one_line(tmp_path):
    done = run_script("--simulate", "--only", "broker_nvml,nope", "--out", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "unknown part(s) nope" in done.stderr


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


# ----------------------------------------------------------------------------- the comparison
def synthetic_gpu_run(tmp_path: Path) -> Path:
    """A made-up GPU run's JSON (no figure here was measured: only its shape matters)."""
    doc = {"schema": report.SCHEMA, "mode": "gpu", "parts": {"process_cost": {"figures": {
        "context_bytes": 1000, "context_s": 2.0, "first_alloc_device_bytes": 4, "cuda_name": "x"}}}}
    path = tmp_path / "2099-01-01-gpu.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_simulated_run_is_compared_figure_by_figure_with_a_gpu_run(tmp_path):
    reference = report.load_reference(synthetic_gpu_run(tmp_path))
    here = {"process_cost": {"figures": {"context_bytes": 0, "context_s": 1.0, "first_alloc_device_bytes": 1,
                                         "cuda_name": "y", "only_here_bytes": 5}}}
    rows = {r["key"]: r for r in report.compare(here, reference)}
    assert set(rows) == {"context_bytes", "context_s", "first_alloc_device_bytes"}  # numbers present in both
    assert rows["context_s"]["ratio"] == 0.5 and rows["first_alloc_device_bytes"]["ratio"] == 0.25
    assert report.newest_reference(tmp_path) == tmp_path / "2099-01-01-gpu.json"


def test_only_a_gpu_run_is_taken_as_the_reference(tmp_path):
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({"schema": report.SCHEMA, "mode": "simulate", "parts": {}}))
    with pytest.raises(ValueError, match="not a GPU run"):
        report.load_reference(path)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        report.load_reference(tmp_path / "bad.json")


def test_where_a_gpu_figure_is_not_the_assumption_it_is_listed():
    parts = {"process_cost": {"figures": {"context_bytes": 500, "nccl_bytes": 0}, "assumed": {"context_bytes": 0, "nccl_bytes": 0}}}
    assert report.differences(parts) == [{"part": "process_cost", "key": "context_bytes", "measured": 500, "assumed": 0}]


# ----------------------------------------------------------------------------- the VMM calls (ctypes)
@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory):
    """tests/tools/gpu_check_fake_libcuda.c built here: the driver calls' signatures, checked, on no GPU."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in libcuda")
    lib = tmp_path_factory.mktemp("libcuda") / "libcuda-fake.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(lib), str(Path(__file__).with_name("gpu_check_fake_libcuda.c"))],
                   check=True, capture_output=True)
    return str(lib)


def test_pages_are_created_mapped_and_given_back_through_the_driver_calls(fake_libcuda):
    from kvcached_broker.tools.gpu_check.part_pages import MAP_OPS, UNMAP_OPS, GpuPages

    pages = GpuPages(fake_libcuda)
    try:
        assert pages.page_bytes == pages.granularity == 2 * MIB
        times = {op: [] for op in (*MAP_OPS, *UNMAP_OPS)}
        pages.round(16, times)
        assert all(len(v) == 16 for v in times.values())
        assert pages.driver.mem_get_info()[0] == GIB  # everything given back
        full = pages.fill_until_refused()
    finally:
        pages.close()
    assert full["oom_error"] == "CUDA_ERROR_OUT_OF_MEMORY" and full["oom_error_is_out_of_memory"] is True
    assert full["oom_pages_created"] == 128  # the 256 MiB left beside the ballast
    assert full["oom_ballast_bytes"] == GIB - 256 * MIB


def test_a_refused_driver_call_names_the_call_and_the_error(fake_libcuda):
    from kvcached_broker.tools.gpu_check.vmm import CudaError, Driver

    driver = Driver(fake_libcuda)
    with pytest.raises(CudaError, match=r"cuMemCreate: CUDA_ERROR_INVALID_VALUE \(1\)"):
        driver.create(3 * MIB)  # not a multiple of the granularity


# ----------------------------------------------------------------------------- the carried files
def carried_folder(tmp_path: Path) -> Path:
    """A carried folder with a manifest whose files are all present and right."""
    folder = tmp_path / "carried"
    files = []
    for rel, role, data in (("wheels/pyzmq-0-cp312.whl", "wheel", b"z"), ("wheels/kvcached_broker-0.1.0-py3-none-any.whl",
                                                                           "project", b"p"),
                            ("sdist/kvcached-0.1.6.tar.gz", "sdist", b"k")):
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
        files.append({"path": rel, "role": role, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    (folder / carried.MANIFEST).write_text(json.dumps({"python": "3.12", "source_digest": "x", "files": files}))
    return folder


def test_a_complete_carried_folder_verifies(tmp_path):
    manifest = carried.verify(carried_folder(tmp_path))
    assert [p.name for p in manifest.path_of(tmp_path / "carried", "sdist")] == ["kvcached-0.1.6.tar.gz"]


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "wheels" / "pyzmq-0-cp312.whl").unlink(), "carried file missing: "),
    (lambda f: (f / "sdist" / "kvcached-0.1.6.tar.gz").write_bytes(b"K"), "carried file altered: "),
    (lambda f: (f / carried.MANIFEST).unlink(), "run scripts/gpu-check --prepare first"),
    (lambda f: (f / carried.MANIFEST).write_text('{"python": "3.12"}'), "is not a gpu-check manifest"),
])
def test_a_missing_or_altered_carried_file_is_a_one_line_error(tmp_path, damage, message):
    folder = carried_folder(tmp_path)
    damage(folder)
    with pytest.raises(carried.CarriedError, match=message.replace("(", r"\(")) as caught:
        carried.verify(folder)
    assert "\n" not in str(caught.value)


def test_the_command_stops_before_installing_anything_when_a_carried_file_is_missing(tmp_path):
    folder = carried_folder(tmp_path)
    (folder / "wheels" / "kvcached_broker-0.1.0-py3-none-any.whl").unlink()
    done = run_script("--carried", str(folder), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().startswith("gpu-check: carried file missing: ") and done.stderr.strip().count("\n") == 0
    assert not (tmp_path / "out").exists()


def test_wheels_for_another_python_are_refused_with_the_command_that_makes_the_right_ones(tmp_path):
    manifest = carried.verify(carried_folder(tmp_path))
    other = carried.Manifest("2.7", manifest.files, manifest.source_digest)
    with pytest.raises(carried.CarriedError, match=r"for CPython 2\.7, this is 3\.\d+: run .*--python-version 3\.\d+"):
        carried.check_python(other)


def test_the_source_digest_follows_the_sources_and_ignores_bytecode(tmp_path):
    root = tmp_path / "tree"
    for name in carried.SOURCES:
        path = root / name if "." in name else root / name / "mod.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x = 1\n")
    before = carried.source_digest(root)
    (root / "broker" / "__pycache__").mkdir()
    (root / "broker" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    assert carried.source_digest(root) == before
    (root / "broker" / "mod.py").write_text("x = 2\n")
    assert carried.source_digest(root) != before


# ----------------------------------------------------------------------------- kvcached's build (GPU runs)
def fake_kvcached_sdist(folder: Path, setup_fails: bool) -> Path:
    """An sdist named as kvcached 0.1.6's, whose ``kvcached._C`` is a plain module (or whose build fails)."""
    import tarfile

    src = folder / "src" / "kvcached-0.1.6"
    (src / "kvcached").mkdir(parents=True)
    (src / "kvcached" / "__init__.py").write_text("")
    (src / "kvcached" / "_C.py").write_text("BUILT = True\n")
    (src / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n'
                                        '[project]\nname = "kvcached"\nversion = "0.1.6"\n')
    (src / "setup.py").write_text("raise SystemExit('Unable to determine GPU backend')\n" if setup_fails
                                  else "from setuptools import setup\nsetup(packages=['kvcached'])\n")
    sdist = folder / "kvcached-0.1.6.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(src, arcname="kvcached-0.1.6")
    return sdist


def test_kvcached_is_built_from_its_sdist_without_the_network_and_checked_by_importing_its_extension(tmp_path):
    from kvcached_broker.tools.gpu_check.kvcached_build import KvcachedBuild

    build = KvcachedBuild(fake_kvcached_sdist(tmp_path, setup_fails=False), tmp_path / "site", tmp_path).start()
    result = build.wait(300)
    assert result.ok, result.log_tail[-2000:]
    assert (tmp_path / "site" / "kvcached" / "_C.py").exists() and result.why == ""


def test_a_failed_kvcached_build_is_one_line_with_the_log_kept(tmp_path):
    from kvcached_broker.tools.gpu_check.kvcached_build import KvcachedBuild

    result = KvcachedBuild(fake_kvcached_sdist(tmp_path, setup_fails=True), tmp_path / "site", tmp_path).start().wait(300)
    assert not result.ok and result.why == "pip install of kvcached-0.1.6.tar.gz exited with 1"
    assert "Unable to determine GPU backend" in result.log_tail


def test_the_link_finds_cuda_stubs_before_the_driver(tmp_path):
    from kvcached_broker.tools.gpu_check.kvcached_build import libcuda_link_dir

    stubs = tmp_path / "cuda" / "lib64" / "stubs"
    stubs.mkdir(parents=True)
    (stubs / "libcuda.so.1").write_bytes(b"")
    found = libcuda_link_dir(tmp_path / "work", tmp_path / "cuda")
    assert found is not None and (found / "libcuda.so").exists()  # a link to a libcuda.so.1 where only that exists
    (stubs / "libcuda.so").write_bytes(b"")
    assert libcuda_link_dir(tmp_path / "work", tmp_path / "cuda") == stubs
