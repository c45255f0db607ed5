"""Memory a runtime hands back to the device and later maps again, followed through to the broker.

SGLang's release of memory occupation and vLLM's sleep and discard free tagged memory
(``kv_cache``, ``weights``, SGLang's ``cuda_graph``); resume and wake map it again.  What the
broker charges follows (docs/accounting.md):

* **The KV cache's pools** (reported by the adapter) are *suspended* once the release is
  done: kept in the book, no longer charged.
* **Everything else** (weights, CUDA graphs) is inside the pinned ``runtime_base``.  Just
  before a release that frees more than the KV cache, the base is pinned again at what the
  device measures, so that it covers all the process uses (CUDA graphs and activations
  allocated since the first pin included); once the release is done it is pinned again, with
  the KV pools suspended in the same request.  What the base lost is no longer charged.
* **Before the runtime maps memory again** (:func:`admit`), what comes back is admitted in
  one request: the KV pools are charged again and the base goes back up to where it was
  before the release.  Both are resident charges reported ahead of their mapping, which the
  device's measurement covers once the memory is mapped, so nothing is charged twice while
  it maps.  A refusal raises ``BudgetExceeded`` and changes nothing: the runtime must not map.
* **Once it is mapped** (:func:`settle`), the base is pinned at what the device measures
  again, so that tags still handed back (a resume of the weights alone) stay uncharged.  If
  it is not mapped after all (another TP rank failed, the runtime's resume raised),
  :func:`roll_back` hands back again exactly what :func:`admit` charged.

Tags are tracked per device; a resume of any tag that was handed back with the base admits
all the base handed back (the split between weights and CUDA graphs is not known), and the
settle after it gives back what did not come back.  Over-charging for a moment, never
overbooking.  Every function here is a no-op for a worker without a session (unprotected).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..client import BudgetExceeded
from ..client.units import format_bytes
from . import announce, process_state, sessions, worker_identity
from .device_session import DeviceSession

log = announce.logger("kvcached_broker.adapters")

KV_CACHE_TAG = "kv_cache"


@dataclass
class _HandedBack:
    before_bytes: int  # the runtime base just before the first release
    tags: set[str] = field(default_factory=set)  # tags other than the KV cache's still handed back


@dataclass(frozen=True)
class _Admission:
    """What :func:`admit` charged again, until the runtime mapped it (or a peer failed)."""

    kv_names: list[str]
    base_from_bytes: int | None  # the base before it was raised (None: not raised)


class _Ledger:
    """Per device: what its base handed back, and an admission not mapped yet."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.handed_back: dict[str, _HandedBack] = {}
        self.admitted: dict[str, _Admission] = {}


def _ledger() -> _Ledger:
    return process_state.part(_Ledger)


def frees_base(tags: set[str]) -> bool:
    """True if releasing ``tags`` frees memory inside the runtime base (anything but KV)."""
    return bool(tags - {KV_CACHE_TAG})


def before_release(identity: worker_identity.WorkerIdentity, tags: set[str]) -> None:
    """Pin the base at what the process uses now, if this release frees more than the KV cache.
    A process that never opened a session has nothing charged to follow: nothing happens (and
    no session is opened here)."""
    session = sessions.existing(identity)
    if session is None or not frees_base(tags):
        return
    try:
        base_bytes = session.repin_base()
    except BudgetExceeded:  # a cap the measured base exceeds: keep the base pinned before
        base_bytes = session.base_bytes()
    if base_bytes is None:
        return
    key = str(identity.device)
    ledger = _ledger()
    with ledger.lock:
        record = ledger.handed_back.get(key)
        if record is None or not record.tags:  # nothing handed back yet (or a release that never finished)
            ledger.handed_back[key] = _HandedBack(base_bytes)
        else:
            record.before_bytes = max(record.before_bytes, base_bytes)


def after_release(identity: worker_identity.WorkerIdentity, tags: set[str], kv_names: list[str]) -> int:
    """The release is done: stop charging what it freed; returns the bytes no longer charged."""
    session = sessions.existing(identity)
    if session is None:
        return 0
    kv = list(kv_names) if KV_CACHE_TAG in tags else []
    record = _record(identity)
    if record is None or not frees_base(tags):
        return session.suspend(kv)
    charged_before = session.base_bytes() or 0
    suspended = session.suspended()
    kv_bytes = sum(session.booked_bytes(name) for name in kv if name not in suspended)
    base_bytes = session.repin_base(suspend=kv)
    if base_bytes is None:
        return 0
    with _ledger().lock:
        record.tags |= tags - {KV_CACHE_TAG}
    freed = kv_bytes + max(0, charged_before - base_bytes)
    log.info("event=memory_handed_back device=%s tags=%s runtime_base=%s no_longer_charged=%s", identity.device,
             ",".join(sorted(tags)), format_bytes(base_bytes), format_bytes(freed))
    return freed


