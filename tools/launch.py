"""Start a ``kvcached-broker serve`` process and wait until it answers; stop it again.

The one way the demo, the replay, the benchmarks and the tests start a broker, so that each
waits on the same event (the broker answering ``status``, or the process exiting) rather
than on a fixed time.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Sequence

from ..client.admin import AdminClient
from ..client.errors import BrokerUnavailable


class BrokerExited(RuntimeError):
    """The broker process exited before it answered."""


class BrokerLauncher:
    """A broker subprocess on ``endpoint``: ``serve --simulate SIZE`` unless ``simulate`` is None."""

    def __init__(
        self,
        endpoint: str,
        *,
        simulate: str | None = "80GiB",
        state_dir: Path | None = None,
        device: int = 0,
        args: Sequence[str] = (),
        log: Path | None = None,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
        new_session: bool = False,
    ):
        self.endpoint = endpoint
        self.simulate = simulate
        self.state_dir = state_dir
        self.device = device
        self.args = list(args)
        self.log_path = log
        self.env = env
        self.prefix = list(prefix)  # e.g. a wrapper that sets the parent-death signal
        self.new_session = new_session  # out of the caller's process group (its ^C is not the broker's)
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "kvcached_broker.broker.cli", "serve", "--device", str(self.device),
                   "--endpoint", self.endpoint]
        if self.simulate is not None:
            command += ["--simulate", self.simulate]
        command += ["--state-dir", str(self.state_dir)] if self.state_dir is not None else ["--no-state"]
        return [*self.prefix, *command, *self.args]

    def start(self, *, wait: bool = True, timeout_s: float = 30.0) -> "BrokerLauncher":
        out: IO[Any] | int = subprocess.DEVNULL
        if self.log_path is not None:
            out = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=self.new_session)
        if wait:
            self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Return once the broker answers ``status``; raise if it exits or never answers."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise BrokerExited(f"broker exited with {self.proc.returncode}" + self._log_tail())
            try:
                with AdminClient(self.endpoint, timeout_s=0.5) as admin:
                    admin.status()
                return
            except BrokerUnavailable:
                if time.monotonic() > deadline:
                    raise BrokerUnavailable(f"broker at {self.endpoint} did not answer within {timeout_s:g}s"
                                            + self._log_tail()) from None
                time.sleep(0.05)  # the socket appears only once the broker has bound it

    def admin(self, timeout_s: float = 5.0) -> AdminClient:
        return AdminClient(self.endpoint, timeout_s=timeout_s)

    def send(self, sig: int) -> None:
        """Send ``sig`` without waiting (SIGSTOP, say)."""
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """Send ``sig`` and wait for the process to exit (SIGKILL after ``timeout_s``)."""
        if not self.running():
            return
        assert self.proc is not None
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_s)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path is not None and self.log_path.exists() else ""

    def _log_tail(self) -> str:
        text = self.log()
        return f":\n{text[-3000:]}" if text else ""

    def __enter__(self) -> "BrokerLauncher":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
