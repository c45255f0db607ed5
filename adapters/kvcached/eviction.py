"""What the runtime's prefix cache can give back under pressure: the hook the wiring implements.

A prefix cache (SGLang's radix cache, vLLM's cached free blocks) keeps blocks no running
request uses; kvcached can only unmap a page once every block on it is freed.  Under broker
pressure the governor asks the pool's hook to evict about ``pages`` pool pages' worth of such
blocks.  The SGLang and vLLM wiring registers one per pool with
:func:`register_eviction_hook`.

Contract for an :class:`EvictionHook`:

* ``evict(pages)`` may be called on the governor's thread, not the runtime's: a cache that is
  not thread-safe must queue the eviction for its own thread (the scheduler's next step) and
  return 0;
* it frees only blocks no running request uses, through the runtime's normal free path (so
  kvcached's ``free`` returns the pages);
* it returns how many blocks it freed now (0 if none, or if it only queued work) and never
  raises into the governor (a failure is logged and counts as 0).

The governor does not trust the return value for accounting: it re-reads what kvcached has
in use and releases only what kvcached reports unmapped.

A hook may also have ``cached_pages() -> int``: about how many pool pages its cache could free
now (on any thread, cheap, never raising).  The governor then tells the broker those pages are
idle (``BrokerClient.report_idle``: the broker asks idle pages first, and asks pools at or
below their share for idle pages only), and a limit deferred below what is in use evicts what
requests leave in the cache as they finish, at its next round.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

from .. import process_state


class EvictionHook(Protocol):
    def evict(self, pages: int) -> int: ...  # optional: def cached_pages(self) -> int


class _Hooks:
    """Each live kvcached manager's prefix-cache hook (weakly keyed: a manager that is gone
    takes its hook with it)."""

    def __init__(self) -> None:
        self.by_manager: "weakref.WeakKeyDictionary[Any, EvictionHook]" = weakref.WeakKeyDictionary()


def register_eviction_hook(manager: Any, hook: EvictionHook | None) -> None:
    """Give ``manager`` (a kvcached ``KVCacheManager``) a prefix-cache hook (None removes it)."""
    hooks = process_state.part(_Hooks).by_manager
    if hook is None:
        hooks.pop(manager, None)
    else:
        hooks[manager] = hook


def hook_for(manager: Any) -> EvictionHook | None:
    return process_state.part(_Hooks).by_manager.get(manager)
