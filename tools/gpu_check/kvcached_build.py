"""kvcached 0.1.6 built from its sdist on the GPU machine, in the background, with its CUDA extension.

kvcached ships no wheels: ``pip install`` compiles ``kvcached._C`` (C++ against torch's stable
ABI and CUDA's driver API, linked with ``-lcuda``).  The GPU machine cannot download anything,
so the sdist travels with the check and is built there, without build isolation (the machine's
torch and setuptools build it), into a folder of its own that only the kvcached part puts on
its path.  The link needs a ``libcuda.so``: CUDA's stub library if the toolkit has one, else the
driver's ``libcuda.so.1`` through a link made here.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BuildResult:
    ok: bool
    seconds: float
    why: str  # '' when ok; else one line
    log_tail: str


def cuda_home() -> Path | None:
    for name in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(name):
            return Path(os.environ[name])
    nvcc = shutil.which("nvcc")
    if nvcc:
        return Path(nvcc).resolve().parent.parent
    default = Path("/usr/local/cuda")
    return default if default.exists() else None


def libcuda_link_dir(workdir: Path, home: Path | None) -> Path | None:
    """A folder with a ``libcuda.so`` the linker can use, or None if there is none on this machine."""
    folders = [Path("/usr/local/nvidia/lib64"), Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/lib64")]
    if home is not None:
        folders[:0] = [home / "lib64" / "stubs", home / "targets" / "x86_64-linux" / "lib" / "stubs", home / "lib" / "stubs"]
    for folder in folders:
        if (folder / "libcuda.so").exists():
            return folder
    for folder in folders:
        if (folder / "libcuda.so.1").exists():
            link_dir = workdir / "libcuda-link"
            link_dir.mkdir(parents=True, exist_ok=True)
            link = link_dir / "libcuda.so"
            if not link.exists():
                link.symlink_to(folder / "libcuda.so.1")
            return link_dir
    return None


class KvcachedBuild:
    """``pip install`` of the sdist into ``target``, started by :meth:`start`, awaited by :meth:`wait`."""

    def __init__(self, sdist: Path, target: Path, workdir: Path):
        self.sdist = sdist
        self.target = target
        self.workdir = workdir
        self.log_path = workdir / "kvcached-build.log"
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.result: BuildResult | None = None

    def command(self) -> list[str]:
        nice = ["nice", "-n", "10"] if shutil.which("nice") else []
        return [*nice, sys.executable, "-m", "pip", "install", "-v", "--no-index", "--no-deps", "--no-build-isolation",
                "--no-cache-dir", "--disable-pip-version-check", "--target", str(self.target), str(self.sdist)]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        home = cuda_home()
        if home is not None:
            env.setdefault("CUDA_HOME", str(home))
        link_dir = libcuda_link_dir(self.workdir, home)
        if link_dir is not None:
            env["LIBRARY_PATH"] = os.pathsep.join(p for p in (str(link_dir), env.get("LIBRARY_PATH", "")) if p)
        env["MAX_JOBS"] = str(max(1, (os.cpu_count() or 2) - 4))  # leave cores to the parts measuring meanwhile
        return env

    def start(self) -> "KvcachedBuild":
        self.target.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                         start_new_session=True)
        return self

    def wait(self, timeout_s: float) -> BuildResult:
        """The build's result, waiting up to ``timeout_s`` for it (then it is stopped: a failure)."""
        if self.result is not None:
            return self.result
        assert self.proc is not None, "start() first"
        try:
            code = self.proc.wait(max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            self.stop()
            self.result = self._result(False, f"the build did not finish within its time ({timeout_s:.0f} s more)")
            return self.result
        if code != 0:
            self.result = self._result(False, f"pip install of {self.sdist.name} exited with {code}")
        else:
            why = self._import_check()
            self.result = self._result(not why, why)
        return self.result

    def _import_check(self) -> str:
        """'' if ``kvcached._C`` imports from the target, else the import's last line."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.target), env.get("PYTHONPATH", "")) if p)
        out = subprocess.run([sys.executable, "-c", "import kvcached, kvcached._C; print(kvcached.__file__)"],
                             capture_output=True, text=True, env=env, timeout=120)
        if out.returncode == 0:
            return ""
        lines = (out.stderr or out.stdout).strip().splitlines()
        return f"kvcached._C does not import: {lines[-1] if lines else out.returncode}"

    def _result(self, ok: bool, why: str) -> BuildResult:
        try:
            tail = self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            tail = ""
        return BuildResult(ok, time.monotonic() - self.started, why, "" if ok else tail)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
