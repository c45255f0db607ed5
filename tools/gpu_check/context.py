"""What a part of the GPU check is given: :class:`PartContext` (the parts are listed in :mod:`.parts`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from .devices import Device
from .record import PartRecord


@dataclass(frozen=True)
class PartContext:
    """What a part is given: the device, its record, its own folder and its deadline.

    ``kvcached_path`` is where kvcached was built for this run (a GPU run; None otherwise)."""

    device: Device
    record: PartRecord
    workdir: Path
    deadline: float  # time.monotonic() by which the part must be done
    kvcached_path: Path | None = None

    def left_s(self) -> float:
        return self.deadline - time.monotonic()
