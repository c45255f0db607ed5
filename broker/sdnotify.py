"""systemd's sd_notify protocol, spoken directly (a datagram to ``$NOTIFY_SOCKET``).

``READY=1`` once the broker answers, ``STATUS=...`` lines, ``WATCHDOG=1`` every half
``WatchdogSec`` when the unit sets one, and ``STOPPING=1`` on the way out.  Without
``$NOTIFY_SOCKET`` every call does nothing.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, env: dict[str, str] | None = None):
        env = dict(os.environ) if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        self._address = ("\0" + address[1:]) if address.startswith("@") else address
        self._sock: socket.socket | None = None
        if self._address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.watchdog_interval_s = self._watchdog_interval(env)

    @staticmethod
    def _watchdog_interval(env: dict[str, str]) -> float | None:
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            return int(usec) / 1e6 / 2
        except ValueError:
            return None

    def notify(self, *lines: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto("\n".join(lines).encode(), self._address)
        except OSError:
            pass  # systemd went away; never let that take the broker down

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def stopping(self) -> None:
        self.notify("STOPPING=1", "STATUS=stopping")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
