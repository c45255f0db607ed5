"""CUDA's virtual memory management calls through ctypes on ``libcuda.so.1`` (no package needed).

The calls kvcached makes for every page it maps (csrc/inc/gpu_vmm.hpp in its sdist):
``cuMemCreate`` (physical memory), ``cuMemMap`` (into a reserved virtual range),
``cuMemSetAccess`` (make it readable and writable from the device), and back: ``cuMemUnmap``,
``cuMemRelease``.  :class:`Driver` opens the primary context of GPU 0 and wraps each call so
that a failure raises :class:`CudaError` naming the call and CUDA's error name.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, byref, c_char_p, c_int, c_size_t, c_ubyte, c_uint64, c_ushort, c_void_p

CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call}: {name} ({code})")
        self.call = call
        self.code = code
        self.name = name


class CUmemLocation(Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class CUmemAllocFlags(Structure):
    _fields_ = [("compressionType", c_ubyte), ("gpuDirectRDMACapable", c_ubyte), ("usage", c_ushort),
                ("reserved", c_ubyte * 4)]


class CUmemAllocationProp(Structure):
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", c_void_p), ("allocFlags", CUmemAllocFlags)]


class CUmemAccessDesc(Structure):
    _fields_ = [("location", CUmemLocation), ("flags", c_int)]


_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuDeviceGet": [POINTER(c_int), c_int],
    "cuDevicePrimaryCtxRetain": [POINTER(c_void_p), c_int],
    "cuDevicePrimaryCtxRelease_v2": [c_int],
    "cuCtxSetCurrent": [c_void_p],
    "cuCtxSynchronize": [],
    "cuMemGetInfo_v2": [POINTER(c_size_t), POINTER(c_size_t)],
    "cuMemGetAllocationGranularity": [POINTER(c_size_t), POINTER(CUmemAllocationProp), c_int],
    "cuMemAddressReserve": [POINTER(c_uint64), c_size_t, c_size_t, c_uint64, c_uint64],
    "cuMemAddressFree": [c_uint64, c_size_t],
    "cuMemCreate": [POINTER(c_uint64), c_size_t, POINTER(CUmemAllocationProp), c_uint64],
    "cuMemRelease": [c_uint64],
    "cuMemMap": [c_uint64, c_size_t, c_size_t, c_uint64, c_uint64],
    "cuMemUnmap": [c_uint64, c_size_t],
    "cuMemSetAccess": [c_uint64, c_size_t, POINTER(CUmemAccessDesc), c_size_t],
    "cuMemAlloc_v2": [POINTER(c_uint64), c_size_t],
    "cuMemFree_v2": [c_uint64],
    "cuGetErrorName": [c_int, POINTER(c_char_p)],
}


class Driver:
    """GPU 0's primary context, current on this thread, and the VMM calls on it."""

    def __init__(self, library: str = "libcuda.so.1", device: int = 0):
        self.lib = ctypes.CDLL(library)
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes = argtypes
            fn.restype = c_int
        self._call("cuInit", 0)
        dev = c_int()
        self._call("cuDeviceGet", byref(dev), device)
        self.device = dev.value
        self.context = c_void_p()
        self._call("cuDevicePrimaryCtxRetain", byref(self.context), self.device)
        self._call("cuCtxSetCurrent", self.context)
        self.prop = CUmemAllocationProp()
        self.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = self.device
        self.access = CUmemAccessDesc()
        self.access.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        self.access.location.id = self.device
        self.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    def _call(self, name: str, *args) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            raise CudaError(name, code, self.error_name(code))

    def error_name(self, code: int) -> str:
        text = c_char_p()
        if self.lib.cuGetErrorName(code, byref(text)) != 0 or text.value is None:
            return f"CUDA error {code}"
        return text.value.decode()

    # ---------------------------------------------------------------- the calls
    def granularity(self) -> int:
        size = c_size_t()
        self._call("cuMemGetAllocationGranularity", byref(size), byref(self.prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        return size.value

    def mem_get_info(self) -> tuple[int, int]:
        free, total = c_size_t(), c_size_t()
        self._call("cuMemGetInfo_v2", byref(free), byref(total))
        return free.value, total.value

    def reserve(self, size_bytes: int, alignment: int = 0) -> int:
        ptr = c_uint64()
        self._call("cuMemAddressReserve", byref(ptr), size_bytes, alignment, 0, 0)
        return ptr.value

    def free_address(self, ptr: int, size_bytes: int) -> None:
        self._call("cuMemAddressFree", ptr, size_bytes)

    def create(self, size_bytes: int) -> int:
        handle = c_uint64()
        self._call("cuMemCreate", byref(handle), size_bytes, byref(self.prop), 0)
        return handle.value

    def release(self, handle: int) -> None:
        self._call("cuMemRelease", handle)

    def map(self, ptr: int, size_bytes: int, handle: int) -> None:
        self._call("cuMemMap", ptr, size_bytes, 0, handle, 0)

    def set_access(self, ptr: int, size_bytes: int) -> None:
        self._call("cuMemSetAccess", ptr, size_bytes, byref(self.access), 1)

    def unmap(self, ptr: int, size_bytes: int) -> None:
        self._call("cuMemUnmap", ptr, size_bytes)

    def alloc(self, size_bytes: int) -> int:
        """Plain device memory (``cuMemAlloc``), as ``cudaMalloc`` takes it."""
        ptr = c_uint64()
        self._call("cuMemAlloc_v2", byref(ptr), size_bytes)
        return ptr.value

    def free(self, ptr: int) -> None:
        self._call("cuMemFree_v2", ptr)

    def synchronize(self) -> None:
        self._call("cuCtxSynchronize")

    def close(self) -> None:
        self._call("cuDevicePrimaryCtxRelease_v2", self.device)
