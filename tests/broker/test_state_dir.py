"""The state directory against a real broker process (docs/reliability.md, "The state directory"):
files that are not regular files, and writes that fail (a full disk).

A full disk is made with ``RLIMIT_FSIZE`` on the broker process: every write past the
first ``ROOM_BYTES`` of a file fails (``EFBIG``; CPython ignores ``SIGXFSZ``), as a write that
needs a new block fails on a full disk (``ENOSPC``), while overwriting the first bytes of a
file in place still works, as on a full disk; the broker handles both errors as one ``OSError``.  Raising the limit
again (``prlimit`` on the running process) is the operator freeing space.  The broker's output
goes to a pipe, which the limit does not touch.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import threading
import urllib.request

import pytest

from kvcached_broker.client import BrokerClient
from kvcached_broker.client.admin import AdminClient
from kvcached_broker.client.errors import BrokerUnavailable
from kvcached_broker.tools.launch import BrokerLauncher

from helpers import GIB, Worker, free_port, session_of, wait_for


def _launcher(short_tmp, *args: str, **kwargs) -> BrokerLauncher:
    return BrokerLauncher(f"ipc://{short_tmp}/gpu0.sock", simulate="16GiB", state_dir=short_tmp / "state",
                          args=["--headroom", "0", "--lease", "30", *args], **kwargs)


def _metric(port: int, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    return next(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == name)


def _one_line(out) -> str:
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    return lines[0]


# ------------------------------------------------------------------ not a regular file
def test_a_journal_that_is_a_fifo_is_refused_on_one_line(short_tmp):
    """Opening it used to wait forever for a writer: the broker never started nor exited."""
    state = short_tmp / "state"
    state.mkdir(mode=0o700)
    os.mkfifo(state / "gpu0.journal", 0o600)
    out = _launcher(short_tmp).expect_refusal()
    assert out.returncode == 1 and "not a regular file (a FIFO)" in _one_line(out)


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux) for the memory safety net")
@pytest.mark.parametrize("name", ["gpu0.journal", "gpu0.snapshot"])
def test_a_state_file_linked_to_dev_zero_is_refused_on_one_line(short_tmp, name):
    """It used to be read until memory ran out (here the address-space limit stops a regression
    from taking the machine's memory with it)."""
    state = short_tmp / "state"
    state.mkdir(mode=0o700)
    (state / name).symlink_to("/dev/zero")
    out = _launcher(short_tmp, prefix=["prlimit", f"--as={4 << 30}", "--"]).expect_refusal()
    assert out.returncode == 1 and "is a symbolic link" in _one_line(out)


# ------------------------------------------------------------------------- a full disk
#: What a file may hold on the "full disk": a snapshot's magic, overwritten in place.
ROOM_BYTES = 8


class _FullDiskBroker:
    """A broker process whose writes to files all fail until :meth:`free_space`; output in a pipe."""

    def __init__(self, launcher: BrokerLauncher):
        self.launcher = launcher
        self.lines: list[str] = []

        def no_room() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (ROOM_BYTES, resource.RLIM_INFINITY))

        self.proc = subprocess.Popen(launcher.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=no_room)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def log(self) -> str:
        return "".join(self.lines)

    def status(self) -> dict | None:
        assert self.proc.poll() is None, f"the broker exited with {self.proc.returncode}: {self.log()[-2000:]}"
        try:
            with AdminClient(self.launcher.endpoint, timeout_s=1.0) as admin:
                return admin.status()
        except BrokerUnavailable:
            return None

    def free_space(self) -> None:
        resource.prlimit(self.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)


def test_a_full_disk_serves_from_memory_marks_the_state_stale_retries_and_recovers(short_tmp, workers):
    """Every restart used to fail the same way while the disk stayed full, each leaving a
    snapshot temp file behind."""
    port = free_port()
    launcher = _launcher(short_tmp, "--metrics-port", str(port))
    launcher.start()
    holder = Worker(launcher.endpoint, "holder", {"weights": 2 * GIB}, pages=3, page_bytes=GIB)
    workers.append(holder)
    launcher.stop(9)
    state = short_tmp / "state"
    (state / "gpu0.snapshot.tmp99999").write_bytes(b"left by a broker killed inside a snapshot")

    full = _FullDiskBroker(launcher)
    try:
        status = wait_for(full.status, what="the broker serving on a full disk")
        writes = status["broker"]["state_writes"]
        assert writes["failing"] and writes["failures"] >= 1 and writes["snapshot_marked_stale"], writes
        assert "event=state_write_failed" in full.log()
        assert _metric(port, "kvcached_broker_state_write_failing") == 1
        assert _metric(port, "kvcached_broker_state_write_failures_total") >= 1
        assert not list(state.glob("gpu0.snapshot.tmp*"))  # the old one cleaned, no new one left
        assert (state / "gpu0.snapshot").read_bytes()[:8] == b"KVBSTALE"
        assert session_of(status, holder.session_id)["state"] == "recovering"  # restored all the same
        with BrokerClient.connect("newcomer", endpoint=launcher.endpoint, page_bytes=GIB, credit_pages=0) as c:
            assert c.acquire(12) == 0 and c.acquire(11) == 11  # served from memory; the holder still counts
            assert full.status()["broker"]["state_writes"]["failing"]
            full.free_space()
            wait_for(lambda: not full.status()["broker"]["state_writes"]["failing"], what="the state written again")
            writes = full.status()["broker"]["state_writes"]
            assert writes["recoveries"] == 1 and not writes["snapshot_marked_stale"], writes
            assert "event=state_write_recovered" in full.log()
            assert _metric(port, "kvcached_broker_state_write_failing") == 0
            assert (state / "gpu0.snapshot").read_bytes()[:8] == b"KVBSNAP2"
            c.release(11)
    finally:
        full.kill()


def test_a_crash_while_writes_fail_restarts_from_the_stale_snapshot_with_growth_held(short_tmp, workers):
    """What was answered after the failed write is not on disk: the restart must not trust it."""
    launcher = _launcher(short_tmp)
    launcher.start()
    holder = Worker(launcher.endpoint, "holder", {}, pages=3, page_bytes=GIB)
    workers.append(holder)
    launcher.stop(9)
    full = _FullDiskBroker(launcher)
    try:
        wait_for(full.status, what="the broker serving on a full disk")
        late = BrokerClient.connect("late", endpoint=launcher.endpoint, page_bytes=GIB, credit_pages=0)
        assert late.acquire(4) == 4  # answered, never written
    finally:
        full.kill()
    launcher.start()  # room again: the restart reads the snapshot marked stale
    with AdminClient(launcher.endpoint, timeout_s=30) as admin:
        status = admin.status()
    assert status["broker"]["state_damage"]["snapshot"].startswith("stale")
    assert status["broker"]["growth_held"]  # until the workers have re-asserted what they hold
    assert session_of(status, holder.session_id)["granted_pages"] == 3
    assert not status["broker"]["state_writes"]["failing"]
    late.close()
    launcher.stop()
