"""What a refused or malformed ledger request gets: one typed error with a one-line message.

The ledger's rules decide *whether* a request fits (:mod:`.ledger`); this module words the
answer.  A refusal names what was asked, for which instance, and the room there is (details:
``instance``, ``asked_bytes``, ``free_bytes``, ``budget_bytes``, ``holders``, ``starting``: the
other instances' holds, promised to start-ups in progress; plus ``held`` while growth is held
after damaged state).  The pool maps a request carries are checked here too: bytes are
non-negative ints, zero entries are dropped, and a usage view is never larger than what the
session holds.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..client.errors import BadRequest
from ..client.units import format_bytes, format_bytes_apart
from .accounts import DeviceInfo, Limits, Refusal


class LedgerView(Protocol):
    """What a refusal reads of the ledger (:class:`.ledger.Ledger`), which words its refusals here."""

    device: DeviceInfo
    limits: dict[str, Limits]
    growth_hold: str | None

    @property
    def budget_bytes(self) -> int: ...

    @property
    def charged_bytes(self) -> int: ...

    def top_charges(self, exclude: str, count: int = 3) -> list[tuple[str, int]]: ...

    def holds_of_others(self, exclude: str) -> list[tuple[str, int]]: ...


def clean_pools(pools: dict[str, int]) -> dict[str, int]:
    for name, size in pools.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BadRequest(f"pool {name!r} needs a non-negative int of bytes, got {size!r}")
    return {name: size for name, size in pools.items() if size > 0}


def clean_views(usage: dict[str, int], held_bytes: int) -> dict[str, int]:
    """Usage views describe what a session holds (reservations and pages), so none may be larger."""
    views = clean_pools(usage)
    for name, size in views.items():
        if size > held_bytes:
            raise BadRequest(
                f"usage view {name!r} ({format_bytes(size)}) is larger than what the session holds "
                f"({format_bytes(held_bytes)} in reservations and pages)",
                details={"view": name, "view_bytes": size, "session_bytes": held_bytes},
            )
    return views


def largest_growth(old: dict[str, int], new: dict[str, int]) -> tuple[str, int]:
    growth = {name: size - old.get(name, 0) for name, size in new.items() if size > old.get(name, 0)}
    if not growth:
        return "(reservations)", 0
    name = max(growth, key=growth.__getitem__)
    return name, growth[name]


def refusal(
    code: str,
    *,
    what: str,
    instance: str,
    asked_bytes: int,
    room_bytes: int,
    ledger: LedgerView,
    details: dict[str, Any],
) -> Refusal:
    """The refusal of ``what`` for ``instance``: ``code`` is why (``held``, ``overcommitted``,
    ``limit_exceeded``, else the budget), worded on one line with the room there is."""
    dev = ledger.device
    where = f"GPU {dev.index}"
    held = code == "held"
    wire_code = code if code in ("overcommitted", "limit_exceeded") else "budget_exceeded"
    if held:
        message = f"{what} for {instance!r} refused for now: {ledger.growth_hold}"
        room_bytes = 0
        details = {**details, "held": True}
    elif code == "overcommitted":
        message = (
            f"{what} for {instance!r} refused: {where} is overcommitted "
            f"(charges {format_bytes(ledger.charged_bytes)} > budget {format_bytes(ledger.budget_bytes)})"
        )
    elif code == "limit_exceeded":
        limits = ledger.limits.get(instance, Limits())
        asked, room = format_bytes_apart(asked_bytes, room_bytes)
        message = f"{what} for {instance!r} refused: asked {asked}, its cap of {format_bytes(limits.max_bytes)} leaves {room}"
    else:
        asked, room = format_bytes_apart(asked_bytes, room_bytes)
        message = (
            f"{what} for {instance!r} refused: asked {asked}, {room} free on {where} "
            f"(budget {format_bytes(ledger.budget_bytes)}, charged {format_bytes(ledger.charged_bytes)})"
        )
    holders = ledger.top_charges(exclude=instance) if code in ("budget_exceeded", "overcommitted") else []
    if holders:
        message += "; held by " + ", ".join(f"{name} {format_bytes(size)}" for name, size in holders)
    starting = ledger.holds_of_others(exclude=instance) if code in ("budget_exceeded", "overcommitted") else []
    if starting:
        message += (f"; start-ups in progress hold {format_bytes(sum(size for _, size in starting))} "
                    f"({', '.join(name for name, _ in starting[:3])}{', ...' if len(starting) > 3 else ''})")
    details = {
        **details,
        "starting": [{"instance": name, "held_bytes": size} for name, size in starting],
        "instance": instance,
        "asked_bytes": asked_bytes,
        "free_bytes": room_bytes,
        "budget_bytes": ledger.budget_bytes,
        "holders": [{"instance": name, "charged_bytes": size} for name, size in holders],
    }
    return Refusal(wire_code, message, details, asked_bytes=asked_bytes, free_bytes=room_bytes, held=held)
