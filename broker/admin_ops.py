"""The admin operations: ``limit``, ``evict`` and ``simulate`` (no I/O of its own).

Each is accepted only from an admin peer (root, the broker's own user, or the admin group; the
check is injected, because it may read ``/proc`` for supplementary groups).  ``evict --kill``
signals a worker only where the admin could have signalled it itself (root, or the worker's
own user); otherwise the whole request is refused and nothing is evicted.
"""

from __future__ import annotations

import logging
from typing import Callable

from ..client import protocol as proto
from ..client import results
from ..client.errors import Forbidden, UnknownSession
from .device_monitor import DeviceMonitor
from .journal import Journal, NullJournal
from .ledger import Ledger
from .lifecycle import SessionLifecycle
from .security import Peer
from .sessions import Binding

log = logging.getLogger("kvcached_broker")


class AdminOps:
    def __init__(self, ledger: Ledger, lifecycle: SessionLifecycle, journal: Journal | NullJournal,
                 device: DeviceMonitor, is_admin: Callable[[Peer], bool]):
        self.ledger = ledger
        self.lifecycle = lifecycle
        self.journal = journal
        self.device = device
        self.is_admin = is_admin

    def require_admin(self, peer: Peer, op: str) -> None:
        if not self.is_admin(peer):
            who = f"uid {peer.uid}" if peer.uid is not None else f"remote peer {peer.address or '?'}"
            raise Forbidden(f"{op} is an admin operation; {who} is not root, the broker's user or in the admin group")

    def set_limit(self, req: proto.SetLimit, rid: bytes, peer: Peer, now: float) -> bytes:
        self.require_admin(peer, "limit")
        limits = self.ledger.set_limits(
            req.instance,
            max_bytes=req.max_bytes, min_bytes=req.min_bytes, weight=req.weight, priority=req.priority,
            revision=req.revision,
        )
        log.info(
            "event=limits instance=%s max_bytes=%s min_bytes=%d weight=%s priority=%d revision=%d uid=%s",
            req.instance, limits.max_bytes, limits.min_bytes, limits.weight, limits.priority, limits.revision, peer.uid,
        )
        return proto.ok_reply(req.id, results.LimitResult(instance=req.instance, **limits.to_dict()))

    def evict(self, req: proto.Evict, rid: bytes, peer: Peer, now: float) -> bytes:
        self.require_admin(peer, "evict")
        table = self.lifecycle.table
        binding = table.by_id(req.session_id)
        if binding is None:
            raise UnknownSession(f"no session {req.session_id} (see `kvcached-broker status` for ids)")
        if req.kill and binding.pid_verified and not _may_signal(peer, binding):
            raise Forbidden(
                f"uid {peer.uid} may not kill pid {binding.pid} (uid {binding.uid}); only root or its own user may. "
                "Nothing was evicted; evict without --kill, or ask root"
            )
        result = results.EvictResult(evicted=binding.session_id)
        if req.kill:
            self._kill(binding, result)
        table.fence(binding)
        self.journal.fence(binding.token, binding.session_id)
        result.freed_bytes = self.lifecycle.end(binding, cause="evicted")
        return proto.ok_reply(req.id, result)

    def _kill(self, binding: Binding, result: results.EvictResult) -> None:
        """Kill the session's process; ``result`` says whether it was, or why not."""
        if not binding.pid_verified:
            result.kill_error = "pid not verified (remote or other pid namespace); not killed"
            return
        try:
            self.lifecycle.processes.kill(binding.pid)
        except OSError as exc:
            result.kill_error = exc.strerror or str(exc)
            return
        result.killed = True

    def simulate(self, req: proto.Simulate, rid: bytes, peer: Peer, now: float) -> bytes:
        self.require_admin(peer, "simulate")
        self.device.simulate(
            None if req.external_bytes is proto.UNSET else req.external_bytes,
            None if req.process_bytes is proto.UNSET else dict(req.process_bytes),
        )
        self.device.observe(self.ledger, now)
        return proto.ok_reply(req.id, results.SimulateResult(external_bytes=self.ledger.external_bytes,
                                                             budget_bytes=self.ledger.budget_bytes))


def _may_signal(peer: Peer, binding: Binding) -> bool:
    """Whether the admin could send a signal to the session's process itself (kill(2)'s rule,
    without capabilities): root, or the same user."""
    return peer.uid == 0 or (peer.uid is not None and peer.uid == binding.uid)
