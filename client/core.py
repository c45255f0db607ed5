"""What a client knows about its session, with no I/O: the sync and asyncio clients both drive it.

It builds requests, reads replies and keeps the client's view of its holdings, which it
re-asserts when it reconnects to a broker that restarted:

* ``pools``: the reservation map the broker last acknowledged;
* ``credit.held_pages`` / ``credit.reserve_pages``: pages handed to the caller / kept in reserve.
"""

from __future__ import annotations

import itertools
import os
import secrets
from typing import Any

import msgspec

from . import protocol as proto
from .credit import CreditReserve, default_credit_pages
from .device import resolve_device
from .endpoint import resolve_endpoint
from .errors import BadRequest, BrokerError, BrokerUnavailable, SessionEvicted, error_from_wire

#: Error codes after which a client re-opens its session with hello(resume) and retries.
RESUME_CODES = frozenset({"not_owner", "unknown_session"})


class ClientCore:
    def __init__(
        self,
        *,
        instance: str,
        tp_rank: int,
        tp_size: int,
        page_bytes: int,
        credit_pages: int | None,
        device_uuid: str | None,
        pid: int | None = None,
        client: str = "",
        limits: dict[str, Any] | None = None,
        adapter: dict[str, Any] | None = None,
    ):
        _check_int("tp_size", tp_size, minimum=1)
        _check_int("tp_rank", tp_rank, minimum=0)
        if tp_rank >= tp_size:
            raise BadRequest(f"tp_rank {tp_rank} must be below tp_size {tp_size}")
        _check_int("page_bytes", page_bytes, minimum=1)
        if credit_pages is not None:
            _check_int("credit_pages", credit_pages, minimum=0)
        if not isinstance(instance, str) or not instance:
            raise BadRequest(f"instance must be a non-empty string, got {instance!r}")
        self.instance = instance
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.page_bytes = page_bytes
        self.device_uuid = device_uuid
        self.pid = os.getpid() if pid is None else pid
        self.client = client
        self.adapter = _adapter_info(adapter)
        self.limits_request = _limits_request(limits)
        self.credit = CreditReserve(default_credit_pages(page_bytes) if credit_pages is None else credit_pages)
        self.pools: dict[str, int] = {}
        self.token: str | None = None
        self.session_id: str | None = None
        self.lease_s = 10.0
        self.heartbeat_s = 2.5
        self.device: dict[str, Any] = {}
        self.evicted = False
        self.closed = False
        self._ids = itertools.count(1)

    # ------------------------------------------------------------- requests
    def next_id(self) -> int:
        return next(self._ids)

    def hello(self, *, resume: bool) -> proto.Hello:
        return proto.Hello(
            id=self.next_id(),
            versions=list(proto.SUPPORTED_VERSIONS),
            instance=self.instance,
            pid=self.pid,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            page_bytes=self.page_bytes,
            nonce=secrets.token_urlsafe(12),
            device_uuid=self.device_uuid,
            resume=self.token if resume else None,
            holdings=self.holdings() if resume else None,
            limits=self.limits_request,
            client=self.client,
            adapter=self.adapter,
        )

    def holdings(self) -> proto.Holdings:
        return proto.Holdings(
            pools=dict(self.pools),
            granted_pages=self.credit.granted_pages,
            reserve_pages=self.credit.reserve_pages,
        )

    def on_hello(self, result: dict[str, Any]) -> None:
        self.token = result["session"]
        self.session_id = result["session_id"]
        self.lease_s = float(result.get("lease_s", self.lease_s))
        self.heartbeat_s = float(result.get("heartbeat_s", self.lease_s / 4))
        self.device = result.get("device", {})

    def check_usable(self) -> None:
        if self.evicted:
            raise SessionEvicted(f"session {self.session_id} was evicted; its memory has been given away")
        if self.closed:
            raise BrokerError("this broker client is closed", code="bad_request")
        if os.getpid() != self.pid:
            raise BrokerError(
                "this broker client belongs to the parent process; create a new client after fork",
                code="not_owner",
            )

    def session_token(self) -> str:
        assert self.token is not None, "hello first"
        return self.token

    # -------------------------------------------------------------- replies
    def error_of(self, reply: proto.Reply) -> BrokerError:
        assert reply.error is not None
        err = error_from_wire(reply.error.code, reply.error.message, reply.error.details)
        if isinstance(err, SessionEvicted):
            self.evicted = True
        return err


