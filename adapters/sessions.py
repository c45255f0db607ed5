"""This worker process's broker sessions, one per device, and the fail-safe around them.

A session is opened on first use (:func:`session`) and kept in a per-process registry
(:class:`Registry`, a :mod:`.process_state` part: a reset closes every session).  Each holds
the device's book (:mod:`.report_book`), which :mod:`.worker` changes one request at a time.

Failing safe.  No broker, endpoint, device or protocol failure may crash a server:

* :func:`session` catches every failure to open a session (an unreachable or refusing
  broker, ``KVCACHED_BROKER=ipc://relative``, a ``CUDA_VISIBLE_DEVICES`` entry NVML cannot
  resolve, a malformed instance name) and returns None: the worker runs unprotected;
* :func:`guard` runs a broker round trip of an open session, reading of the answer included:
  a refusal (``BudgetExceeded``) goes to the caller, which explains it; an eviction is always
  raised (its memory was given away); anything else (a timeout, ``rate_limited``,
  ``internal``, an unknown code, an answer in a shape the adapter cannot read) turns the
  worker unprotected and returns None.

Unprotected is said once per process (``event=unprotected`` on stderr, :mod:`.announce`).
With ``KVCACHED_REQUIRE=1`` every one of those failures raises :class:`BrokerRequired`
instead: a startup error with the reason.  Callers that sit between TP collectives call
:func:`guard` and keep taking part in the collective whatever it returns.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from ..client import BrokerClient, BrokerError, BudgetExceeded
from ..client.endpoint import broker_disabled
from . import announce, flags, process_state
from .report_book import ReportBook
from .worker_identity import WorkerIdentity, adapter_info, announce_active

log = announce.logger("kvcached_broker.adapters")

T = TypeVar("T")

#: What reading a broker answer of an unexpected shape raises (a missing field, a field of the
#: wrong type or value): a protocol failure, handled like any other broker failure.
MALFORMED_ANSWER = (LookupError, TypeError, ValueError, AttributeError)


class BrokerRequired(RuntimeError):
    """KVCACHED_REQUIRE=1 and the broker cannot protect this worker.  One line."""


@dataclass
class DeviceSession:
    """One device's session and its book (:mod:`.report_book`: what the process reports and holds)."""

    client: BrokerClient
    identity: WorkerIdentity
    book: ReportBook = field(default_factory=ReportBook)


class Registry:
    """This process's broker sessions, one per device, and the devices left unprotected (and
    why).  ``lock`` guards both, and is held across a session's round trips (one request per
    device at a time); ``hooks_lock`` guards only what :func:`.worker.settle_warm_up` runs first, so
    registering never waits behind a broker call.  Closing the part closes every session."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.by_device: dict[str, DeviceSession] = {}
        self.unprotected: dict[str, str] = {}  # device -> why
        #: How sessions are opened (None: :func:`connect`); tests and embedders set it.
        self.client_factory: Callable[[WorkerIdentity], BrokerClient] | None = None
        self.hooks_lock = threading.Lock()
        self.before_settling: list[Callable[[], None]] = []  # given by the modules above this one
        self.closed = False  # closed by a reset: no session opens here again

    def close(self) -> None:
        with self.lock:
            self.closed = True
            entries = list(self.by_device.values())
            self.by_device.clear()
            self.unprotected.clear()
        for entry in entries:
            try:
                entry.client.close()
            except BrokerError:
                pass


def registry() -> Registry:
    """This process's registry (created on first use, closed by a reset)."""
    return process_state.part(Registry)


def set_client_factory(factory: Callable[[WorkerIdentity], BrokerClient] | None) -> None:
    """Open this process's sessions with ``factory`` (None: :func:`connect`, at
    ``KVCACHED_BROKER`` or the default endpoint); tests and embedders.  Kept until a reset."""
    registry().client_factory = factory


