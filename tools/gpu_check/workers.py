"""Start and drive :mod:`.worker` processes: one request line, one reply line, each with a time limit."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .devices import Device

MODULE = "kvcached_broker.tools.gpu_check.worker"


class WorkerFailed(RuntimeError):
    """A worker answered with an error, exited, or did not answer in time (one line)."""


class WorkerProcess:
    """One :mod:`.worker` process.  ``request`` raises :class:`WorkerFailed` rather than hang."""

    def __init__(self, proc: subprocess.Popen, name: str, stderr_path: Path):
        self.proc = proc
        self.name = name
        self.stderr_path = stderr_path
        self.pid = proc.pid
        self._buffer = b""

    @classmethod
    def start(cls, device: Device, name: str, *, env: dict[str, str] | None = None) -> "WorkerProcess":
        """Start it; :meth:`wait_ready` reads its first line (start several, then wait for all)."""
        stderr_path = device.workdir / f"{name}.err"
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", MODULE, *device.worker_args()], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=err, env=env)
        return cls(proc, name, stderr_path)

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        return self._receive(timeout_s)

    def request(self, op: str, timeout_s: float = 60.0, **args: Any) -> dict[str, Any]:
        """Send one request and return its reply; WorkerFailed on an error reply, an exit or a timeout."""
        self.send(op, **args)
        return self.receive(timeout_s, op)

    def send(self, op: str, **args: Any) -> None:
        """Send one request without waiting (several workers can be started on something at once)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerFailed(f"worker {self.name} is gone (exit {self.proc.poll()}){self._stderr_tail()}") from None

    def receive(self, timeout_s: float = 60.0, op: str = "request") -> dict[str, Any]:
        """The reply to the request sent last; WorkerFailed as :meth:`request`."""
        answer = self._receive(timeout_s)
        if "error" in answer:
            raise WorkerFailed(f"worker {self.name}: {op}: {answer['error']}")
        return answer

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerFailed(f"worker {self.name} did not answer within {timeout_s:g} s")
                if not sel.select(left):
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise WorkerFailed(f"worker {self.name} exited with {self.proc.wait(10)}{self._stderr_tail()}")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _stderr_tail(self) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace").strip()
        except OSError:
            return ""
        return f": {text.splitlines()[-1][:300]}" if text else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request("exit", timeout_s=10)
            except WorkerFailed:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def start_workers(device: Device, names: list[str], timeout_s: float = 120.0) -> list[WorkerProcess]:
    """Start several workers at once and wait until each is ready (torch's import is slow)."""
    workers = [WorkerProcess.start(device, name) for name in names]
    try:
        for worker in workers:
            worker.wait_ready(timeout_s)
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers
