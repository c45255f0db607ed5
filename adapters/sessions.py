"""This worker process's broker sessions, one per device (:class:`.device_session.DeviceSession`),
and the devices left unprotected.

A session is opened on first use (:func:`session`) and kept in a per-process registry
(:class:`Registry`, a :mod:`.process_state` part: a reset closes every session).  The registry
is each session's host: a session asks it whether its device is still protected, and tells it
when a round trip failed (:meth:`.device_session.DeviceSession.guard`).

Failing safe.  No broker, endpoint, device or protocol failure may crash a server:

* :func:`session` catches every failure to open a session (an unreachable or refusing
  broker, ``KVCACHED_BROKER=ipc://relative``, a ``CUDA_VISIBLE_DEVICES`` entry NVML cannot
  resolve, a malformed instance name) and returns None: the worker runs unprotected;
* a session's round trip that fails for any reason but a refusal or an eviction marks its
  device unprotected here, and its operations answer None from then on.

Unprotected is said once per process (``event=unprotected`` on stderr, :mod:`.announce`).
With ``KVCACHED_REQUIRE=1`` every one of those failures raises :class:`BrokerRequired`
instead: a startup error with the reason.  Callers that sit between TP collectives call a
session's operations and keep taking part in the collective whatever they return.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from ..client import BrokerClient, BrokerError
from ..client.endpoint import broker_disabled
from . import announce, flags, process_state
from .device_session import DeviceSession
from .worker_identity import WorkerIdentity, adapter_info, announce_active

log = announce.logger("kvcached_broker.adapters")


class BrokerRequired(RuntimeError):
    """KVCACHED_REQUIRE=1 and the broker cannot protect this worker.  One line."""


class Registry:
    """This process's broker sessions, one per device, and the devices left unprotected (and
    why); the sessions' host (:class:`.device_session.SessionHost`).  ``lock`` guards both, and
    is held across a session's round trips (one request per device at a time); ``hooks_lock``
    guards only what :meth:`.device_session.DeviceSession.settle_warm_up` runs first, so
    registering never waits behind a broker call.  Closing the part closes every session."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.by_device: dict[str, DeviceSession] = {}
        self.unprotected: dict[str, str] = {}  # device -> why
        #: How sessions are opened (None: :func:`connect`); tests and embedders set it.
        self.client_factory: Callable[[WorkerIdentity], BrokerClient] | None = None
        self.hooks_lock = threading.Lock()
        self.before_settling_steps: list[Callable[[], None]] = []  # given by the modules above this one
        self.closed = False  # closed by a reset: no session opens here again

    # ------------------------------------------------------------ the sessions' host
    def usable(self, device: str) -> bool:
        return not self.closed and device not in self.unprotected

    def failed(self, device: str, why: str, cause: BaseException) -> None:
        if self.closed:  # the reset closed the session under the call: nothing to mark
            return
        with self.lock:
            _unprotected_now(device, why, cause)

    def before_settling(self) -> None:
        with self.hooks_lock:
            steps = list(self.before_settling_steps)
        for step in steps:
            step()

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


def before_settling_warm_up(step: Callable[[], None]) -> None:
    """Have every session's :meth:`~.device_session.DeviceSession.settle_warm_up` run ``step``
    before it pins the base at what the device measures (once however often given): kvcached
    mode's governors report every page they mapped first (:mod:`.kvcached.runner`), so the base
    counts none of them."""
    state = registry()
    with state.hooks_lock:
        if step not in state.before_settling_steps:
            state.before_settling_steps.append(step)


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
def session(identity: WorkerIdentity) -> DeviceSession | None:
    """The session for ``identity.device``, opened on first use; None if unprotected."""
    state = registry()
    key = str(identity.device)
    with state.lock:
        if state.closed:  # a reset is closing the process's state: nothing opens now
            return None
        existing = state.by_device.get(key)
        if existing is not None and key not in state.unprotected:
            return existing
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
        opened = state.by_device[key] = DeviceSession(client, identity, state, state.lock)
        announce_active(identity, client)
        log.info(
            "event=adapter_session runtime=%s device=%s instance=%s session=%s endpoint=%s",
            identity.runtime, identity.device, identity.instance_name(), client.session_id, client.endpoint,
        )
        return opened


def existing(identity: WorkerIdentity) -> DeviceSession | None:
    """The session opened for ``identity.device``, whether or not it is still usable; None if
    none was opened (nothing is opened here)."""
    state = registry()
    with state.lock:
        return state.by_device.get(str(identity.device))


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
