"""The endpoint is checked again once something answers there (client/trust.py ``endpoint_guard``).

A check made only before the hello misses a socket directory that appears, or changes hands,
after it: the client would then believe an impostor.  Each test puts a fake broker (a real
ROUTER socket, answering as a broker would) where the client looks, owned by another user
(uid 4242) by the time it answers, and the sync client, the asyncio client and the admin
client must refuse it with ``UntrustedEndpoint`` and send it nothing more.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import msgpack
import pytest
import zmq

from kvcached_broker.client import AsyncBrokerClient, BrokerClient, BrokerError, UntrustedEndpoint, trust
from kvcached_broker.client.admin import AdminClient
from kvcached_broker.client.endpoint import ipc_path

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to own files as another user")

OTHER_UID = 4242


class Impostor:
    """A ROUTER at ``directory/gpu0.sock`` that answers like a broker and grants whatever is asked.

    When a request with op ``hand_over_on`` arrives, the directory and the socket pass to
    another user before it is answered.  ``not_owner_first`` answers the first session request
    with ``not_owner`` (as a restarted broker would), so the client resumes.  ``ops`` lists the
    ops it received, in order.
    """

    def __init__(self, directory: Path, *, hand_over_on: str | None = None, not_owner_first: bool = False):
        directory.mkdir(exist_ok=True)
        self.directory = directory
        self.endpoint = f"ipc://{directory}/gpu0.sock"
        self.hand_over_on = hand_over_on
        self.not_owner_first = not_owner_first
        self.ops: list[str] = []
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def hand_to_another_user(self) -> None:
        os.chown(self.directory / "gpu0.sock", OTHER_UID, OTHER_UID)
        os.chown(self.directory, OTHER_UID, OTHER_UID)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sock.close(0)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50, zmq.POLLIN):
                continue
            routing_id, body = self._sock.recv_multipart()
            message = msgpack.unpackb(body)
            self.ops.append(message["op"])
            reply = {"type": "reply", "id": message["id"], "ok": True, "result": self._answer(message)}
            if message["op"] == self.hand_over_on:
                self.hand_to_another_user()
            elif message["op"] != "hello" and self.not_owner_first:
                self.not_owner_first = False
                reply = {"type": "reply", "id": message["id"], "ok": False,
                         "error": {"code": "not_owner", "message": "restarted", "details": {"resume": True}}}
            self._sock.send_multipart([routing_id, msgpack.packb(reply)])

    @staticmethod
    def _answer(message: dict) -> dict:
        op = message["op"]
        if op == "hello":
            return {"session": "T" * 32, "session_id": "s-0000beef", "version": 1, "lease_s": 10.0,
                    "heartbeat_s": 2.5, "resumed": message.get("resume") is not None, "claims": "kept",
                    "device": {}, "holdings": {"pools": {}, "granted_pages": 0, "reserve_pages": 0, "holds": {}}}
        if op == "acquire":
            return {"granted": message["pages"], "granted_pages": message["pages"]}
        if op == "status":
            return {"overcommitted": False, "instances": [], "granted_bytes": 0}
        return {}


@pytest.fixture
def impostors():
    started: list[Impostor] = []
    yield started
    for impostor in started:
        impostor.close()


def _connect(flavor: str, endpoint: str):
    kw = dict(endpoint=endpoint, credit_pages=0, timeout_s=10)
    if flavor == "sync":
        return BrokerClient.connect("victim", background=False, **kw)

    async def connect_and_close():
        client = await AsyncBrokerClient.connect("victim", **kw)
        await client.close()

    import asyncio

    return asyncio.run(connect_and_close())


@pytest.mark.parametrize("flavor", ["sync", "async"])
def test_connect_refuses_an_impostor_that_appears_after_the_first_check(short_tmp, monkeypatch, impostors, flavor):
    directory = short_tmp / "kvcached-1000"
    checked_before_the_hello = trust.check_endpoint

    def another_user_arrives_after_the_check(uri, env=None, *, require_socket=False):
        checked_before_the_hello(uri, env, require_socket=require_socket)
        if not impostors:  # the directory did not exist yet; another user creates it now
            impostors.append(Impostor(directory))
            impostors[0].hand_to_another_user()

    monkeypatch.setattr(trust, "check_endpoint", another_user_arrives_after_the_check)
    with pytest.raises(UntrustedEndpoint, match=f"owned by uid {OTHER_UID}"):
        _connect(flavor, f"ipc://{directory}/gpu0.sock")
    assert impostors[0].ops == ["hello"]  # answered once, then believed in nothing


def _impostor_after_broker(b, impostors) -> Impostor:
    """The broker dies and something else listens at its path, owned by another user by the
    time it answers the client's resume."""
    b.kill()
    path = ipc_path(b.endpoint)
    path.unlink()
    impostor = Impostor(path.parent, hand_over_on="hello", not_owner_first=True)
    impostors.append(impostor)
    return impostor


def test_a_resume_refuses_an_endpoint_that_changed_hands(broker_factory, impostors):
    b = broker_factory(simulate="16GiB")
    client = BrokerClient.connect("victim", endpoint=b.endpoint, credit_pages=0, timeout_s=10, background=False)
    assert client.acquire(1) == 1
    impostor = _impostor_after_broker(b, impostors)
    with pytest.raises(UntrustedEndpoint, match=f"owned by uid {OTHER_UID}"):
        client.acquire(1_000_000)
    with pytest.raises(BrokerError, match="closed"):
        client.acquire(1)
    assert impostor.ops == ["acquire", "hello"]


async def test_an_async_resume_refuses_an_endpoint_that_changed_hands(broker_factory, impostors):
    b = broker_factory(simulate="16GiB")
    client = await AsyncBrokerClient.connect("victim", endpoint=b.endpoint, credit_pages=0, timeout_s=10)
    assert await client.acquire(1) == 1
    impostor = _impostor_after_broker(b, impostors)
    with pytest.raises(UntrustedEndpoint, match=f"owned by uid {OTHER_UID}"):
        await client.acquire(1_000_000)
    with pytest.raises(BrokerError, match="closed"):
        await client.acquire(1)
    assert impostor.ops == ["acquire", "hello"]


def test_the_admin_client_believes_only_an_answer_from_a_trusted_endpoint(short_tmp, impostors):
    impostor = Impostor(short_tmp / "kvcached-admin", hand_over_on="status")
    impostors.append(impostor)
    with AdminClient(impostor.endpoint) as admin:
        with pytest.raises(UntrustedEndpoint, match=f"owned by uid {OTHER_UID}"):
            admin.status()  # the directory was trusted when it was sent, not when it was answered
    assert impostor.ops == ["status"]
