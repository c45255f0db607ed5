"""Session tokens the broker can verify without the session's record (no I/O).

A token is the session's public id and a MAC over it, keyed by the broker's secret (kept in
the state directory, ``checkpoint.StateStore``) and bound to the process it was issued to::

    token = ID_HEX (8 characters) + base64url(HMAC-SHA256(secret, id, holder)[:18]) (24 characters)

where ``holder`` is ``pid:PID:START_TICKS`` for a session whose pid the kernel verified, and
``uid:UID`` (``uid:-`` over tcp) otherwise.  So a broker that lost a session's record (damaged
or deleted state) can still tell, from a resume hello, that the token was issued by a broker
holding this secret, for this session id, to this very process (a pid that started at another
time, say a recycled one, does not verify).  A made-up token, or one copied from another
process, does not verify, and gets no re-assertion allowance (``session_opener``).

Invariant: ``verify(issue(id, holder), holder) == id``; any other token or holder gives None.
Tokens are 32 characters of ``[A-Za-z0-9_-]``, as the wire's ``Token`` type requires.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

#: Bytes of a broker's secret.
SECRET_BYTES = 32
TOKEN_CHARS = 32
_ID_PREFIX = "s-"
_ID_HEX = 8
_MAC_BYTES = 18  # 24 characters of base64url, no padding
_DOMAIN = b"kvcached-broker session token v1\0"


def holder_of(pid: int, pid_verified: bool, start_ticks: int | None, uid: int | None) -> str:
    """What a token is bound to: the verified process, or else the peer's uid."""
    if pid_verified:
        return f"pid:{pid}:{'-' if start_ticks is None else start_ticks}"
    return f"uid:{'-' if uid is None else uid}"


class SessionTokens:
    """Issues and verifies tokens with one secret (``rekey`` replaces it before any is issued)."""

    def __init__(self, secret: bytes | None = None):
        self._secret = secret if secret is not None else secrets.token_bytes(SECRET_BYTES)

    def rekey(self, secret: bytes) -> None:
        self._secret = secret

    def issue(self, session_id: str, holder: str) -> str:
        """The token of ``session_id`` (``s-`` and 8 hex digits) for ``holder``."""
        return session_id[len(_ID_PREFIX):] + self._mac(session_id, holder)

    def verify(self, token: str, holder: str) -> str | None:
        """The session id ``token`` was issued for, if it was issued by this secret to ``holder``."""
        if len(token) != TOKEN_CHARS:
            return None
        id_hex = token[:_ID_HEX]
        if not all(c in "0123456789abcdef" for c in id_hex):
            return None
        session_id = _ID_PREFIX + id_hex
        if not hmac.compare_digest(token[_ID_HEX:], self._mac(session_id, holder)):
            return None
        return session_id

    def _mac(self, session_id: str, holder: str) -> str:
        message = _DOMAIN + session_id.encode() + b"\0" + holder.encode()
        digest = hmac.new(self._secret, message, hashlib.sha256).digest()[:_MAC_BYTES]
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")
