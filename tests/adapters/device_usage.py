"""A simulated GPU that measures each process's usage as NVML does, for the adapter tests.

The broker charges a process ``max(measured, pools + pages) + holds`` (docs/accounting.md).
A simulated device measures nothing unless told (``simulate --process PID=SIZE``), so the
tests tell it what each worker process has allocated, as the worker allocates it: its
weights before it sizes its KV cache, its weights and KV once the pools are built.  Setting
it answers only once the broker has taken the new figure in (the admin request re-reads the
device), so nothing here waits or sleeps.
"""

from __future__ import annotations

from kvcached_broker.client.admin import AdminClient


class MeasuredUsage:
    """What the simulated device behind ``endpoint`` measures processes using (bytes)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.set_pids: set[int] = set()

    def set(self, pid: int, size_bytes: int) -> None:
        """The device now measures ``pid`` using ``size_bytes`` (0 clears it)."""
        with AdminClient(self.endpoint, timeout_s=5.0) as admin:
            admin.simulate(process_bytes={pid: size_bytes})
        self.set_pids.add(pid)

    def clear(self) -> None:
        if self.set_pids:
            with AdminClient(self.endpoint, timeout_s=5.0) as admin:
                admin.simulate(process_bytes={pid: 0 for pid in self.set_pids})
            self.set_pids.clear()


def session_of(status: dict, pid: int) -> dict:
    """The one session of process ``pid`` in a status document."""
    (found,) = [s for i in status["instances"] for s in i["sessions"] if s["pid"] == pid]
    return found


def instance_of(status: dict, pid: int) -> dict:
    (found,) = [i for i in status["instances"] if any(s["pid"] == pid for s in i["sessions"])]
    return found
