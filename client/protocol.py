"""The wire protocol: every message the broker and its clients exchange.

Transport: ZeroMQ, broker ROUTER and client DEALER; each ZeroMQ message is one MessagePack
map.  Requests are tagged by ``op``; broker messages by ``type`` (``reply`` or a push such as
``pressure``).  Both sides import this module, and the broker validates every request
against these schemas on arrival, so a plain ``msgpack`` client interoperates as long as it
sends maps of the documented shape.  Unknown fields are ignored (forward compatibility);
wrong types, out-of-range integers and oversized maps or strings are ``bad_request``.

Units: sizes are ``*_bytes`` ints, page counts ``*_pages`` ints, times ``*_s`` floats.

Every message struct is ``gc=False``: messages hold only plain values and never a reference
cycle, so the cyclic collector need not track the one allocated per request.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec
from msgspec import UNSET as UNSET  # the schemas' "not given", read by both sides as proto.UNSET
from msgspec import Meta, Struct, UnsetType

from .units import MAX_SIZE_BYTES

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)

#: A session's lease unless the broker is configured otherwise (``serve --lease``); a hello's
#: answer says the lease in force (``lease_s``), a client assumes this one until it has one.
DEFAULT_LEASE_S = 10.0

#: A session's page size unless its client asks for another (``connect(page_bytes=)``); the
#: adapters' sessions all use it (elastic KV pages of any size are counted in session pages).
DEFAULT_PAGE_BYTES = 2 << 20

#: The pool the broker sets on ``reserve(measured_base=True)``: what the process measures
#: beyond everything else it reports (weights, CUDA context, runtime buffers).
RUNTIME_BASE_POOL = "runtime_base"
#: What is left of a worker's runtime slack once its warm-up is over: kept for the activations
#: of later batches, reserved and allocated only as they come (a re-pin grows the base into it
#: by what the device measures, ``Ledger._with_measured_base``).
RUNTIME_SLACK_POOL = "runtime_slack"

#: The broker drops (and ZeroMQ disconnects) any request larger than this.
MAX_REQUEST_BYTES = 64 << 10
MAX_POOLS = 64
MAX_PAGES = 1 << 40
MAX_TP_SIZE = 4096
MAX_SETTLED = 1024

Bytes = Annotated[int, Meta(ge=0, le=MAX_SIZE_BYTES)]
Pages = Annotated[int, Meta(ge=0, le=MAX_PAGES)]
PositivePages = Annotated[int, Meta(ge=1, le=MAX_PAGES)]
PageBytes = Annotated[int, Meta(ge=1, le=1 << 40)]
RequestId = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Pid = Annotated[int, Meta(ge=0, le=(1 << 31) - 1)]
Token = Annotated[str, Meta(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
#: A session token on a session request: only ever a key into the broker's session table, where
#: anything it did not issue is ``unknown_session``, so its length is bounded but no pattern is
#: matched (the request path does not pay for one; see docs/performance.md).
SessionToken = Annotated[str, Meta(min_length=8, max_length=64)]
PublicId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
#: Instance and pool names: what shows in status and in Prometheus labels.
Name = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@/+-]+$")]
PoolName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
PoolMap = Annotated[dict[PoolName, Bytes], Meta(max_length=MAX_POOLS)]
Weight = Annotated[float, Meta(gt=0.0, le=1e6)]
FreeText = Annotated[str, Meta(max_length=256)]
#: Where a worker says it is in its start-up (shown in status): ``sizing``, ``warming``, ``serving``.
Phase = Annotated[str, Meta(max_length=32, pattern=r"^[a-z_]*$")]
#: Who is asked first when memory must be reclaimed: the lowest priority first.
MIN_PRIORITY = -1000
MAX_PRIORITY = 1000
#: An instance's priority and share weight when no limit sets them.
DEFAULT_PRIORITY = 0
DEFAULT_WEIGHT = 1.0
Priority = Annotated[int, Meta(ge=MIN_PRIORITY, le=MAX_PRIORITY)]
#: The longest an ``acquire`` may wait at the broker for memory to come back.
MAX_WAIT_S = 5.0
WaitSeconds = Annotated[float, Meta(ge=0.0, le=MAX_WAIT_S)]


class Holdings(Struct, kw_only=True, forbid_unknown_fields=False, gc=False):
    """What a session holds: re-asserted by a client that reconnects after a broker restart."""

    pools: PoolMap = {}
    granted_pages: Pages = 0
    reserve_pages: Pages = 0
    holds: PoolMap = {}
    #: A session that reports mapping: how many of ``granted_pages`` are mapped (None: none).
    mapped_pages: Pages | None = None


class LimitsRequest(Struct, kw_only=True, gc=False):
    """Limits a worker asks for at hello; the broker's admin policy may clamp them."""

    max_bytes: Bytes | None | UnsetType = UNSET
    min_bytes: Bytes | UnsetType = UNSET
    weight: Weight | UnsetType = UNSET
    priority: Priority | UnsetType = UNSET


