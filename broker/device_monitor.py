"""The device as the ledger sees it: readings turned into budget, headroom and measured usage.

A :class:`DeviceMonitor` reads its probe (NVML, or a simulated device) when asked, and tells
the ledger what changed: the device's size, the headroom (a fixed size or a share of the
size), the memory used by processes the broker does not know (``external``), and what every
registered process is measured using.  It logs each crossing of the budget (``overcommitted``
and ``back_under_budget``) once, and it is where the admin ``simulate`` op lands.
"""

from __future__ import annotations

import logging

from ..client.errors import BadRequest
from ..client.units import parse_headroom
from .device import DeviceProbe, SimulatedDevice
from .ledger import Ledger

log = logging.getLogger("kvcached_broker")


class DeviceMonitor:
    def __init__(self, probe: DeviceProbe, headroom: str):
        self.probe = probe
        first = probe.read()
        self.total_bytes = first.total_bytes
        self.external_bytes = first.external_for((), 0)
        self._headroom_bytes, self._headroom_fraction = parse_headroom(headroom, first.total_bytes)
        self._was_overcommitted = False

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
        """Read the device and give the ledger what it says (a failed read is logged, not raised)."""
        try:
            reading = self.probe.read()
        except Exception as exc:
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

    def simulate(self, external_bytes: int | None, process_bytes: dict[int, int] | None) -> None:
        """Inject usage into a simulated device (the admin ``simulate`` op)."""
        if not isinstance(self.probe, SimulatedDevice):
            raise BadRequest("simulate works only on a simulated device (serve --simulate SIZE)")
        if external_bytes is not None:
            self.probe.set_external(external_bytes)
        if process_bytes is not None:
            self.probe.set_process_bytes(process_bytes)
