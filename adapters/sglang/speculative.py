"""Speculative decoding: whether draft KV pools follow a target's pools in this process.

With MTP, EAGLE, EAGLE3, STANDALONE, DFlash or frozen-KV MTP, SGLang builds a draft worker
in the scheduler process of every TP rank, and its model runner(s) build their own KV pools
right after the target's (0.5.23: ``Scheduler.init_memory_pools``, draft after target;
0.5.12-0.5.13: the draft worker is built after the target worker).  Every release sizes the
target's KV budget to cover the draft's per-token KV too (DFlash and DeepSeek-V4 MTP since
0.5.12; EAGLE/MTP of the target's shape in 0.5.23).  NGRAM and UNO have no draft model and
build no draft pool.

Read from the object SGLang sizes the pools on: ``KVCacheConfigurator`` (0.5.16+) or the
``ModelRunner`` (before), both with ``spec_algorithm`` and ``is_draft_worker``.
"""

from __future__ import annotations

from typing import Any

#: ``SpeculativeAlgorithm`` predicates of algorithms that build no draft pool
_NO_DRAFT_POOL = ("is_none", "is_ngram", "is_uno")


def is_draft(owner: Any) -> bool:
    """True for a draft worker's configurator or model runner."""
    return bool(getattr(owner, "is_draft_worker", False))


def drafts_follow(owner: Any) -> bool:
    """True when draft pools will be built in this process after ``owner``'s (a target's)."""
    if owner is None or is_draft(owner):
        return False
    algorithm = getattr(owner, "spec_algorithm", None)
    if algorithm is None:
        return False
    for predicate in _NO_DRAFT_POOL:
        check = getattr(algorithm, predicate, None)
        if callable(check) and check():
            return False
    return True