class AdapterInfo(Struct, kw_only=True, forbid_unknown_fields=False, gc=False):
    """Which runtime adapter opened a session (shown in status per session as ``adapter``)."""

    runtime: Annotated[str, Meta(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_.-]+$")]
    runtime_version: Annotated[str, Meta(max_length=64)] = ""
    patches: Annotated[list[Annotated[str, Meta(min_length=1, max_length=96)]], Meta(max_length=64)] = []


class Request(Struct, tag_field="op", kw_only=True, gc=False):
    id: RequestId


class Hello(Request, tag="hello", kw_only=True):
    """Open (or resume) a session.  A retried hello with the same nonce gets the same session."""

    versions: Annotated[list[Annotated[int, Meta(ge=0, le=1 << 16)]], Meta(min_length=1, max_length=16)]
    instance: Name
    pid: Pid
    tp_rank: Annotated[int, Meta(ge=0, lt=MAX_TP_SIZE)] = 0
    tp_size: Annotated[int, Meta(ge=1, le=MAX_TP_SIZE)] = 1
    page_bytes: PageBytes
    nonce: Token
    device_uuid: Annotated[str, Meta(max_length=96)] | None = None
    resume: Token | None = None
    holdings: Holdings | None = None
    #: With ``resume``: ids of requests whose effect ``holdings`` already shows (a release the
    #: client booked before sending it).  A broker that adopts ``holdings`` answers these ids
    #: from its reply cache, so a release in flight across a restart is applied exactly once.
    settled: Annotated[list[RequestId], Meta(max_length=MAX_SETTLED)] = []
    limits: LimitsRequest | None = None
    client: FreeText = ""
    adapter: AdapterInfo | None = None
    #: The worker will say which of its granted pages it has mapped (``mapped``, or a release's
    #: ``mapped_pages``); until it does, a granted page is charged in full on top of what the
    #: device measures, as a hold is.  For workers that map pages on demand (kvcached).
    report_mapping: bool = False


class Reserve(Request, tag="reserve", kw_only=True):
    """Replace the session's static reservations; a pool set to 0 is removed."""

    session: SessionToken
    pools: PoolMap
    #: How the reserved bytes are used, as overlapping views (e.g. vLLM cache groups that alias
    #: one buffer).  Shown in status as ``usage_breakdown``; never charged.  None keeps it.
    usage: PoolMap | None = None
    #: Memory promised to the session that it has not allocated yet (a KV sizing hold),
    #: charged on top of what the device measures the process using.  None keeps the holds.
    holds: PoolMap | None = None
    #: Set the ``runtime_base`` pool to what the device measures this process using beyond
    #: everything else it reports (weights, CUDA context): pin it before holding.
    measured_base: bool = False
    #: One hold of ``holds`` that may shrink to what fits, and the least of it the worker can
    #: use: the broker holds the largest size in between (the answer's ``holds`` says which).
    min_holds: PoolMap | None = None
    #: Where the worker is in its start-up, shown in status (None keeps it).
    phase: Phase | None = None


class Acquire(Request, tag="acquire", kw_only=True):
    """Ask for ``pages``; with ``min_pages`` the broker grants the largest fit in [min, pages]."""

    session: SessionToken
    pages: PositivePages
    min_pages: Pages | None = None
    #: The client's credit reserve before this grant.
    reserve_pages: Pages | None = None
    #: How many of (reserve + grant) its caller takes, at least ``caller_min_pages``; the rest
    #: stays in the reserve (``credit.split_grant``), so status shows it at once.
    caller_pages: Pages | None = None
    caller_min_pages: Pages | None = None
    #: A session that reports mapping: these pages are mapped already (a client asking a broker
    #: that lost its session for what it holds), so they are charged as resident, not promised.
    mapped: bool = False
    #: Wait up to this long at the broker for room (a release, a reading) instead of a refusal
    #: now; the reply comes when the ask is granted, or with the refusal when the time is up.
    wait_s: WaitSeconds | None = None
    #: Of its granted pages, how many the session could give back without touching memory a
    #: running request uses (its reserve, free pages, unused prefix-cache blocks); informational.
    idle_pages: Pages | None = None


class Release(Request, tag="release", kw_only=True):
    session: SessionToken
    pages: PositivePages
    reserve_pages: Pages | None = None
    #: A session that reports mapping: how many of the pages it keeps are mapped afterwards.
    mapped_pages: Pages | None = None
    idle_pages: Pages | None = None


class Mapped(Request, tag="mapped", kw_only=True):
    """A session that reports mapping: ``mapped_pages`` of its granted pages are mapped now."""

    session: SessionToken
    mapped_pages: Pages
    reserve_pages: Pages | None = None
    idle_pages: Pages | None = None


class Heartbeat(Request, tag="heartbeat", kw_only=True):
    session: SessionToken
    reserve_pages: Pages | None = None
    idle_pages: Pages | None = None


class Close(Request, tag="close", kw_only=True):
    session: SessionToken


class Status(Request, tag="status", kw_only=True):
    session: SessionToken | None = None
    reserve_pages: Pages | None = None


class SetLimit(Request, tag="limit", kw_only=True):
    """Admin: change an instance's limits.  ``max_bytes: None`` clears the cap."""

    instance: Name
    max_bytes: Bytes | None | UnsetType = UNSET
    min_bytes: Bytes | UnsetType = UNSET
    weight: Weight | UnsetType = UNSET
    priority: Priority | UnsetType = UNSET
    revision: Annotated[int, Meta(ge=0)] | None = None


class Evict(Request, tag="evict", kw_only=True):
    """Admin: fence a session by its public id and free what it held."""

    session_id: PublicId
    kill: bool = False


class Simulate(Request, tag="simulate", kw_only=True):
    """Admin, simulated devices only: inject memory used outside the broker's view."""

    external_bytes: Bytes | UnsetType = UNSET
    process_bytes: Annotated[dict[Pid, Bytes], Meta(max_length=4096)] | UnsetType = UNSET


AnyRequest = Union[Hello, Reserve, Acquire, Release, Mapped, Heartbeat, Close, Status, SetLimit, Evict, Simulate]


class ErrorBody(Struct, kw_only=True, gc=False):
    code: str
    message: str
    details: dict[str, Any] = {}


class Reply(Struct, tag_field="type", tag="reply", kw_only=True, omit_defaults=True, gc=False):
    """The answer to request ``id`` (``None`` when the request could not be read at all)."""

    id: int | None
    ok: bool
    result: Any = None
    error: ErrorBody | None = None


class Pressure(Struct, tag_field="type", tag="pressure", kw_only=True, omit_defaults=True, gc=False):
    """Push: the broker asks this session to give back ``pages`` (credit reserve first).

    ``soft``: only what it holds idle (its reserve, free pages, unused prefix-cache blocks), never
    memory a running request uses; the session is at or below its fair share."""

    session_id: str
    pages: int
    reason: str = ""
    soft: bool = False


BrokerMessage = Union[Reply, Pressure]

_request_decoder = msgspec.msgpack.Decoder(AnyRequest)
_broker_decoder = msgspec.msgpack.Decoder(BrokerMessage)
_encoder = msgspec.msgpack.Encoder()


class ProtocolError(ValueError):
    """A frame that is not a valid message; ``request_id`` is set when it could be read."""

    def __init__(self, message: str, request_id: int | None = None):
        super().__init__(message)
        self.request_id = request_id


def decode_request(frame: bytes) -> AnyRequest:
    """Decode and validate one request, or raise :class:`ProtocolError` with a one-line reason."""
    if len(frame) > MAX_REQUEST_BYTES:
        raise ProtocolError(f"request of {len(frame)} bytes exceeds the {MAX_REQUEST_BYTES}-byte limit")
    try:
        return _request_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"invalid request: {exc}", _salvage_id(frame)) from None
    except RecursionError:
        raise ProtocolError("invalid request: nested too deeply", _salvage_id(frame)) from None


def _salvage_id(frame: bytes) -> int | None:
    """Best effort: the ``id`` of an invalid request, so its sender can match the error."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except Exception:  # noqa: BLE001 - best effort: a frame that does not decode has no id
        return None
    if isinstance(raw, dict):
        rid = raw.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < (1 << 63):
            return rid
    return None


def decode_broker_message(frame: bytes) -> Reply | Pressure:
    """Raises ``msgspec.DecodeError`` for a frame that is not a broker message (nesting too)."""
    try:
        return _broker_decoder.decode(frame)
    except RecursionError:
        raise msgspec.DecodeError("broker message nested too deeply") from None


#: ``encode(message) -> bytes``: any message struct as MessagePack (the encoder's own bound
#: method, so a request pays for no wrapper call).
encode = _encoder.encode


def ok_reply(request_id: int | None, result: Any = None) -> bytes:
    return _encoder.encode(Reply(id=request_id, ok=True, result=result))


def error_reply(request_id: int | None, code: str, message: str, details: dict[str, Any] | None = None) -> bytes:
    body = ErrorBody(code=code, message=message, details=details or {})
    return _encoder.encode(Reply(id=request_id, ok=False, error=body))
