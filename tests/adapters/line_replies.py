"""A test process's reply channel (the kvcached-mode vLLM engine and workers, ``vllm/tp_engine.py``
and ``vllm/tp_worker.py``; an SGLang rank, ``sglang/sglang_rank.py``): one JSON line per reply on
the stdout it was started with; everything else it prints (kvcached prints) goes to stderr."""

from __future__ import annotations

import json
import os
import sys
from typing import Callable


def open_channel() -> Callable[[dict], None]:
    """Keep this process's stdout for replies and send every other print to stderr; the reply
    function."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj: dict) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    return reply
