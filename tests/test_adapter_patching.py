"""What every adapter stands on: flags, version gates, the import hook, patches, the worker's
broker session, and the elastic page budget."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached_broker.adapters import flags, worker
from kvcached_broker.adapters.elastic import ElasticBudget
from kvcached_broker.adapters.import_hook import when_imported
from kvcached_broker.adapters.patching import Patch, PatchError, apply_patch
from kvcached_broker.adapters.versions import in_range, parse
from kvcached_broker.client import BrokerClient, BudgetExceeded

from helpers import GIB, MIB

ROOT = Path(__file__).resolve().parents[1]


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


def test_version_ranges():
    assert parse("0.5.13.post1") > parse("0.5.13") > parse("0.5.13rc1")
    assert parse("0.5.23") > parse("0.5.13.post1")
    assert in_range("0.5.13.post1", "0.5.12", "0.6") and not in_range("0.5.11", "0.5.12")
    assert in_range("0.33.0", "0.30", None) and not in_range("0.6.0", None, "0.6")


@pytest.fixture
def fake_runtime(tmp_path, monkeypatch):
    pkg = tmp_path / "fakeruntime"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "target.py").write_text("VALUE = 1\ndef f():\n    return 'original'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fakeruntime.sub.target"
    for name in [m for m in sys.modules if m.startswith("fakeruntime")]:
        del sys.modules[name]


def test_import_hook_runs_after_the_module_body(fake_runtime):
    seen = []
    when_imported(fake_runtime, lambda m: seen.append(m.VALUE))
    assert seen == []
    import importlib

    importlib.import_module(fake_runtime)
    assert seen == [1]
    when_imported(fake_runtime, lambda m: seen.append("late"))  # already imported: runs now
    assert seen == [1, "late"]


def _patch(module, minimum=None, below=None, apply=None):
    def default(mod):
        mod.f = lambda: "patched"

    return Patch(name="fake_f", distribution="pytest", module=module, apply=apply or default,
                 minimum=minimum, below=below)


def test_patch_is_idempotent_and_version_gated(fake_runtime, monkeypatch):
    import importlib

    mod = importlib.import_module(fake_runtime)
    assert apply_patch(_patch(fake_runtime, below="1"), mod).outcome == "skipped"  # pytest is >= 1
    assert mod.f() == "original"
    assert apply_patch(_patch(fake_runtime, minimum="1"), mod).outcome == "applied"
    assert mod.f() == "patched"
    assert apply_patch(_patch(fake_runtime, minimum="1"), mod).outcome == "already"


def test_patch_failures_raise_only_under_require(fake_runtime, monkeypatch):
    import importlib

    mod = importlib.import_module(fake_runtime)

    def broken(m):
        raise AttributeError("no such class")

    assert apply_patch(_patch(fake_runtime, apply=broken), mod).outcome == "failed"
    monkeypatch.setenv("KVCACHED_REQUIRE", "1")
    with pytest.raises(PatchError, match="no such class"):
        apply_patch(_patch(fake_runtime, apply=broken), mod)


def test_kv_pool_bridge_flag_is_refused_clearly(monkeypatch):
    from kvcached_broker.adapters import autopatch

    monkeypatch.setenv("KVCACHED_SGLANG_DSV4_KV_POOL_BRIDGE", "1")
    with pytest.raises(PatchError, match="future work"):
        autopatch.apply(["sglang"])


@pytest.mark.parametrize("editable", [False, True])
def test_the_pth_startup_hook_is_installed_by_regular_and_editable_installs(tmp_path, editable):
    """kvcached's .pth silently vanished from editable installs (#470); ours must not."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(py)] if _pip_has_python_option() else None
    if pip is None:
        pytest.skip("this pip cannot install into another interpreter")
    args = ["install", "--quiet", "--no-deps"] + (["-e"] if editable else []) + [str(ROOT)]
    out = subprocess.run(pip + args, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    code = "import kvcached_broker.adapters.autopatch as a; print(a.hook_installed())"
    env = {**os.environ, "ENABLE_KVCACHED": "1"}
    env.pop("PYTHONPATH", None)
    shown = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert shown.stdout.strip() == "True", shown.stderr
    env["ENABLE_KVCACHED"] = "0"
    shown = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert shown.stdout.strip() == "False"  # flags off: the hook does nothing, not even import us


def _pip_has_python_option() -> bool:
    out = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    major, minor = (int(x) for x in out.stdout.split()[1].split(".")[:2])
    return (major, minor) >= (22, 3)


# ----------------------------------------------------------------------------- worker session
@pytest.fixture
def adapter_broker(inproc_factory):
    b = inproc_factory(total_bytes=10 * GIB)
    worker.reset()
    worker.client_factory = lambda ident: BrokerClient.connect(
        ident.instance_name(), endpoint=b.endpoint, tp_rank=ident.tp_rank, tp_size=ident.tp_size,
        page_bytes=ident.page_bytes, credit_pages=0,
    )
    yield b
    worker.reset()
    worker.client_factory = None


def test_reporters_merge_into_one_reservation_map(adapter_broker):
    ident = worker.WorkerIdentity("sglang", 0, instance="merge")
    worker.report(ident, "dsv4", {"swa_kv_pool": GIB, "c4_kv_pool": 512 * MIB})
    worker.report(ident, "kv_static", {"kv_static": 2 * GIB})
    worker.report(ident, "dsv4", {"swa_kv_pool": 2 * GIB, "c4_kv_pool": 0})  # rebuilt: replaces its own entry
    (inst,) = adapter_broker.status()["instances"]
    assert inst["pools"] == {"swa_kv_pool": 2 * GIB, "kv_static": 2 * GIB}
    with pytest.raises(BudgetExceeded):
        worker.report(ident, "kv_static", {"kv_static": 9 * GIB})
    worker.forget(ident, "dsv4")
    assert adapter_broker.status()["instances"][0]["pools"] == {"kv_static": 2 * GIB}


def test_unreachable_broker_is_a_warning_or_under_require_an_error(monkeypatch, short_tmp):
    worker.reset()
    monkeypatch.setenv("KVCACHED_BROKER", f"ipc://{short_tmp}/none{{device}}.sock")
    monkeypatch.setenv("KVCACHED_BROKER_TIMEOUT_S", "0.3")
    ident = worker.WorkerIdentity("sglang", 0, instance="lonely")
    assert worker.session(ident) is None
    worker.reset()
    monkeypatch.setenv("KVCACHED_REQUIRE", "1")
    with pytest.raises(worker.BrokerRequired, match="KVCACHED_REQUIRE=1"):
        worker.session(ident)
    worker.reset()


def test_elastic_budget_grows_in_batches_refuses_and_trims_with_hysteresis(adapter_broker):
    client = BrokerClient.connect("elastic", endpoint=adapter_broker.endpoint, page_bytes=GIB, credit_pages=0)
    budget = ElasticBudget(client, physical_pages=20, batch_pages=2)
    assert budget.ensure(3) and budget.granted_pages == 5
    assert budget.ensure(5) and budget.granted_pages == 5  # no round trip
    assert budget.ensure(10) and budget.granted_pages == 10  # 12 would not fit on 10 GiB: floor only
    assert not budget.ensure(11) and budget.refusals == 1
    assert budget.trim(used_pages=8) == 0  # within slack: keep
    assert budget.trim(used_pages=3) == 5 and budget.granted_pages == 5
    budget.close()
    assert adapter_broker.status()["granted_bytes"] == 0
    client.close()


def test_elastic_budget_agrees_across_tp_ranks(adapter_broker):
    client = BrokerClient.connect("elastic-tp", endpoint=adapter_broker.endpoint, page_bytes=GIB, credit_pages=0)
    budget = ElasticBudget(client, physical_pages=20, batch_pages=4, reduce_min=lambda v: min(v, 3))
    assert budget.ensure(2) and budget.granted_pages == 3  # another rank got only 3
    assert adapter_broker.ledger.sessions[client.session_id].granted_pages == 3
    client.close()


def test_tensor_storage_is_counted_once():
    torch = pytest.importorskip("torch")
    from kvcached_broker.adapters.tensors import storage_bytes

    base = torch.zeros(1024, dtype=torch.float32)
    view = base[:10]
    other = torch.zeros(10, dtype=torch.int8)
    assert storage_bytes([base, view, {"x": other, "y": None}, (base,)]) == 4096 + 10