def prepare(
    instance: str,
    device: int | str,
    tp_rank: int,
    tp_size: int,
    page_bytes: int,
    endpoint: str | None,
    credit_pages: int | None,
    *,
    device_uuid: str | None,
    limits: dict[str, Any] | None,
    client: str,
    adapter: dict[str, Any] | None = None,
) -> tuple[ClientCore, str]:
    """What ``connect`` does before any I/O: find the GPU and its broker, check the arguments."""
    physical = resolve_device(device)
    uuid = device_uuid or physical.uuid
    target = resolve_endpoint(physical.index, uuid=uuid, endpoint=endpoint)
    if target is None:
        raise BrokerUnavailable("the broker is switched off (KVCACHED_BROKER=off)")
    core = ClientCore(
        instance=instance,
        tp_rank=tp_rank,
        tp_size=tp_size,
        page_bytes=page_bytes,
        credit_pages=credit_pages,
        device_uuid=uuid,
        limits=limits,
        client=client,
        adapter=adapter,
    )
    return core, target


def _limits_request(limits: dict[str, Any] | None) -> proto.LimitsRequest | None:
    """``{"max_bytes": .., "min_bytes": .., "weight": ..}`` asked for at hello (admin policy may clamp)."""
    if limits is None:
        return None
    unknown = set(limits) - {"max_bytes", "min_bytes", "weight"}
    if unknown:
        raise BadRequest(f"unknown limit {sorted(unknown)[0]!r}; use max_bytes, min_bytes, weight")
    for key in ("max_bytes", "min_bytes"):
        if key in limits and limits[key] is not None:
            _check_int(key, limits[key], minimum=0)
    weight = limits.get("weight", proto.UNSET)
    if weight is not proto.UNSET and (isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0):
        raise BadRequest(f"weight must be a positive number, got {weight!r}")
    return proto.LimitsRequest(
        max_bytes=limits.get("max_bytes", proto.UNSET),
        min_bytes=limits.get("min_bytes", proto.UNSET) if limits.get("min_bytes") is not None else proto.UNSET,
        weight=float(weight) if weight is not proto.UNSET else proto.UNSET,
    )


def _adapter_info(adapter: dict[str, Any] | None) -> proto.AdapterInfo | None:
    """``{"runtime": .., "runtime_version": .., "patches": [..]}``: the adapter opening the session."""
    if adapter is None:
        return None
    try:
        return msgspec.convert(adapter, proto.AdapterInfo)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"adapter info: {exc}") from None


def check_pages(name: str, value: Any, *, minimum: int) -> int:
    _check_int(name, value, minimum=minimum)
    if value > proto.MAX_PAGES:
        raise BadRequest(f"{name} must be at most {proto.MAX_PAGES}, got {value}")
    return value


def check_pools(pools: Any) -> dict[str, int]:
    if not isinstance(pools, dict):
        raise BadRequest(f"reserve() takes a dict of pool name to bytes, got {type(pools).__name__}")
    if len(pools) > proto.MAX_POOLS:
        raise BadRequest(f"at most {proto.MAX_POOLS} pools per session, got {len(pools)}")
    clean = {}
    for name, size in pools.items():
        if not isinstance(name, str) or not name:
            raise BadRequest(f"pool names must be non-empty strings, got {name!r}")
        _check_int(f"pool {name!r}", size, minimum=0)
        clean[name] = int(size)
    return clean


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise BadRequest(f"{name} must be an int >= {minimum}, got {value!r}")
