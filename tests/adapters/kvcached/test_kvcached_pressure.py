"""kvcached mode's pressure fan-out and the uncharged-page ledger, alone (no kvcached needed).

A broker that restarted and could not grant a session everything back leaves the client with
``uncharged_pages``; the pools of that client are asked for them once, split as a pressure ask
(most idle first), and the asked figure follows the uncharged one down as pages go back.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvcached_broker.adapters.kvcached import pressure


class Pool:
    """What :func:`pressure.split` reads of a governor."""

    def __init__(self, granted: int, inuse: int, ratio: int = 8):
        self.governed = True
        self.grants = SimpleNamespace(pages=granted, ratio=ratio)
        self.real = SimpleNamespace(get_num_inuse_pages=lambda: inuse)
        self.asked = 0
        self.soft_asked = 0

    def ask_back(self, pages: int, *, soft: bool = False) -> None:
        if soft:
            self.soft_asked += pages
        else:
            self.asked += pages


class Client:
    """The part of a ``BrokerClient`` pressure uses: its uncharged-page book and callback."""

    def __init__(self):
        self._core = SimpleNamespace(uncharged_pages=0)
        self.session_id = "s-test"
        self.callback = None
        self.soft_callback = None

    @property
    def uncharged_pages(self) -> int:
        return self._core.uncharged_pages

    def on_pressure(self, callback, *, soft=None) -> None:
        self.callback = callback
        self.soft_callback = soft


def test_a_short_reassertion_is_asked_of_the_pools_once_most_idle_first():
    client = Client()
    busy, idle = Pool(granted=10, inuse=9), Pool(granted=10, inuse=2)
    pressure.enlist(client, busy)
    pressure.enlist(client, idle)
    pressure.check_shortfalls()
    assert pressure.unasked_shortfall(client) == 0 and busy.asked == idle.asked == 0

    client._core.uncharged_pages = 96  # 12 pool pages of 8 session pages
    assert pressure.unasked_shortfall(client) == 96  # the engine's allocations miss meanwhile
    pressure.check_shortfalls()
    assert (idle.asked, busy.asked) == (10, 2)  # the most idle pool first
    assert pressure.unasked_shortfall(client) == 0
    pressure.check_shortfalls()  # asked once, not every round
    assert (idle.asked, busy.asked) == (10, 2)

    client._core.uncharged_pages = 40  # the pools gave some back (the client books them first)
    pressure.check_shortfalls()
    assert (idle.asked, busy.asked) == (10, 2)
    client._core.uncharged_pages = 56  # a second short re-assertion: only the new part is asked
    pressure.check_shortfalls()
    assert idle.asked + busy.asked == 12 + 2


def test_a_client_without_an_uncharged_book_has_none():
    assert pressure.uncharged_pages(SimpleNamespace()) == 0
    assert pressure.uncharged_pages(SimpleNamespace(uncharged_pages=3)) == 3


def test_a_soft_ask_is_split_as_a_hard_one_and_marked_soft():
    """The broker's soft ask (idle memory only) reaches the pools through the client's soft
    callback, split most idle first, and never counts as a hard ask."""
    client = Client()
    busy, idle = Pool(granted=10, inuse=9), Pool(granted=10, inuse=2)
    pressure.enlist(client, busy)
    pressure.enlist(client, idle)
    assert client.soft_callback is not None
    assert client.soft_callback(96) == 0  # 12 pool pages; the pages go back on the governors' thread
    assert (idle.soft_asked, busy.soft_asked) == (10, 2)
    assert idle.asked == busy.asked == 0
    client.callback(8)
    assert (idle.asked, busy.asked) == (1, 0)
