"""Who owns which session: tokens, connections, retries and fences (no I/O).

The ledger counts bytes; this table answers "may this connection drive that session?".

* A session has a public id (shown in status, used by ``evict``) and a secret token (sent
  only to the worker that opened it).  A token is usable only from the connection it is
  bound to; a worker that reconnects re-binds it with ``hello(resume=token)`` from the same
  process.
* Each session keeps its recent replies by request id, so a retried request gets the cached
  reply and is never applied twice: the last ``reply_cache`` (256) replies, fewer where they
  would hold more than ``MAX_REPLY_CACHE_BYTES``, never fewer than ``MIN_REPLIES_KEPT``.
* An evicted session's token is fenced: later requests with it get ``evicted``.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..client.errors import BadRequest

#: What one session's reply cache may hold (1,024 sessions of one user: 64 MiB, where 512
#: replies of up to 9 KiB each, a reserve naming 64 pools, held 3.2 MiB a session), unless its
#: newest ``MIN_REPLIES_KEPT`` replies alone are larger.  A client has only a few requests
#: outstanding at once, and an id older than the window is refused, never applied twice.
MAX_REPLY_CACHE_BYTES = 64 << 10
MIN_REPLIES_KEPT = 16


@dataclass(eq=False)
class Binding:
    session_id: str
    token: str
    nonce: str
    pid: int
    pid_verified: bool
    pid_start_ticks: int | None
    uid: int | None
    version: int
    client: str = ""
    adapter: dict[str, Any] | None = None  # the runtime adapter that opened it (status)
    resumed: bool = False  # its current nonce came with a resume (a repeat of it is answered so)
    routing_id: bytes | None = None
    #: request id -> (hash of the request's bytes, or None for "any body", reply)
    replies: dict[int, tuple[int | None, bytes]] = field(default_factory=dict)
    #: The largest request id trimmed out of ``replies``: an id at or below it that is not
    #: cached can no longer be told apart from a replay, so it is refused.
    forgotten_id: int = -1
    reply_bytes: int = 0  # the bytes of the replies in ``replies``

    def remember_reply(self, request_id: int, body_hash: int | None, reply: bytes, limit: int) -> None:
        """Keep the last ``limit`` replies, or as many of the newest (at least
        ``MIN_REPLIES_KEPT``) as fit ``MAX_REPLY_CACHE_BYTES``.  Trimmed in bulk, to ``limit``
        replies and half the bytes: amortised O(1)."""
        replies = self.replies
        previous = replies.get(request_id)
        if previous is not None:
            self.reply_bytes -= len(previous[1])
        replies[request_id] = (body_hash, reply)
        self.reply_bytes += len(reply)
        if len(replies) > 2 * limit or (self.reply_bytes > MAX_REPLY_CACHE_BYTES and len(replies) > MIN_REPLIES_KEPT):
            self._trim(limit)

    def _trim(self, limit: int) -> None:
        replies = self.replies
        keep_bytes = MAX_REPLY_CACHE_BYTES // 2
        left = len(replies)
        old_ids: list[int] = []
        for request_id, (_, reply) in replies.items():
            if left <= limit and (left <= MIN_REPLIES_KEPT or self.reply_bytes <= keep_bytes):
                break
            old_ids.append(request_id)
            self.reply_bytes -= len(reply)
            left -= 1
        for old in old_ids:
            del replies[old]
        if old_ids:
            self.forgotten_id = max(self.forgotten_id, max(old_ids))

    def replay(self, request_id: int, body_hash: int) -> bytes | None:
        """The cached reply for a retried request id, or None if the id is new.

        Raises :class:`BadRequest` if the id was used for a different request, or is older
        than the reply window (its first answer is forgotten, so applying it could be twice).
        """
        cached = self.replies.get(request_id)
        if cached is None:
            if request_id <= self.forgotten_id:
                raise BadRequest(
                    f"request id {request_id} is older than this session's reply window; use a new id",
                    details={"id": request_id, "forgotten_id": self.forgotten_id},
                )
            return None
        first_hash, reply = cached
        if first_hash is not None and first_hash != body_hash:
            raise BadRequest(
                f"request id {request_id} was already used for a different request", details={"id": request_id}
            )
        return reply


class HelloRateLimiter:
    """A token bucket per peer key: ``burst`` hellos at once, ``rate_per_s`` sustained."""

    def __init__(self, rate_per_s: float, burst: int):
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._buckets: dict[Any, tuple[float, float]] = {}

    def allow(self, key: Any, now_s: float) -> bool:
        tokens, last = self._buckets.get(key, (float(self.burst), now_s))
        tokens = min(float(self.burst), tokens + (now_s - last) * self.rate_per_s)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now_s)
            return False
        self._buckets[key] = (tokens - 1.0, now_s)
        if len(self._buckets) > 4096:
            self._forget_full(now_s)
        return True

    def _forget_full(self, now_s: float) -> None:
        for key, (tokens, last) in list(self._buckets.items()):
            if tokens + (now_s - last) * self.rate_per_s >= self.burst:
                del self._buckets[key]


class SessionTable:
    """Bindings by token, public id and hello nonce, plus the fence of evicted tokens."""

    def __init__(self, *, reply_cache: int = 256, fence_limit: int = 4096):
        self.reply_cache = reply_cache
        self.fence_limit = fence_limit
        self._by_token: dict[str, Binding] = {}
        self._by_id: dict[str, Binding] = {}
        self._by_nonce: dict[str, Binding] = {}
        self._by_pid: dict[int, set[str]] = {}
        self._count_by_uid: dict[int, int] = {}
        self.fenced: "OrderedDict[str, str]" = OrderedDict()  # token -> session id
        # The lookups, bound straight to the dicts: every request makes one, and a bound
        # ``dict.get`` costs no Python frame.
        self.by_token: Callable[[str], Binding | None] = self._by_token.get
        self.by_id: Callable[[str], Binding | None] = self._by_id.get
        self.by_nonce: Callable[[str], Binding | None] = self._by_nonce.get

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Binding]:
        return iter(list(self._by_id.values()))

    def new_session_id(self) -> str:
        """A public id (``s-`` and 8 hex digits) no session in the table has."""
        while True:
            session_id = "s-" + secrets.token_hex(4)
            if session_id not in self._by_id:
                return session_id

    def add(self, binding: Binding) -> None:
        self._by_token[binding.token] = binding
        self._by_id[binding.session_id] = binding
        self._by_nonce[binding.nonce] = binding
        if binding.pid_verified:
            self._by_pid.setdefault(binding.pid, set()).add(binding.session_id)
        if binding.uid is not None:
            self._count_by_uid[binding.uid] = self._count_by_uid.get(binding.uid, 0) + 1

    def remove(self, session_id: str) -> Binding | None:
        binding = self._by_id.pop(session_id, None)
        if binding is None:
            return None
        self._by_token.pop(binding.token, None)
        if self._by_nonce.get(binding.nonce) is binding:
            del self._by_nonce[binding.nonce]
        if binding.pid_verified:
            ids = self._by_pid.get(binding.pid)
            if ids is not None:
                ids.discard(session_id)
                if not ids:
                    del self._by_pid[binding.pid]
        if binding.uid is not None:
            left = self._count_by_uid.get(binding.uid, 1) - 1
            if left > 0:
                self._count_by_uid[binding.uid] = left
            else:
                self._count_by_uid.pop(binding.uid, None)
        return binding

    def fence(self, binding: Binding) -> None:
        self.fenced[binding.token] = binding.session_id
        while len(self.fenced) > self.fence_limit:
            self.fenced.popitem(last=False)

    def rekey_nonce(self, binding: Binding, nonce: str) -> None:
        if self._by_nonce.get(binding.nonce) is binding:
            del self._by_nonce[binding.nonce]
        binding.nonce = nonce
        self._by_nonce[nonce] = binding

    def reply_cache_view(self) -> dict[str, int]:
        """The reply cache's bounds per session, and what every session's holds now."""
        return {"replies": self.reply_cache, "bytes": MAX_REPLY_CACHE_BYTES, "min_replies": MIN_REPLIES_KEPT,
                "held_bytes": sum(binding.reply_bytes for binding in self._by_id.values())}

    def session_ids_of_pid(self, pid: int) -> list[str]:
        return sorted(self._by_pid.get(pid, ()))

    def count_for_pid(self, pid: int) -> int:
        return len(self._by_pid.get(pid, ()))

    def count_for_uid(self, uid: int) -> int:
        return self._count_by_uid.get(uid, 0)

    def pids(self) -> list[int]:
        return list(self._by_pid)
