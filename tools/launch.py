"""Start a ``kvcached-broker serve`` process and wait until it answers; stop it again.

The one way the demo, the replay, the benchmarks and the tests start a broker, so that each
waits on the same event (the broker answering ``status``, or the process exiting) rather
than on a fixed time.  A broker that must refuse to start is run the same way
(:meth:`BrokerLauncher.expect_refusal`), waiting on its exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

from ..client.admin import AdminClient
from ..client.endpoint import default_endpoint, resolve_endpoint
from ..client.errors import BrokerUnavailable


class BrokerExited(RuntimeError):
    """The broker process exited before it answered."""


class BrokerStarted(RuntimeError):
    """A broker expected to refuse to start was still running when its time was up."""


class BrokerLauncher:
    """A broker subprocess on ``endpoint``: ``serve --simulate SIZE`` unless ``simulate`` is None.

    * ``endpoint=None``: no ``--endpoint``; the broker takes its default (``KVCACHED_BROKER``,
      else ``KVCACHED_BROKER_RUNTIME_DIR``..., read from ``env``), and :attr:`endpoint` is that;
    * ``env``: the whole environment (default: this process's); ``extra_env`` is laid over it;
    * output: to ``log`` (stdout and stderr together), or with ``capture`` kept apart in files
      that :meth:`stdout` and :meth:`stderr` read at any time (no pipe to fill), else dropped.
    """

    def __init__(
        self,
        endpoint: str | None,
        *,
        simulate: str | None = "80GiB",
        state_dir: Path | None = None,
        device: int = 0,
        args: Sequence[str] = (),
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        capture: bool = False,
        prefix: Sequence[str] = (),
        new_session: bool = False,
    ):
        if capture and log is not None:
            raise ValueError("capture or log, not both")
        self.env: dict[str, str] | None = None
        if env is not None or extra_env:
            self.env = {**(os.environ if env is None else env), **(extra_env or {})}
        self.bind_endpoint = endpoint is not None  # whether the command names it
        if endpoint is None:
            endpoint = resolve_endpoint(device, env=self.env) or default_endpoint(device, self.env)
        self.endpoint = endpoint
        self.simulate = simulate
        self.state_dir = state_dir
        self.device = device
        self.args = list(args)
        self.log_path = log
        self.capture = capture
        self.prefix = list(prefix)  # e.g. a wrapper that sets the parent-death signal
        self.new_session = new_session  # out of the caller's process group (its ^C is not the broker's)
        self.proc: subprocess.Popen | None = None
        self._out: IO[str] | None = None
        self._err: IO[str] | None = None

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "kvcached_broker.broker.cli", "serve", "--device", str(self.device)]
        if self.bind_endpoint:
            command += ["--endpoint", self.endpoint]
        if self.simulate is not None:
            command += ["--simulate", self.simulate]
        command += ["--state-dir", str(self.state_dir)] if self.state_dir is not None else ["--no-state"]
        return [*self.prefix, *command, *self.args]

    def start(self, *, wait: bool = True, timeout_s: float = 60.0) -> "BrokerLauncher":
        """Start the process; with ``wait``, return once it answers ``status`` (``timeout_s``
        only bounds a failure)."""
        self._spawn(capture=self.capture)
        if wait:
            self.wait_ready(timeout_s)
        return self

    def _spawn(self, *, capture: bool) -> None:
        out: IO[Any] | int = subprocess.DEVNULL
        err: IO[Any] | int = subprocess.STDOUT
        self._close_output()
        if capture:
            self._out = out = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
            self._err = err = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        elif self.log_path is not None:
            out = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=err, env=self.env,
                                     start_new_session=self.new_session)
        if not capture and not isinstance(out, int):
            out.close()  # the child has its own copy

    def wait_ready(self, timeout_s: float = 60.0) -> None:
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

    def expect_refusal(self, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        """Run a broker that must refuse to start: wait for it to exit and return its exit status
        and output.  Raises :class:`BrokerStarted` (after stopping it) if it has not exited
        within ``timeout_s``, which only bounds that failure."""
        self._spawn(capture=True)
        assert self.proc is not None
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise BrokerStarted(f"a broker expected to refuse to start ran for {timeout_s:g}s"
                                + self._log_tail()) from None
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self.stdout(), self.stderr())

    def admin(self, timeout_s: float = 30.0) -> AdminClient:
        return AdminClient(self.endpoint, timeout_s=timeout_s)

    def status(self) -> dict[str, Any]:
        with self.admin() as admin:
            return admin.status()

    def send(self, sig: int) -> None:
        """Send ``sig`` without waiting (SIGSTOP, say)."""
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        """Send ``sig`` and wait for the process to exit (SIGKILL after ``timeout_s``); its exit status."""
        if self.proc is None:
            return None
        if self.running():
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @staticmethod
    def _read(stream: IO[str] | None) -> str:
        if stream is None or stream.closed:
            return ""
        stream.seek(0)
        return stream.read()

    def stdout(self) -> str:
        """What the broker has written to stdout so far (``capture``)."""
        return self._read(self._out)

    def stderr(self) -> str:
        """What the broker has written to stderr so far (``capture``): its log lines."""
        return self._read(self._err)

    def log(self) -> str:
        if self.capture:
            return self.stdout() + self.stderr()
        return self.log_path.read_text() if self.log_path is not None and self.log_path.exists() else ""

    def _log_tail(self) -> str:
        text = self.stdout() + self.stderr() if self._err is not None else self.log()
        return f":\n{text[-3000:]}" if text else ""

    def _close_output(self) -> None:
        for stream in (self._out, self._err):
            if stream is not None:
                stream.close()
        self._out = self._err = None

    def __enter__(self) -> "BrokerLauncher":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
