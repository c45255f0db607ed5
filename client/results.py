"""What an ok reply carries for each request: its ``result``, typed (docs/protocol.md, §4 under
each request, and §13 for the status document).

The broker builds these and encodes them as MessagePack maps (the field names below are the
map's keys; a field left ``UNSET`` is not sent); a client decodes the map of a reply with the
struct of the request it answers (:func:`decode`), so a reply that does not have the shape its
request calls for is a :class:`~.protocol.ProtocolError`, one line, never a ``KeyError`` deep
in the client.  Unknown keys are ignored (a newer broker may say more).

Units: bytes and pages as named; seconds as ``_s``.  ``status`` answers with the status
document (:class:`StatusDocument`), which a client checks and keeps as the map it came as
(:func:`checked_status`), so the keys a newer broker adds are not lost.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, Struct, UnsetType

from .protocol import DEFAULT_PRIORITY, DEFAULT_WEIGHT, ErrorBody, Holdings, ProtocolError


class Result(Struct, kw_only=True, forbid_unknown_fields=False, gc=False):
    """Every field is sent, but an ``UNSET`` one (said only where it applies)."""


class DeviceInfo(Result):
    index: int
    uuid: str
    name: str
    simulated: bool


class LimitsView(Result):
    """An instance's limits as the broker holds them (``source``: admin, config or hello)."""

    max_bytes: int | None = None
    min_bytes: int = 0
    weight: float = DEFAULT_WEIGHT
    priority: int = DEFAULT_PRIORITY
    revision: int = 0
    source: str = "admin"


HelloOutcome = Literal["applied", "clamped", "ignored", "forbidden"]


class HelloLimits(Result):
    """What became of the limits a hello asked for."""

    outcome: HelloOutcome
    reason: str = ""


class HelloResult(Result):
    session: str  # the token the session's requests carry
    session_id: str
    version: int | UnsetType = UNSET
    lease_s: float | UnsetType = UNSET  # (an older broker may leave these out: the client keeps its own)
    heartbeat_s: float | UnsetType = UNSET
    holdings: Holdings = msgspec.field(default_factory=Holdings)  # what the broker charges the session (a resume's, as it took them up)
    resumed: bool = False
    claims: str | None = None  # a resume's claimed holdings: "adopted", "refused" or None
    pid_verified: bool = False
    device: DeviceInfo | UnsetType = UNSET
    limits: LimitsView | UnsetType = UNSET
    hello_limits: HelloLimits | UnsetType = UNSET


class Holder(Result):
    instance: str
    charged_bytes: int


class ReserveResult(Result):
    """Every field but ``holders`` is required: a worker sizes its start-up from
    ``grantable_bytes`` and ``ever_bytes``, so an answer without them is malformed, never
    "nothing could ever be granted"."""

    pools: dict[str, int]
    holds: dict[str, int]
    reserved_bytes: int
    measured_bytes: int  # 0 where the device cannot tell
    grantable_bytes: int
    ever_bytes: int
    holders: list[Holder] | UnsetType = UNSET  # only for a reserve with min_holds


class StartingHold(Result):
    instance: str
    held_bytes: int  # what it holds for its start-up in progress


class RefusalDetails(Result):
    """The ``details`` of a refusal for room or a cap (``budget_exceeded``, ``overcommitted``,
    ``limit_exceeded``; docs/protocol.md, §5), typed.  A field left out (an older broker, a
    refusal that does not say it) is its default."""

    instance: str = ""
    asked_bytes: int | UnsetType = UNSET  # what the charge would have grown by
    free_bytes: int | UnsetType = UNSET  # the room there was
    budget_bytes: int | UnsetType = UNSET
    holders: list[Holder] = []  # the other instances holding the most
    starting: list[StartingHold] = []  # the other instances' holds for start-ups in progress
    held: bool = False  # refused only because growth is held after damaged state
    pool: str = ""  # the pool asked for ("elastic": an acquire)
    pool_asked_bytes: int | UnsetType = UNSET  # that pool's own growth


class AcquireResult(Result):
    granted: int  # pages granted by this ask (0: refused)
    granted_pages: int  # what the session holds now
    waited_s: float | UnsetType = UNSET  # how long the ask waited at the broker, if it did
    refused: ErrorBody | UnsetType = UNSET  # why nothing was granted


class ReleaseResult(Result):
    granted_pages: int
    unmapped_pages: int | UnsetType = UNSET  # a session that reports mapping
    settled: bool | UnsetType = UNSET  # True: answered by a resume that adopted the books (applied before)


