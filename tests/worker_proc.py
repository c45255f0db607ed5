"""A worker process for multi-process tests.

    python worker_proc.py ENDPOINT INSTANCE '{"pool": bytes}' PAGES [PAGE_BYTES] [LEASE_HINT]

Connects, reserves the pools, acquires PAGES, prints one JSON line ``{"ready": ..., "session_id": ...}``
and then keeps the session alive (the client's background thread heartbeats) until killed.
On SessionEvicted it prints ``{"evicted": true}`` and exits 17.  Sending it a line on stdin
makes it print its current view (``held_pages``, ``pools``, status of its own session); a JSON
line ``{"pools": ..., "holds": ..., "phase": ...}`` reserves them first and prints the result.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from kvcached_broker.client import BrokerClient, SessionEvicted


def main() -> int:
    endpoint, instance, pools_json, pages = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    page_bytes = int(sys.argv[5]) if len(sys.argv) > 5 else 2 << 20
    client = BrokerClient.connect(instance, endpoint=endpoint, page_bytes=page_bytes, credit_pages=0, timeout_s=30)
    client.reserve(json.loads(pools_json))
    got = client.acquire(pages) if pages else 0
    print(json.dumps({"ready": True, "session_id": client.session_id, "granted": got}), flush=True)

    def answer_queries() -> None:
        for line in sys.stdin:
            try:
                if line.startswith("{"):  # {"pools": ..., "holds": ...}: reserve them, print the pools
                    ask = json.loads(line)
                    pools = client.reserve(ask["pools"], holds=ask.get("holds"), phase=ask.get("phase"))
                    print(json.dumps({"pools": pools, "holds": client.holds}), flush=True)
                    continue
                status = client.status()
            except SessionEvicted:
                print(json.dumps({"evicted": True}), flush=True)
                continue
            print(json.dumps({"held_pages": client.held_pages, "pools": client.pools, "status": status}), flush=True)

    threading.Thread(target=answer_queries, daemon=True).start()
    while True:
        time.sleep(0.05)
        if client._core.evicted:
            print(json.dumps({"evicted": True}), flush=True)
            return 17


if __name__ == "__main__":
    sys.exit(main())
