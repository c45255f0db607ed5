"""Part: what one 2 MiB page costs the driver, the physical floor of a hand-over; and a full device.

On a GPU (:mod:`.vmm`): ``ROUNDS`` times, ``PAGES`` pages are created, mapped into one
reserved range and made accessible, one call at a time as kvcached maps them, then unmapped and
released; each call is timed per page.  Then the device is filled with one plain allocation
(all but ``OOM_ROOM_BYTES`` of what is free) and pages are created until ``cuMemCreate`` fails:
the error a granted page meets when something else took the memory.

On the simulated device a page is what kvcached's test double charges for it: an allocation
on the shared device (``SharedGpu.allocate``, a file under a lock) and its free; mapping and
access are not modelled (None).  A full simulated device refuses with ``DeviceFull``.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from .context import PartContext
from .devices import MIB, SIMULATED_TOTAL_BYTES
from .measure import percentile

PAGE_BYTES = 2 * MIB
PAGES = 256
ROUNDS = 3
OOM_ROOM_BYTES = 256 * MIB
OOM_MAX_PAGES = 4096
MAP_OPS = ("create", "map", "set_access")
UNMAP_OPS = ("unmap", "release")


def run(ctx: PartContext) -> None:
    rec = ctx.record
    rec.assume(oom_error_is_out_of_memory=True)
    pages = SimulatedPages(ctx) if ctx.device.simulated else GpuPages()
    try:
        rec.figures(page_bytes=pages.page_bytes, pages_per_round=PAGES, rounds=ROUNDS,
                    granularity_bytes=pages.granularity)
        times: dict[str, list[float]] = {op: [] for op in (*MAP_OPS, *UNMAP_OPS)}
        for _ in range(ROUNDS):
            pages.round(PAGES, times)
        for op, values in times.items():
            rec.figures(**{f"{op}_per_page_p50_s": percentile(values, 0.5) if values else None,
                           f"{op}_per_page_p99_s": percentile(values, 0.99) if values else None})
        rec.figures(map_page_p50_s=percentile(per_page(times, MAP_OPS), 0.5),
                    unmap_page_p50_s=percentile(per_page(times, UNMAP_OPS), 0.5))
        full = pages.fill_until_refused()
        rec.figures(**full)
        rec.check("a full device refuses a page with an out-of-memory error", bool(full["oom_error_is_out_of_memory"]),
                  f"error {full['oom_error']!r} after {full['oom_pages_created']} pages")
    finally:
        pages.close()


class GpuPages:
    """Pages through the driver, as kvcached's C++ maps them."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        from .vmm import Driver

        self.driver = Driver(library)
        self.granularity = self.driver.granularity()
        self.page_bytes = -(-PAGE_BYTES // self.granularity) * self.granularity

    def round(self, count: int, times: dict[str, list[float]]) -> None:
        d, size = self.driver, self.page_bytes
        base = d.reserve(count * size, size)
        handles = []
        try:
            for i in range(count):
                ptr = base + i * size
                handle = _timed(times["create"], d.create, size)
                handles.append(handle)
                _timed(times["map"], d.map, ptr, size, handle)
                _timed(times["set_access"], d.set_access, ptr, size)
            d.synchronize()
            for i, handle in enumerate(handles):
                _timed(times["unmap"], d.unmap, base + i * size, size)
                _timed(times["release"], d.release, handle)
            handles = []
        finally:
            for handle in handles:  # a failure half-way: give back what is left, untimed
                d.release(handle)
            d.free_address(base, count * size)

    def fill_until_refused(self) -> dict:
        from .vmm import CudaError

        d = self.driver
        free_bytes, _ = d.mem_get_info()
        ballast, ballast_bytes = None, max(0, free_bytes - OOM_ROOM_BYTES)
        while ballast is None and ballast_bytes > 0:
            try:
                ballast = d.alloc(ballast_bytes)
            except CudaError:
                ballast_bytes -= OOM_ROOM_BYTES  # fragmentation or the driver's own reserve
        handles: list[Any] = []
        error, failed_s = None, None
        try:
            left_bytes, _ = d.mem_get_info()
            while len(handles) < OOM_MAX_PAGES:
                started = time.perf_counter()
                try:
                    handles.append(d.create(self.page_bytes))
                except CudaError as exc:
                    failed_s, error = time.perf_counter() - started, exc.name
                    break
        finally:
            for handle in handles:
                d.release(handle)
            if ballast is not None:
                d.free(ballast)
        return {"oom_ballast_bytes": ballast_bytes if ballast is not None else 0, "oom_free_before_bytes": left_bytes,
                "oom_pages_created": len(handles), "oom_error": error, "oom_failed_create_s": failed_s,
                "oom_error_is_out_of_memory": error is not None and "OUT_OF_MEMORY" in error}

    def close(self) -> None:
        self.driver.close()


class SimulatedPages:
    """Pages as the simulated device charges them: kvcached's test double allocates each on the
    shared device (:class:`~kvcached_broker.tools.shared_gpu.SharedGpu`); nothing more is modelled."""

    def __init__(self, ctx: PartContext):
        from ..shared_gpu import SharedGpu

        self.gpu = SharedGpu(ctx.device.usage_dir, SIMULATED_TOTAL_BYTES)
        self.granularity = PAGE_BYTES
        self.page_bytes = PAGE_BYTES

    def round(self, count: int, times: dict[str, list[float]]) -> None:
        for _ in range(count):
            _timed(times["create"], self.gpu.allocate, self.page_bytes)
        for _ in range(count):
            _timed(times["release"], self.gpu.free, self.page_bytes)

    def fill_until_refused(self) -> dict:
        from ..shared_gpu import DeviceFull

        free_bytes = self.gpu.free_bytes()
        ballast = max(0, free_bytes - OOM_ROOM_BYTES)
        self.gpu.set_usage(ballast)
        created, error, failed_s = 0, None, None
        try:
            left = self.gpu.free_bytes()
            while created < OOM_MAX_PAGES:
                started = time.perf_counter()
                try:
                    self.gpu.allocate(self.page_bytes)
                except DeviceFull as exc:
                    failed_s, error = time.perf_counter() - started, str(exc)
                    break
                created += 1
        finally:
            self.gpu.set_usage(0)
        return {"oom_ballast_bytes": ballast, "oom_free_before_bytes": left, "oom_pages_created": created,
                "oom_error": error, "oom_failed_create_s": failed_s,
                "oom_error_is_out_of_memory": error is not None and "out of memory" in error}

    def close(self) -> None:
        self.gpu.set_usage(0)


def per_page(times: dict[str, list[float]], ops: tuple[str, ...]) -> list[float]:
    """Each page's time over ``ops`` (the ops a device does not model are left out)."""
    return [sum(each) for each in zip(*(times[op] for op in ops if times[op]))]


def _timed(into: list[float], fn: Callable, *args):
    started = time.perf_counter()
    result = fn(*args)
    into.append(time.perf_counter() - started)
    return result
