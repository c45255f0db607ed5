"""Shared fixtures: real brokers on simulated GPUs, over real ipc sockets.

* ``broker``: a ``kvcached-broker serve`` subprocess (what operators run);
* ``inproc``: a :class:`BrokerServer` in a thread of the test process, for tests that
  need to look inside the ledger over real sockets (``inproc_factory`` for other settings);
* ``broker_factory``: brokers as ``broker`` is, with other settings (all through
  ``tools/launch.py``'s ``BrokerLauncher``, the one way a broker process is started);
* ``workers``: worker processes a test started (``helpers.Worker``), killed at the end;
* ``adapter_broker``: an in-process broker the adapters' worker session connects to.

Tests whose subject is a decision (decoding, quotas, the reply cache, refusals) drive the
request core directly instead (``helpers.make_core``); these fixtures are for what needs
sockets, processes, crashes and restarts.

Socket paths live in short directories under /tmp because an ipc path may not exceed 107 bytes.

Which tests a run collects is each module's ``runtime`` marker (:mod:`overlay_selection`): the
core run collects the modules that name none, an overlay run (scripts/test-adapters.sh) those
that name its runtimes, and checks, test by test, that they are installed at the overlay's
versions.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvcached_broker.client.admin import AdminClient
from kvcached_broker.tools.launch import BrokerLauncher

import overlay_selection
from helpers import GIB, MIB, require_kvcached_mode, require_runtime  # noqa: F401


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave out a test module whose ``runtime`` marker is not this run's overlay, and a folder
    holding none that is (neither imported, nor the folder's conftest)."""
    overlay = overlay_selection.current()
    if collection_path.is_dir():
        return None if overlay_selection.selected_anywhere(collection_path, overlay) else True
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        if not overlay_selection.selected(overlay_selection.needs_in_run(collection_path), overlay):
            return True
    return None


@pytest.fixture(autouse=True)
def overlay_versions(request: pytest.FixtureRequest) -> None:
    """A test marked for runtimes runs against them at the overlay's versions (a missing or
    another version fails inside an overlay: :func:`helpers.require_runtime`)."""
    marker = request.node.get_closest_marker("runtime")
    if marker is None:
        return
    names = set(marker.args)
    runtimes = sorted(names - {"kvcached"})
    if not runtimes:
        require_runtime("kvcached")
    elif "kvcached" in names:
        require_kvcached_mode(runtimes[0], runtimes[0])
    else:
        require_runtime(runtimes[0])


@pytest.fixture
def short_tmp():
    path = Path(tempfile.mkdtemp(prefix="kb-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class BrokerProcess:
    """A broker subprocess; ``restart()`` starts a new one on the same endpoint and state."""

    workdir: Path
    simulate: str = "80GiB"
    lease_s: float = 10.0
    extra_args: list[str] = field(default_factory=list)
    device: int = 0
    socket_subdir: str = ""  # a directory the broker creates itself (0750, socket group)
    launcher: BrokerLauncher | None = None

    @property
    def endpoint(self) -> str:
        sub = f"/{self.socket_subdir}" if self.socket_subdir else ""
        return f"ipc://{self.workdir}{sub}/gpu{self.device}.sock"

    @property
    def state_dir(self) -> Path:
        return self.workdir / "state"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"broker{self.device}.log"

    @property
    def proc(self):
        return self.launcher.proc if self.launcher is not None else None

    def _launcher(self, endpoint: str | None = None, **kwargs) -> BrokerLauncher:
        kwargs.setdefault("log", self.log_path)
        return BrokerLauncher(
            endpoint or self.endpoint, simulate=self.simulate, state_dir=self.state_dir, device=self.device,
            args=["--lease", str(self.lease_s), "--log-level", "debug", *self.extra_args], **kwargs,
        )

    def second(self, endpoint: str | None = None):
        """Another broker with this one's settings (on ``endpoint``, else this one's), which
        must refuse to start: its exit status and output."""
        return self._launcher(endpoint, log=None).expect_refusal()

    def start(self, wait: bool = True) -> "BrokerProcess":
        self.launcher = self._launcher().start(wait=wait)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        assert self.launcher is not None
        self.launcher.wait_ready(timeout_s)

    def admin(self, timeout_s: float = 30.0) -> AdminClient:
        return AdminClient(self.endpoint, timeout_s=timeout_s)

    def status(self) -> dict:
        with self.admin() as admin:
            return admin.status()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.launcher is not None:
            self.launcher.stop(sig)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def restart(self) -> "BrokerProcess":
        self.kill()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


@pytest.fixture
def broker_factory(short_tmp):
    started: list[BrokerProcess] = []

    def make(**kwargs) -> BrokerProcess:
        b = BrokerProcess(workdir=short_tmp, **kwargs)
        started.append(b)
        return b.start()

    make.workdir = short_tmp
    yield make
    for b in started:
        b.kill()


@pytest.fixture
def broker(broker_factory) -> BrokerProcess:
    return broker_factory()


@dataclass
class InprocBroker:
    server: object
    thread: threading.Thread
    endpoint: str
    probe: object

    @property
    def ledger(self):
        return self.server.ledger

    def admin(self) -> AdminClient:
        return AdminClient(self.endpoint, timeout_s=30.0)

    def status(self) -> dict:
        with self.admin() as admin:
            return admin.status()


@pytest.fixture
def inproc_factory(short_tmp):
    from kvcached_broker.broker.device import SimulatedDevice
    from kvcached_broker.broker.config import ServeConfig
    from kvcached_broker.broker.server import BrokerServer

    servers: list[InprocBroker] = []

    def make(total_bytes: int = 80 * GIB, headroom: str = "0", device: int = 0, state: bool = False, **config) -> InprocBroker:
        probe = SimulatedDevice(device, total_bytes)
        endpoint = f"ipc://{short_tmp}/inproc{device}.sock"
        cfg = ServeConfig(
            endpoint=endpoint,
            device_index=device,
            headroom=headroom,
            state_dir=(short_tmp / f"state{device}") if state else None,
            **config,
        )
        server = BrokerServer(cfg, probe)
        server.start()
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        b = InprocBroker(server, thread, endpoint, probe)
        servers.append(b)
        return b

    yield make
    for b in servers:
        b.server.stop()
        b.thread.join(timeout=10)


@pytest.fixture
def inproc(inproc_factory) -> InprocBroker:
    return inproc_factory()


@pytest.fixture
def workers():
    """Worker processes (``helpers.Worker``) a test started: woken and killed at the end."""
    started = []
    yield started
    for w in started:
        try:
            os.kill(w.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        w.kill()


@pytest.fixture
def adapter_broker(inproc_factory):
    """A 10 GiB in-process broker that the adapters' worker session opens its sessions on."""
    from kvcached_broker.adapters import process_state, sessions
    from kvcached_broker.client import BrokerClient

    b = inproc_factory(total_bytes=10 * GIB)
    process_state.reset()
    sessions.set_client_factory(lambda ident: BrokerClient.connect(
        ident.instance_name(), endpoint=b.endpoint, tp_rank=ident.tp_rank, tp_size=ident.tp_size,
        page_bytes=ident.page_bytes, credit_pages=0,
    ))
    yield b
    process_state.reset()
    sessions.set_client_factory(None)


@pytest.fixture
def children():
    """Start idle child processes (each runs until its stdin closes); killed and reaped at the end."""
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        started.append(child)
        return child

    yield start
    for child in started:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=60)
