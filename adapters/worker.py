"""This worker process's session with its GPU's broker, shared by every adapter patch in it.

A serving worker has several things to report (DeepSeek-V4 side pools, a static KV pool,
elastic pages) but one session per device.  :class:`ReservationBook` merges what each
reporter says under its own key into the session's one reservation map, so a rebuilt pool
replaces its own entry and never erases another's.

With ``KVCACHED_REQUIRE=1`` an unreachable broker raises at startup; otherwise it is logged
once and the worker runs unprotected (``session()`` returns None).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..client import BrokerClient, BrokerError, BrokerUnavailable
from ..client.endpoint import broker_disabled
from . import flags

log = logging.getLogger("kvcached_broker.adapters")


class BrokerRequired(RuntimeError):
    """KVCACHED_REQUIRE=1 and the broker cannot protect this worker."""


@dataclass
class WorkerIdentity:
    runtime: str  # "sglang" or "vllm"
    device: int | str
    tp_rank: int = 0
    tp_size: int = 1
    page_bytes: int = 2 << 20
    instance: str | None = None
    #: Adapters batch their own elastic grants (``ElasticBudget``), so by default the client
    #: keeps no credit reserve of its own: a worker that only reserves holds no idle pages.
    credit_pages: int | None = 0

    def instance_name(self) -> str:
        return self.instance or flags.instance_name(self.runtime)


@dataclass
class _DeviceSession:
    client: BrokerClient
    book: dict[str, dict[str, int]] = field(default_factory=dict)
    usage: dict[str, dict[str, int]] = field(default_factory=dict)


_lock = threading.RLock()
_sessions: dict[str, _DeviceSession] = {}
_warned: set[str] = set()
#: Tests and embedders may replace how clients are made (e.g. a fixed endpoint).
client_factory: Callable[[WorkerIdentity], BrokerClient] | None = None


def _connect(identity: WorkerIdentity) -> BrokerClient:
    if client_factory is not None:
        return client_factory(identity)
    return BrokerClient.connect(
        identity.instance_name(),
        device=identity.device,
        tp_rank=identity.tp_rank,
        tp_size=identity.tp_size,
        page_bytes=identity.page_bytes,
        credit_pages=identity.credit_pages,
        client=f"kvcached-broker-adapter/{identity.runtime}",
    )


def session(identity: WorkerIdentity) -> BrokerClient | None:
    """The session for ``identity.device``, opened on first use; None if unprotected."""
    key = str(identity.device)
    with _lock:
        existing = _sessions.get(key)
        if existing is not None:
            return existing.client
        if broker_disabled():
            return _unprotected(key, "KVCACHED_BROKER=off")
        try:
            client = _connect(identity)
        except BrokerError as exc:
            return _unprotected(key, str(exc))
        _sessions[key] = _DeviceSession(client)
        log.info(
            "event=adapter_session runtime=%s device=%s instance=%s session=%s endpoint=%s",
            identity.runtime, identity.device, identity.instance_name(), client.session_id, client.endpoint,
        )
        return client


def _unprotected(key: str, why: str) -> None:
    if flags.require():
        raise BrokerRequired(f"kvcached-broker is required (KVCACHED_REQUIRE=1) but unusable for device {key}: {why}")
    if key not in _warned:
        _warned.add(key)
        log.warning("event=unprotected device=%s reason=%r detail=memory_is_not_arbitrated", key, why)
    return None


def report(
    identity: WorkerIdentity, reporter: str, pools: dict[str, int], usage: dict[str, int] | None = None
) -> dict[str, int] | None:
    """Set ``reporter``'s pools (replacing what it reported before) and send the merged map.

    ``usage`` is the reporter's informational breakdown (overlapping views, never charged).
    Raises ``BudgetExceeded`` (naming the pool) if the broker has no room; the book is then
    left as it was.
    """
    client = session(identity)
    if client is None:
        return None
    key = str(identity.device)
    with _lock:
        entry = _sessions[key]
        proposed = {**entry.book, reporter: {k: v for k, v in pools.items() if v > 0}}
        proposed_usage = {**entry.usage, reporter: {k: v for k, v in (usage or {}).items() if v > 0}}
        result = client.reserve(_merge(proposed), usage=_merge(proposed_usage))
        entry.book, entry.usage = proposed, proposed_usage
        return result


def _merge(by_reporter: dict[str, dict[str, int]]) -> dict[str, int]:
    merged: dict[str, int] = {}
    for pools in by_reporter.values():
        for name, size in pools.items():
            merged[name] = merged.get(name, 0) + size
    return merged


def forget(identity: WorkerIdentity, reporter: str) -> None:
    """Drop ``reporter``'s pools (its pool was freed)."""
    key = str(identity.device)
    with _lock:
        entry = _sessions.get(key)
        if entry is not None and reporter in entry.book:
            report(identity, reporter, {})
            del entry.book[reporter]
            entry.usage.pop(reporter, None)


def reset() -> None:
    """Close every session (tests; a worker shutting down)."""
    with _lock:
        for entry in _sessions.values():
            try:
                entry.client.close()
            except BrokerUnavailable:
                pass
        _sessions.clear()
        _warned.clear()
