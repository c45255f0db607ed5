"""What one peer may hold of the broker: file descriptors and connections (broker/connections.py),
``/metrics`` connections (broker/metrics.py), and the bytes it can make the broker buffer.

The decisions first (``ConnectionBook``, no I/O), then real brokers and real sockets: a broker
whose open-file limit is low (``prlimit``) flooded with plain connections, and with idle
``/metrics`` connections, which used to abort it (SIGABRT in libzmq's ipc listener).  Floods
come from child processes, so that this process's own open-file limit does not matter.
"""

from __future__ import annotations

import http.client
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import msgpack
import pytest
import zmq

from kvcached_broker.broker.connections import ConnectionBook, connection_bounds
from kvcached_broker.client import BrokerClient
from kvcached_broker.tools.launch import BrokerLauncher

from helpers import GIB, free_port, raw_dealer, wait_for

needs_prlimit = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")


# ------------------------------------------------------------------------ the decisions
def test_connections_are_bounded_in_all_and_per_peer_and_refused_ones_take_no_slot():
    book = ConnectionBook(connection_bounds(open_files=1 << 16, max_total=4, max_per_peer=2))
    assert [book.accepted(fd, "alice") for fd in (10, 11, 12)] == [None, None, "per_peer"]
    assert [book.accepted(fd, "bob") for fd in (13, 14)] == [None, None]
    assert book.accepted(15, "carol") == "total"
    book.closed(12)  # a refused one closing frees nothing
    assert book.accepted(16, "carol") == "total"
    book.closed(10)
    assert book.accepted(17, "carol") is None
    view = book.view()
    assert (view["admitted"], view["refused"]) == (4, {"total": 2, "per_peer": 1})


def test_an_fd_number_reused_without_a_disconnect_is_not_counted_twice():
    book = ConnectionBook(connection_bounds(open_files=1 << 16, max_total=2, max_per_peer=2))
    assert book.accepted(10, "alice") is None
    assert book.accepted(10, "alice") is None  # its DISCONNECTED never came: the old one is gone
    assert book.view()["admitted"] == 1


@pytest.mark.parametrize(("open_files", "total"), [(256, 96), (1024, 384), (65536, 4352), (1 << 20, 4352)])
def test_connections_get_at_most_half_of_what_the_open_file_limit_leaves(open_files, total):
    assert connection_bounds(open_files, max_total=4352, max_per_peer=1088).max_total == total


# -------------------------------------------------------------------- real brokers, fds
FLOOD = """
import socket, sys
socks = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sys.argv[1])
    except OSError:
        break
    socks.append(s)
print(len(socks), flush=True)
sys.stdin.read()
"""


