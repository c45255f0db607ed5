"""The two drivers of the one client core: ``BrokerClient`` (threads) and ``AsyncBrokerClient``.

They have the same public surface (the async one with coroutines), the same calls run through
either against a real broker end in the same books, on both sides, and the package's lazy
re-exports keep pyzmq out of the broker's request core.
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
from typing import Any

import pytest

from kvcached_broker.client import AsyncBrokerClient, BrokerClient

from helpers import GIB

#: Methods that are plain functions on both clients (registering a callback does no I/O).
PLAIN_ON_BOTH = {"on_pressure", "report_idle"}


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def _parameters(fn: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_both_clients_have_the_same_public_surface():
    assert _public(BrokerClient) == _public(AsyncBrokerClient)
    for name in sorted(_public(BrokerClient)):
        plain, coro = inspect.getattr_static(BrokerClient, name), inspect.getattr_static(AsyncBrokerClient, name)
        assert type(plain) is type(coro), name  # a property on one is a property on the other
        if isinstance(plain, property):
            continue
        sync_fn, async_fn = getattr(BrokerClient, name), getattr(AsyncBrokerClient, name)
        assert _parameters(sync_fn) == _parameters(async_fn), name
        assert not inspect.iscoroutinefunction(sync_fn), name
        assert inspect.iscoroutinefunction(async_fn) == (name not in PLAIN_ON_BOTH), name
    assert {"__enter__", "__exit__"} <= set(dir(BrokerClient))
    assert {"__aenter__", "__aexit__"} <= set(dir(AsyncBrokerClient))
    assert _parameters(BrokerClient.__init__) == _parameters(AsyncBrokerClient.__init__)


#: The same calls for both drivers: (method, args, kwargs).
SCENARIO: list[tuple[str, tuple, dict]] = [
    ("reserve", ({"weights": 3 * GIB},), {"holds": {"kv": GIB}}),
    ("acquire", (2,), {}),  # asks 4: 2 held, 2 in reserve
    ("acquire", (1,), {}),  # from the reserve
    ("acquire", (20,), {"min_pages": 3}),  # the most that fit
    ("release", (4,), {}),  # into the reserve, up to its high watermark
    ("acquire_tp", (3, lambda local: min(local, 2)), {}),  # another rank got 2: 1 back
    ("reserve", ({"weights": 3 * GIB},), {"holds": {}}),  # the hold is gone
    ("release", (10,), {}),  # the surplus above the high watermark goes back
    ("heartbeat", (), {}),
]


def _books(client: Any, broker: Any) -> dict[str, Any]:
    session = broker.ledger.sessions[client.session_id]
    return {
        "client": (client.held_pages, client.reserve_pages, client.pools, client.holds, client.pressure_log),
        "broker": (session.granted_pages, session.reserve_pages, dict(session.pools), dict(session.holds)),
    }


def _run_sync(broker: Any) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    with BrokerClient.connect("same", endpoint=broker.endpoint, page_bytes=GIB, credit_pages=2,
                              background=False) as c:
        results = [getattr(c, name)(*args, **kwargs) for name, args, kwargs in SCENARIO]
        status = c.status()
        return results, _books(c, broker), _status_books(status)


async def _run_async(broker: Any) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    async with await AsyncBrokerClient.connect("same", endpoint=broker.endpoint, page_bytes=GIB, credit_pages=2,
                                               background=False) as c:
        results = [await getattr(c, name)(*args, **kwargs) for name, args, kwargs in SCENARIO]
        status = await c.status()
        return results, _books(c, broker), _status_books(status)


def _status_books(status: dict[str, Any]) -> dict[str, Any]:
    (instance,) = status["instances"]
    return {key: status[key] for key in ("granted_bytes", "reserved_bytes", "free_bytes")} | {
        "reserve_pages": [s["reserve_pages"] for s in instance["sessions"]]}


def test_the_same_calls_through_both_drivers_end_in_the_same_books(inproc_factory):
    broker = inproc_factory(total_bytes=16 * GIB)
    sync_run = _run_sync(broker)
    assert broker.status()["instances"] == []  # closed: nothing left for the second run
    async_run = asyncio.run(_run_async(broker))
    assert sync_run == async_run
    results, books, status = sync_run
    assert results[1:6] == [2, 1, 9, None, 2]
    assert books["client"][:2] == (0, 2) and books["broker"] == (2, 2, {"weights": 3 * GIB}, {})
    assert status["granted_bytes"] == 2 * GIB and status["reserve_pages"] == [2]


def test_importing_the_request_core_does_not_import_zmq():
    code = (
        "import sys\n"
        "import kvcached_broker.broker.request_core\n"
        "import kvcached_broker.client as client\n"
        "assert 'zmq' not in sys.modules, sorted(m for m in sys.modules if 'zmq' in m)\n"
        "assert client.BudgetExceeded.code == 'budget_exceeded'\n"  # errors stay eager
        "from kvcached_broker.client import BrokerClient, AsyncBrokerClient\n"
        "from kvcached_broker.client.sync_client import BrokerClient as Defined\n"
        "assert BrokerClient is Defined and 'zmq' in sys.modules\n"
        "from kvcached_broker.client import *\n"
        "assert AsyncBrokerClient.__name__ == 'AsyncBrokerClient'\n"
        "try:\n"
        "    client.NoSuchThing\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('an unknown name must be an AttributeError')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999", "0", "-2", "soon"])
def test_a_bad_KVCACHED_BROKER_TIMEOUT_S_is_one_clear_error_naming_the_variable(monkeypatch, short_tmp, value):
    """``nan`` and ``inf`` raised a bare ValueError / OverflowError from deep in the transport."""
    from kvcached_broker.client.errors import BrokerUnavailable

    monkeypatch.setenv("KVCACHED_BROKER_TIMEOUT_S", value)
    for connect in (lambda: BrokerClient.connect("m", endpoint=f"ipc://{short_tmp}/none.sock"),
                    lambda: asyncio.run(AsyncBrokerClient.connect("m", endpoint=f"ipc://{short_tmp}/none.sock"))):
        with pytest.raises(BrokerUnavailable) as raised:
            connect()
        assert "KVCACHED_BROKER_TIMEOUT_S" in raised.value.message and "\n" not in raised.value.message
        assert "positive number of seconds" in raised.value.message


def test_a_socket_that_fails_is_the_broker_unavailable_not_a_zeromq_error(short_tmp):
    from kvcached_broker.client import BrokerUnavailable
    from kvcached_broker.client.transport import SyncTransport, Timeouts

    transport = SyncTransport(f"ipc://{short_tmp}/nobody.sock", Timeouts(0.2, 0.4))
    transport._sock.close(0)  # as a ZeroMQ context torn down under the client would leave it
    with pytest.raises(BrokerUnavailable, match="the socket failed"):
        transport.request(b"x", 1)
