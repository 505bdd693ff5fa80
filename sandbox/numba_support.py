"""Numba CUDA set-up shared by the Numba variants: a NumPy compatibility shim, the choice between
the real CUDA target and the simulator, array placement, and the Philox device function.

Import `cuda` from here, never `numba.cuda` directly, so that both choices are made first:

- numba-cuda 0.30.4 registers an overload for `np.row_stack`, which NumPy 2.5 removed; the first
  compile then fails with AttributeError. `np.row_stack` was an alias of `np.vstack`, so the shim
  restores that alias when it is missing (and only then).
- Kernels are declared with `kernel` (below): `cuda.jit` with Numba's disk cache in the module
  cache's folder (SANDBOX_CACHE_DIR, sandbox/kernel_cache.py), off when that cache is off.
- Without a GPU, NUMBA_ENABLE_CUDASIM=1 is set (unless the user chose) before numba.cuda is
  imported, so the Numba variants run under the CUDA simulator on the CPU. `SIMULATOR` says which.
"""
from __future__ import annotations

import math
import os

import numpy as np

from . import arrays
from .device import has_gpu

if not hasattr(np, "row_stack"):          # NumPy >= 2.5 removed this alias of vstack
    np.row_stack = np.vstack

if "NUMBA_ENABLE_CUDASIM" not in os.environ and not has_gpu():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

from . import kernel_cache  # noqa: E402

# Numba's own disk cache (compiled kernels keyed by bytecode, closure constants and signature) lives
# beside the CUBIN cache, so a second process skips the Numba JIT as it skips NVRTC; off with it.
NUMBA_CACHE = kernel_cache.enabled() and kernel_cache.cache_dir() is not None
if NUMBA_CACHE and "NUMBA_CACHE_DIR" not in os.environ:
    os.environ["NUMBA_CACHE_DIR"] = str(kernel_cache.cache_dir() / "numba")

import numba  # noqa: E402

numba.core.config.reload_config()
from numba import cuda  # noqa: E402

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

M0, M1 = 0xD2511F53, 0xCD9E8D57        # Philox round multipliers (sandbox/philox.py)
W0, W1 = 0x9E3779B9, 0xBB67AE85        # Weyl key increments
U32 = 0xFFFFFFFF


def kernel(fn):
    """`cuda.jit` for a variant's kernel, cached on disk where the module cache is on."""
    return cuda.jit(cache=NUMBA_CACHE)(fn)


def to_backend(x, name="array"):
    """Host arrays under the simulator, CuPy views on a GPU (Numba kernels take any strides)."""
    return np.ascontiguousarray(arrays.to_host(x)) if SIMULATOR else arrays._to_device(x)


def empty(shape, dtype):
    if SIMULATOR:
        return np.empty(shape, dtype=dtype)
    import cupy
    return cupy.empty(shape, dtype=dtype)


def asarray(x):
    if SIMULATOR:
        return np.asarray(x)
    import cupy
    return cupy.asarray(x)


def make_philox(rounds: int):
    """Philox4x32-`rounds` as a Numba device function (c0, c1, c2, c3, k0, k1) -> 4 words."""

    @cuda.jit(device=True, inline=True)
    def philox(c0, c1, c2, c3, k0, k1):
        c0, c1, c2, c3 = np.uint64(c0), np.uint64(c1), np.uint64(c2), np.uint64(c3)
        k0, k1 = np.uint64(k0), np.uint64(k1)
        for r in range(rounds):
            if r > 0:
                k0 = (k0 + np.uint64(W0)) & np.uint64(U32)
                k1 = (k1 + np.uint64(W1)) & np.uint64(U32)
            p0 = np.uint64(M0) * c0
            p1 = np.uint64(M1) * c2
            c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & np.uint64(U32),
                              (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & np.uint64(U32))
        return c0, c1, c2, c3

    return philox


NEG_INF = -math.inf


def zeros(shape, dtype):
    """Zero-filled on the device (on the current stream), not a host array copied over."""
    if SIMULATOR:
        return np.zeros(shape, dtype=dtype)
    import cupy
    return cupy.zeros(shape, dtype=dtype)


def full(shape, value, dtype):
    if SIMULATOR:
        return np.full(shape, value, dtype=dtype)
    import cupy
    return cupy.full(shape, value, dtype=dtype)


def launch(kernel, grid, block, *args):
    """kernel[grid, block](*args) on the caller's stream (CuPy's current one, which the API sets to
    torch's current stream for torch tensors). Device arrays are handed to Numba with sync=False:
    Numba would otherwise synchronise on the stream each array's interface names (a host wait)."""
    if SIMULATOR:
        kernel[grid, block](*args)
        return
    import cupy
    ptr = cupy.cuda.get_current_stream().ptr
    stream = cuda.external_stream(ptr) if ptr else cuda.default_stream()
    args = tuple(cuda.as_cuda_array(a, sync=False) if hasattr(a, "__cuda_array_interface__") else a
                 for a in args)
    kernel[grid, block, stream](*args)
