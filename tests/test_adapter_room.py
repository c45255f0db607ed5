"""The one room calculation both runtimes size by (adapters/room.py), against a real broker's status:
the broker's ``grantable_bytes``, the same figure derived for a broker that does not publish it,
what the instance could ever be given, and what the caller replaces counted as room."""

from __future__ import annotations

import pytest

from kvcached_broker.adapters import room
from kvcached_broker.client import BrokerClient

from helpers import GIB


@pytest.fixture
def colocated(inproc_factory):
    """A 10 GiB broker: ``a`` holds 3 GiB, ``b`` holds 1 GiB under a 4 GiB floor."""
    b = inproc_factory(total_bytes=10 * GIB)
    a_client = BrokerClient.connect("a", endpoint=b.endpoint, credit_pages=0)
    b_client = BrokerClient.connect("b", endpoint=b.endpoint, credit_pages=0)
    a_client.reserve({"weights": 3 * GIB})
    b_client.reserve({"weights": GIB})
    with b.admin() as admin:
        admin.limit("b", min_bytes=4 * GIB)
    yield b
    a_client.close()
    b_client.close()


def without_grantable(status: dict) -> dict:
    """The status an older broker gives: no ``grantable_bytes``."""
    return {**status, "instances": [{k: v for k, v in i.items() if k != "grantable_bytes"}
                                    for i in status["instances"]]}


def test_the_room_is_the_brokers_grantable_and_what_it_could_ever_give(colocated):
    found = room.from_status(colocated.status(), "a", colocated.endpoint)
    assert found.grantable_bytes == 3 * GIB  # 6 free, 3 of them b's unfilled floor
    assert found.ever_bytes == 3 * GIB  # 10 less b's 4 GiB floor, less the 3 it holds
    assert found.others_bytes == {"b": GIB} and found.describe_others() == "b 1.00 GiB"
    with colocated.admin() as admin:
        admin.limit("a", max_bytes=5 * GIB)
    capped = room.from_status(colocated.status(), "a", colocated.endpoint)
    assert capped.grantable_bytes == 2 * GIB and capped.ever_bytes == 2 * GIB  # within its own cap


def test_an_older_broker_gets_the_same_room_from_the_totals(colocated):
    for limits in ({}, {"max_bytes": 5 * GIB}):
        if limits:
            with colocated.admin() as admin:
                admin.limit("a", **limits)
        status = colocated.status()
        for name in ("a", "b", "nobody-yet"):
            published = room.from_status(status, name, colocated.endpoint)
            derived = room.from_status(without_grantable(status), name, colocated.endpoint)
            assert derived == published


def test_what_the_caller_replaces_counts_as_room(colocated):
    plain = room.from_status(colocated.status(), "a", colocated.endpoint)
    replacing = room.from_status(colocated.status(), "a", colocated.endpoint, replacing_bytes=GIB)
    assert replacing.grantable_bytes == plain.grantable_bytes + GIB
    assert replacing.ever_bytes == plain.ever_bytes + GIB


def test_a_status_of_another_shape_raises_what_the_worker_guard_reads_as_a_broker_failure(colocated):
    with pytest.raises(KeyError):
        room.from_status({"instances": []}, "a", colocated.endpoint)
    status = colocated.status()
    broken = {**status, "instances": [{**i, "grantable_bytes": None} for i in status["instances"]]}
    with pytest.raises(TypeError):
        room.from_status(broken, "a", colocated.endpoint)
