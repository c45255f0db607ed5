"""Who may use a broker (broker/security.py, client/trust.py): tokens bound to their process,
socket and directory permissions, unsafe socket paths, admin peers and groups, TCP only with
CURVE or on loopback, and endpoints another user prepared."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached_broker.client import BrokerClient, BrokerUnavailable
from kvcached_broker.tools.launch import BrokerLauncher

from helpers import GIB, MIB, Worker, free_port, journal_records, python_env, session_of, wait_for


def test_a_stolen_token_is_useless_from_another_process(broker, workers):
    w = Worker(broker.endpoint, "owner", {"weights": GIB}, pages=0)
    workers.append(w)
    token = None
    journal = broker.state_dir / "gpu0.journal"
    wait_for(lambda: journal.exists() and journal.stat().st_size, what="the worker's session in the journal")
    for record in journal_records(broker.state_dir / "gpu0.journal"):
        if record["kind"] == "session" and record["id"] == w.session_id:
            token = record["token"]
    assert token
    import msgpack
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)  # bounds a failure only
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.endpoint)
    sock.send(msgpack.packb({"op": "hello", "id": 1, "versions": [1], "instance": "owner", "pid": os.getpid(),
                             "page_bytes": 2 * MIB, "nonce": "thief-nonce", "resume": token}))
    reply = msgpack.unpackb(sock.recv())
    assert reply["ok"] is False and reply["error"]["code"] == "not_owner"
    sock.send(msgpack.packb({"op": "reserve", "id": 2, "session": token, "pools": {}}))
    assert msgpack.unpackb(sock.recv())["error"]["code"] == "not_owner"
    sock.close()
    assert broker.status()["reserved_bytes"] == GIB


def test_socket_and_directory_are_not_world_writable(broker):
    sock_path = Path(broker.endpoint[len("ipc://") :])
    sock_mode = stat.S_IMODE(os.stat(sock_path).st_mode)
    dir_mode = stat.S_IMODE(os.stat(sock_path.parent).st_mode)
    assert sock_mode == 0o660, oct(sock_mode)
    assert not dir_mode & 0o002
    state_mode = stat.S_IMODE(os.stat(broker.state_dir).st_mode)
    assert state_mode & 0o077 == 0


def test_default_socket_directory_is_created_0750(short_tmp):
    runtime = short_tmp / "run"
    broker = BrokerLauncher(None, simulate="8GiB", env={**python_env(), "KVCACHED_BROKER_RUNTIME_DIR": str(runtime)})
    with broker:  # no --endpoint: the default socket, in a directory the broker creates
        assert broker.endpoint == f"ipc://{runtime}/gpu0.sock"
        assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o750
        assert stat.S_IMODE(os.stat(runtime / "gpu0.sock").st_mode) == 0o660


@pytest.mark.parametrize("problem", ["symlink", "world_writable", "foreign_owner", "not_a_socket"])
def test_unsafe_socket_paths_are_refused(short_tmp, problem):
    target = short_tmp / "real"
    target.mkdir()
    sock_dir = short_tmp / "sock"
    if problem == "symlink":
        sock_dir.symlink_to(target)
    elif problem == "world_writable":
        sock_dir.mkdir()
        os.chmod(sock_dir, 0o777)
    elif problem == "foreign_owner":
        sock_dir.mkdir()
        os.chown(sock_dir, 65534, 65534)
    else:
        sock_dir.mkdir()
        (sock_dir / "gpu0.sock").write_text("not a socket")
    out = BrokerLauncher(f"ipc://{sock_dir}/gpu0.sock", simulate="8GiB").expect_refusal()
    assert out.returncode == 1, out
    assert len(out.stderr.strip().splitlines()) == 1 and str(sock_dir) in out.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_admin_operations_need_an_admin_peer(broker_factory):
    import grp

    nogroup = grp.getgrgid(65534).gr_name
    os.chmod(broker_factory.workdir, 0o755)
    b = broker_factory(extra_args=["--socket-group", nogroup], socket_subdir="run")
    script = (
        "import sys, os;"
        "from kvcached_broker.client.admin import AdminClient;"
        "from kvcached_broker.client.errors import Forbidden;"
        "os.setgid(65534); os.setuid(65534);"
        f"a = AdminClient({b.endpoint!r});"
        "print(a.status()['device']['index']);"
        "\ntry:\n    a.limit('x', max_bytes=1)\nexcept Forbidden as e:\n    print('forbidden', e)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "0" and "forbidden" in out.stdout and "uid 65534" in out.stdout
    assert all(i["name"] != "x" for i in b.status()["instances"])


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_admin_group_members_may_set_limits(broker_factory):
    import grp

    nogroup = grp.getgrgid(65534).gr_name
    os.chmod(broker_factory.workdir, 0o755)
    b = broker_factory(extra_args=["--socket-group", nogroup, "--admin-group", nogroup], socket_subdir="run")
    script = (
        "import os;"
        "from kvcached_broker.client.admin import AdminClient;"
        "os.setgid(65534); os.setuid(65534);"
        f"print(AdminClient({b.endpoint!r}).limit('x', max_bytes=1 << 30).max_bytes)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(1 << 30)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run an admin as another user")
def test_an_admin_group_member_cannot_kill_another_users_worker(broker_factory, workers):
    import grp

    nogroup = grp.getgrgid(65534).gr_name
    os.chmod(broker_factory.workdir, 0o755)
    b = broker_factory(extra_args=["--socket-group", nogroup, "--admin-group", nogroup], socket_subdir="run")
    w = Worker(b.endpoint, "roots", {"weights": GIB}, pages=0)  # runs as root
    workers.append(w)
    script = (
        "import os;"
        "from kvcached_broker.client.admin import AdminClient;"
        "from kvcached_broker.client.errors import Forbidden;"
        "os.setgid(65534); os.setuid(65534);"
        f"a = AdminClient({b.endpoint!r});"
        f"\ntry:\n    a.evict({w.session_id!r}, kill=True)\nexcept Forbidden as e:\n    print('forbidden', e)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("forbidden") and "may not kill" in out.stdout
    assert w.proc.poll() is None and session_of(b.status(), w.session_id) is not None  # nothing happened


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a worker as another user")
def test_a_hello_of_another_user_sets_no_limits_on_an_instance_it_does_not_own(broker_factory, workers):
    """Issue 26, item 5: a non-admin peer opened a session under another user's instance name
    with limits {max_bytes: 0} and capped it at 0, where the admin CLI said forbidden."""
    import grp

    nogroup = grp.getgrgid(65534).gr_name
    os.chmod(broker_factory.workdir, 0o755)
    b = broker_factory(simulate="16GiB", extra_args=["--socket-group", nogroup, "--headroom", "0"],
                       socket_subdir="run")
    w = Worker(b.endpoint, "prod", {}, pages=2, page_bytes=GIB)  # root's server
    workers.append(w)
    script = (
        "import os, json;"
        "from kvcached_broker.client import BrokerClient;"
        "os.setgid(65534); os.setuid(65534);"
        f"c = BrokerClient.connect('prod', endpoint={b.endpoint!r}, page_bytes={GIB}, credit_pages=0,"
        " limits={'max_bytes': 0}, background=False);"
        "print(json.dumps(c.acquire(1)))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "event=hello_limits instance=prod outcome=forbidden" in out.stderr  # the client says so
    prod = next(i for i in b.status()["instances"] if i["name"] == "prod")
    assert prod["max_bytes"] is None and out.stdout.strip() == "1"  # no cap: the intruder even got its page
    assert "event=hello_limits instance=prod uid=65534 outcome=forbidden" in b.log()
    with BrokerClient.connect("prod", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0) as c:
        assert c.acquire(4) == 4  # root's instance is not capped


def test_insecure_tcp_needs_the_flag_and_loopback(short_tmp):
    out = BrokerLauncher("tcp://127.0.0.1:45611", simulate="8GiB").expect_refusal()
    assert out.returncode == 1 and "CURVE" in out.stderr
    out = BrokerLauncher("tcp://0.0.0.0:45611", simulate="8GiB", args=["--insecure-tcp"]).expect_refusal()
    assert out.returncode == 1 and "loopback" in out.stderr


def test_every_loopback_address_counts_for_insecure_tcp(short_tmp):
    broker = BrokerLauncher(f"tcp://127.0.0.2:{free_port()}", simulate="8GiB", args=["--insecure-tcp"], capture=True)
    with broker:  # it answers status there: it started
        assert "event=ready" in broker.stderr(), broker.stderr()
        assert "loopback" not in broker.stderr()


def test_tcp_with_curve_admits_only_authorized_clients(short_tmp, monkeypatch):
    keys = short_tmp / "curve"
    cli = [sys.executable, "-m", "kvcached_broker.broker.cli"]
    for name, where in (("server", keys), ("worker", keys / "authorized"), ("stranger", short_tmp / "other")):
        assert subprocess.run(cli + ["keygen", str(where), name], capture_output=True).returncode == 0
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    monkeypatch.setenv("KVCACHED_BROKER_CURVE_SERVER", str(keys / "server.key"))
    monkeypatch.setenv("KVCACHED_BROKER_CURVE_CLIENT", str(keys / "authorized" / "worker.key_secret"))
    with BrokerLauncher(endpoint, simulate="8GiB", args=["--curve-dir", str(keys)]):  # ready: an authorized client got status
        c = BrokerClient.connect("curve-worker", endpoint=endpoint, credit_pages=0)
        assert c.acquire(3) == 3
        status = c.status()
        assert status["instances"][0]["sessions"][0]["pid_verified"] is False  # tcp: no kernel credentials
        c.close()
        monkeypatch.setenv("KVCACHED_BROKER_CURVE_CLIENT", str(short_tmp / "other" / "stranger.key_secret"))
        with pytest.raises(BrokerUnavailable):
            BrokerClient.connect("intruder", endpoint=endpoint, timeout_s=1.0)
        monkeypatch.delenv("KVCACHED_BROKER_CURVE_CLIENT")
        monkeypatch.delenv("KVCACHED_BROKER_CURVE_SERVER")
        with pytest.raises(BrokerUnavailable):
            BrokerClient.connect("plaintext", endpoint=endpoint, timeout_s=1.0)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to own files as another user")
def test_the_client_refuses_an_endpoint_another_user_prepared(short_tmp, monkeypatch):
    from kvcached_broker.client import UntrustedEndpoint

    impostor = short_tmp / "kvcached-1000"
    impostor.mkdir()
    os.chown(impostor, 4242, 4242)
    endpoint = f"ipc://{impostor}/gpu0.sock"
    with pytest.raises(UntrustedEndpoint, match="owned by uid 4242"):
        BrokerClient.connect("victim", endpoint=endpoint, timeout_s=0.5)
    monkeypatch.setenv("KVCACHED_BROKER_UID", "4242")  # a broker that runs as that user: trusted
    with pytest.raises(BrokerUnavailable):
        BrokerClient.connect("victim", endpoint=endpoint, timeout_s=0.5)
    link = short_tmp / "link"
    link.symlink_to(impostor)
    with pytest.raises(UntrustedEndpoint, match="symlink"):
        BrokerClient.connect("victim", endpoint=f"ipc://{link}/gpu0.sock", timeout_s=0.5)

