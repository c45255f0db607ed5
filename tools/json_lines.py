"""A child process driven by JSON lines: one request object a line on its stdin, one answer
object a line on its stdout (the demo's DeepSeek-V4-shaped server and the kvcached pools)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

#: How long a process asked to exit has before it is killed, and how long a kill may take.
STOP_WAIT_S = 15.0


def send(proc: subprocess.Popen, op: str, **args: Any) -> None:
    """Write the request ``{"op": op, **args}`` (raises OSError, e.g. BrokenPipeError, once it is gone)."""
    stdin = proc.stdin
    assert stdin is not None, "started without stdin=PIPE"
    stdin.write(json.dumps({"op": op, **args}) + "\n")
    stdin.flush()


def receive(proc: subprocess.Popen) -> dict[str, Any] | None:
    """The next answer, or None once the process has closed its stdout (it exited)."""
    stdout = proc.stdout
    assert stdout is not None, "started without stdout=PIPE"
    line = stdout.readline()
    return json.loads(line) if line else None


def exit_status(proc: subprocess.Popen) -> int:
    """The exit status of a process whose stdout has closed (it has exited, or is about to)."""
    return proc.wait(timeout=10)


def stop(proc: subprocess.Popen) -> None:
    """Ask the process to exit (``{"op": "exit"}``) and wait for it; kill it if it does not go."""
    if proc.poll() is not None:
        return
    try:
        send(proc, "exit")
        receive(proc)
    except OSError:
        pass
    try:
        proc.wait(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_WAIT_S)
