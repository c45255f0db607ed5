"""Patching a runtime as it is imported: version gates (adapters/versions.py), the import hook
(adapters/import_hook.py) and patches (adapters/patching.py), on a fake runtime package."""

from __future__ import annotations

import sys

import pytest

from kvcached_broker.adapters import import_hook
from kvcached_broker.adapters.import_hook import when_imported
from kvcached_broker.adapters.patching import Patch, PatchError, apply_patch
from kvcached_broker.adapters.versions import in_range, parse


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



@pytest.mark.parametrize("error", [RuntimeError("upstream changed"), ValueError("bad"), AssertionError("x"),
                                   NotImplementedError("y"), IndexError(3)])
def test_any_error_from_a_patch_is_a_failed_patch_never_a_broken_import(fake_runtime, monkeypatch, error):
    """A patch function may meet anything in a release it was not written for: whatever it raises,
    the runtime's import goes on (the patch is ``failed``, logged); only KVCACHED_REQUIRE stops it."""
    def broken(m):
        raise error

    monkeypatch.setitem(import_hook.watched(), fake_runtime, [])  # this test's hook only, gone after it
    when_imported(fake_runtime, lambda mod: apply_patch(_patch(fake_runtime, apply=broken), mod))
    import importlib

    mod = importlib.import_module(fake_runtime)  # the import survives the broken patch
    assert mod.f() == "original" and not getattr(mod, "__kvcached_broker_patched_fake_f__", False)
    result = apply_patch(_patch(fake_runtime, apply=broken), mod)
    assert result.outcome == "failed" and result.reason.startswith(type(error).__name__)
    monkeypatch.setenv("KVCACHED_REQUIRE", "1")
    with pytest.raises(PatchError, match=type(error).__name__):
        apply_patch(_patch(fake_runtime, apply=broken), mod)


def test_wrap_once_wraps_a_function_once_and_keeps_its_name():
    from kvcached_broker.adapters.patching import WRAPPED, wrap_once

    def original(x):
        """doc"""
        return x

    def wrap(fn):
        def original(x):
            return fn(x) + 1
        return wrap_once(fn, original)

    once = wrap(original)
    twice = wrap(once)
    assert twice is once and once(1) == 2 and getattr(once, WRAPPED) and once.__doc__ == "doc"


def test_wrap_methods_refuses_a_class_that_only_inherits_the_method():
    import types

    from kvcached_broker.adapters.patching import PatchError, wrap_methods

    class Base:
        def run(self):
            return "base"

    class Child(Base):
        pass

    module = types.ModuleType("runtime.fake")
    module.Child, module.Base = Child, Base
    with pytest.raises(PatchError, match=r"runtime.fake.Child lacks run"):
        wrap_methods(module, "Child", {"run": lambda original: original})
    with pytest.raises(PatchError, match=r"runtime.fake has no Missing"):
        wrap_methods(module, "Missing", {"run": lambda original: original})
    assert Base().run() == "base"
