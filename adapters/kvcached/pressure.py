"""Broker pressure to the pools of one session: one callback per client, fanned out.

A process's pools share its per-device session, and a client has one ``on_pressure``
callback.  :func:`enlist` registers it once per client; an ask for ``n`` session pages is
split over that client's pools, the most idle first (granted minus in use), in pool pages,
and the governors' thread is woken.  The callback returns 0 at once: the pages go back on the
governors' thread as kvcached unmaps them, and the broker counts what a session releases
after an ask as returned.  So the client's background thread never waits on kvcached, and no
lock is taken inside another (a nested client lock and manager lock could deadlock).

**Uncharged pages.**  A broker that restarted and could not grant a session back everything
it held (its re-assertion came back short) charges fewer pages than the session's pools hold;
the client books the difference as ``uncharged_pages`` and gives those back first, with no
request, on its next releases.  :func:`check_shortfalls` (the governors' thread, every round)
asks the client's pools for them exactly as for a pressure ask (:func:`split`), once per
shortfall, and :func:`unasked_shortfall` lets the engine's allocation path miss until they
were asked, so no page is mapped that the broker does not charge.
"""

from __future__ import annotations

import math
import threading
import weakref

from .. import announce, process_state
from . import runner

log = announce.logger("kvcached_broker.adapters")

class _Pressure:
    """Which governors each client's pressure reaches, and how many of each client's uncharged
    pages were asked back already; both weakly keyed by client (a closed client that is gone
    takes its entries with it).  ``lock`` guards ``pools``; ``short_asked`` is written on the
    governors' thread only and read without a lock on the engine's path.  A client is given
    its pressure callback once, when it first appears in ``pools``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pools: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # client -> WeakSet of governors
        self.short_asked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # client -> pages asked back


def enlist(client, governor) -> None:
    """Let broker pressure on ``client``'s session reach ``governor`` (its shortfalls too: from
    now on :func:`check_shortfalls` runs first in every round of the governors' thread)."""
    runner.first_in_every_round(check_shortfalls, "kvcached_shortfall_check_failed")
    state = process_state.part(_Pressure)
    with state.lock:
        pools = state.pools.get(client)
        if pools is None:
            pools = state.pools[client] = weakref.WeakSet()
            ref = weakref.ref(client)
            client.on_pressure(lambda pages: _answer(ref, pages), soft=lambda pages: _answer(ref, pages, soft=True))
        pools.add(governor)


def _answer(client_ref, session_pages: int, soft: bool = False) -> int:
    client = client_ref()
    state = process_state.part(_Pressure)
    with state.lock:
        pools = list(state.pools.get(client, ())) if client is not None else []
    split(pools, session_pages, soft=soft)
    runner.wake()
    return 0


def split(governors, session_pages: int, *, soft: bool = False) -> dict[object, int]:
    """Ask ``governors`` for ``session_pages`` back, most idle first; ``{governor: pool pages}``."""
    live = [g for g in governors if g.governed and g.grants is not None and g.grants.pages > 0]
    live.sort(key=lambda g: g.grants.pages - g.real.get_num_inuse_pages(), reverse=True)
    asked: dict[object, int] = {}
    left = session_pages
    for governor in live:
        if left <= 0:
            break
        pages = min(governor.grants.pages, math.ceil(left / governor.grants.ratio))
        governor.ask_back(pages, soft=soft)
        asked[governor] = pages
        left -= pages * governor.grants.ratio
    return asked


def uncharged_pages(client) -> int:
    """Session pages ``client`` holds that its broker does not charge (a re-assertion that came
    back short).  The client books them (``BrokerClient.uncharged_pages``); a client without that
    book has none."""
    found = getattr(client, "uncharged_pages", 0)
    try:
        return max(0, int(found or 0))
    except (TypeError, ValueError):
        return 0


def unasked_shortfall(client) -> int:
    """Uncharged session pages of ``client`` not yet asked of its pools (the engine's path: no
    lock, no round trip)."""
    return uncharged_pages(client) - process_state.part(_Pressure).short_asked.get(client, 0)


def check_shortfalls() -> None:
    """Ask each client's pools for the pages its broker no longer charges (the governors' thread).

    Each shortfall is asked once, split as a pressure ask is (most idle pool first): a pool
    lowers its limit over free pages and releases at once, evicts its prefix cache and defers
    the rest.  The client gives uncharged pages back first, without a request, so what the
    pools release settles the shortfall, and the asked figure follows it down."""
    state = process_state.part(_Pressure)
    with state.lock:
        clients = [(client, list(pools)) for client, pools in state.pools.items()]
    for client, pools in clients:
        uncharged = uncharged_pages(client)
        asked = min(state.short_asked.get(client, 0), uncharged)
        if uncharged > asked:
            split(pools, uncharged - asked)
            log.warning("event=kvcached_uncharged_pages session=%s session_pages=%d detail=the broker charges fewer "
                        "pages than the pools hold (a short re-assertion); asked back from the pools",
                        getattr(client, "session_id", None), uncharged - asked)
            asked = uncharged
        state.short_asked[client] = asked
