"""A worker process for the SGLang adapter tests: real SGLang pools, the adapter on.

It speaks JSON lines: one on stdout per step it reaches, and it waits on stdin between steps
(a line to go on; end of input to exit), so a test can look at the broker while it is alive.

    sglang_worker.py dsv4 FULL_PAGES SWA_PAGES [--explicit-apply]
        build a DeepSeekV4TokenToKVPool; print its per-pool tensor bytes
    sglang_worker.py together FREE_BYTES PRE_LOAD_BYTES
        open the broker session and print {"event": "ready", "pid": ...}; on a line from the
        test (the moment every instance sizes at once), run SGLang's real KV profile seeing
        FREE_BYTES free (PRE_LOAD_BYTES before the weights loaded); print the budget it got
        (held) or the start-up error it raised
    sglang_worker.py tp RANK WORLD PORT FULL_PAGES [FREE_BYTES]
        join a gloo TP group through SGLang's own parallel state; with FREE_BYTES, run SGLang's
        real KV profile over the real world group first (then drop its hold); build a
        DeepSeek-V4 pool and print its per-pool tensor bytes

    sglang_worker.py occupation RANK WORLD PORT
        join a gloo TP group; build a DeepSeek-V4 pool (reported); on a line, release memory
        occupation (every tag) through SGLang's own method, on the next resume it; print what
        each step raised and how many adapter collectives (TP min-reduces) it ran

The dsv4 mode configures logging as an SGLang scheduler does (SGLang's own ``configure_logger``,
at ``--log-level error``) before anything reaches the broker.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def wait() -> bool:
    """True on a line from the test, False at end of input."""
    return bool(sys.stdin.readline())


def dsv4(full_pages: int, swa_pages: int, explicit: bool) -> None:
    from kvcached_broker.adapters import autopatch

    if explicit:
        autopatch.apply(["sglang"])
    import sglang_cpu

    sglang_cpu.configure_logging("error")
    pool = sglang_cpu.build_dsv4_pool(full_pages, swa_pages)
    say(pid=os.getpid(), hook=autopatch.hook_installed(), pools=sglang_cpu.tensor_bytes_by_pool(pool))
    wait()


def together(free_bytes: int, pre_load_bytes: int) -> int:
    import sglang_cpu

    from kvcached_broker.adapters import sessions
    from kvcached_broker.adapters.sglang import kv_budget, parallel

    profiler = sglang_cpu.profiler(free_bytes)  # SGLang imported before the moment, not during it
    sessions.session(parallel.identity("cpu"))  # registered: the device now counts its weights as its own
    say(event="ready", pid=os.getpid())
    if not wait():
        return 0
    try:
        kv_bytes = sglang_cpu.run_profile(profiler, pre_load_bytes)
    except kv_budget.BrokerBudgetError as exc:
        say(event="refused", error=str(exc))
        wait()
        return 3
    say(event="sized", kv_bytes=kv_bytes)
    wait()
    return 0


def init_tp(rank: int, world: int, port: int) -> None:
    import sglang.srt.distributed.parallel_state as ps

    ps.init_distributed_environment(world_size=world, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                    local_rank=rank, backend="gloo")
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=world)  # up to 0.5.15
    except TypeError:  # later releases read the widths from the published server args
        from sglang.srt.runtime_context import get_context

        get_context().override_server_args(tp_size=world).__enter__()
        ps.initialize_model_parallel()


def tensor_parallel(rank: int, world: int, port: int, full_pages: int, free_bytes: int | None) -> None:
    import sglang_cpu

    from kvcached_broker.adapters.sglang import reporting, parallel

    init_tp(rank, world, port)
    group = parallel.tp_group()
    kv_bytes = None
    if free_bytes is not None:
        kv_bytes = sglang_cpu.profile(free_bytes, real_world_group=True)
        reporting.release_hold(parallel.identity("cpu"))
    pool = sglang_cpu.build_dsv4_pool(full_pages, full_pages // 4)
    say(rank=group.rank, size=group.size, kv_bytes=kv_bytes, pools=sglang_cpu.tensor_bytes_by_pool(pool))
    wait()


def occupation(rank: int, world: int, port: int) -> None:
    import sglang_cpu

    from kvcached_broker.adapters import sessions
    from kvcached_broker.adapters.sglang import parallel

    init_tp(rank, world, port)
    collectives = _count_collectives(parallel.RankGroup)
    pool = sglang_cpu.build_dsv4_pool(16, 4)  # reported while it lives
    client = sessions.session(parallel.identity("cpu")).client
    updater = sglang_cpu.weight_updater(sglang_cpu.MemorySaver(), parallel.tp_group().cpu_group)
    say(event="ready", rank=rank, pid=os.getpid(), session=client.session_id)
    for step, run in (("release", sglang_cpu.release), ("resume", sglang_cpu.resume)):
        if not wait():
            return
        collectives.clear()
        try:
            run(updater)
            say(event=step, rank=rank, error=None, collectives=len(collectives))
        except Exception as exc:  # noqa: BLE001 - the test wants to see what it was
            say(event=step, rank=rank, error=type(exc).__name__, message=str(exc), collectives=len(collectives))
    wait()
    del pool


def _count_collectives(group_class) -> list[int]:
    """Record every ``reduce_min`` the adapter runs over a group (the calls go on to the real one)."""
    calls: list[int] = []
    real = group_class.reduce_min

    def reduce_min(self, value: int) -> int:
        calls.append(value)
        return real(self, value)

    group_class.reduce_min = reduce_min
    return calls


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "dsv4":
        dsv4(int(argv[1]), int(argv[2]), "--explicit-apply" in argv)
    elif mode == "together":
        return together(int(argv[1]), int(argv[2]))
    elif mode == "occupation":
        occupation(int(argv[1]), int(argv[2]), int(argv[3]))
    elif mode == "tp":
        tensor_parallel(int(argv[1]), int(argv[2]), int(argv[3]), int(argv[4]), int(argv[5]) if len(argv) > 5 else None)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
