"""``kvcached-broker demo``: the whole mission on one simulated GPU, or three co-located workers.

With torch and kvcached 0.1.6's Python code importable (``make demo`` installs them; a plain
install finds kvcached on the path or at ``$KVCACHED_BROKER_KVCACHED_PATH``), the demo is
:mod:`.kvcached_sim.mission_demo`: a DeepSeek-V4-shaped server whose side pools are reported
per pool and held static, beside two servers with real kvcached pools in kvcached mode whose
KV memory moves under pressure, every frame checked.

Without them, or with ``KVCACHED_BROKER_DEMO=classic``, it is the three-worker demo (it says
which, and why, in one line), a simulated 80 GiB GPU shared by:

* ``deepseek-v4``: reports its runtime-owned DeepSeek-V4 pools (SWA, C4, C128, indexer and
  compressor state) plus weights as reservations, then holds a few elastic pages;
* ``llama-a`` and ``llama-b``: weights plus elastic KV pages whose demand rises and falls out
  of phase, so that they compete for what is left and are sometimes refused.

The broker and each worker are separate processes talking over a real ipc socket; the demo
shows the broker's status redrawn in place, then stops everything and exits 0.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20
ROLES = ("deepseek-v4", "llama-a", "llama-b")  # the classic demo's workers, started in this order

DSV4_POOLS = {
    "weights": 18 * GIB,
    "swa_kv_pool": int(2.5 * GIB),
    "c4_kv_pool": 6 * GIB,
    "c128_kv_pool": GIB // 4,
    "c4_indexer_kv_pool": int(1.5 * GIB),
    "compress_state_pools": 640 * MIB,
    "indexer_compress_state_pools": 320 * MIB,
}
ELASTIC_PAGE_BYTES = 64 * MIB


DEMO_ENV = "KVCACHED_BROKER_DEMO"


def run_demo(seconds: float = 8.0, keep: bool = False) -> int:
    """The mission demo if it can run here, else the three-worker demo, saying why in one line."""
    if os.environ.get(DEMO_ENV, "").strip().lower() == "classic":
        return run_classic(seconds, keep)
    from .kvcached_sim import missing

    why = missing()
    if why:
        print(f"kvcached-broker demo: three co-located workers (the demo with kvcached pools needs what is "
              f"missing here: {why}; `make demo` installs it)", flush=True)
        return run_classic(seconds, keep)
    from .kvcached_sim import mission_demo

    return mission_demo.run(seconds, keep)


def run_classic(seconds: float = 8.0, keep: bool = False) -> int:
    """Three workers on a simulated 80 GiB GPU, the broker's status redrawn in place."""
    from ..broker.render import CLEAR_HOME, render_bars
    from ..client.errors import BrokerUnavailable
    from .launch import BrokerLauncher

    workdir = Path(tempfile.mkdtemp(prefix="kvcached-broker-demo-"))
    endpoint = f"ipc://{workdir}/gpu0.sock"
    env = {**os.environ, "KVCACHED_BROKER": endpoint}
    launcher = BrokerLauncher(endpoint, state_dir=workdir / "state", args=["--lease", "5", "--log-level", "warning"],
                              log=workdir / "broker.log", env=env)
    workers: list[subprocess.Popen] = []
    try:
        launcher.start()
        admin = launcher.admin()
        for role in ROLES:
            workers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "kvcached_broker.tools.demo", role, endpoint, str(seconds + 5)], env=env
                )
            )
            _wait_for_instance(admin, role, workers[-1])
        interactive = sys.stdout.isatty()
        end = time.monotonic() + seconds
        last_print = 0.0
        while time.monotonic() < end:
            try:
                frame = render_bars(admin.status())
            except BrokerUnavailable as exc:
                frame = f"broker unreachable: {exc.message}"
            now = time.monotonic()
            if interactive:
                sys.stdout.write(CLEAR_HOME + f"kvcached-broker demo: {end - now:4.1f}s left\n\n{frame}\n")
                sys.stdout.flush()
            elif now - last_print >= 2.0:
                print(f"--- t={seconds - (end - now):4.1f}s\n{frame}\n", flush=True)
                last_print = now
            time.sleep(0.5)  # the redraw interval of a live view
        final = admin.status()
        print("\nfinal:\n" + render_bars(final), flush=True)
        admin.close()
        return 0
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
        for worker in workers:
            try:
                worker.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.kill()
        launcher.stop()
        if not keep:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)


def _wait_for_instance(admin, name: str, worker: subprocess.Popen) -> None:
    """Start workers one at a time, so each has reported its reservations before the next."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and worker.poll() is None:
        if name in _reported(admin.status()):
            return
        time.sleep(0.05)


def _reported(status: dict) -> set[str]:
    """The instances that have reported their reservations."""
    return {inst["name"] for inst in status["instances"] if inst["reserved_bytes"]}


# ------------------------------------------------------------------ workers


def _wait_for_everyone(client, stop: list, timeout_s: float = 30.0) -> None:
    """Until every role has reported its reservations (a KV demand that started earlier could
    take the room a later worker's weights need, as it did on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while not stop and time.monotonic() < deadline:
        if _reported(client.status()).issuperset(ROLES):
            return
        time.sleep(0.05)
def _worker(role: str, endpoint: str, seconds: float) -> int:
    from ..client import BrokerClient

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    page_bytes = ELASTIC_PAGE_BYTES
    with BrokerClient.connect(role, endpoint=endpoint, page_bytes=page_bytes, credit_pages=2) as client:
        if role == "deepseek-v4":
            client.reserve(DSV4_POOLS)
            client.acquire(32)
            while not stop and seconds > 0:
                time.sleep(0.1)
                seconds -= 0.1
            return 0
        client.reserve({"weights": 16 * GIB})
        _wait_for_everyone(client, stop)  # the KV demand starts once every worker's weights are in
        phase = 0.0 if role == "llama-a" else math.pi / 2
        peak_pages = (20 * GIB) // page_bytes
        start = time.monotonic()
        while not stop and time.monotonic() - start < seconds:
            t = time.monotonic() - start
            want = int(peak_pages * (0.1 + 0.9 * math.sin(t * 0.9 + phase) ** 2))
            held = client.held_pages
            if want > held:
                client.acquire(want - held, min_pages=1)
            elif want < held:
                client.release(held - want)
            time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2], float(sys.argv[3])))
