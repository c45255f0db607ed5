"""kvcached 0.1.6's real Python code on a CPU, for the demo, the hand-over benchmark and the tests.

Only ``kvcached.vmm_ops`` (kvcached's native extension) is replaced, by :mod:`.vmm_ops_double`,
which models the C++ allocator and charges mapped pages to a simulated GPU that processes share
(:class:`kvcached_broker.tools.shared_gpu.SharedGpu`).  :mod:`.kvcached_cpu` installs it;
:mod:`.pool_process` is a serving process with one real ``KVCacheManager`` built through
kvcached's SGLang integration; :mod:`.pools` starts and drives such processes.

kvcached's code itself is never shipped here: it is found on the path (``pip install
kvcached``, or the overlay ``scripts/fetch-kvcached.py`` unpacks, named by
``KVCACHED_BROKER_KVCACHED_PATH`` as ``make demo`` does), and torch must be importable (a CPU
build is enough).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

KVCACHED_VERSION = "0.1.6"
#: Where ``scripts/fetch-kvcached.py`` unpacks kvcached's Python package, relative to a checkout.
OVERLAY = Path(".adapter-envs") / f"kvcached-{KVCACHED_VERSION}"
#: A directory holding kvcached's Python package (``make demo`` sets it to the checkout's overlay).
PATH_ENV = "KVCACHED_BROKER_KVCACHED_PATH"


def kvcached_path() -> str | None:
    """``$KVCACHED_BROKER_KVCACHED_PATH`` if kvcached is there and not importable already, else None.

    Never a guess from the working directory: without kvcached on the path or that variable,
    ``kvcached-broker demo`` shows the three-worker demo (the core tests rely on it).
    """
    if importlib.util.find_spec("kvcached") is not None:
        return None
    candidate = os.environ.get(PATH_ENV, "")
    if candidate and (Path(candidate) / "kvcached" / "__init__.py").exists():
        return str(Path(candidate).resolve())
    return None


def missing() -> str:
    """Why the simulation cannot run here ('' when it can): torch and kvcached 0.1.6 are needed."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (a CPU build is enough: pip install torch)"
    path = kvcached_path()
    if importlib.util.find_spec("kvcached") is None and path is None:
        return (f"kvcached {KVCACHED_VERSION}'s Python code is not importable (fetch it with "
                f"scripts/fetch-kvcached.py and set {PATH_ENV})")
    version = _kvcached_version(path)
    if version != KVCACHED_VERSION:
        return f"kvcached {version} found, the simulation needs {KVCACHED_VERSION}"
    return ""


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with kvcached's directory on ``PYTHONPATH`` if needed."""
    env = dict(os.environ if env is None else env)
    path = kvcached_path()
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    return env


def _kvcached_version(path: str | None) -> str | None:
    from importlib.metadata import PackageNotFoundError, distributions, version

    if path is None:
        try:
            return version("kvcached")
        except PackageNotFoundError:
            return None
    for dist in distributions(path=[path]):
        if dist.metadata["Name"] == "kvcached":
            return dist.version
    return None
