"""Instructions per request on the broker's request path, counted by callgrind.

Wall-clock times on a shared VM move by tens of percent between runs; instruction counts
repeat.  This drives the broker's request handling in-process, with no sockets: a session
that alternates ``acquire(1)`` and ``release(1)`` (plus a heartbeat every 16 requests), rounds
of 16 requests each followed by the journal commit, exactly as the server loop runs them.

    python benchmarks/request_path.py --compare     # runs itself under callgrind twice

prints the instructions per request (the difference between a run of N requests and a run
of 0, divided by N), so start-up costs cancel out.  ``--requests N`` alone runs the workload
once, without callgrind (that is what callgrind runs).

``--compare --client`` counts the other side the same way: a ``BrokerClient`` (no credit
reserve, so every call is a round trip) making ``acquire(1)`` and ``release(1)`` calls over a
transport that answers in-process with the reply a broker would send (its encoding is counted
too; no socket, no request core).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROUND = 16


class _Processes:
    """Every pid is alive and watched: the request path makes no process checks of its own."""

    def start_ticks(self, pid):
        return 1

    def alive(self, pid, start_ticks):
        return True

    def kill(self, pid):
        raise OSError("not here")

    def watch(self, pid):
        return True

    def unwatch(self, pid):
        return None


def build(state_dir: Path | None):
    """The request core and its journal, as the server wires them, without sockets."""
    from kvcached_broker.broker.device import SimulatedDevice
    from kvcached_broker.broker.request_core import build_core

    core = build_core(SimulatedDevice(0, 80 << 30), _Processes(), headroom="0", state_dir=state_dir)
    core.restore(core.journal.restore(), 0.0)
    core.journal.started()
    return core


def workload(requests: int, state_dir: Path | None) -> None:
    from kvcached_broker.broker.security import Peer
    from kvcached_broker.client import protocol as proto

    core = build(state_dir)
    peer = Peer(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), address="localhost")
    rid = b"\x00path"
    hello = proto.encode(proto.Hello(id=1, versions=[1], instance="path", pid=os.getpid(), page_bytes=2 << 20,
                                     nonce="path-nonce-0"))
    token = proto.decode_broker_message(core.handle(rid, peer, hello, 0.0)).result["session"]
    frames = []
    for i in range(requests):
        request_id = 2 + i
        if i % ROUND == ROUND - 1:
            frames.append(proto.encode(proto.Heartbeat(id=request_id, session=token)))
        elif i % 2:
            frames.append(proto.encode(proto.Release(id=request_id, session=token, pages=1)))
        else:
            frames.append(proto.encode(proto.Acquire(id=request_id, session=token, pages=1)))
    handle, commit = core.handle, core.journal.commit
    for start in range(0, len(frames), ROUND):
        for frame in frames[start : start + ROUND]:
            handle(rid, peer, frame, 1.0)
        commit(1.0)


class _AnsweringTransport:
    """A ``SyncTransport`` stand-in that answers each request as a broker with room would."""

    endpoint = "tcp://127.0.0.1:1"  # not an ipc socket: the client's endpoint guard has no file to check

    def __init__(self):
        from kvcached_broker.client import protocol as proto

        self._proto = proto
        self.pushes: list = []
        self._granted_pages = 0

    def request(self, payload: bytes, request_id: int, *, total_s: float | None = None):
        proto = self._proto
        request = proto.decode_request(payload)
        if isinstance(request, proto.Hello):
            result = {"session": "t" * 32, "session_id": "s-00000001", "lease_s": 30.0, "heartbeat_s": 5.0,
                      "page_bytes": request.page_bytes, "version": 1}
        elif isinstance(request, proto.Acquire):
            self._granted_pages += request.pages
            result = {"granted": request.pages, "granted_pages": self._granted_pages}
        else:
            self._granted_pages -= request.pages
            result = {"granted_pages": self._granted_pages}
        return proto.decode_broker_message(proto.encode(proto.Reply(id=request_id, ok=True, result=result)))

    def close(self) -> None:
        return None


def client_workload(calls: int) -> None:
    from kvcached_broker.client.core import prepare
    from kvcached_broker.client.sync_client import BrokerClient

    transport = _AnsweringTransport()
    core, _ = prepare("path", 0, 0, 1, 2 << 20, transport.endpoint, 0, device_uuid=None, limits=None,
                      client="request-path")
    client = BrokerClient(core, transport)
    client._run(client._ops.open(resume=False))  # what connect does, without its socket
    for _ in range(calls // 2):
        client.acquire(1)
        client.release(1)


def count(requests: int, state: bool, client: bool = False) -> int:
    out_dir = Path(tempfile.mkdtemp(prefix="kb-callgrind-"))
    out_file = out_dir / "callgrind.out"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}", sys.executable, __file__,
           "--requests", str(requests)] + (["--state-dir", str(out_dir / "state")] if state else [])
    cmd += ["--client"] if client else []
    result = subprocess.run(cmd, capture_output=True, text=True)
    match = re.search(r"Collected : (\d+)", result.stderr)
    if result.returncode != 0 or not match:
        raise SystemExit(f"callgrind failed:\n{result.stderr[-2000:]}")
    return int(match.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, help="run the workload once (what callgrind runs)")
    parser.add_argument("--state-dir", type=Path, help="journal into this directory")
    parser.add_argument("--compare", action="store_true", help="count instructions per request under callgrind")
    parser.add_argument("--client", action="store_true", help="count the client's side instead")
    parser.add_argument("-n", type=int, default=4000, help="requests per counted run (default 4000)")
    args = parser.parse_args()
    if args.requests is not None:
        if args.client:
            client_workload(args.requests)
        else:
            workload(args.requests, args.state_dir)
        return 0
    if args.client:
        base, loaded = count(0, False, client=True), count(args.n, False, client=True)
        print(f"BrokerClient, acquire(1)/release(1): {(loaded - base) / args.n:,.0f} instructions per call")
        return 0
    for state in (True, False):
        base, loaded = count(0, state), count(args.n, state)
        label = "with journal" if state else "--no-state"
        print(f"request path, {label}: {(loaded - base) / args.n:,.0f} instructions per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
