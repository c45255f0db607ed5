"""The ``status --json`` document (a contract: docs/design.md, "status --json").

Fields named in the contract are always present with exactly those names and meanings; fields
added since are listed in the README, "`status --json`" ("Added fields"), and never change meaning.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import msgspec

from ..client import results
from .accounts import Limits, Session, SessionState
from .ledger import Ledger
from .sessions import SessionTable


def build_status(
    ledger: Ledger,
    table: SessionTable,
    broker: dict[str, Any],
    now_s: float,
    policy_view: Callable[[str], tuple[int, results.PressureView]] | None = None,
) -> results.StatusDocument:
    """The document; ``policy_view(instance)``: its fair share (bytes) and pressure figures."""
    dev = ledger.device
    names = sorted(set(ledger.instance_names()) | set(ledger.limits))
    by_instance: dict[str, list[Session]] = {name: [] for name in names}
    for session in ledger.sessions.values():
        by_instance[session.instance].append(session)
    instances = []
    for name in names:
        instance = _instance(ledger, table, name, by_instance[name], now_s)
        if policy_view is not None:
            instance.fair_share_bytes, instance.pressure = policy_view(name)
        instances.append(instance)
    return results.StatusDocument(
        device=results.DeviceInfo(index=dev.index, uuid=dev.uuid, name=dev.name, simulated=dev.simulated),
        total_bytes=ledger.total_bytes,
        headroom_bytes=ledger.headroom_bytes,
        external_bytes=ledger.external_bytes,
        budget_bytes=ledger.budget_bytes,
        reserved_bytes=ledger.reserved_bytes,
        granted_bytes=ledger.granted_bytes,
        unreported_bytes=ledger.unreported_bytes,
        held_bytes=ledger.held_bytes,
        free_bytes=ledger.free_bytes,
        overcommitted=ledger.overcommitted,
        instances=instances,
        broker=broker,
    )


def _instance(ledger: Ledger, table: SessionTable, name: str, sessions: list[Session],
              now_s: float) -> results.InstanceStatus:
    limits = ledger.limits.get(name, Limits())
    reserved, granted, unreported = ledger.instance_totals(name)
    pools: dict[str, int] = {}
    holds: dict[str, int] = {}
    usage: dict[str, int] = {}
    for session in sessions:
        for pool, size in session.pools.items():
            pools[pool] = pools.get(pool, 0) + size
        for pool, size in session.holds.items():
            pools[pool] = pools.get(pool, 0) + size
            holds[pool] = holds.get(pool, 0) + size
        for view, size in session.usage.items():
            usage[view] = usage.get(view, 0) + size
    sessions.sort(key=lambda s: (s.tp_rank, s.id))
    conflicts = instance_conflicts(sessions).get(name)
    return results.InstanceStatus(
        name=name,
        max_bytes=limits.max_bytes,
        min_bytes=limits.min_bytes,
        weight=limits.weight,
        priority=limits.priority,
        limits_revision=limits.revision,
        reserved_bytes=reserved,
        granted_bytes=granted,
        unreported_bytes=unreported,
        charged_bytes=reserved + granted + unreported,
        grantable_bytes=ledger.grantable_bytes(name),
        held_bytes=sum(holds.values()),
        pools=_sorted(pools),
        holds=_sorted(holds),
        usage_breakdown=_sorted(usage),
        conflicts=msgspec.convert(conflicts, list[results.Conflict]) if conflicts else [],
        sessions=[_session(table, s, now_s) for s in sessions],
    )


def instance_conflicts(sessions: Iterable[Session]) -> dict[str, list[dict[str, Any]]]:
    """The name collisions among live sessions, by instance (instances without one are absent).

    Two servers given one ``KVCACHED_BROKER_INSTANCE`` merge into one instance; what gives
    them away is one of:

    * ``rank``: live sessions of one ``tp_rank`` opened by more than one process (a server's
      rank is one process; one process may open several sessions);
    * ``tp_size``: live sessions that disagree on ``tp_size`` (every rank of a server agrees).

    Each conflict is ``{kind, rank | tp_sizes, sessions: [id], pids: [pid]}``, ids and pids
    sorted, conflicts in a fixed order (``tp_size`` first, then ranks ascending), so that the
    same sessions always give an equal answer.  Pure: reads the sessions, changes nothing.
    Stale and recovering sessions are left out (a restarted server's old session is not a
    second server).  Processes are told apart by pid (for a tcp peer, the pid it gave).
    """
    live: dict[str, list[Session]] = {}
    for session in sessions:
        if session.state is SessionState.LIVE:
            live.setdefault(session.instance, []).append(session)
    found: dict[str, list[dict[str, Any]]] = {}
    for name, members in sorted(live.items()):
        conflicts = _tp_size_conflicts(members) + _rank_conflicts(members)
        if conflicts:
            found[name] = conflicts
    return found


def _tp_size_conflicts(members: list[Session]) -> list[dict[str, Any]]:
    tp_sizes = sorted({s.tp_size for s in members})
    if len(tp_sizes) < 2:
        return []
    return [{"kind": "tp_size", "tp_sizes": tp_sizes, **_who(members)}]


def _rank_conflicts(members: list[Session]) -> list[dict[str, Any]]:
    by_rank: dict[int, list[Session]] = {}
    for session in members:
        by_rank.setdefault(session.tp_rank, []).append(session)
    return [
        {"kind": "rank", "rank": rank, **_who(group)}
        for rank, group in sorted(by_rank.items())
        if len({s.pid for s in group}) > 1
    ]


def _who(members: list[Session]) -> dict[str, list[str] | list[int]]:
    return {"sessions": sorted(s.id for s in members), "pids": sorted({s.pid for s in members})}


def _sorted(sizes: dict[str, int]) -> dict[str, int]:
    """A copy in name order (most maps here hold a pool or two)."""
    return dict(sorted(sizes.items())) if len(sizes) > 1 else dict(sizes)


def _session(table: SessionTable, session: Session, now_s: float) -> results.SessionStatus:
    binding = table.by_id(session.id)
    account = session.account
    return results.SessionStatus(
        id=session.id,
        rank=session.tp_rank,
        tp_size=session.tp_size,
        pid=session.pid,
        pid_verified=session.pid_verified,
        state=session.state._value_,
        page_bytes=session.page_bytes,
        granted_pages=session.granted_pages,
        reserve_pages=session.reserve_pages,
        reserved_bytes=session.reserved_bytes,
        granted_bytes=session.granted_bytes,
        held_bytes=session.held_bytes,
        report_mapping=session.report_mapping,
        unmapped_pages=session.unmapped_pages,
        idle_pages=session.idle_pages,
        phase=session.phase,
        measured_bytes=account.measured_bytes if account is not None else 0,
        pools=_sorted({**session.pools, **session.holds} if session.holds else session.pools),
        holds=_sorted(session.holds),
        usage_breakdown=_sorted(session.usage),
        idle_s=round(max(0.0, now_s - session.last_seen_s), 3),
        client=binding.client if binding else "",
        adapter=binding.adapter if binding else None,
    )
