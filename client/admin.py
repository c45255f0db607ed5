"""Session-less requests: status for anyone, limits/evict/simulate for admins (the CLI uses this)."""

from __future__ import annotations

import itertools
from typing import Any, Callable

from msgspec import UNSET, Struct, UnsetType

from . import protocol as proto
from . import results
from .errors import BrokerUnavailable, error_from_wire
from .transport import CurveKeys, SyncTransport, Timeouts, socket_missing
from .trust import endpoint_guard


class AdminClient:
    def __init__(self, endpoint: str, *, timeout_s: float = 3.0, curve: CurveKeys | None = None, fail_fast: bool = True):
        if fail_fast and socket_missing(endpoint):
            raise BrokerUnavailable(
                f"kvcached-broker at {endpoint} is not running (no socket file)", details={"endpoint": endpoint}
            )
        self.endpoint = endpoint
        self._transport = SyncTransport(endpoint, Timeouts.from_env(timeout_s), curve=curve)
        self._guard = endpoint_guard(endpoint, self._transport.close)
        self._ids = itertools.count(1)

    def _call(self, make: Callable[[int], Struct]) -> Any:
        """Send one request; its reply is believed only once the endpoint it came from checks out."""
        request_id = next(self._ids)
        self._guard(False)
        reply = self._transport.request(proto.encode(make(request_id)), request_id)
        self._guard(True)
        if not reply.ok:
            assert reply.error is not None
            raise error_from_wire(reply.error.code, reply.error.message, reply.error.details)
        return reply.result

    def status(self) -> dict[str, Any]:
        """The status document (``results.StatusDocument``), as the map it came as."""
        return results.checked_status(self._call(lambda rid: proto.Status(id=rid)))

    def limit(
        self,
        instance: str,
        *,
        max_bytes: int | None | UnsetType = UNSET,
        min_bytes: int | UnsetType = UNSET,
        weight: float | UnsetType = UNSET,
        revision: int | None = None,
        priority: int | UnsetType = UNSET,
    ) -> results.LimitResult:
        return results.decode(self._call(
            lambda rid: proto.SetLimit(
                id=rid, instance=instance, max_bytes=max_bytes, min_bytes=min_bytes, weight=weight,
                priority=priority, revision=revision,
            )
        ), results.LimitResult)

    def evict(self, session_id: str, *, kill: bool = False) -> results.EvictResult:
        return results.decode(self._call(lambda rid: proto.Evict(id=rid, session_id=session_id, kill=kill)),
                              results.EvictResult)

    def simulate(self, *, external_bytes: int | UnsetType = UNSET,
                 process_bytes: dict[int, int] | UnsetType = UNSET) -> results.SimulateResult:
        return results.decode(self._call(lambda rid: proto.Simulate(
            id=rid, external_bytes=external_bytes, process_bytes=process_bytes)), results.SimulateResult)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
