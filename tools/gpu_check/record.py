"""What one part of the GPU check leaves behind: figures, what the simulation assumes, checks.

A part runs in a process of its own and writes its record to disk after every entry
(atomically: a temporary file, then a rename), so a part killed at its time limit still leaves
everything it measured up to then.

* **figures**: what was measured, named with their units (``_bytes``, ``_s``), each a number,
  a bool, a string or None;
* **assumed**: for the figures the simulation has a model of, the value the model gives (the
  simulated device charges a process nothing before it allocates, reports usage at once, ...).
  On a GPU a figure that differs from its assumption is a finding; with ``--simulate`` the
  figure must equal it (a check the runner adds), so a simulation that changes its model
  without saying so here fails;
* **checks**: what the project promises, true or false, each with a one-line detail;
* **notes**: anything a reader needs to read the figures (one line each).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: How a part ended: every check passed / a check failed / it raised / it ran out of time /
#: it could not run here.
STATUSES = ("ok", "failed", "error", "timeout", "skipped")
Scalar = int | float | bool | str | None


class Skip(Exception):
    """This part cannot run here; the message says why, in one line."""


class PartRecord:
    """A part's record, written to ``path`` after every change."""

    def __init__(self, path: Path, name: str, mode: str):
        self.path = Path(path)
        self.data: dict[str, Any] = {"name": name, "mode": mode, "figures": {}, "assumed": {}, "checks": [],
                                     "notes": []}
        self._write()

    def figure(self, key: str, value: Scalar) -> Scalar:
        self.data["figures"][key] = _scalar(key, value)
        self._write()
        return value

    def figures(self, **values: Scalar) -> None:
        for key, value in values.items():
            self.data["figures"][key] = _scalar(key, value)
        self._write()

    def assume(self, **values: Scalar) -> None:
        """What the simulation's model says these figures are."""
        for key, value in values.items():
            self.data["assumed"][key] = _scalar(key, value)
        self._write()

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.data["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        self._write()
        return bool(ok)

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self._write()

    def finish(self, status: str, why: str = "") -> None:
        """How the part ended (``ok`` becomes ``failed`` if a check failed); ``why`` in one line."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
        if status == "ok" and not all(c["ok"] for c in self.data["checks"]):
            status = "failed"
        self.data.update(status=status, why=why)
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=False))
        os.replace(tmp, self.path)


def read_record(path: Path) -> dict[str, Any] | None:
    """A part's record as written so far, or None if it wrote none (or it cannot be read)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _scalar(key: str, value: Any) -> Scalar:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"figure {key!r} must be a number, a bool, a string or None, not {type(value).__name__}")