def _flood(path: str, count: int) -> subprocess.Popen:
    """A process holding ``count`` plain connections to ``path`` (no ZeroMQ handshake) until its stdin closes."""
    proc = subprocess.Popen([sys.executable, "-c", FLOOD, path, str(count)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip(), "the flood could not connect at all"
    return proc


def _end(procs) -> None:
    for proc in procs:
        proc.stdin.close()
        proc.wait(timeout=60)


@needs_prlimit
def test_a_flood_of_plain_connections_past_the_soft_open_file_limit_leaves_the_broker_serving(short_tmp):
    """1,600 plain connections against a soft open-file limit of 512 used to abort the broker
    ('Too many open files (src/ipc_listener.cpp)').  Now the limit is raised to the hard one
    (2,048), connections are bounded to half of what it leaves (896), and the rest are refused."""
    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    broker = BrokerLauncher(endpoint, simulate="8GiB", prefix=["prlimit", "--nofile=512:2048", "--"],
                            log=short_tmp / "broker.log").start()
    floods = [_flood(f"{short_tmp}/gpu0.sock", 400) for _ in range(4)]
    try:
        assert broker.proc.poll() is None, (short_tmp / "broker.log").read_text()[-2000:]
        status = wait_for(lambda: _refusing(broker), what="connections past the bound refused")
        connections = status["broker"]["limits"]["connections"]
        assert connections["max"] == 896 and connections["admitted"] <= 896, connections
        assert status["broker"]["limits"]["open_files"]["soft"] == 2048
    finally:
        _end(floods)
    with BrokerClient.connect("after", endpoint=endpoint, page_bytes=GIB, credit_pages=0) as c:
        assert c.acquire(2) == 2
    assert broker.proc.poll() is None
    broker.stop()


def _refusing(broker):
    """The status once the broker has refused a connection (it takes the flood's 1,600 in its
    own time: on a loaded machine a first status came when it had admitted 599 and refused none)."""
    status = _status_or_none(broker)
    return status if status is not None and status["broker"]["limits"]["connections"]["refused"]["total"] else None


def _status_or_none(broker):
    from kvcached_broker.client.admin import AdminClient
    from kvcached_broker.client.errors import BrokerUnavailable

    assert broker.proc.poll() is None, "the broker died"
    try:
        with AdminClient(broker.endpoint, timeout_s=2.0) as admin:
            return admin.status()
    except BrokerUnavailable:
        return None


@needs_prlimit
def test_the_soft_open_file_limit_is_raised_to_the_hard_one_at_start(short_tmp):
    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    with BrokerLauncher(endpoint, simulate="8GiB", prefix=["prlimit", "--nofile=256:4096", "--"]) as broker:
        open_files = broker.status()["broker"]["limits"]["open_files"]
    assert open_files == {"soft": 4096, "hard": 4096, "soft_at_start": 256}


def test_one_peer_gets_at_most_its_share_of_connections(inproc_factory):
    b = inproc_factory(max_connections_per_uid=4)
    admin = b.admin()
    first = admin.status()["broker"]["limits"]["connections"]
    socks = []
    for _ in range(5):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # a refused one stays refused
        sock.connect(b.endpoint)
        socks.append(sock)
    try:
        connections = wait_for(lambda: _connections_once(admin, first["accepted"] + 5), what="5 more accepted")
        assert connections["admitted"] == 4 and connections["refused"] == {"total": 0, "per_peer": 2}, connections
    finally:
        for sock in socks:
            sock.close(0)
        admin.close()


def _connections_once(admin, accepted: int):
    connections = admin.status()["broker"]["limits"]["connections"]
    return connections if connections["accepted"] >= accepted and sum(connections["refused"].values()) else None


# ----------------------------------------------------------------------------- /metrics
def _scrape(port: int) -> str | None:
    """/metrics' text, or None while the bounded pool still turns connections away (it closes
    them unanswered until it has noticed the idle ones closed: on a loaded machine, a moment)."""
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    except (http.client.RemoteDisconnected, ConnectionResetError):
        return None



IDLE_HTTP = """
import socket, sys
socks = []
for _ in range(int(sys.argv[2])):
    s = socket.socket()
    s.settimeout(0.5)
    try:
        s.connect(("127.0.0.1", int(sys.argv[1])))
    except OSError:
        continue
    socks.append(s)
print(len(socks), flush=True)
sys.stdin.read()
"""


@needs_prlimit
def test_idle_metrics_connections_take_a_bounded_pool_not_the_workers_descriptors(short_tmp):
    """300 idle /metrics connections used to start 300 threads, each holding a descriptor,
    until the next worker's connection aborted the broker."""
    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    port = free_port()
    broker = BrokerLauncher(endpoint, simulate="8GiB", args=["--metrics-port", str(port)],
                            prefix=["prlimit", "--nofile=256:256", "--"], log=short_tmp / "broker.log").start()
    idle = subprocess.Popen([sys.executable, "-c", IDLE_HTTP, str(port), "300"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert int(idle.stdout.readline()) > 0
        threads = len(list(Path(f"/proc/{broker.proc.pid}/task").iterdir()))
        assert threads < 40, threads
        with BrokerClient.connect("worker", endpoint=endpoint, page_bytes=GIB, credit_pages=0) as c:
            assert c.acquire(2) == 2
        metrics = broker.status()["broker"]["limits"]["metrics"]
        assert metrics["threads"] == 4 and metrics["refused"] > 0, metrics
    finally:
        _end([idle])
    assert broker.proc.poll() is None, (short_tmp / "broker.log").read_text()[-2000:]
    from prometheus_client.parser import text_string_to_metric_families

    text = wait_for(lambda: _scrape(port), what="a scrape answered once the idle connections are gone")
    samples = {(sample.name, sample.labels.get("limit")): sample.value
               for family in text_string_to_metric_families(text) for sample in family.samples}
    assert samples[("kvcached_broker_limit", "metrics_threads")] == 4
    assert ("kvcached_broker_connections_refused_total", None) in samples
    broker.stop()


# -------------------------------------------------------------- replies nobody reads
def _unread_dealer(endpoint: str) -> zmq.Socket:
    """A DEALER that asks and never reads: its own queue holds one message, its kernel buffer little."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    return sock


def _rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096


def _answered(admin, at_least: int) -> dict | None:
    status = admin.status()
    return status if status["broker"]["counters"]["requests"] >= at_least else None


def test_status_replies_nobody_reads_are_dropped_past_a_bound_not_kept(short_tmp):
    """500 unread status requests, each answered with a 300 KB document, held ~150 MB (1,000 of
    1.5 MB held 1.5 GB in the issue); now a connection has at most 2 such replies waiting."""
    from kvcached_broker.broker.reply_budget import LARGE_REPLY_BYTES
    from kvcached_broker.client.admin import AdminClient

    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    broker = BrokerLauncher(endpoint, simulate="8TiB", args=["--headroom", "0"], log=short_tmp / "broker.log").start()
    pools = {f"p{k:02d}" + "x" * 61: 1 << 20 for k in range(64)}  # the largest pool map a request may carry
    clients = [BrokerClient.connect("big", endpoint=endpoint, credit_pages=0, background=False) for _ in range(60)]
    for c in clients:
        c.reserve(pools)
    admin = AdminClient(endpoint, timeout_s=60)
    try:
        size = len(msgpack.packb(admin.status()))
        assert size > 16 * LARGE_REPLY_BYTES
        asked = admin.status()["broker"]["counters"]["requests"]
        before = _rss_bytes(broker.proc.pid)
        sock = _unread_dealer(endpoint)
        for request_id in range(500):
            sock.send(msgpack.packb({"op": "status", "id": request_id}))
        status = wait_for(lambda: _answered(admin, asked + 500), what="the 500 answered")
        grown = _rss_bytes(broker.proc.pid) - before
        assert grown < 48 << 20, f"the broker grew {grown >> 20} MiB"
        replies = status["broker"]["limits"]["replies"]
        assert replies["dropped"].get("large_per_connection", 0) >= 450, replies
        # the unread connection's two, and at most the admin's own previous reply: read by the
        # admin, but tracked until libzmq's I/O thread lets go of it, which may be a moment later
        assert replies["large_waiting_bytes"] <= 3 * size + 8192
        sock.close(0)
    finally:
        admin.close()
        for c in clients:
            c.close()
        broker.stop()


def test_small_replies_nobody_reads_are_dropped_past_the_connection_queue(inproc):
    """With a queue of 100,000 replies a connection, a peer could keep that many answers waiting."""
    sock = _unread_dealer(inproc.endpoint)
    admin = inproc.admin()
    asked = admin.status()["broker"]["counters"]["requests"]
    for request_id in range(10_000):
        sock.send(msgpack.packb({"op": "heartbeat", "id": request_id, "session": "x" * 20}))
    status = wait_for(lambda: _answered(admin, asked + 10_000), what="the 10,000 answered")
    assert status["broker"]["limits"]["replies"]["dropped"].get("queue_full", 0) > 0
    assert status["broker"]["limits"]["requests"] == {"max_bytes": 64 << 10, "per_connection": 16}
    sock.close(0)
    admin.close()


def test_a_multipart_request_is_refused_and_each_frame_is_bounded(inproc):
    """libzmq delivers a multipart message whole, so the broker cannot refuse it before it has
    arrived; it answers ``bad_request`` (protocol.md §1), and ZeroMQ drops a connection whose
    frame is over 64 KiB before any of it is buffered."""
    sock = raw_dealer(inproc.endpoint)
    sock.send_multipart([msgpack.packb({"op": "status", "id": 1}), b"x"])
    reply = msgpack.unpackb(sock.recv())
    assert reply["error"]["code"] == "bad_request" and reply["id"] is None
    sock.close(0)
