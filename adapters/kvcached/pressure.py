"""Broker pressure to the pools of one session: one callback per client, fanned out.

A process's pools share its per-device session, and a client has one ``on_pressure``
callback.  :func:`enlist` registers it once per client; an ask for ``n`` session pages is
split over that client's pools, the most idle first (granted minus in use), in pool pages,
and the governors' thread is woken.  The callback returns 0 at once: the pages go back on the
governors' thread as kvcached unmaps them, and the broker counts what a session releases
after an ask as returned.  So the client's background thread never waits on kvcached, and no
lock is taken inside another (a nested client lock and manager lock could deadlock).
"""

from __future__ import annotations

import math
import threading
import weakref

from . import runner

_lock = threading.Lock()
_pools: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # client -> WeakSet of governors


def enlist(client, governor) -> None:
    with _lock:
        pools = _pools.get(client)
        if pools is None:
            pools = _pools[client] = weakref.WeakSet()
            ref = weakref.ref(client)
            client.on_pressure(lambda pages: _answer(ref, pages))
        pools.add(governor)


def _answer(client_ref, session_pages: int) -> int:
    client = client_ref()
    with _lock:
        pools = list(_pools.get(client, ())) if client is not None else []
    split(pools, session_pages)
    runner.wake()
    return 0


def split(governors, session_pages: int) -> dict[object, int]:
    """Ask ``governors`` for ``session_pages`` back, most idle first; ``{governor: pool pages}``."""
    live = [g for g in governors if g.governed and g.grants is not None and g.grants.pages > 0]
    live.sort(key=lambda g: g.grants.pages - g.real.get_num_inuse_pages(), reverse=True)
    asked: dict[object, int] = {}
    left = session_pages
    for governor in live:
        if left <= 0:
            break
        pages = min(governor.grants.pages, math.ceil(left / governor.grants.ratio))
        governor.ask_back(pages)
        asked[governor] = pages
        left -= pages * governor.grants.ratio
    return asked
