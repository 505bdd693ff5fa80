"""Is there a CUDA GPU, and which array module runs on it?

Detection goes through the driver library directly (ctypes) so that it needs neither CuPy nor
Numba, and so that it can run before Numba decides between the real target and the simulator.
"""
from __future__ import annotations

import ctypes
import functools
import os


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return 0
    for lib in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            cuda = ctypes.CDLL(lib)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    return 0


def has_gpu() -> bool:
    return gpu_count() > 0


def cupy_or_none():
    """CuPy if it is installed and a GPU is present, else None."""
    if not has_gpu():
        return None
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def require_cupy(what: str):
    cp = cupy_or_none()
    if cp is None:
        why = "no CUDA GPU was found" if not has_gpu() else "CuPy is not installed (pip install .[cuda13])"
        raise RuntimeError(f"{what} needs a CUDA GPU through CuPy, but {why}")
    return cp


def device_name() -> str:
    cp = cupy_or_none()
    if cp is None:
        return "cpu (no GPU)"
    return cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
