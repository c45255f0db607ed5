"""The adapters have one contact with kvcached: adapters/kvcached/kvcached_api.py.

Every other module of ``adapters/`` (kvcached mode, and the SGLang and vLLM modules that serve
it) reaches kvcached through the public calls that module's docstring lists: none imports
kvcached, looks a kvcached module up in ``sys.modules`` or by name, or reads one of kvcached's
private names.  The check reads the source with :mod:`ast` (no kvcached needed), and a second
test proves it catches each kind of contact.  There is no exception: a patch table naming
``kvcached.integration.*.patches`` as the module it waits for is a string the import hook
matches, not a contact, and passes as it is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ADAPTERS = ROOT / "adapters"
CONTACT = ADAPTERS / "kvcached" / "kvcached_api.py"

#: kvcached's private names kvcached_api.py reads (its manager's and its integration modules').
PRIVATE = {"_post_init_done", "_memory_limit_revision", "_wait_post_init", "_is_worker", "_world_size",
           "_kvcached_device", "_kvcached_initialized", "_listeners", "_is_owned", "_release_save",
           "_acquire_restore"}


def _is_kvcached(module: str) -> bool:
    return module == "kvcached" or module.startswith("kvcached.")


def contacts(source: str) -> list[str]:
    """Each place ``source`` reaches kvcached other than through its public calls."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if _is_kvcached(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_kvcached(node.module or ""):
            found.append(f"{line}: from {node.module} import")
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE:
            found.append(f"{line}: .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "_lock" and not _is_self(node.value):
            found.append(f"{line}: another object's ._lock")  # the manager's lock (our own objects say self._lock)
        elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "modules"
              and _is_kvcached(_text(node.slice) or "")):
            found.append(f"{line}: looks up {_text(node.slice)!r}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in PRIVATE or node.value == "_lock":
                found.append(f"{line}: {node.value!r}")
        elif isinstance(node, ast.Call) and node.args:
            text = _text(node.args[0])
            if text is not None and _is_kvcached(text) and _looks_up_a_module(node.func):
                found.append(f"{line}: looks up {text!r}")
    return found


def _text(node: ast.expr) -> str | None:
    """A string constant, or an f-string's leading constant part."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return None


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _looks_up_a_module(func: ast.expr) -> bool:
    """``sys.modules.get(...)``, ``importlib.import_module(...)``, ``__import__(...)``."""
    if isinstance(func, ast.Name):
        return func.id == "__import__"
    return isinstance(func, ast.Attribute) and func.attr in ("get", "import_module", "__getitem__")


def test_only_kvcached_api_reaches_kvcached():
    offenders = {}
    for path in sorted(ADAPTERS.rglob("*.py")):
        if path == CONTACT:
            continue
        found = contacts(path.read_text())
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, f"kvcached reached outside kvcached_api.py: {offenders}"


def test_the_check_reads_every_runtime_folder():
    folders = {path.parent.name for path in ADAPTERS.rglob("*.py")}
    assert {"adapters", "kvcached", "broadcast", "sglang", "vllm"} <= folders


def test_the_contact_module_itself_is_what_the_check_would_catch():
    assert contacts(CONTACT.read_text()), "kvcached_api.py reaches kvcached: the check must see it"


@pytest.mark.parametrize("source", [
    "import kvcached.utils",
    "from kvcached.locks import NoOpLock",
    "done = manager._post_init_done.is_set()",
    "revision = getattr(manager, '_memory_limit_revision', -1)",
    "module = sys.modules.get('kvcached.tp_ipc_util')",
    "module = sys.modules.get(f'kvcached.integration.{runtime}.interfaces')",
    "module = importlib.import_module('kvcached.observability')",
    "device = getattr(sys.modules.get(name), '_kvcached_device', None)",
    "module = sys.modules['kvcached.utils']",
    "module = __import__('kvcached.utils')",
    "lock = getattr(manager, '_lock', None)",
    "manager._lock = threading.RLock()",
])
def test_the_check_catches_each_kind_of_contact(source):
    assert contacts(source)


def test_the_check_lets_the_patch_table_and_public_calls_through():
    assert not contacts("Patch('p', 'kvcached', 'kvcached.kv_cache_manager', apply)\n"
                        "manager.set_memory_limit(1, revision=2)\nmanager.memory_limit_state()\n"
                        "allocator.get_num_total_pages()\nwith self._lock:\n    pass\nviews[f'kvcached.{name}.limit'] = 1")


def test_kvcached_limit_state_is_read_once_and_a_field_it_lacks_reads_as_the_default():
    from kvcached_broker.adapters.kvcached.kvcached_api import LimitState

    state = LimitState.of({"status": "deferred", "reason": "inuse_capacity_above_limit", "revision": 7,
                           "effective_limit_bytes": 1 << 30, "pool_name": "mha"})
    assert state == LimitState("deferred", "inuse_capacity_above_limit", 7, 1 << 30) and state.deferred
    assert LimitState.of({"status": "applied", "effective_limit_bytes": None}) == LimitState("applied")
    for odd in (None, [], {"status": 3, "revision": True, "effective_limit_bytes": "1"}):
        assert LimitState.of(odd) == LimitState("unknown") and not LimitState.of(odd).deferred
