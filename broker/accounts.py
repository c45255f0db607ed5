"""What the ledger keeps and answers: sessions, accounts, limits, grants (plain data, no rules).

The rules that change these records are in :mod:`.ledger`; docs/accounting.md has the model.

Units: ``*_bytes`` are ints of bytes, ``*_pages`` ints of pages, ``*_s`` float seconds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

from ..client import protocol as proto
from ..client import results

class SessionState(str, enum.Enum):
    LIVE = "live"
    STALE = "stale"  # lease lapsed; still charged (a hung process still holds its memory)
    RECOVERING = "recovering"  # restored from a checkpoint; waiting for its worker to reconnect


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    uuid: str
    name: str
    simulated: bool


#: Who set an instance's limits.
LimitSource = Literal["admin", "config", "hello"]


@dataclass
class Limits:
    """An instance's limits.  ``revision`` grows by one on every change.

    ``source`` says who set them: ``admin`` (the ``limit`` command), ``config`` (the config
    file) or ``hello`` (the instance's own worker asked; such limits give way to an admin's or
    the config's, and leave with the instance).  ``owner_uid``: the uid of the worker whose hello
    set them; they hold only while every session of the instance is that uid's.

    ``priority`` orders reclaim, never shares: when memory must come back, instances of the
    lowest priority are asked first (``policy.PressureBook``).
    """

    max_bytes: int | None = None
    min_bytes: int = 0
    weight: float = proto.DEFAULT_WEIGHT
    revision: int = 0
    source: LimitSource = "admin"
    priority: int = proto.DEFAULT_PRIORITY
    owner_uid: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"max_bytes": self.max_bytes, "min_bytes": self.min_bytes, "weight": self.weight,
                "priority": self.priority, "revision": self.revision, "source": self.source}

    def view(self) -> results.LimitsView:
        """These limits as a reply carries them."""
        return results.LimitsView(**self.to_dict())


@dataclass(eq=False)
class Session:
    """One worker process's holdings.  ``pools`` never holds a zero entry."""

    id: str
    instance: str
    pid: int
    pid_verified: bool
    tp_rank: int
    tp_size: int
    page_bytes: int
    opened_s: float
    last_seen_s: float
    state: SessionState = SessionState.LIVE
    pools: dict[str, int] = field(default_factory=dict)  # resident: allocated
    holds: dict[str, int] = field(default_factory=dict)  # promised, not allocated yet
    reserved_bytes: int = 0  # pools and holds
    held_bytes: int = 0  # holds
    granted_pages: int = 0
    reserve_pages: int = 0
    #: The worker says which of its granted pages it has mapped (hello ``report_mapping``):
    #: until it does, a granted page is *promised* memory, charged on top of what the device
    #: measures, as a hold is.  Otherwise every granted page counts as mapped.
    report_mapping: bool = False
    #: Granted pages not mapped yet (0 unless ``report_mapping``); at most ``granted_pages``.
    unmapped_pages: int = 0
    #: Where the worker says it is in its start-up (``sizing``, ``warming``, ``serving``, ...);
    #: shown in status, never used in a decision.
    phase: str = ""
    #: Of its granted pages, how many the worker says it could give back without touching memory
    #: a running request uses (its reserve, free pages, unused prefix-cache blocks); at most
    #: ``granted_pages``.  Informational (never charged, never journaled): it only chooses whom
    #: the broker asks for memory back, and how much.
    idle_pages: int = 0
    restored: bool = False  # loaded from a checkpoint and not yet resumed by its worker
    #: While the ledger holds growth, how much more this session may still grow to re-assert
    #: what it held: set only for a session opened by a resume hello whose record was lost
    #: (what that hello claimed), used up by its growth, 0 for everyone else and after the hold.
    reassert_allowance_bytes: int = 0
    #: What the broker did with the holdings the last hello claimed: ``adopted`` or
    #: ``refused`` (a restored session; refused keeps the restored figures), ``kept`` (a
    #: session the broker never lost keeps its own), ``ignored`` (a new session starts empty).
    resume_claims: str = "ignored"
    usage: dict[str, int] = field(default_factory=dict)  # informational breakdown; never charged
    account: "ProcessAccount | None" = field(default=None, repr=False)

    @property
    def granted_bytes(self) -> int:
        return self.granted_pages * self.page_bytes

    @property
    def reported_bytes(self) -> int:
        """Everything it holds: its pools, its holds and its pages."""
        return self.reserved_bytes + self.granted_pages * self.page_bytes

    @property
    def mapped_pages(self) -> int:
        return self.granted_pages - self.unmapped_pages

    @property
    def resident_bytes(self) -> int:
        """What measured usage can cover: pools and mapped pages, not holds or unmapped pages."""
        return self.reserved_bytes - self.held_bytes + (self.granted_pages - self.unmapped_pages) * self.page_bytes

    @property
    def promised_bytes(self) -> int:
        """What is charged on top of measured usage: holds and unmapped pages."""
        return self.held_bytes + self.unmapped_pages * self.page_bytes


@dataclass(eq=False)
class InstanceAccount:
    name: str
    session_ids: set[str] = field(default_factory=set)
    reserved_bytes: int = 0
    granted_bytes: int = 0
    excess_bytes: int = 0

    @property
    def charge_bytes(self) -> int:
        return self.reserved_bytes + self.granted_bytes + self.excess_bytes


@dataclass(eq=False)
class ProcessAccount:
    """Charges of one process; sessions without a verified pid each get their own account."""

    instance: str  # unreported excess is attributed to this instance
    reported_bytes: int = 0  # resident pools and pages of its sessions (holds are charged apart)
    measured_bytes: int = 0
    session_ids: set[str] = field(default_factory=set)

    @property
    def excess_bytes(self) -> int:
        return max(0, self.measured_bytes - self.reported_bytes)

    @property
    def charge_bytes(self) -> int:
        return max(self.reported_bytes, self.measured_bytes)


@dataclass(frozen=True)
class Claim:
    """Holdings a worker re-asserts when it resumes a restored session."""

    pools: dict[str, int]
    granted_pages: int
    reserve_pages: int
    holds: dict[str, int] = field(default_factory=dict)
    #: For a session that reports mapping: how many of ``granted_pages`` are mapped (None: none).
    mapped_pages: int | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request for room the ledger refused, typed for the broker's own decisions; ``code``,
    ``message`` and ``details`` are what the worker gets (:mod:`.refusals` words them)."""

    code: str  # budget_exceeded, overcommitted or limit_exceeded
    message: str
    details: dict[str, Any]
    asked_bytes: int  # what the charge would have grown by
    free_bytes: int  # the room there was
    held: bool  # refused only because growth is held after damaged state

    @property
    def for_room(self) -> bool:
        """Refused for the device's room (the budget, or an overcommit a reading may end), not
        for the instance's own cap or a recovery hold: memory coming back could satisfy it."""
        return self.code in ("budget_exceeded", "overcommitted") and not self.held


@dataclass(frozen=True, slots=True)
class Grant:
    """The answer to :meth:`Ledger.acquire`: ``pages`` granted (0 is a refusal, not an error)."""

    pages: int
    refusal: Refusal | None = None


#: Shared answers for the common small grants, so the grant path allocates none.
SMALL_GRANTS = tuple(Grant(pages) for pages in range(257))


@dataclass
class LedgerChanges:
    """What changed since the last :meth:`Ledger.drain_changes` (for the checkpoint journal)."""

    sessions: set[str] = field(default_factory=set)
    closed: set[str] = field(default_factory=set)
    limits: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.sessions or self.closed or self.limits)