class MappedResult(Result):
    granted_pages: int
    unmapped_pages: int


class HeartbeatResult(Result):
    state: str
    granted_pages: int


class CloseResult(Result):
    closed: str
    freed_bytes: int


class LimitResult(LimitsView, kw_only=True):
    """The ``limit`` command's answer: the instance, and its limits as they now are (the
    fields of :class:`LimitsView`, in the same map)."""

    instance: str


class EvictResult(Result):
    evicted: str
    killed: bool = False
    kill_error: str | UnsetType = UNSET
    freed_bytes: int = 0


class SimulateResult(Result):
    external_bytes: int
    budget_bytes: int


# ------------------------------------------------------------------ the status document
class Conflict(Result):
    """Two servers under one instance name: sessions of one ``rank`` from several processes, or
    sessions that disagree on ``tp_sizes``."""

    kind: Literal["rank", "tp_size"]
    sessions: list[str]
    pids: list[int]
    rank: int | UnsetType = UNSET
    tp_sizes: list[int] | UnsetType = UNSET


# The status document's fields: those of its contract (docs/design.md, "status --json") are
# required; those added since (the README's list) have defaults, so a client reads an older
# broker's document too.
class SessionStatus(Result):
    id: str
    rank: int
    tp_size: int
    pid: int
    state: str  # live, stale or recovering
    page_bytes: int
    granted_pages: int
    reserve_pages: int
    pools: dict[str, int]
    pid_verified: bool = False
    reserved_bytes: int = 0
    granted_bytes: int = 0
    held_bytes: int = 0
    report_mapping: bool = False
    unmapped_pages: int = 0
    idle_pages: int = 0
    phase: str = ""
    measured_bytes: int = 0
    holds: dict[str, int] = {}
    usage_breakdown: dict[str, int] = {}
    idle_s: float = 0.0
    client: str = ""
    adapter: dict[str, Any] | None = None


class PressureView(Result):
    """What the broker asked an instance to give back, and what it did (bytes)."""

    pending_bytes: int
    asks: int
    soft_asks: int
    asked_bytes: int
    returned_bytes: int
    ignored_bytes: int
    waiting_asks: int = 0
    waiting_bytes: int = 0


class InstanceStatus(Result):
    name: str
    max_bytes: int | None
    min_bytes: int
    reserved_bytes: int
    granted_bytes: int
    pools: dict[str, int]
    sessions: list[SessionStatus]
    weight: float = DEFAULT_WEIGHT
    priority: int = DEFAULT_PRIORITY
    limits_revision: int = 0
    unreported_bytes: int = 0
    charged_bytes: int = 0
    grantable_bytes: int = 0
    held_bytes: int = 0
    holds: dict[str, int] = {}
    usage_breakdown: dict[str, int] = {}
    conflicts: list[Conflict] = []
    fair_share_bytes: int | UnsetType = UNSET
    pressure: PressureView | UnsetType = UNSET


class StatusDocument(Result):
    """``status``'s answer and ``status --json`` (docs/design.md, "status --json"; the fields added
    since in the README).  ``broker`` is the serving process's own figures (version, uptime,
    counters, state writes), a map whose keys the README lists."""

    device: DeviceInfo
    total_bytes: int
    headroom_bytes: int
    external_bytes: int
    budget_bytes: int
    reserved_bytes: int
    granted_bytes: int
    unreported_bytes: int
    free_bytes: int
    overcommitted: bool
    instances: list[InstanceStatus]
    held_bytes: int = 0
    broker: dict[str, Any] = {}


def checked_status(status: Any) -> dict[str, Any]:
    """``status`` as it came, once it has the shape of a :class:`StatusDocument` (keys a newer
    broker adds stay); :class:`ProtocolError` (one line) if it has not."""
    decode(status, StatusDocument)
    assert isinstance(status, dict)  # a StatusDocument decodes only from a map
    return status


R = TypeVar("R", bound=Result)


def decode(result: Any, shape: type[R]) -> R:
    """A reply's ``result`` map as ``shape``; :class:`ProtocolError` (one line) if it is not one."""
    try:
        return msgspec.convert(result, shape)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"the broker's answer is not a {shape.__name__}: {exc}") from None


def as_map(result: Struct) -> dict[str, Any]:
    """``result`` as the map the wire carries (for callers that keep plain data)."""
    return msgspec.to_builtins(result)  # type: ignore[no-any-return]
