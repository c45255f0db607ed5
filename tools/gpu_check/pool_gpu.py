"""The simulation's pool process on a real GPU: kvcached 0.1.6 with its CUDA allocator, governed.

    python -m kvcached_broker.tools.gpu_check.pool_gpu WORKDIR TOTAL_BYTES IPC_NAME ENDPOINT [--layers 4] ...

The same program as ``kvcached_broker.tools.kvcached_sim.pool_process`` (the same requests and
replies, :func:`~kvcached_broker.tools.kvcached_sim.pool_process.run_pool`), except that nothing
is replaced: kvcached maps pages with ``cuMemCreate``/``cuMemMap`` on GPU 0 through its C++
extension, and this process's bytes on the device (``device_bytes`` in its status) are what
NVML says it uses.  ``WORKDIR`` and ``TOTAL_BYTES`` are the simulated device's there, and
unused here.
"""

from __future__ import annotations

import os
import sys

from ...broker.device import NvmlDevice


class NvmlProcessView:
    """This process's bytes on GPU 0 as NVML reports them (what the broker measures it using)."""

    def __init__(self) -> None:
        self.device = NvmlDevice(0)
        self.pid = os.getpid()

    def mine_bytes(self) -> int:
        return self.device.read().process_bytes.get(self.pid, 0)


def main(argv: list[str] | None = None) -> None:
    from ..kvcached_sim import pool_process

    args = pool_process.parse_args(sys.argv[1:] if argv is None else argv)
    os.environ["KVCACHED_IPC_NAME"] = args.ipc_name  # kvcached reads it at import
    pool_process.run_pool(args, NvmlProcessView())


if __name__ == "__main__":
    main()
