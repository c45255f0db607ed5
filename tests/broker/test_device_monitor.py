"""The device monitor alone (broker/device_monitor.py): readings into the ledger, headroom as a
size or a share, external and measured usage, overcommit crossings and instance-name
collisions logged once each, and the admin ``simulate`` op's landing."""

from __future__ import annotations

import logging

import pytest

from kvcached_broker.broker.accounts import DeviceInfo
from kvcached_broker.broker.device import DeviceReading, SimulatedDevice
from kvcached_broker.broker.device_monitor import DeviceMonitor
from kvcached_broker.client.errors import BadRequest

from helpers import GIB

RUNNING = {100: 1, 200: 1, 300: 1}  # pid -> start ticks of the processes the device may list


class ScriptedProbe:
    """A probe (not a simulated device) whose next readings a test sets; ``fail`` makes it raise."""

    info = DeviceInfo(index=0, uuid="GPU-scripted", name="scripted GPU", simulated=False)

    def __init__(self, total_bytes: int, used_bytes: int = 0):
        self.reading = DeviceReading(total_bytes=total_bytes, used_bytes=used_bytes)
        self.fail = False

    def read(self) -> DeviceReading:
        if self.fail:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return self.reading


def _open(ledger, sid: str, pid: int, instance: str | None = None, tp_rank: int = 0, tp_size: int = 1):
    return ledger.open_session(sid, instance=instance or sid, pid=pid, pid_verified=True, tp_rank=tp_rank,
                               tp_size=tp_size, page_bytes=GIB, now_s=0.0)


def test_the_first_reading_sizes_the_ledger():
    probe = ScriptedProbe(80 * GIB, used_bytes=3 * GIB)  # someone else already uses 3 GiB
    monitor = DeviceMonitor(probe, "5%")
    ledger = monitor.new_ledger()
    assert ledger.total_bytes == 80 * GIB and ledger.headroom_bytes == 4 * GIB == monitor.headroom_bytes
    assert ledger.external_bytes == 3 * GIB and ledger.budget_bytes == 73 * GIB
    assert ledger.device.uuid == "GPU-scripted"


def test_a_share_of_headroom_follows_the_size_and_a_fixed_one_does_not():
    probe = ScriptedProbe(80 * GIB)
    share, fixed = DeviceMonitor(probe, "10%"), DeviceMonitor(probe, "2GiB")
    by_share, by_size = share.new_ledger(), fixed.new_ledger()
    probe.reading = DeviceReading(total_bytes=40 * GIB, used_bytes=0)  # a MIG slice resized, say
    share.observe(by_share)
    fixed.observe(by_size)
    assert by_share.total_bytes == by_size.total_bytes == 40 * GIB
    assert by_share.headroom_bytes == 4 * GIB and by_size.headroom_bytes == 2 * GIB


def test_registered_processes_are_measured_and_the_rest_is_external():
    probe = ScriptedProbe(80 * GIB)
    monitor = DeviceMonitor(probe, "0")
    ledger = monitor.new_ledger()
    _open(ledger, "a", pid=100)
    ledger.acquire("a", 2)  # 2 GiB reported
    probe.reading = DeviceReading(total_bytes=80 * GIB, used_bytes=10 * GIB, process_bytes={100: 3 * GIB, 999: GIB})
    monitor.observe(ledger)
    assert ledger.external_bytes == 7 * GIB  # everything but what pid 100 uses
    assert ledger.measured_bytes("a") == 3 * GIB
    assert ledger.unreported_bytes == GIB  # measured beyond what it reported


def test_a_failed_reading_is_logged_and_changes_nothing(caplog):
    probe = ScriptedProbe(80 * GIB)
    monitor = DeviceMonitor(probe, "0")
    ledger = monitor.new_ledger()
    probe.fail = True
    with caplog.at_level(logging.ERROR, logger="kvcached_broker"):
        monitor.observe(ledger)
    assert "event=device_read_failed" in caplog.text and "GPU_IS_LOST" in caplog.text
    assert ledger.total_bytes == 80 * GIB and ledger.external_bytes == 0


def test_each_crossing_of_the_budget_is_logged_once(caplog):
    probe = ScriptedProbe(10 * GIB)
    monitor = DeviceMonitor(probe, "0")
    ledger = monitor.new_ledger()
    _open(ledger, "a", pid=100)
    assert ledger.acquire("a", 8).pages == 8
    with caplog.at_level(logging.WARNING, logger="kvcached_broker"):
        probe.reading = DeviceReading(total_bytes=10 * GIB, used_bytes=12 * GIB, process_bytes={100: 8 * GIB})
        monitor.observe(ledger)  # 4 GiB appear from outside: 12 charged of 10
        monitor.observe(ledger)
        assert ledger.overcommitted
        probe.reading = DeviceReading(total_bytes=10 * GIB, used_bytes=8 * GIB, process_bytes={100: 8 * GIB})
        monitor.observe(ledger)
        monitor.observe(ledger)
    events = [r.getMessage().split()[0] for r in caplog.records]
    assert events == ["event=overcommitted", "event=back_under_budget"]


def test_an_instance_name_collision_is_logged_once_and_again_when_it_changes(caplog):
    monitor = DeviceMonitor(ScriptedProbe(80 * GIB), "0")
    ledger = monitor.new_ledger()
    _open(ledger, "s1", pid=100, instance="model")
    _open(ledger, "s2", pid=200, instance="model")  # rank 0 from two processes: two servers, one name
    with caplog.at_level(logging.WARNING, logger="kvcached_broker"):
        monitor.observe(ledger)
        monitor.observe(ledger)
        assert caplog.text.count("event=instance_collision") == 1
        assert "instance=model kind=rank rank=0 sessions=s1,s2 pids=100,200" in caplog.text
        _open(ledger, "s3", pid=300, instance="model")  # a third server: a new collision
        monitor.log_new_collisions(ledger)
        assert caplog.text.count("event=instance_collision") == 2
        ledger.close_session("s3")
        ledger.close_session("s2")  # gone: nothing more to log, and no line for its end
        monitor.observe(ledger)
        assert caplog.text.count("event=instance_collision") == 2


def test_simulate_lands_on_a_simulated_device_all_or_nothing():
    device = SimulatedDevice(0, 16 * GIB, start_ticks=RUNNING.get)
    monitor = DeviceMonitor(device, "0")
    ledger = monitor.new_ledger()
    monitor.simulate(2 * GIB, {100: GIB})
    monitor.observe(ledger)
    assert ledger.external_bytes == 3 * GIB  # pid 100 is not registered: external too
    with pytest.raises(BadRequest, match="no running process 4242"):
        monitor.simulate(5 * GIB, {200: GIB, 4242: GIB})
    assert device.read().process_bytes == {100: GIB}  # the refusal changed nothing
    monitor.observe(ledger)
    assert ledger.external_bytes == 3 * GIB
    monitor.simulate(None, {100: 0})  # 0 clears one
    monitor.observe(ledger)
    assert ledger.external_bytes == 2 * GIB


def test_simulate_is_refused_on_a_real_device():
    monitor = DeviceMonitor(ScriptedProbe(80 * GIB), "0")
    with pytest.raises(BadRequest, match="only on a simulated device"):
        monitor.simulate(GIB, None)
