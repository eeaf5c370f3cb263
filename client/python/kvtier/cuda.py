"""Views of handles on a GPU device tier, through CUDA IPC.

A daemon whose device tier is a GPU lists each device segment with a `cuda_ipc_handle` (the
cudaIpcMemHandle_t of one allocation) and keeps its generation table in host shared memory.
`SegmentMap.view(handle, head_dim, like="torch" | "cupy" | "cuda")` opens the allocation once
per segment (cudaIpcOpenMemHandle on this thread's current device), checks the handle's
generation in the host table, and gives K and V as [num_tokens][head_dim] device arrays over
the daemon's memory: torch tensors, CuPy arrays, or `CudaArray` objects that any consumer of
`__cuda_array_interface__` takes (torch.as_tensor, cupy.asarray, numba). An allocation is closed
when the daemon lists its segment with another stamp (retired, or the daemon restarted and
reused the id), by `SegmentMap.prune()` for segments no longer listed, and by `close()`; views
over it must not be read after that.

The runtime is CuPy's when CuPy is installed, else the CUDA runtime library that PyTorch's CUDA
build loads (found through ctypes). Tests hand SegmentMap a runtime of their own.
"""
from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class CudaUnavailable(Exception):
    """No CUDA runtime could be loaded in this process."""


class CupyRuntime:
    """CUDA IPC through CuPy."""

    def __init__(self):
        import cupy  # noqa: F401  (ImportError: not installed)
        from cupy.cuda import runtime
        self._rt = runtime

    def open(self, handle: bytes) -> tuple[int, int]:
        """(device pointer, device ordinal) of another process's allocation."""
        return self._rt.ipcOpenMemHandle(handle, _LAZY_ENABLE_PEER_ACCESS), self._rt.getDevice()

    def close(self, ptr: int) -> None:
        self._rt.ipcCloseMemHandle(ptr)


class _IpcMemHandle(ctypes.Structure):
    """cudaIpcMemHandle_t: 64 opaque bytes, passed by value."""
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class CudartRuntime:
    """CUDA IPC through the CUDA runtime library, by ctypes: the one PyTorch's CUDA build ships
    (nvidia/cuda_runtime/lib in site-packages), or the system's."""

    def __init__(self):
        names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
        try:
            import nvidia.cuda_runtime  # PyTorch's CUDA wheels depend on it
            for d in nvidia.cuda_runtime.__path__:
                names += sorted(glob.glob(os.path.join(d, "lib", "libcudart.so*")))
        except ImportError:
            pass
        self._lib = None
        for name in names:
            try:
                self._lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if self._lib is None:
            raise CudaUnavailable("no CUDA runtime library (libcudart) could be loaded")
        self._lib.cudaGetErrorName.argtypes = [ctypes.c_int]
        self._lib.cudaGetErrorName.restype = ctypes.c_char_p
        self._lib.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        # The handle is a struct passed by value (ctypes passes a bare array as a pointer).
        self._lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                                   _IpcMemHandle, ctypes.c_uint]
        self._lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]

    def _check(self, what: str, err: int) -> None:
        if err != 0:
            raise OSError(f"{what}: {self._lib.cudaGetErrorName(err).decode()}")

    def open(self, handle: bytes) -> tuple[int, int]:
        ptr, dev = ctypes.c_void_p(), ctypes.c_int()
        h = _IpcMemHandle.from_buffer_copy(handle)
        self._check("cudaGetDevice", self._lib.cudaGetDevice(ctypes.byref(dev)))
        self._check("cudaIpcOpenMemHandle",
                    self._lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS))
        return ptr.value, dev.value

    def close(self, ptr: int) -> None:
        self._check("cudaIpcCloseMemHandle", self._lib.cudaIpcCloseMemHandle(ptr))


def default_runtime():
    """CuPy's runtime when CuPy is installed, else libcudart through ctypes."""
    try:
        return CupyRuntime()
    except ImportError:
        return CudartRuntime()


@dataclass(frozen=True)
class CudaArray:
    """[rows][cols] 2-byte values in device memory, read-only, described the way
    `__cuda_array_interface__` consumers expect (version 3, C order)."""
    ptr: int
    rows: int
    cols: int
    device: int
    typestr: str = "<f2"

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.rows, self.cols), "typestr": self.typestr,
                "data": (self.ptr, True), "version": 3, "strides": None, "stream": None}


def as_like(a: CudaArray, like: str):
    """The array as a torch tensor or a CuPy array over the same memory (no copy), or as is."""
    if like == "torch":
        import torch
        return torch.as_tensor(a, device=f"cuda:{a.device}")
    if like == "cupy":
        import cupy
        return cupy.asarray(a)
    return a
