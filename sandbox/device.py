"""Device facts in one place: is there a CUDA GPU, which array module runs on it, its architecture,
SM count and per-block shared-memory limit, and the compile targets without one.

Detection goes through the driver library directly (ctypes) so that it needs neither CuPy nor
Numba, and so that it can run before Numba decides between the real target and the simulator.
Queries of the GPU are cached per device; "the current device" is CuPy's current device where CuPy
is loaded, else device 0.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

# The architectures the compile-only report builds for without a GPU (A100, H100 / H200).
DEFAULT_ARCHS = ("sm_80", "sm_90")

# Largest shared memory one thread block may opt into (cudaFuncAttributeMaxDynamicSharedMemorySize
# plus static), per architecture, in bytes: the CUDA programming guide's per-compute-capability table.
SMEM_PER_BLOCK_OPTIN = {
    "sm_80": 163 * 1024,     # A100
    "sm_86": 99 * 1024,      # GA10x
    "sm_89": 99 * 1024,      # Ada
    "sm_90": 227 * 1024,     # H100 / H200
}

# CUdevice_attribute values of the driver API (cuda.h)
_ATTRIBUTES = {"sm_count": 16, "major": 75, "minor": 76, "smem_optin": 97}


@functools.lru_cache(maxsize=None)
def _driver():
    """libcuda through ctypes, initialised; None without a driver, or under the CUDA simulator."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return None
    for lib in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            cuda = ctypes.CDLL(lib)
        except OSError:
            continue
        return cuda if cuda.cuInit(0) == 0 else None
    return None


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    cuda = _driver()
    if cuda is None:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


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


def device_name() -> str:
    cp = cupy_or_none()
    if cp is None:
        return "cpu (no GPU)"
    return cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()


def current_device() -> int | None:
    """The index of the current GPU (CuPy's current device where CuPy is loaded, else 0); None
    without a GPU. CuPy is not imported here."""
    if not has_gpu():
        return None
    cp = sys.modules.get("cupy")
    return int(cp.cuda.runtime.getDevice()) if cp is not None else 0


@functools.lru_cache(maxsize=None)
def _attributes(index: int) -> dict:
    """The driver attributes of device `index` that this module reports (see _ATTRIBUTES)."""
    cuda = _driver()
    dev = ctypes.c_int(0)
    if cuda is None or cuda.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(index)) != 0:
        raise RuntimeError(f"no CUDA device {index}")
    values = {}
    for name, attribute in _ATTRIBUTES.items():
        value = ctypes.c_int(0)
        if cuda.cuDeviceGetAttribute(ctypes.byref(value), ctypes.c_int(attribute), dev) != 0:
            raise RuntimeError(f"cuDeviceGetAttribute({name}) failed on CUDA device {index}")
        values[name] = value.value
    return values


def _index(device) -> int | None:
    return current_device() if device is None else int(device)


def compute_capability(device: int | None = None) -> tuple[int, int] | None:
    """(major, minor) of a GPU (default: the current one); None without a GPU."""
    index = _index(device)
    if index is None:
        return None
    a = _attributes(index)
    return a["major"], a["minor"]


def arch(device: int | None = None) -> str | None:
    """'sm_90' and the like for a GPU (default: the current one); None without a GPU."""
    cc = compute_capability(device)
    return None if cc is None else f"sm_{cc[0]}{cc[1]}"


def target_archs() -> tuple[str, ...]:
    """What to compile for: the current GPU's architecture, or DEFAULT_ARCHS without a GPU."""
    current = arch()
    return DEFAULT_ARCHS if current is None else (current,)


def sm_count(device: int | None = None) -> int | None:
    """Streaming multiprocessors of a GPU (default: the current one); None without a GPU."""
    index = _index(device)
    return None if index is None else _attributes(index)["sm_count"]


def smem_per_block_optin(arch_name: str | None = None) -> int:
    """The per-block opt-in shared-memory limit in bytes: of `arch_name` (from SMEM_PER_BLOCK_OPTIN),
    else of the current GPU (queried from the driver), else of sm_90, the default target."""
    if arch_name is not None:
        try:
            return SMEM_PER_BLOCK_OPTIN[arch_name]
        except KeyError:
            raise ValueError(f"no shared-memory limit known for {arch_name!r}; known: "
                             f"{', '.join(SMEM_PER_BLOCK_OPTIN)}") from None
    index = current_device()
    if index is None:
        return SMEM_PER_BLOCK_OPTIN["sm_90"]
    return _attributes(index)["smem_optin"]
