"""The scheduler's model-worker start-up: the KV sizing hold lives until every pool is built.

``Scheduler.init_model_worker`` (``sglang.srt.managers.scheduler``, every supported release)
builds everything that holds KV memory in a scheduler process: the target worker's pools and
then the draft worker's (0.5.23: ``init_memory_pools``, target then draft, each worker's
model runners in turn; 0.5.12-0.5.13: the target worker, then the draft worker).  Inside it,
pool reports only shrink the KV sizing hold (``reporting``); when it returns (or fails),
what is left of the hold is dropped.  Draft pools, however many runners build them,
therefore come out of the hold and never race other instances for fresh room.

Outside this scope (a release where the patch could not apply, or pools built elsewhere),
``kv_sizing.charge_pools`` drops the hold with the last pool it expects
(``speculative.drafts_follow``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .. import process_state
from ..patching import wrap_methods, wrap_once
from . import reporting


class _StartUps:
    """How many model-worker start-ups are building pools in this process now (``depth`` >= 0,
    guarded by ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0


def active() -> bool:
    """True while a model-worker start-up is building pools in this process."""
    state = process_state.part(_StartUps)
    with state.lock:
        return state.depth > 0


@contextlib.contextmanager
def kv_startup() -> Iterator[None]:
    """The scope of one start-up: the sizing hold is dropped when the outermost one ends."""
    state = process_state.part(_StartUps)  # the one this scope counted in, ended in, even across a reset
    with state.lock:
        state.depth += 1
    try:
        yield
    finally:
        with state.lock:
            state.depth -= 1
            outermost = state.depth == 0
        if outermost:
            reporting.end_start_ups()


def wrap_init_model_worker(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_model_worker(self: Any, *args: Any, **kwargs: Any) -> Any:
        with kv_startup():
            return original(self, *args, **kwargs)

    return wrap_once(original, init_model_worker)


def apply_scheduler(module: Any) -> None:
    """Patch ``Scheduler.init_model_worker`` in ``sglang.srt.managers.scheduler``."""
    wrap_methods(module, "Scheduler", {"init_model_worker": wrap_init_model_worker})
