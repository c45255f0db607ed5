"""What the broker keeps for peers that do not read their replies (no I/O).

A reply waits in libzmq's queue for its connection until the peer reads it.  A peer that asks
and never reads would make the broker keep every answer: 1,000 unread status requests, each
answered with the whole status document, held 1.5 GB.  So:

* every connection's queue holds at most ``REPLIES_PER_CONNECTION`` replies (the ROUTER's
  ``SNDHWM``); past that a reply is dropped (``queue_full``);
* a reply over ``LARGE_REPLY_BYTES`` (a status document, in practice) is sent without a copy
  and tracked until libzmq has handed it to the kernel; a connection may have
  ``LARGE_PER_CONNECTION`` of them waiting, a peer (uid, or address over tcp)
  ``LARGE_BYTES_PER_PEER`` and everyone together ``LARGE_BYTES``; past a bound a large
  reply is dropped.  A peer that reads its replies never meets these bounds.

A dropped reply is a request that gets no answer: the client's timeout and retry cover it,
with the same id and bytes, so nothing is applied twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable

REPLIES_PER_CONNECTION = 256
LARGE_REPLY_BYTES = 16 << 10
LARGE_PER_CONNECTION = 2
LARGE_BYTES_PER_PEER = 32 << 20
LARGE_BYTES = 256 << 20


@dataclass
class _Waiting:
    connection: bytes
    peer: Hashable
    size_bytes: int
    read: Callable[[], bool]  # whether libzmq has let go of it (handed to the kernel, or dropped)


class ReplyBudget:
    """Large replies sent and not yet taken by their peers, and the replies dropped, by reason."""

    def __init__(self, *, per_connection: int = LARGE_PER_CONNECTION, bytes_per_peer: int = LARGE_BYTES_PER_PEER,
                 total_bytes: int = LARGE_BYTES):
        self.per_connection = per_connection
        self.bytes_per_peer = bytes_per_peer
        self.total_bytes = total_bytes
        self._waiting: list[_Waiting] = []
        self.dropped: dict[str, int] = {}

    def admit(self, connection: bytes, peer: Hashable, size_bytes: int) -> str | None:
        """Whether a large reply may be sent now; returns the bound it would pass, or None."""
        self._forget_read()
        mine = peers = 0
        total = size_bytes
        for waiting in self._waiting:
            total += waiting.size_bytes
            if waiting.connection == connection:
                mine += 1
            if waiting.peer == peer:
                peers += waiting.size_bytes
        if mine >= self.per_connection:
            return self.drop("large_per_connection")
        if peers + size_bytes > self.bytes_per_peer:
            return self.drop("large_per_peer")
        if total > self.total_bytes:
            return self.drop("large_total")
        return None

    def sent(self, connection: bytes, peer: Hashable, size_bytes: int, read: Callable[[], bool]) -> None:
        self._waiting.append(_Waiting(connection, peer, size_bytes, read))

    def drop(self, reason: str) -> str:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        return reason

    def waiting_bytes(self) -> int:
        self._forget_read()
        return sum(waiting.size_bytes for waiting in self._waiting)

    def _forget_read(self) -> None:
        if self._waiting:
            self._waiting = [waiting for waiting in self._waiting if not waiting.read()]

    def view(self) -> dict[str, Any]:
        return {
            "per_connection": REPLIES_PER_CONNECTION,
            "large_bytes": LARGE_REPLY_BYTES,
            "large_per_connection": self.per_connection,
            "large_bytes_per_peer": self.bytes_per_peer,
            "large_bytes_total": self.total_bytes,
            "large_waiting_bytes": self.waiting_bytes(),
            "dropped": dict(self.dropped),
        }
