"""Which DeepSeek-V4 side pools the adapter reports, when kvcached may report some itself.

kvcached 0.1.6 manages no V4 pool and reports none: its
``observability.get_capabilities()["features"]["runtime_reservation_reporting"]`` is False, so
every V4 pool is SGLang's and a reservation of this adapter (``dsv4_reservation``).  A later
kvcached may report SGLang's runtime-owned V4 pools itself (kvcached PR #376:
``register_runtime_owned_reservation(device, pool_name, num_bytes)``, names ``dsv4.<pool>``), or
move one into its own management and report it at 0 (#400: the SWA pool).  Its reports and the
adapter's are never both counted:

* :func:`reported_by_kvcached`: while the capability is off (or cannot be read), nothing; when it
  is on, the adapter's names of the pools kvcached lists (``get_runtime_owned_reservations()``
  entries' ``pool_name``, ``dsv4.`` stripped), or, if kvcached lists nothing readable, every V4
  pool: stepping all of the adapter's aside rather than counting any twice (that memory is then
  charged as the process's measured usage);
* ``dsv4_reservation.register`` leaves those pools out of its report (a pool reported before
  is removed), logged once per pool (``event=dsv4_pool_reported_by_kvcached``);
* ``dsv4_reservation.before_kvcached_grant`` runs before a kvcached pool takes its first grant:
  when :func:`kvcached_reports`, every live V4 pool is measured again, so a pool that moved into
  kvcached's ownership stops being a reservation before kvcached's pool takes grants for the
  same memory.

This module reads kvcached only (through ``..kvcached.kvcached_api``); ``dsv4_reservation`` builds on it.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import announce
from ..kvcached import kvcached_api

CAPABILITY = "runtime_reservation_reporting"
PREFIX = "dsv4."
#: kvcached names every V4 pool: step all of the adapter's aside
ALL = frozenset({"*"})


def kvcached_reports() -> bool:
    """True when the installed kvcached says it reports runtime-owned reservations."""
    try:
        return bool(kvcached_api.capabilities()["features"].get(CAPABILITY, False))
    except Exception:  # noqa: BLE001 - no kvcached, or an unreadable record: it reports nothing
        return False


def reported_by_kvcached() -> frozenset[str]:
    """The adapter's V4 pool names kvcached reports itself (:data:`ALL`: every one)."""
    if not kvcached_reports():
        return frozenset()
    entries = kvcached_api.runtime_owned_reservations()
    if entries is None:  # unreadable: step every pool aside
        return ALL
    names = {_name_of(entry) for entry in entries}
    return frozenset(name[len(PREFIX):] for name in names if name.startswith(PREFIX))


def _name_of(entry: Any) -> str:
    if isinstance(entry, dict):
        return str(entry.get("pool_name") or entry.get("name") or "")
    return str(getattr(entry, "pool_name", "") or getattr(entry, "name", "") or "")


def without_kvcached_reports(pools: dict[str, int]) -> dict[str, int]:
    """``pools`` less the ones kvcached reports itself (each said once)."""
    reported = reported_by_kvcached()
    if not reported:
        return pools
    kept = {}
    for name, size in pools.items():
        if reported is ALL or name in reported:
            announce.once(f"dsv4_pool_reported_by_kvcached:{name}", logging.WARNING, "dsv4_pool_reported_by_kvcached",
                          pool=name, detail="kvcached reports it: not reserved here too")
            continue
        kept[name] = size
    return kept
