"""systemd notification (broker/sdnotify.py): READY only once status answers, then WATCHDOG and STOPPING."""

from __future__ import annotations

import signal
import socket

from kvcached_broker.client.admin import AdminClient

from helpers import GIB, serve, stop


def test_sd_notify_ready_only_once_status_answers_then_watchdog_and_stopping(short_tmp):
    notify_path = short_tmp / "notify.sock"
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(notify_path))
    sink.settimeout(15)
    endpoint = f"ipc://{short_tmp}/gpu0.sock"
    proc = serve(["--simulate", "8GiB", "--endpoint", endpoint, "--no-state"],
                 env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "200000"})
    try:
        first = sink.recv(4096).decode().split("\n")
        assert "READY=1" in first and any(line.startswith("STATUS=serving GPU 0") for line in first)
        with AdminClient(endpoint, timeout_s=0.5) as admin:  # the moment READY arrives, status answers
            assert admin.status()["total_bytes"] == 8 * GIB
        messages = [sink.recv(4096).decode() for _ in range(3)]
        assert sum("WATCHDOG=1" in m for m in messages) >= 2  # every half WatchdogSec (0.1 s)
        proc.send_signal(signal.SIGTERM)
        seen = []
        while not any("STOPPING=1" in m for m in seen):
            seen.append(sink.recv(4096).decode())
        assert proc.wait(timeout=10) == 0
    finally:
        stop(proc)
        sink.close()

