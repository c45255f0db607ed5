"""The ``.pth`` startup hook in fresh interpreters: KVCACHED_REQUIRE=1 stops the start, else one warning.

CPython's ``site`` prints and swallows any exception a ``.pth`` line raises, so a hook that
only raised could never stop a start.  Each case here starts a real interpreter of the
test venv (whose site-packages holds the installed hook) and looks at its exit status and
its stderr; the ``-c`` code only runs if the interpreter got past the hook.

The hook itself must be installed by regular and by editable installs alike (last test).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from helpers import adapter_line

from kvcached_broker.adapters import support
from kvcached_broker.adapters.autopatch import REQUIRE_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
PROBE = "import sys; print('interpreter ran'); print('sglang' in sys.modules)"
BRIDGE = {"KVCACHED_SGLANG_DSV4_KV_POOL_BRIDGE": "1"}


def _start(tmp_path: Path, extra_path: str | None = None, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED", "ENABLE_KVCACHED"))}
    full.pop("PYTHONPATH", None)
    if extra_path:
        full["PYTHONPATH"] = extra_path
    full.update(env)
    return subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)


def _lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def test_the_installed_hook_is_the_one_in_the_source_tree():
    installed = Path(sysconfig.get_paths()["purelib"]) / "kvcached_broker_autopatch.pth"
    source = ROOT / "adapters" / "kvcached_broker_autopatch.pth"
    assert installed.read_text() == source.read_text(), "reinstall the package (pip install -e .) to update the hook"


@pytest.fixture
def broken_dependency(tmp_path) -> str:
    """A directory that shadows pyzmq with a package whose import fails (a broken install)."""
    shadow = tmp_path / "shadow" / "zmq"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('libzmq.so.5: cannot open shared object file')\n")
    return str(shadow.parent)


CASES = {
    "refused flag": (BRIDGE, None, "KVCACHED_SGLANG_DSV4_KV_POOL_BRIDGE=1 is not supported"),
    "malformed flag": ({"KVCACHED_SGLANG_DSV4_RUNTIME_RESERVATION": "sometimes"}, None,
                       "KVCACHED_SGLANG_DSV4_RUNTIME_RESERVATION='sometimes': expected 1/0"),
    "malformed enable flag": ({"ENABLE_KVCACHED": "maybe"}, None, "ENABLE_KVCACHED='maybe'"),
    "import error": ({}, "broken", "ImportError: libzmq.so.5: cannot open shared object file"),
    "bad instance name": ({"KVCACHED_BROKER_INSTANCE": "model a"}, None, "KVCACHED_BROKER_INSTANCE='model a'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_require_stops_the_start_with_one_line_and_no_runtime_import(tmp_path, broken_dependency, case):
    env, path, reason = CASES[case]
    env = {"ENABLE_KVCACHED": "1", **env, "KVCACHED_REQUIRE": "1"}
    out = _start(tmp_path, broken_dependency if path else None, **env)
    assert out.returncode == REQUIRE_EXIT_CODE, out.stderr
    assert out.stdout == ""  # the -c code never ran
    (line,) = _lines(out.stderr)
    assert adapter_line(line, "ERROR", "startup_refused") and reason in line


@pytest.mark.parametrize("case", list(CASES))
def test_without_require_the_interpreter_runs_on_with_one_warning(tmp_path, broken_dependency, case):
    env, path, reason = CASES[case]
    out = _start(tmp_path, broken_dependency if path else None, **{"ENABLE_KVCACHED": "1", **env})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["interpreter ran", "False"]
    (line,) = _lines(out.stderr)
    assert adapter_line(line, "WARNING", "autopatch_failed") and reason in line


def test_a_malformed_require_flag_counts_as_required(tmp_path):
    out = _start(tmp_path, ENABLE_KVCACHED="1", KVCACHED_REQUIRE="maybe")
    assert out.returncode == REQUIRE_EXIT_CODE and out.stdout == ""
    (line,) = _lines(out.stderr)
    assert "KVCACHED_REQUIRE='maybe'" in line


def test_a_clean_start_says_nothing(tmp_path):
    out = _start(tmp_path, ENABLE_KVCACHED="1", KVCACHED_REQUIRE="1")
    assert (out.returncode, out.stdout.splitlines(), out.stderr) == (0, ["interpreter ran", "False"], "")


# ------------------------------------------------------------------ an unsupported release
def _installed(root: Path, name: str, version: str) -> None:
    """A distribution ``name`` at ``version`` under ``root``: its metadata and an empty package."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _beyond(runtime: str) -> str:
    """A release past the supported range (``<below>.9``), and one before it (``0.0.1``)."""
    return f"{support.runtime(runtime).supported.below}.9"


