"""A vLLM worker process for cross-runtime tests: vLLM's own planner and allocation, adapter on.

    vllm_worker.py KV_BYTES
        with ENABLE_KVCACHED=1 and KVCACHED_BROKER pointing at a broker, build a
        DeepSeek-V4-shaped KVCacheConfig (a hybrid one on vLLM releases without the V4 spec
        fields), allocate it through the module attribute vLLM's GPU model runner uses (the
        adapter's patch is on it), print one JSON line with the buffer's bytes, and wait for
        end of input.
    vllm_worker.py together PROFILED_BYTES
        open the broker session and print {"event": "ready", "pid": ...}; on a line from the
        test (the moment every instance sizes at once), run vLLM's Worker.determine_available_memory
        through the adapter's wrapper, with PROFILED_BYTES as vLLM's own profile; print what it
        got (held) or the start-up error it raised, and wait for end of input.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def allocate(kv_bytes: int) -> int:
    from kvcached_broker.adapters import autopatch

    import vllm_shapes as shapes

    vc, kv_cfg = shapes.dsv4_config(kv_bytes) if shapes.has_v4_specs() else shapes.hybrid_config(kv_bytes)
    caches = shapes.allocate(vc, kv_cfg)
    from kvcached_broker.adapters.tensors import storage_bytes

    say(pid=os.getpid(), hook=autopatch.hook_installed(), v4=shapes.has_v4_specs(), buffer_bytes=storage_bytes(caches))
    sys.stdin.read()
    return 0


def together(profiled_bytes: int) -> int:
    import vllm.v1.worker.gpu_worker  # noqa: F401  (patched on import, before the moment)

    import vllm_shapes as shapes

    from kvcached_broker.adapters import sessions
    from kvcached_broker.adapters.vllm import parallel
    from kvcached_broker.adapters.vllm.kv_budget import KVCacheBudgetError

    gpu_worker, determine = shapes.gpu_worker(), shapes.determine(profiled_bytes)
    sessions.session(parallel.identity(0))  # registered: the device now counts its weights as its own
    say(event="ready", pid=os.getpid())
    if not sys.stdin.readline():
        return 0
    try:
        say(event="sized", kv_bytes=determine(gpu_worker))
    except KVCacheBudgetError as exc:
        say(event="refused", error=str(exc))
    sys.stdin.read()
    return 0


def main(argv: list[str]) -> int:
    if argv[0] == "together":
        return together(int(argv[1]))
    return allocate(int(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
