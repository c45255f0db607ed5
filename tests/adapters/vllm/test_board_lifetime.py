"""No board or doorbell outlives the engine: after EngineCore and its TP workers exit, and after a
SIGKILL of all of them followed by a fresh start, nothing of theirs is left in ``/dev/shm`` (the
board) or among the abstract Unix sockets (the doorbells, ``/proc/net/unix``).
"""

from __future__ import annotations

import pytest
from kvcached_vllm_harness import overlay  # noqa: F401  (autouse: kvcached and vLLM at the overlay's versions)
from kvcached_vllm_harness import gpus, processes  # noqa: F401  (fixtures)
import os

from tp_harness import BLOCKS_PER_PAGE, Processes

from kvcached_broker.adapters.kvcached import liveness

pytestmark = pytest.mark.runtime("kvcached", "vllm")

DOORBELL = "@kvcached-broker-doorbell-"


def doorbells(pids: list[int]) -> list[str]:
    """The doorbell sockets of ``pids`` (of this PID namespace) still bound on this host:
    ``<prefix><pid namespace>-<pid>-<token>``."""
    prefixes = tuple(f"{DOORBELL}{liveness.pid_namespace()}-{pid}-" for pid in pids)
    with open("/proc/net/unix") as f:
        return [line.split()[-1] for line in f if line.split() and line.split()[-1].startswith(prefixes)]


def start(gpus, processes: Processes):
    workers = [processes.worker(gpu, rank, 2) for rank, gpu in enumerate(gpus)]
    assert all(w.ready["registered"] for w in workers)
    engine = processes.engine(2)
    assert engine.request("fill", blocks=4 * BLOCKS_PER_PAGE)["got"] == 4 * BLOCKS_PER_PAGE
    return engine, workers


def test_no_board_or_doorbell_is_left_after_exit_nor_after_a_sigkill_and_a_fresh_start(gpus, processes, short_tmp):
    gpu0, gpu1 = gpus(2)
    engine, workers = start([gpu0, gpu1], processes)
    path = processes.board_path()
    assert os.path.exists(path) and len(doorbells([engine.pid] + [w.pid for w in workers])) == 3
    killed = [engine.pid] + [w.pid for w in workers]
    for process in (engine, *workers):  # nobody leaves the board: it stays, naming dead processes
        process.proc.kill()
        process.proc.wait(timeout=30)
    assert os.path.exists(path)

    (short_tmp / "fresh").mkdir()
    fresh = Processes(short_tmp / "fresh")  # another instance (its own board) starts on the same host
    processes.on_stop(fresh.stop_all)
    engine, workers = start([gpu0, gpu1], fresh)
    assert not os.path.exists(path)  # its first worker swept the board whose every writer died
    fresh_path = fresh.board_path()
    assert os.path.exists(fresh_path)
    pids = [engine.pid] + [w.pid for w in workers]

    fresh.stop_all()  # EngineCore first, then the workers: the last one out removes the board
    assert not os.path.exists(fresh_path)
    assert doorbells(killed + pids) == []


def test_the_board_goes_when_the_workers_exit_before_engine_core(gpus, processes):
    gpu0, gpu1 = gpus(2)
    engine, workers = start([gpu0, gpu1], processes)
    path = processes.board_path()
    for worker in workers:
        worker.stop()
    assert os.path.exists(path)  # EngineCore still maps it: a leaving worker never removes it
    engine.stop()
    assert not os.path.exists(path)
    assert doorbells([engine.pid] + [w.pid for w in workers]) == []