def coming_back_bytes(identity: worker_identity.WorkerIdentity, tags: set[str], kv_names: list[str]) -> int:
    """What :func:`admit` would charge again for ``tags``."""
    session = sessions.existing(identity)
    if session is None:
        return 0
    kv = _kv_coming_back(session, tags, kv_names)
    base_bytes = _base_coming_back(identity, tags)
    growth = max(0, base_bytes - (session.base_bytes() or 0)) if base_bytes is not None else 0
    return sum(session.booked_bytes(name) for name in kv) + growth


def admit(identity: worker_identity.WorkerIdentity, tags: set[str], kv_names: list[str]) -> int:
    """Before the runtime maps ``tags`` again: charge them again, in one request.

    ``BudgetExceeded`` if the broker has no room (nothing changes, and the runtime must not
    map); returns the bytes charged again.
    """
    session = sessions.existing(identity)
    if session is None:
        return 0
    kv = _kv_coming_back(session, tags, kv_names)
    base_bytes = _base_coming_back(identity, tags)
    if not kv and base_bytes is None:
        return 0
    base_before = session.base_bytes()
    charged = session.resume(kv, base_bytes=base_bytes)
    _remember_admission(identity, kv, base_before if base_bytes is not None else None)
    return charged


def _remember_admission(identity: worker_identity.WorkerIdentity, kv_names: list[str], base_from_bytes: int | None) -> None:
    """Add to what is admitted and not mapped yet (EngineCore admits, then the worker's own wake does)."""
    key = str(identity.device)
    ledger = _ledger()
    with ledger.lock:
        earlier = ledger.admitted.get(key)
        if earlier is not None:
            kv_names = earlier.kv_names + [name for name in kv_names if name not in earlier.kv_names]
            if earlier.base_from_bytes is not None:
                base_from_bytes = earlier.base_from_bytes
        ledger.admitted[key] = _Admission(kv_names, base_from_bytes)


def settle(identity: worker_identity.WorkerIdentity, tags: set[str]) -> None:
    """The runtime mapped ``tags`` again: pin the base at what the device measures."""
    ledger = _ledger()
    with ledger.lock:
        ledger.admitted.pop(str(identity.device), None)
    record = _record(identity)
    session = sessions.existing(identity)
    if session is None or record is None or not record.tags & tags:
        return
    session.repin_base()
    with ledger.lock:
        record.tags -= tags
        if not record.tags:
            ledger.handed_back.pop(str(identity.device), None)


def roll_back(identity: worker_identity.WorkerIdentity) -> None:
    """What :func:`admit` charged was not mapped (another TP rank failed, or the runtime's own
    resume did): hand it back again, and nothing else."""
    ledger = _ledger()
    with ledger.lock:
        admission = ledger.admitted.pop(str(identity.device), None)
    session = sessions.existing(identity)
    if admission is not None and session is not None:
        session.suspend(admission.kv_names, base_bytes=admission.base_from_bytes)


def handed_back(identity: worker_identity.WorkerIdentity) -> bool:
    """True while memory of this device's base or KV cache is handed back."""
    record = _record(identity)
    session = sessions.existing(identity)
    return (record is not None and bool(record.tags)) or (session is not None and bool(session.suspended()))


def _record(identity: worker_identity.WorkerIdentity) -> _HandedBack | None:
    ledger = _ledger()
    with ledger.lock:
        return ledger.handed_back.get(str(identity.device))


def _kv_coming_back(session: DeviceSession, tags: set[str], kv_names: list[str]) -> list[str]:
    if KV_CACHE_TAG not in tags:
        return []
    suspended = set(session.suspended())
    return [name for name in kv_names if name in suspended]


def _base_coming_back(identity: worker_identity.WorkerIdentity, tags: set[str]) -> int | None:
    """The base to book before ``tags`` map again (None: the base does not change)."""
    record = _record(identity)
    if record is None or not record.tags & tags:
        return None
    return record.before_bytes

