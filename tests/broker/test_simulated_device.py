"""A simulated device reports a process only while it runs, as NVML does.

NVML lists running processes only: when one exits, its memory is freed and it is gone from the
list.  The simulated device (``simulate --process PID=SIZE``, and the shared device of
``serve --simulate-usage-dir``) must do the same, or a dead process's usage stays as external
memory and shrinks the budget for good.  The tests drive real brokers, the real CLI and real
child processes, and wait on the broker's state, never on time.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from kvcached_broker.broker.device import SimulatedDevice, read_shared_usage
from kvcached_broker.client.procfs import running_start_ticks
from kvcached_broker.tools.shared_gpu import SharedGpu

from helpers import CLI, GIB, wait_for

def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def external_is(b, size_bytes: int):
    """A predicate: the broker's status once it shows ``size_bytes`` of external memory."""
    return lambda: (lambda s: s if s["external_bytes"] == size_bytes else None)(b.status())


# ----------------------------------------------------------------------------- simulate --process
def test_a_dead_process_usage_stops_counting_and_the_budget_comes_back(broker, children):
    before = broker.status()
    child = children()
    with broker.admin() as admin:
        admin.simulate(process_bytes={child.pid: 10 * GIB})
    assert broker.status()["external_bytes"] == 10 * GIB  # unregistered: external, as on a GPU
    assert broker.status()["budget_bytes"] == before["budget_bytes"] - 10 * GIB
    child.kill()
    child.wait(timeout=30)
    after = wait_for(external_is(broker, 0), what="the dead process's usage to leave the device")
    assert after["budget_bytes"] == before["budget_bytes"]


def test_a_killed_process_not_yet_reaped_is_gone_from_the_device_too(broker, children):
    """A zombie has no memory left (the driver freed it at exit), so NVML does not list it."""
    child = children()
    with broker.admin() as admin:
        admin.simulate(process_bytes={child.pid: 3 * GIB})
    child.kill()  # not waited for: a zombie until the fixture reaps it
    wait_for(external_is(broker, 0), what="the zombie's usage to leave the device")


def test_usage_for_a_process_that_does_not_run_is_refused_and_changes_nothing(broker, children):
    child = children()
    child.kill()
    child.wait(timeout=30)
    out = cli("simulate", "--endpoint", broker.endpoint, "--process", f"{child.pid}=1GiB", "--external", "1GiB")
    assert out.returncode == 1, out
    assert len(out.stderr.strip().splitlines()) == 1 and str(child.pid) in out.stderr
    assert broker.status()["external_bytes"] == 0


def test_a_recycled_pid_is_not_the_process_the_usage_was_set_for():
    """The pid is matched with its start time, so a new process that got the pid is not charged."""
    starts = {4242: 100}
    device = SimulatedDevice(0, 8 * GIB, start_ticks=starts.get)
    device.set_process_bytes({4242: 2 * GIB})
    assert device.read().process_bytes == {4242: 2 * GIB}
    starts[4242] = 101  # the process exited and another one got its pid
    reading = device.read()
    assert reading.process_bytes == {} and reading.used_bytes == 0
    starts[4242] = 100
    assert device.read().process_bytes == {}  # dropped for good, not hidden


# ----------------------------------------------------------------------------- the CLI flag itself
def test_simulate_process_flag_is_repeatable_and_zero_clears(broker, children):
    a, b = children(), children()
    out = cli("simulate", "--endpoint", broker.endpoint, "--process", f"{a.pid}=1GiB", "--process", f"{b.pid}=2GiB")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["external_bytes"] == 3 * GIB
    assert broker.status()["external_bytes"] == 3 * GIB
    out = cli("simulate", "--endpoint", broker.endpoint, "--process", f"{a.pid}=0")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["external_bytes"] == 2 * GIB
    out = cli("simulate", "--endpoint", broker.endpoint, "--process", f"{b.pid}=0", "--external", "512MiB")
    assert out.returncode == 0, out.stderr
    assert broker.status()["external_bytes"] == 512 << 20


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--process", "abc"],
        ["--process", "=1GiB"],
        ["--process", "0=1GiB"],
        ["--process=-5=1GiB"],
        ["--process", "12=lots"],
        ["--process", "12=80GB"],
        ["--process", "12=-1GiB"],
        ["--process", f"{1 << 31}=1GiB"],
        ["--process", "12=1GiB", "--process", "12=2GiB"],
        ["--external", "lots"],
        ["--external", "1GB"],
    ],
)
def test_bad_simulate_input_exits_2_with_one_line(args, short_tmp):
    out = cli("simulate", "--endpoint", f"ipc://{short_tmp}/nobody.sock", *args)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcached-broker simulate: "), out.stderr


# ----------------------------------------------------------------------------- the shared device
def test_shared_usage_of_a_recycled_pid_is_dropped(short_tmp, children):
    """A usage file names its writer's start time: a later process with the same pid is not it."""
    child = children()
    (short_tmp / str(child.pid)).write_text(f"{GIB} {running_start_ticks(child.pid) + 1}")
    assert read_shared_usage(short_tmp) == {}
    (short_tmp / str(child.pid)).write_text(f"{GIB} {running_start_ticks(child.pid)}")
    assert read_shared_usage(short_tmp) == {child.pid: GIB}
    (short_tmp / str(child.pid)).write_text(str(2 * GIB))  # no start time: taken for the live pid
    assert read_shared_usage(short_tmp) == {child.pid: 2 * GIB}


def test_shared_gpu_stamps_its_usage_and_ignores_a_previous_holder_of_its_pid(short_tmp):
    me = SharedGpu(short_tmp, 16 * GIB)
    (short_tmp / str(me.pid)).write_text(f"{5 * GIB} {running_start_ticks(me.pid) - 1}")  # a dead namesake's
    assert me.mine_bytes() == 0 and me.free_bytes() == 16 * GIB
    me.allocate(GIB)
    assert me.mine_bytes() == GIB and read_shared_usage(short_tmp) == {me.pid: GIB}


def test_a_killed_process_on_the_shared_device_frees_its_memory_before_it_is_reaped(broker_factory, children):
    usage = broker_factory.workdir / "gpu-usage"
    b = broker_factory(simulate="16GiB", extra_args=["--headroom", "0", "--simulate-usage-dir", str(usage)])
    child = children()
    SharedGpu(usage, 16 * GIB, pid=child.pid).set_usage(4 * GIB)
    wait_for(external_is(b, 4 * GIB), what="the broker to measure the child")
    child.kill()  # a zombie until the fixture reaps it
    wait_for(external_is(b, 0), what="the killed child's memory to be free")
    assert SharedGpu(usage, 16 * GIB).free_bytes() == 16 * GIB
