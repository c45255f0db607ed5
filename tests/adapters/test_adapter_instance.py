"""Default instance names: shared by every rank of one server, never by two servers.

The old default, ``{runtime}-{pgid}``, gave every process started from one shell (and every
container's pid-1 launcher) the same name.  Here every process is a child of the test
process, so they all share its process group, exactly the case that collided.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvcached_broker.adapters import instance

RANK = """
import sys, torch.distributed as dist
from kvcached_broker.adapters import instance
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
print(instance.default_name("sglang"), flush=True)
dist.barrier()
"""
ALONE = "from kvcached_broker.adapters import instance; print(instance.default_name('vllm'))"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED", "MASTER_"))}
    env.pop("ENABLE_KVCACHED", None)
    return env


def _server(world: int) -> list[subprocess.Popen]:
    port = _free_port()
    return [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(world), str(port)], env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]


def _names(procs: list[subprocess.Popen]) -> list[str]:
    names = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        names.append(out.strip())
    return names


def test_ranks_of_one_server_share_a_name_and_two_servers_started_together_do_not():
    pytest.importorskip("torch")
    a, b = _server(2), _server(2)
    groups = {os.getpgid(proc.pid) for proc in a + b}
    names_a, names_b = _names(a), _names(b)
    assert groups == {os.getpgid(0)}  # one process group: the old default merged these servers
    assert names_a[0] == names_a[1] and names_b[0] == names_b[1]
    assert names_a[0] != names_b[0]
    port_a = names_a[0].split("@")[0].removeprefix("sglang-")
    assert port_a.isdigit() and names_a[0].startswith("sglang-") and "@" in names_a[0]


def test_processes_without_a_process_group_get_names_of_their_own():
    names = [subprocess.run([sys.executable, "-c", ALONE], env=_env(), capture_output=True, text=True,
                            timeout=60).stdout.strip() for _ in range(2)]
    assert names[0] != names[1] and all(n.startswith("vllm-pid") for n in names)


def test_a_routable_rendezvous_names_the_server_the_same_on_every_node():
    never = lambda kind: pytest.fail("a routable address needs no host scope")  # noqa: E731
    assert instance.compose("vllm", ("10.0.0.1", 29500), never) == "vllm-29500@10.0.0.1"
    assert instance.compose("sglang", ("127.0.0.1", 29500), lambda kind: f"host.{kind}") == "sglang-29500@host.net"
    assert instance.compose("sglang", None, lambda kind: f"host.{kind}") == f"sglang-pid{os.getpid()}@host.pid"


def test_the_loopback_scope_differs_between_network_namespaces():
    """Two containers that each listen on 127.0.0.1:29500 differ in their network namespace."""
    mine = instance._host_scope("net")
    other = subprocess.run(["unshare", "--user", "--map-root-user", "--net", sys.executable, "-c",
                            "from kvcached_broker.adapters import instance; print(instance._host_scope('net'))"],
                           capture_output=True, text=True, timeout=60)
    if other.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {other.stderr.strip()[-200:]}")
    assert other.stdout.strip() != mine and other.stdout.strip().split(".")[0] == mine.split(".")[0]


def test_an_explicit_name_is_used_as_given_and_validated():
    assert instance.instance_name("sglang", {"KVCACHED_BROKER_INSTANCE": " dsv4-a "}) == "dsv4-a"
    with pytest.raises(instance.InstanceNameError, match="KVCACHED_BROKER_INSTANCE='dsv4 a'"):
        instance.explicit({"KVCACHED_BROKER_INSTANCE": "dsv4 a"})
    assert instance.defaulted({}) and not instance.defaulted({"KVCACHED_BROKER_INSTANCE": "x"})
