"""Every way a worker's broker can fail, arranged for the adapter tests of both runtimes.

Real where the failure is real: a socket nobody listens on, an endpoint or a device the
client cannot use, a broker that refuses the hello for its own rate limit, a broker process
that is stopped (SIGSTOP: slow) or gone (SIGKILL), an operator's eviction.  Injected at the
client boundary only where no real broker produces the failure on demand: an ``internal``
error, a ``rate_limited`` reply to a session request, an error code this client does not
know (a newer broker), and an answer of another shape (a reserve answer or a status document
with fields missing, or of the wrong type, put on the wire's reply before the client reads it).

``arrange(kind)`` sets the failure up for the adapter's real connection path
(``sessions.session`` with ``KVCACHED_BROKER``); for the failures of a live session,
``break_after_open(identity)`` opens the session first and then breaks it.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

import msgspec

from kvcached_broker.adapters import process_state, sessions, worker_identity
from kvcached_broker.client.errors import error_from_wire

#: failure kind -> a piece of the reason the worker gives when it turns unprotected
REASONS = {
    "unreachable": "[unavailable]",
    "invalid_endpoint": "an ipc path must be absolute",
    "unresolvable_device": "NVML cannot resolve it",
    "hello_rate_limited": "[rate_limited]",
    "slow": "[unavailable]",
    "gone": "[unavailable]",
    "rate_limited": "[rate_limited]",
    "internal": "[internal]",
    "unknown_code": "[quota_exhausted]",
    "answer_missing_fields": "Object missing required field",
    "answer_wrong_types": "Expected `",
}
#: the failures of a session that opened
AFTER_OPEN = {"slow", "gone", "rate_limited", "internal", "unknown_code", "answer_missing_fields",
              "answer_wrong_types", "evicted"}
KINDS = [*REASONS, "evicted"]
#: what the injected kinds answer, as a broker would put it on the wire
INJECTED = {
    "rate_limited": ("rate_limited", "too many requests from this peer; retry shortly"),
    "internal": ("internal", "ledger invariant check failed; the request was not applied"),
    "unknown_code": ("quota_exhausted", "this broker speaks a newer protocol"),
}


def _without_fields(answer: dict) -> dict:
    """A status document, or a reserve answer, with its fields missing."""
    return {"instances": []} if "instances" in answer else {"pools": answer.get("pools", {})}


def _with_wrong_types(answer: dict) -> dict:
    if "instances" in answer:
        instances = [{**i, "grantable_bytes": None, "charged_bytes": None} for i in answer["instances"]]
        return {**answer, "instances": instances, "free_bytes": None}
    return {**answer, "holds": None, "grantable_bytes": None, "ever_bytes": None}


#: the kinds whose answers arrive in a shape the adapter cannot read
MALFORMED = {"answer_missing_fields": _without_fields, "answer_wrong_types": _with_wrong_types}


@dataclass
class Arranged:
    kind: str
    request: object
    broker: object = None
    stopped_pid: int | None = None
    armed: list = field(default_factory=list)

    @property
    def reason(self) -> str | None:
        return REASONS.get(self.kind)

    def break_after_open(self, identity: worker_identity.WorkerIdentity) -> None:
        """For the failures of a live session: open it now, then make it fail."""
        if self.kind not in AFTER_OPEN:
            return
        session = sessions.session(identity)
        assert session is not None, "the session should open before it fails"
        if self.kind == "slow":
            self.stopped_pid = self.broker.proc.pid
            os.kill(self.stopped_pid, signal.SIGSTOP)
        elif self.kind == "gone":
            self.broker.kill()
        elif self.kind == "evicted":
            with self.broker.admin() as admin:
                admin.evict(session.client.session_id)
        else:
            self.armed.append(True)  # an injected error, or a malformed status

    def undo(self) -> None:
        """Resume a stopped broker, then close the worker's sessions while their broker still runs."""
        if self.stopped_pid is not None:
            os.kill(self.stopped_pid, signal.SIGCONT)
            self.stopped_pid = None
        process_state.reset()


def _failing_client(arranged: Arranged, endpoint: str):
    """Real sessions on ``endpoint``; once armed, every request answers the injected error."""
    code, message = INJECTED[arranged.kind]

    def factory(identity):
        client = sessions.connect(identity, endpoint=endpoint)
        for name in ("reserve", "status", "acquire", "release"):
            real = getattr(client, name)

            def call(*args, _real=real, **kwargs):
                if arranged.armed:
                    raise error_from_wire(code, message, {})
                return _real(*args, **kwargs)

            setattr(client, name, call)
        return client

    return factory


def _malformed_client(arranged: Arranged, endpoint: str):
    """Real sessions on ``endpoint``; once armed, the replies that carry a status document or a
    reserve answer arrive reshaped on the wire, before the client reads them (as from a broker
    that sends another shape)."""
    reshape = MALFORMED[arranged.kind]

    def factory(identity):
        client = sessions.connect(identity, endpoint=endpoint)
        transport = client._transport
        real_request = transport.request

        def request(*args, **kwargs):
            reply = real_request(*args, **kwargs)
            if arranged.armed and reply.ok and isinstance(reply.result, dict) and (
                    "instances" in reply.result or "pools" in reply.result):
                return msgspec.structs.replace(reply, result=reshape(reply.result))
            return reply

        transport.request = request
        return client

    return factory


def arrange(kind: str, request, monkeypatch, total_bytes: int = 1 << 30) -> Arranged:
    """Set ``kind`` up for this test (environment, brokers, client factory)."""
    short_tmp = request.getfixturevalue("short_tmp")
    arranged = Arranged(kind, request)
    sessions.set_client_factory(None)  # the adapter's own connection path
    monkeypatch.setenv("KVCACHED_BROKER_TIMEOUT_S", "0.5")
    if kind == "unreachable":
        monkeypatch.setenv("KVCACHED_BROKER", f"ipc://{short_tmp}/nobody{{device}}.sock")
    elif kind == "invalid_endpoint":
        monkeypatch.setenv("KVCACHED_BROKER", "ipc://relative/gpu{device}.sock")
    elif kind in ("slow", "gone"):
        arranged.broker = request.getfixturevalue("broker_factory")(simulate="1GiB", extra_args=["--headroom", "0"])
        monkeypatch.setenv("KVCACHED_BROKER", arranged.broker.endpoint)
    else:
        config = {"max_sessions_per_pid": 0} if kind == "hello_rate_limited" else {}
        arranged.broker = request.getfixturevalue("inproc_factory")(total_bytes=total_bytes, **config)
        monkeypatch.setenv("KVCACHED_BROKER", arranged.broker.endpoint)
        if kind == "unresolvable_device":
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000000-dead-beef-0000-000000000000")
        if kind in INJECTED:
            sessions.set_client_factory(_failing_client(arranged, arranged.broker.endpoint))
        elif kind in MALFORMED:
            sessions.set_client_factory(_malformed_client(arranged, arranged.broker.endpoint))
    request.addfinalizer(arranged.undo)
    return arranged


def unprotected_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "event=unprotected" in line]

