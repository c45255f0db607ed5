"""Processes of another runtime's overlay, for the tests where runtimes share one GPU.

A vLLM overlay run starts SGLang processes from ``.adapter-envs/sglang-0.5.23``: the overlay's
``.env`` file names the variables to export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SGLANG_ENV = ROOT / ".adapter-envs" / "sglang-0.5.23.env"
SGLANG_WORKER = HERE.parent / "sglang" / "sglang_worker.py"
VLLM_WORKER = HERE / "vllm_worker.py"


def require_sglang_overlay() -> None:
    if not SGLANG_ENV.exists():
        if os.environ.get("KVCACHED_BROKER_TEST_RUNTIME"):
            pytest.fail(f"{SGLANG_ENV} is missing: run `make adapter-envs`")
        pytest.skip("the SGLang overlay is not built")


def overlay_env(env_file: Path) -> dict[str, str]:
    """The variables an overlay's .env file exports."""
    values = {}
    for line in env_file.read_text().splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            values[key] = value.strip('"')
    return values


def overlay_version(env_file: Path) -> str:
    """The upstream version an overlay holds (``sglang-0.5.23.env`` -> ``0.5.23``)."""
    return env_file.name.removesuffix(".env").split("-", 1)[1]


def base_env() -> dict[str, str]:
    """This environment without this overlay's own variables."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_TARGET_DEVICE")}


def sglang_env(**extra: str) -> dict[str, str]:
    return {**base_env(), **overlay_env(SGLANG_ENV), **extra}


def vllm_env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def start(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def read_json(proc: subprocess.Popen, what: str) -> dict:
    """The next JSON line the process prints (upstream may print its own lines first)."""
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    proc.kill()
    raise AssertionError(f"{what} exited: {proc.communicate()[1][-3000:]}")


def spawn(argv, env) -> tuple[subprocess.Popen, dict]:
    proc = start(argv, env)
    return proc, read_json(proc, argv[0])
