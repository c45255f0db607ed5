"""A test double for ``kvcached.vmm_ops`` (kvcached 0.1.6's native extension) that keeps the
semantics kvcached's Python code relies on, with physical pages on a shared simulated GPU.

Installed as ``sys.modules["kvcached.vmm_ops"]`` before kvcached is imported (see
:func:`kvcached_broker.tools.kvcached_sim.kvcached_cpu.install`); everything else in kvcached is its
real Python code (the tests, ``make demo`` and the hand-over benchmark all use it).  Modelled on
csrc/page_allocator.cpp, csrc/allocator.cpp and csrc/inc/mem_info_tracker.hpp of the 0.1.6 sdist:

* **PageAllocator.**  Page ids live in exactly one of: the *free* list (unmapped), the
  *reserved* list (mapped, not in use: the prealloc reserve), in use (handed out by
  ``alloc_page``), in flight (popped by the prealloc thread, being mapped), or the *reclaimed*
  list (beyond the current size).  ``num_free_pages`` counts free + reserved + in flight, so
  ``total_pages = inuse + free + reserved + in flight`` and **mapped (in use + reserved + in
  flight) <= total_pages** at every moment: a size is a bound on mapped memory.
  ``alloc_page`` takes from the reserve first, else maps a free page; ``free_page(s)`` return
  pages to the reserve up to ``KVCACHED_MAX_RESERVED_PAGES`` and unmap the rest; ``resize`` grows
  from reclaimed ids first, and shrinks from free pages, unmapping the reserve if that is not
  enough, or returns False (pages in use); ``trim`` unmaps the reserve.
* **The prealloc thread** keeps ``min(KVCACHED_MIN_RESERVED_PAGES, free pages, physical pages
  free on the device)`` pages mapped, as the C++ worker does, woken by allocations.
* **The kvctl watcher** polls the pool's ``/dev/shm`` segment every 100 ms and turns a changed
  ``total_size`` into a resize target (per-layer bytes) that stays until the segment changes
  again (sticky, as the real one: ``KVCacheManager._alloc`` re-applies it on every call).
* **Broadcast mode** (``world_size > 1`` or ``set_use_worker_ipc(True)``): map/unmap go through
  the Python callbacks; their ``StateConsistencyError`` fails the pool, ``MapQuarantinedError``
  quarantines the pages, any other exception is a failed map (the page goes back).
* **Physical pages exist only once mapped.**  ``map_to_kv_tensors*`` allocate each newly mapped
  page's bytes on the :class:`SharedGpu` (``DeviceFull`` -> ``RuntimeError``, as cuMemCreate out
  of memory, after rolling back the pages this call mapped); unmapping frees them; a prepared
  unmap keeps its pages until commit (freed) or abort (kept mapped).  ``create_kv_tensors``
  allocates the pool's zero page (one compound page in the contiguous layout) and returns
  ``meta`` tensors (virtual: no bytes).  ``cudaMemGetInfo`` is the shared device's free bytes.

Units: bytes unless a name says pages; a page id is a *compound* page of
``page_size * num_layers * num_kv_buffers`` bytes.
"""

from __future__ import annotations

import collections
import fcntl
import mmap
import os
import struct
import threading
from typing import Callable

import torch

from kvcached.errors import MapQuarantinedError, QuarantinedResizeError, StateConsistencyError

MIN_RESERVED_PAGES = int(os.environ.get("KVCACHED_MIN_RESERVED_PAGES", "5"))
MAX_RESERVED_PAGES = int(os.environ.get("KVCACHED_MAX_RESERVED_PAGES", "10"))
GPU_UTILIZATION = float(os.environ.get("KVCACHED_GPU_UTILIZATION", "0.95"))
RESIZE_POLL_S = 0.1
SHM_DIR = "/dev/shm"
_SEGMENT = struct.Struct("=qqq")  # MemInfoStruct{total_size, used_size, prealloc_size}

_gpu = None  # the SharedGpu pages are mapped on (configure())


