"""systemd notification (broker/sdnotify.py): READY only once status answers, then WATCHDOG and STOPPING."""

from __future__ import annotations

import signal
import socket

from kvcached_broker.client.endpoint import ipc_path
from kvcached_broker.tools.launch import BrokerLauncher

from helpers import GIB


def test_sd_notify_ready_only_once_status_answers_then_watchdog_and_stopping(short_tmp):
    notify_path = short_tmp / "notify.sock"
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(notify_path))
    sink.settimeout(60)  # bounds a failure only: every wait below is for a message
    broker = BrokerLauncher(f"ipc://{short_tmp}/gpu0.sock", simulate="8GiB",
                            extra_env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "200000"})
    try:
        broker.start(wait=False)
        first = sink.recv(4096).decode().split("\n")
        assert "READY=1" in first and any(line.startswith("STATUS=serving GPU 0") for line in first)
        assert ipc_path(broker.endpoint).is_socket()  # bound before READY: nothing left to start
        with broker.admin() as admin:  # and status answers
            assert admin.status()["total_bytes"] == 8 * GIB
        messages: list[str] = []
        while sum("WATCHDOG=1" in m for m in messages) < 2:  # every half WatchdogSec (0.1 s), again and again
            messages.append(sink.recv(4096).decode())
        broker.send(signal.SIGTERM)
        seen = []
        while not any("STOPPING=1" in m for m in seen):
            seen.append(sink.recv(4096).decode())
        assert broker.proc.wait(timeout=60) == 0
    finally:
        broker.stop()
        sink.close()