UNSUPPORTED = {"vLLM newer": ("vllm", _beyond("vllm")), "vLLM older": ("vllm", "0.0.1"),
               "SGLang newer": ("sglang", _beyond("sglang")), "kvcached newer": ("kvcached", _beyond("kvcached"))}
RUNTIME_PROBE = "import sys, {name}; print('imported {name}')"


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_require_stops_an_unsupported_release_at_interpreter_start_with_one_line(tmp_path, case):
    """The release is read from the distribution's metadata at interpreter start: the runtime is
    never imported (the -c code never runs), the process exits 78 with one line naming the
    release and the supported range."""
    name, version = UNSUPPORTED[case]
    _installed(tmp_path / "site", name, version)
    out = _start(tmp_path, str(tmp_path / "site"), ENABLE_KVCACHED="1", KVCACHED_REQUIRE="1")
    assert out.returncode == REQUIRE_EXIT_CODE and out.stdout == "", out.stderr
    (line,) = _lines(out.stderr)
    runtime = support.runtime(name)
    assert adapter_line(line, "ERROR", "startup_refused")
    assert f"{runtime.label} {version}" in line and str(runtime.supported) in line


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_without_require_every_process_of_an_unsupported_release_says_it_once(tmp_path, case):
    """One ``event=unprotected`` line naming the release and the supported range, whatever the
    process imports next; none of the runtime's patches is registered (no skip lines)."""
    name, version = UNSUPPORTED[case]
    _installed(tmp_path / "site", name, version)
    env = {"ENABLE_KVCACHED": "1", "KVCACHED_BROKER": "off"}
    out = subprocess.run([sys.executable, "-c", RUNTIME_PROBE.format(name=name)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120, env={**_clean_env(), "PYTHONPATH": str(tmp_path / "site"), **env})
    assert out.returncode == 0 and out.stdout.splitlines() == [f"imported {name}"], out.stderr
    (line,) = _lines(out.stderr)
    runtime = support.runtime(name)
    assert adapter_line(line, "WARNING", "unprotected") and f"runtime={name} version={version} " in line
    assert f"supported='{runtime.supported}'" in line


def test_kvcacheds_release_does_not_matter_where_kvcached_mode_is_off(tmp_path):
    _installed(tmp_path / "site", "kvcached", _beyond("kvcached"))
    out = _start(tmp_path, str(tmp_path / "site"), KVCACHED_AUTOPATCH="1", KVCACHED_REQUIRE="1")
    assert (out.returncode, out.stderr) == (0, "")


def test_beside_a_supported_runtime_an_unsupported_one_stops_only_a_process_that_imports_it(tmp_path):
    """SGLang at a supported release and vLLM past the range in one environment: a process that
    serves with SGLang starts; one that imports vLLM stops there, with one line."""
    site = tmp_path / "site"
    _installed(site, "sglang", support.SGLANG.tested()[-1])
    _installed(site, "vllm", _beyond("vllm"))
    probe = "import sglang; print('sglang', flush=True); import vllm; print('vllm')"
    env = {**_clean_env(), "PYTHONPATH": str(site), "ENABLE_KVCACHED": "1", "KVCACHED_REQUIRE": "1",
           "KVCACHED_BROKER": "off"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env=env)
    assert out.returncode == REQUIRE_EXIT_CODE and out.stdout.splitlines() == ["sglang"], out.stderr
    (line,) = _lines(out.stderr)
    assert adapter_line(line, "ERROR", "startup_refused") and f"vLLM {_beyond('vllm')}" in line


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("KVCACHED", "ENABLE_KVCACHED")) and k != "PYTHONPATH"}


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