def connect(identity: WorkerIdentity, endpoint: str | None = None) -> BrokerClient:
    """Open a session for ``identity`` (``endpoint=None``: ``KVCACHED_BROKER`` or the default)."""
    return BrokerClient.connect(
        identity.instance_name(),
        device=identity.device,
        tp_rank=identity.tp_rank,
        tp_size=identity.tp_size,
        page_bytes=identity.page_bytes,
        endpoint=endpoint,
        credit_pages=identity.credit_pages,
        client=f"kvcached-broker-adapter/{identity.runtime}",
        adapter=adapter_info(identity.runtime),
        report_mapping=True,  # pages are taken by kvcached pools, which say what they have mapped
    )


def _connect(identity: WorkerIdentity) -> BrokerClient:
    factory = registry().client_factory
    if factory is not None:
        return factory(identity)
    return connect(identity)


# ------------------------------------------------------------------------------ the session
def session(identity: WorkerIdentity) -> BrokerClient | None:
    """The session for ``identity.device``, opened on first use; None if unprotected."""
    state = registry()
    key = str(identity.device)
    with state.lock:
        if state.closed:  # a reset is closing the process's state: nothing opens now
            return None
        existing = state.by_device.get(key)
        if existing is not None and key not in state.unprotected:
            return existing.client
        if key in state.unprotected:
            return None
        if broker_disabled():
            announce_active(identity, None)
            _unprotected_now(key, "KVCACHED_BROKER=off")
            return None
        try:
            client = _connect(identity)
        except Exception as exc:  # noqa: BLE001 - any failure to open leaves the worker unprotected
            announce_active(identity, None)
            _unprotected_now(key, _describe(exc), exc)
            return None
        state.by_device[key] = DeviceSession(client, identity)
        announce_active(identity, client)
        log.info(
            "event=adapter_session runtime=%s device=%s instance=%s session=%s endpoint=%s",
            identity.runtime, identity.device, identity.instance_name(), client.session_id, client.endpoint,
        )
        return client


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return text if isinstance(exc, BrokerError) else f"{type(exc).__name__}: {text}"


def _unprotected_now(key: str, why: str, cause: BaseException | None = None) -> None:
    """Mark ``key`` unprotected (said once per process); under KVCACHED_REQUIRE=1, raise."""
    if flags.required():
        raise BrokerRequired(
            f"kvcached-broker is required (KVCACHED_REQUIRE=1) but unusable for device {key}: {why}"
        ) from cause
    _mark_unprotected(key, why)


def _mark_unprotected(key: str, why: str) -> None:
    state = registry()
    with state.lock:
        state.unprotected[key] = why
    announce.once("unprotected", logging.WARNING, "unprotected", pid=os.getpid(), device=key, reason=why,
                  detail="this process's GPU memory is not arbitrated by kvcached-broker")


def open_identities() -> list[WorkerIdentity]:
    """The identity of every usable session of this process (one per device)."""
    state = registry()
    with state.lock:
        return [entry.identity for key, entry in state.by_device.items() if key not in state.unprotected]


def unprotected_reason(identity: WorkerIdentity) -> str | None:
    state = registry()
    with state.lock:
        return state.unprotected.get(str(identity.device))


def guard(identity: WorkerIdentity, action: str, call: Callable[[], T]) -> T | None:
    """Run ``call`` (a broker round trip, and the reading of its answer); None if the worker is,
    or just turned, unprotected.

    ``BudgetExceeded`` (a refusal) and a fatal error (eviction) propagate; any other failure,
    an answer the caller cannot read included, makes the worker unprotected (or, under
    ``KVCACHED_REQUIRE=1``, raises ``BrokerRequired``).
    """
    state = registry()
    if session(identity) is None:
        return None
    cause: Exception
    try:
        return call()
    except BudgetExceeded:
        raise
    except BrokerError as exc:
        if exc.fatal:
            raise
        why, cause = str(exc), exc
    except MALFORMED_ANSWER as exc:
        why, cause = f"the broker's answer is not in the shape this adapter reads ({type(exc).__name__}: {exc})", exc
    if state.closed:  # the reset closed the session under the call: nothing to mark
        return None
    with state.lock:
        _unprotected_now(str(identity.device), f"{action}: {why}", cause)
    return None