def configure(gpu) -> None:
    """Map physical pages on ``gpu`` (a ``kvcached_broker.tools.shared_gpu.SharedGpu``)."""
    global _gpu
    _gpu = gpu


def device():
    if _gpu is None:
        raise RuntimeError("vmm_ops_double: configure(SharedGpu) first")
    return _gpu


def mem_get_info() -> tuple[int, int]:
    """``cudaMemGetInfo``: (free bytes, total bytes) of the shared device."""
    gpu = device()
    return gpu.free_bytes(), gpu.total_bytes


# ------------------------------------------------------------------ the /dev/shm segment
def _segment_path(name: str) -> str:
    return name if name.startswith("/") else os.path.join(SHM_DIR, name)


def default_ipc_name(group_id: int) -> str:
    base = os.environ.get("KVCACHED_IPC_NAME") or f"kvcached_engine_{os.getpgrp()}"
    return base if group_id == 0 else f"{base}_g{group_id}"


class MemInfoTracker:
    """``/dev/shm/<ipc_name>``: three int64 ``[total_size, used_size, prealloc_size]`` under flock."""

    def __init__(self, total_mem_size: int, group_id: int, ipc_name: str):
        self.ipc_name = ipc_name or default_ipc_name(group_id)
        self.path = _segment_path(self.ipc_name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            os.ftruncate(fd, _SEGMENT.size)
            self._identity = os.fstat(fd)
        finally:
            os.close(fd)
        self._write(lambda _info: (total_mem_size, 0, 0))
        self.released = False

    def _write(self, change: Callable[[tuple[int, int, int]], tuple[int, int, int]]) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with mmap.mmap(fd, _SEGMENT.size) as mm:
                mm[:] = _SEGMENT.pack(*change(_SEGMENT.unpack(mm[:])))
        finally:
            os.close(fd)

    def read(self) -> tuple[int, int, int] | None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            with mmap.mmap(fd, _SEGMENT.size, access=mmap.ACCESS_READ) as mm:
                return _SEGMENT.unpack(mm[:])
        finally:
            os.close(fd)

    def update_memory_usage(self, used_bytes: int, prealloc_bytes: int) -> None:
        self._write(lambda info: (info[0], used_bytes, prealloc_bytes))

    def check_and_get_resize_target(self, current_mem_size: int, num_layers: int, num_kv_buffers: int) -> int:
        info = self.read()
        if info is None:
            return -1
        new_mem_size = info[0] // num_layers // num_kv_buffers
        return new_mem_size if new_mem_size != current_mem_size else -1

    def release_segment(self) -> bool:
        """Unlink the segment this tracker created (not a replacement at the same path)."""
        if not self.released:
            try:
                current = os.stat(self.path)
                if os.path.samestat(current, self._identity):
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.released = True
        return True


# ------------------------------------------------------------------ InternalPage
class InternalPage:
    """Blocks of one page: ``[start_block, end_block)``, blocks straddling a page edge dropped."""

    def __init__(self, page_id: int, page_size: int):
        self.page_id = int(page_id)
        self.page_size = int(page_size)
        self.start_block = self.end_block = self.num_kv_blocks = 0
        self.free_list: list[int] = []

    def init(self, block_mem_size: int) -> None:
        self.start_block, self.end_block = self.get_block_range(self.page_id, self.page_size, block_mem_size)
        self.num_kv_blocks = self.end_block - self.start_block
        self.free_list = list(range(self.start_block, self.end_block))

    def alloc(self, num_blocks: int = 1) -> list[int]:
        if len(self.free_list) < num_blocks:
            raise RuntimeError("Not enough free blocks in page")
        taken, self.free_list = self.free_list[:num_blocks], self.free_list[num_blocks:]
        return taken

    def free(self, block_id: int) -> None:
        self.free_list.append(block_id)

    def free_batch(self, block_ids) -> None:
        self.free_list.extend(block_ids)

    def empty(self) -> bool:
        return len(self.free_list) == self.num_kv_blocks

    def full(self) -> bool:
        return not self.free_list

    def num_free_blocks(self) -> int:
        return len(self.free_list)

    def get_free_blocks(self) -> list[int]:
        return list(self.free_list)

    @staticmethod
    def get_block_range(page_id: int, page_size: int, block_mem_size: int) -> tuple[int, int]:
        start = (page_id * page_size + block_mem_size - 1) // block_mem_size
        end = ((page_id + 1) * page_size) // block_mem_size
        return start, end

    @staticmethod
    def get_num_blocks(page_size: int, block_mem_size: int) -> int:
        return page_size // block_mem_size


# ------------------------------------------------------------------ PageAllocator
class PageAllocator:
    def __init__(self, num_layers: int, mem_size_per_layer: int, page_size: int, world_size: int = 1,
                 pp_rank: int = 0, async_sched: bool = False, contiguous_layout: bool = True,
                 enable_page_prealloc: bool = True, num_kv_buffers: int = 2, group_id: int = 0,
                 ipc_name: str = ""):
        self.num_layers = num_layers
        self.page_size = page_size
        self.world_size = world_size
        self.pp_rank = pp_rank
        self.async_sched = async_sched
        self.contiguous_layout = contiguous_layout
        self.enable_page_prealloc = enable_page_prealloc
        self.num_kv_buffers = num_kv_buffers
        self.group_id = group_id
        self._last_observed_mem_size = mem_size_per_layer
        pages = mem_size_per_layer // page_size
        self._num_free_pages = pages
        self._num_total_pages = pages
        self._min_reserved = min(pages, MIN_RESERVED_PAGES)
        self._max_reserved = min(pages, MAX_RESERVED_PAGES)
        self._free: collections.deque[int] = collections.deque(range(pages))
        self._reserved: collections.deque[int] = collections.deque()
        self._reclaimed: collections.deque[int] = collections.deque()
        self._quarantined: list[int] = []
        self._in_flight = 0  # popped by the prealloc thread, being mapped
        self._error = ""
        self._failed = False
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._transaction_lock = threading.Lock()
        self._thread_ctl = threading.Lock()
        self._prealloc_running = False
        self._prealloc_needed = False
        self._prealloc_thread: threading.Thread | None = None
        self._resize_target = -1
        self._watcher_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._map_callback: Callable | None = None
        self._unmap_callback: Callable | None = None
        self._use_worker_ipc = False
        self._tracker = MemInfoTracker(mem_size_per_layer * num_layers * num_kv_buffers, group_id, ipc_name)

    # ---------------------------------------------------------- allocation
    def alloc_page(self) -> InternalPage:
        self._throw_if_failed()
        with self._cond:
            while True:
                if self._failed:
                    raise StateConsistencyError(self._error)
                if self._reserved:
                    page_id = self._reserved.popleft()
                    self._num_free_pages -= 1
                    if len(self._reserved) < self._min_reserved:
                        self._prealloc_needed = True
                        self._cond.notify_all()
                    self._update_usage()
                    return InternalPage(page_id, self.page_size)
                if self._free:
                    page_id = self._free.popleft()
                    self._num_free_pages -= 1
                    break
                if self._num_free_pages <= 0:
                    raise RuntimeError("No free pages left")
                if not self.enable_page_prealloc:
                    raise RuntimeError("Inconsistent page allocator state: no free pages available")
                self._cond.wait()
        try:
            self._map_pages([page_id])
        except MapQuarantinedError as exc:
            with self._lock:
                self._quarantine([page_id], str(exc))
            raise
        except StateConsistencyError as exc:
            with self._lock:
                self._quarantine([page_id], str(exc))
                self._failed = True
            raise
        except Exception as exc:
            with self._cond:
                self._free.appendleft(page_id)
                self._num_free_pages += 1
                self._cond.notify_all()
            raise RuntimeError(f"Failed to map page {page_id}: {exc}") from exc
        if self.enable_page_prealloc:
            self._trigger_preallocation()
        with self._lock:
            self._update_usage()
        return InternalPage(page_id, self.page_size)

    def free_page(self, page_id: int) -> None:
        self.free_pages([page_id])

    def free_pages(self, page_ids) -> None:
        self._throw_if_failed()
        page_ids = list(page_ids)
        with self._cond:
            self._num_free_pages += len(page_ids)
            room = self._max_reserved - len(self._reserved)
            keep = page_ids[:max(0, room)]
            unmap = page_ids[max(0, room):]
            self._reserved.extend(keep)
            if not unmap:
                self._update_usage()
                self._cond.notify_all()
                return
        self._unmap_pages(unmap)
        with self._cond:
            self._free.extend(unmap)
            self._update_usage()
            self._cond.notify_all()

    # ---------------------------------------------------------- sizing
    def resize(self, new_mem_size: int) -> bool:
        self._throw_if_failed()
        new_pages = new_mem_size // self.page_size
        with self._lock:
            if self._quarantined:
                if new_pages == self._num_total_pages:
                    return True
                raise QuarantinedResizeError("cannot resize a pool with quarantined pages")
            if new_pages < self._inuse():
                return False
            total = self._num_total_pages
            if new_pages == total:
                return True
            if new_pages > total:
                grow = new_pages - total
                reuse = min(len(self._reclaimed), grow)
                for _ in range(reuse):
                    self._free.append(self._reclaimed.popleft())
                grow -= reuse
                self._num_free_pages += reuse
                if grow > 0:
                    self._free.extend(range(total, total + grow))
                    self._num_free_pages += grow
                self._num_total_pages = new_pages
                self._update_usage()
                return True
            reclaim = total - new_pages
            if len(self._free) >= reclaim:
                self._reclaim(reclaim, new_pages)
                return True
            if not self._reserved:
                return False
            unmap = list(self._reserved)
            self._reserved.clear()
        self._unmap_pages(unmap)
        with self._lock:
            reclaim = self._num_total_pages - new_pages
            self._free.extend(unmap)
            self._update_usage()
            if len(self._free) < reclaim:
                return False
            self._reclaim(reclaim, new_pages)
        return True

    def _reclaim(self, pages: int, new_total: int) -> None:
        for _ in range(pages):
            self._reclaimed.append(self._free.pop())
        self._num_free_pages -= pages
        self._num_total_pages = new_total

    def trim(self) -> None:
        self._throw_if_failed()
        with self._lock:
            unmap = list(self._reserved)
            self._reserved.clear()
            if not unmap:
                self._update_usage()
                return
        self._unmap_pages(unmap)
        with self._lock:
            self._free.extend(unmap)
            self._update_usage()

    # ---------------------------------------------------------- queries
    def get_num_free_pages(self) -> int:
        self._throw_if_failed()
        return self._num_free_pages

    def get_num_inuse_pages(self) -> int:
        return self._num_total_pages - self._num_free_pages

    def get_num_total_pages(self) -> int:
        return self._num_total_pages

    def get_num_reserved_pages(self) -> int:
        with self._lock:
            return len(self._reserved)

    def get_page_state(self) -> dict[str, int]:
        with self._lock:
            return {"total_pages": self._num_total_pages, "free_pages": self._num_free_pages,
                    "inuse_pages": self._inuse(), "reserved_pages": len(self._reserved)}

    def get_transaction_state(self) -> dict[str, object]:
        with self._lock:
            state = "FAILED" if self._failed else ("DEGRADED" if self._quarantined else "HEALTHY")
            return {"state": state, "quarantined_page_ids": list(self._quarantined),
                    "quarantined_pages": len(self._quarantined),
                    "retained_bytes_upper_bound": len(self._quarantined) * self._compound_bytes(),
                    "last_error": self._error}

    def get_avail_physical_pages(self) -> int:
        free, total = mem_get_info()
        usable = max(0, free - int(total * (1.0 - GPU_UTILIZATION)))
        return usable // self.page_size // self.num_layers // self.num_kv_buffers

    def check_and_get_resize_target(self, current_mem_size: int) -> int:
        return self._tracker.check_and_get_resize_target(current_mem_size, self.num_layers, self.num_kv_buffers)

    def get_resize_target(self) -> int:
        return self._resize_target

    def get_page_id(self, block_id: int, block_mem_size: int) -> int:
        return block_id * block_mem_size // self.page_size

    def group_indices_by_page(self, indices, block_mem_size: int) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for idx in indices:
            groups.setdefault(idx * block_mem_size // self.page_size, []).append(idx)
        return groups

    def reset_free_page_order(self) -> None:
        with self._lock:
            self._free = collections.deque(sorted(self._free))

    # ---------------------------------------------------------- threads
    def start_prealloc_thread(self) -> None:
        if not self.enable_page_prealloc:
            return
        with self._thread_ctl:
            if self._prealloc_thread is None:
                self._prealloc_running = True
                self._prealloc_thread = threading.Thread(target=self._prealloc_worker, daemon=True,
                                                         name=f"kvcached-prealloc-g{self.group_id}")
                self._prealloc_thread.start()
                self._trigger_preallocation()
            if self._watcher is None:
                self._watcher_stop.clear()
                self._watcher = threading.Thread(target=self._resize_watcher, daemon=True,
                                                 name=f"kvcached-resize-watcher-g{self.group_id}")
                self._watcher.start()

    def stop_prealloc_thread(self) -> None:
        if not self.enable_page_prealloc:
            return
        with self._thread_ctl:
            if self._prealloc_thread is not None:
                with self._cond:
                    self._prealloc_running = False
                    self._cond.notify_all()
                self._prealloc_thread.join()
                self._prealloc_thread = None
            if self._watcher is not None:
                self._watcher_stop.set()
                self._watcher.join()
                self._watcher = None

    def release_shared_segment(self) -> bool:
        return self._tracker.release_segment()

    def set_broadcast_map_callback(self, callback: Callable) -> None:
        with self._lock:
            self._map_callback = callback

    def set_broadcast_unmap_callback(self, callback: Callable) -> None:
        with self._lock:
            self._unmap_callback = callback

    def set_use_worker_ipc(self, use_worker_ipc: bool) -> None:
        self._use_worker_ipc = bool(use_worker_ipc)

    def _prealloc_worker(self) -> None:
        while self._prealloc_running:
            with self._cond:
                while not self._prealloc_needed and self._prealloc_running and not self._failed:
                    self._cond.wait()
                if not self._prealloc_running or self._failed:
                    return
                self._prealloc_needed = False
                to_reserve = max(0, self._min_reserved - len(self._reserved))
                to_reserve = min(to_reserve, len(self._free), self.get_avail_physical_pages())
                if to_reserve <= 0:
                    continue
                pages = [self._free.popleft() for _ in range(to_reserve)]
                self._in_flight += len(pages)
            try:
                self._map_pages(pages)
            except MapQuarantinedError as exc:
                with self._lock:
                    self._in_flight -= len(pages)
                    self._num_free_pages -= len(pages)
                    self._quarantine(pages, str(exc))
                continue
            except StateConsistencyError as exc:
                with self._lock:
                    self._in_flight -= len(pages)
                    self._num_free_pages -= len(pages)
                    self._quarantine(pages, str(exc))
                    self._failed = True
                return
            except Exception:  # noqa: BLE001 - a failed prealloc puts its pages back, as the C++ does
                with self._cond:
                    self._in_flight -= len(pages)
                    self._free.extendleft(reversed(pages))
                    self._cond.notify_all()
                continue
            with self._cond:
                self._in_flight -= len(pages)
                self._reserved.extend(pages)
                self._update_usage()
                self._cond.notify_all()

    def _resize_watcher(self) -> None:
        while not self._watcher_stop.wait(RESIZE_POLL_S):
            target = self._tracker.check_and_get_resize_target(self._last_observed_mem_size, self.num_layers,
                                                               self.num_kv_buffers)
            if target >= 0:
                self._last_observed_mem_size = target
                self._resize_target = target

    def _trigger_preallocation(self) -> None:
        with self._cond:
            self._prealloc_needed = True
            self._cond.notify_all()

    # ---------------------------------------------------------- mapping
    def _offsets(self, page_ids) -> list[int]:
        stride = self._compound_bytes() if self.contiguous_layout else self.page_size
        return [pid * stride for pid in page_ids]

    def _broadcast(self) -> bool:
        return self.world_size > 1 or self._use_worker_ipc

    def _map_pages(self, page_ids) -> None:
        with self._transaction_lock:
            self._throw_if_failed()
            offsets = self._offsets(page_ids)
            try:
                if self._broadcast() and self._map_callback is not None:
                    self._map_callback(self.world_size, offsets)
                elif not _tensors(self.group_id).map(offsets)[0]:
                    raise RuntimeError("Failed to map pages to KV tensors")
            except StateConsistencyError as exc:
                self._fail_pool(str(exc))
                raise

    def _unmap_pages(self, page_ids) -> None:
        with self._transaction_lock:
            self._throw_if_failed()
            offsets = self._offsets(page_ids)
            try:
                if self._broadcast() and self._unmap_callback is not None:
                    self._unmap_callback(self.world_size, offsets)
                elif not _tensors(self.group_id).unmap(offsets):
                    raise RuntimeError("Failed to unmap pages from KV tensors")
            except Exception as exc:
                reason = f"KV unmap could not complete: {exc}"
                self._fail_pool(reason)
                raise StateConsistencyError(reason) from exc

    def check_invariant(self) -> None:
        """Every page id is in exactly one place: total = in use + free + reserved + in flight."""
        with self._lock:
            ids = list(self._free) + list(self._reserved)
            assert len(ids) == len(set(ids)), "a page id is listed twice"
            placed = self._inuse() + len(self._free) + len(self._reserved) + self._in_flight
            assert placed == self._num_total_pages, (
                f"total {self._num_total_pages} != in use {self._inuse()} + free {len(self._free)} "
                f"+ reserved {len(self._reserved)} + in flight {self._in_flight}")

    # ---------------------------------------------------------- internals
    def _compound_bytes(self) -> int:
        return self.page_size * self.num_layers * self.num_kv_buffers

    def _inuse(self) -> int:
        return self._num_total_pages - self._num_free_pages

    def _update_usage(self) -> None:
        compound = self._compound_bytes()
        self._tracker.update_memory_usage(self._inuse() * compound, len(self._reserved) * compound)

    def _quarantine(self, page_ids, reason: str) -> None:
        self._quarantined.extend(page_ids)
        self._error = reason
        self._update_usage()
        self._cond.notify_all()

    def _fail_pool(self, reason: str) -> None:
        with self._cond:
            self._error = reason
            self._failed = True
            self._cond.notify_all()

    def _throw_if_failed(self) -> None:
        if self._failed:
            raise StateConsistencyError(self._error)


# ------------------------------------------------------------------ FTensorAllocator
class _KvTensors:
    """One group's virtual KV tensors: which logical offsets are mapped, and their physical bytes."""

    def __init__(self, page_size: int, contiguous: bool):
        self.page_size = page_size
        self.contiguous = contiguous
        self.num_layers = 0
        self.num_kv_buffers = 2
        self.unified_pool = False
        self.zero_page_bytes = 0
        self.mapped: set[int] = set()
        self.pending: tuple[str, list[int]] | None = None  # prepared unmap: (id, offsets still backed)
        self.outcomes: dict[str, str] = {}
        self.lock = threading.Lock()

    def page_bytes(self) -> int:
        """Physical bytes behind one logical offset (every layer's K and V of one page id)."""
        per_layer = 1 if self.unified_pool and not self.contiguous else self.num_kv_buffers
        return self.page_size * self.num_layers * per_layer

    def create(self, num_layers: int, num_kv_buffers: int, unified_pool: bool) -> None:
        with self.lock:
            self.num_layers, self.num_kv_buffers, self.unified_pool = num_layers, num_kv_buffers, unified_pool
            if not self.zero_page_bytes:
                zero = self.page_size * num_layers * num_kv_buffers if self.contiguous else self.page_size
                _allocate(zero)
                self.zero_page_bytes = zero

    def created(self) -> bool:
        with self.lock:
            return self.num_layers > 0

    def map(self, offsets) -> tuple[bool, list[int]]:
        with self.lock:
            if self.num_layers == 0:
                return False, []
            self._reject_if_pending("map KV tensors")
            newly: list[int] = []
            try:
                for offset in offsets:
                    if offset in self.mapped:
                        continue
                    _allocate(self.page_bytes())
                    self.mapped.add(offset)
                    newly.append(offset)
            except Exception:
                for offset in newly:
                    self.mapped.discard(offset)
                    device().free(self.page_bytes())
                raise
            return True, newly

    def unmap(self, offsets) -> bool:
        with self.lock:
            if self.num_layers == 0:
                return False
            self._reject_if_pending("unmap KV tensors")
            for offset in offsets:
                if offset in self.mapped:
                    self.mapped.discard(offset)
                    device().free(self.page_bytes())
            return True

    def prepare_unmap(self, offsets, transaction_id: str) -> bool:
        with self.lock:
            if not transaction_id:
                raise ValueError("unmap transaction id must not be empty")
            if self.num_layers == 0:
                return False
            if self.pending is not None:
                if self.pending[0] == transaction_id:
                    return True
                raise RuntimeError(f"state_inconsistency: another unmap transaction is pending: {self.pending[0]}")
            if transaction_id in self.outcomes:
                if self.outcomes[transaction_id] == "committed":
                    return True
                raise RuntimeError(f"unmap transaction was already aborted: {transaction_id}")
            retained = [o for o in offsets if o in self.mapped]
            self.mapped.difference_update(retained)  # unmapped from the VA, physical pages retained
            self.pending = (transaction_id, retained)
            return True

    def commit_unmap(self, transaction_id: str) -> bool:
        with self.lock:
            if self.pending is not None and self.pending[0] == transaction_id:
                for _ in self.pending[1]:
                    device().free(self.page_bytes())
                self.pending = None
                self.outcomes[transaction_id] = "committed"
                return True
            if self.pending is not None:
                raise RuntimeError(f"state_inconsistency: commit does not match pending unmap transaction {self.pending[0]}")
            if self.outcomes.get(transaction_id) == "committed":
                return True
            raise RuntimeError(f"unknown unmap transaction: {transaction_id}")

    def abort_unmap(self, transaction_id: str) -> bool:
        with self.lock:
            if self.pending is not None and self.pending[0] == transaction_id:
                self.mapped.update(self.pending[1])
                self.pending = None
                self.outcomes[transaction_id] = "aborted"
                return True
            if self.pending is not None:
                raise RuntimeError(f"state_inconsistency: abort does not match pending unmap transaction {self.pending[0]}")
            if self.outcomes.get(transaction_id) == "committed":
                raise RuntimeError(f"cannot abort a committed unmap transaction: {transaction_id}")
            self.outcomes[transaction_id] = "aborted"
            return True

    def destroy(self) -> None:
        with self.lock:
            backed = len(self.mapped) + (len(self.pending[1]) if self.pending else 0)
            freed = backed * self.page_bytes() + self.zero_page_bytes
            self.mapped.clear()
            self.pending = None
            self.zero_page_bytes = 0
        if freed:
            device().free(freed)

    def _reject_if_pending(self, operation: str) -> None:
        if self.pending is not None:
            raise RuntimeError(f"cannot {operation} while unmap transaction {self.pending[0]} is pending")


def _allocate(size_bytes: int) -> None:
    """cuMemCreate: take ``size_bytes`` on the shared device (out of memory -> RuntimeError)."""
    try:
        device().allocate(size_bytes)
    except RuntimeError as exc:  # DeviceFull is a RuntimeError, as the driver's OOM is here
        raise RuntimeError(f"CUDA error: out of memory ({exc})") from exc


_groups: dict[int, _KvTensors] = {}
_groups_lock = threading.Lock()
_page_size = 2 << 20
_contiguous = True


def _tensors(group_id: int) -> _KvTensors:
    with _groups_lock:
        if not _groups:
            raise RuntimeError("FTensorAllocator::init() must be called first")
        if group_id not in _groups:
            _groups[group_id] = _KvTensors(_page_size, _contiguous)
        return _groups[group_id]


def init_kvcached(dev_str: str, page_size: int = 0, contiguous_layout: bool = True) -> None:
    global _page_size, _contiguous
    shutdown_kvcached()
    with _groups_lock:
        if page_size > 0:
            _page_size = page_size
        _contiguous = bool(contiguous_layout)
        _groups[0] = _KvTensors(_page_size, _contiguous)


def shutdown_kvcached() -> None:
    with _groups_lock:
        groups = list(_groups.values())
        _groups.clear()
    for group in groups:
        group.destroy()


_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def create_kv_tensors(size: int, dtype_size: int, dev_str: str, num_layers: int, num_kv_buffers: int = 2,
                      group_id: int = 0, unified_pool: bool = False) -> list[torch.Tensor]:
    """Virtual KV tensors (``meta``: no bytes) plus the pool's physical zero page."""
    group = _tensors(group_id)
    aligned = -(-size // group.page_size) * group.page_size
    group.create(num_layers, num_kv_buffers, unified_pool)
    dtype = _DTYPES[dtype_size]
    if group.contiguous:
        return [torch.empty(aligned * num_layers // dtype_size, dtype=dtype, device="meta")]
    return [torch.empty(aligned // dtype_size, dtype=dtype, device="meta") for _ in range(num_layers)]


def kv_tensors_created(group_id: int = 0) -> bool:
    return _tensors(group_id).created()


def map_to_kv_tensors(offsets, group_id: int = 0) -> bool:
    return _tensors(group_id).map(list(offsets))[0]


def map_to_kv_tensors_with_result(offsets, group_id: int = 0) -> tuple[bool, list[int]]:
    return _tensors(group_id).map(list(offsets))


def unmap_from_kv_tensors(offsets, group_id: int = 0) -> bool:
    return _tensors(group_id).unmap(list(offsets))


def prepare_unmap_from_kv_tensors(offsets, transaction_id: str, group_id: int = 0) -> bool:
    return _tensors(group_id).prepare_unmap(list(offsets), transaction_id)


def commit_unmap_from_kv_tensors(transaction_id: str, group_id: int = 0) -> bool:
    return _tensors(group_id).commit_unmap(transaction_id)


def abort_unmap_from_kv_tensors(transaction_id: str, group_id: int = 0) -> bool:
    return _tensors(group_id).abort_unmap(transaction_id)


def mapped_bytes(group_id: int = 0) -> int:
    """Physical bytes backing this process's mapped offsets of ``group_id`` (tests)."""
    group = _tensors(group_id)
    with group.lock:
        return (len(group.mapped) + (len(group.pending[1]) if group.pending else 0)) * group.page_bytes()


__all__ = [
    "InternalPage", "PageAllocator", "abort_unmap_from_kv_tensors", "commit_unmap_from_kv_tensors",
    "create_kv_tensors", "init_kvcached", "kv_tensors_created", "map_to_kv_tensors",
    "map_to_kv_tensors_with_result", "prepare_unmap_from_kv_tensors", "shutdown_kvcached",
    "unmap_from_kv_tensors",
]
