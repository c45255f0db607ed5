"""The device as the ledger sees it: readings turned into budget, headroom and measured usage.

A :class:`DeviceMonitor` reads its probe (NVML, or a simulated device) when asked, and tells
the ledger what changed: the device's size, the headroom (a fixed size or a share of the
size), the memory used by processes the broker does not know (``external``), and what every
registered process is measured using.  It logs each crossing of the budget (``overcommitted``
and ``back_under_budget``) once, and each new instance-name collision (``instance_collision``,
see :func:`.status.instance_conflicts`) once, and it is where the admin ``simulate`` op lands.
"""

from __future__ import annotations

import logging
from typing import Any

from ..client.errors import BadRequest
from ..client.units import parse_headroom
from .device import DeviceProbe, NoSuchProcess, SimulatedDevice
from .ledger import Ledger
from .status import instance_conflicts

log = logging.getLogger("kvcached_broker")


class DeviceMonitor:
    def __init__(self, probe: DeviceProbe, headroom: str):
        self.probe = probe
        first = probe.read()
        self.total_bytes = first.total_bytes
        self.external_bytes = first.external_for((), 0)
        self._headroom_bytes, self._headroom_fraction = parse_headroom(headroom, first.total_bytes)
        self._was_overcommitted = False
        # the collisions of the last observation: (instance, kind, rank, sessions)
        self._collisions_seen: set[tuple[str, str, int | None, tuple[str, ...]]] = set()

    @property
    def headroom_bytes(self) -> int:
        return self._headroom_bytes or 0

    def new_ledger(self) -> Ledger:
        """A ledger for this device, sized by its first reading."""
        return Ledger(
            self.probe.info,
            total_bytes=self.total_bytes,
            headroom_bytes=self.headroom_bytes,
            external_bytes=self.external_bytes,
        )

    def observe(self, ledger: Ledger, now_s: float = 0.0) -> None:
        """Read the device and give the ledger what it says (a failed read is logged, not raised),
        and log the instance-name collisions that are new since the last call."""
        self.log_new_collisions(ledger)
        try:
            reading = self.probe.read()
        except Exception as exc:  # noqa: BLE001 - a failed reading is logged; the next tick reads again
            log.error("event=device_read_failed error=%s", exc)
            return
        headroom = self._headroom_bytes
        if self._headroom_fraction is not None:
            headroom = int(reading.total_bytes * self._headroom_fraction)
        pids = [s.pid for s in ledger.sessions.values() if s.pid_verified]
        external = reading.external_for(pids, ledger.reserved_bytes + ledger.granted_bytes)
        ledger.observe_device(
            total_bytes=reading.total_bytes,
            headroom_bytes=headroom,
            external_bytes=external,
            measured_by_pid={pid: reading.process_bytes.get(pid, 0) for pid in pids},
        )
        over = ledger.overcommitted
        if over != self._was_overcommitted:
            self._was_overcommitted = over
            log.warning(
                "event=%s charged=%d budget=%d external=%d",
                "overcommitted" if over else "back_under_budget",
                ledger.charged_bytes,
                ledger.budget_bytes,
                ledger.external_bytes,
            )

    def log_new_collisions(self, ledger: Ledger) -> None:
        """Warn once for each instance-name collision that was not there at the last call.

        A collision is keyed by its instance, kind, rank and sessions: one that lasts is logged
        once; one whose sessions change (a third server joins) is new and logged again."""
        current: set[tuple[str, str, int | None, tuple[str, ...]]] = set()
        for name, conflicts in instance_conflicts(ledger.sessions.values()).items():
            for conflict in conflicts:
                key = (name, conflict["kind"], conflict.get("rank"), tuple(conflict["sessions"]))
                current.add(key)
                if key not in self._collisions_seen:
                    _log_collision(name, conflict)
        self._collisions_seen = current

    def simulate(self, external_bytes: int | None, process_bytes: dict[int, int] | None) -> None:
        """Inject usage into a simulated device (the admin ``simulate`` op)."""
        if not isinstance(self.probe, SimulatedDevice):
            raise BadRequest("simulate works only on a simulated device (serve --simulate SIZE)")
        if process_bytes is not None:  # first: a refusal here must leave everything as it was
            try:
                self.probe.set_process_bytes(process_bytes)
            except NoSuchProcess as exc:
                raise BadRequest(str(exc)) from None
        if external_bytes is not None:
            self.probe.set_external(external_bytes)


def _log_collision(instance: str, conflict: dict[str, Any]) -> None:
    if conflict["kind"] == "rank":
        where = f"rank={conflict['rank']}"
    else:
        where = "tp_sizes=" + ",".join(map(str, conflict["tp_sizes"]))
    log.warning(
        "event=instance_collision instance=%s kind=%s %s sessions=%s pids=%s "
        "detail=two_servers_share_this_instance_name_give_each_its_own_KVCACHED_BROKER_INSTANCE",
        instance, conflict["kind"], where, ",".join(conflict["sessions"]), ",".join(map(str, conflict["pids"])),
    )
