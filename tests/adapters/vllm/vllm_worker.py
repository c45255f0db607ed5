"""A vLLM worker process for cross-runtime tests: vLLM's own planner and allocation, adapter on.

    vllm_worker.py KV_BYTES

With ENABLE_KVCACHED=1 and KVCACHED_BROKER pointing at a broker, it builds a DeepSeek-V4-shaped
KVCacheConfig (a hybrid one on vLLM releases without the V4 spec fields), allocates it through
the module attribute vLLM's GPU model runner uses (the adapter's patch is on it), prints one
JSON line with the buffer's bytes, and waits for end of input.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    kv_bytes = int(sys.argv[1])
    from kvcached_broker.adapters import autopatch

    import vllm_shapes as shapes

    vc, kv_cfg = shapes.dsv4_config(kv_bytes) if shapes.has_v4_specs() else shapes.hybrid_config(kv_bytes)
    caches = shapes.allocate(vc, kv_cfg)
    from kvcached_broker.adapters.tensors import storage_bytes

    print(json.dumps({"pid": os.getpid(), "hook": autopatch.hook_installed(), "v4": shapes.has_v4_specs(),
                      "buffer_bytes": storage_bytes(caches)}), flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
