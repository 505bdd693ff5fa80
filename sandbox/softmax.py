"""Row-wise softmax three ways (lecture 003, Algorithms 1-3), in NumPy, CUDA C and Numba CUDA.

    naive   d = sum exp(x); y = exp(x) / d                      2 passes, overflows for x > ~88
    safe    m = max x; d = sum exp(x - m); y = exp(x - m) / d   3 passes
    online  (m, d) in one pass, d rescaled by exp(m_old - m_new) whenever the max grows; then y
                                                                2 passes

`softmax(x, algorithm, backend)` takes a [rows, n] float32 array (NumPy, CuPy or any CUDA array)
and returns the caller's array type. `reference(x, algorithm)` is the float64 NumPy version of each
algorithm, the same passes in the same order, used as the check. The CUDA kernels live in
kernels_cu/softmax.cu, the Numba ones in softmax_numba.py (one thread block per row in both).
"""
from __future__ import annotations

import functools

import numpy as np

from . import arrays

ALGORITHMS = ("naive", "safe", "online")
BACKENDS = ("cuda", "numba")


def _check(x, algorithm, backend="cuda"):
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown softmax algorithm {algorithm!r}; choose from {ALGORITHMS}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown softmax backend {backend!r}; choose from {BACKENDS}")
    if len(x.shape) != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"softmax takes a non-empty [rows, n] array, got shape {tuple(x.shape)}")
    if str(x.dtype) != "float32":
        raise ValueError(f"softmax kernels are float32, got {x.dtype}")


# ---- NumPy (float64) references, pass by pass

def reference(x, algorithm: str = "online") -> np.ndarray:
    x = np.asarray(arrays.to_host(x), np.float64)
    if algorithm == "naive":
        with np.errstate(over="ignore", invalid="ignore"):
            e = np.exp(x)
            return e / e.sum(axis=1, keepdims=True)
    if algorithm == "safe":
        m = x.max(axis=1, keepdims=True)
        e = np.exp(x - m)
        return e / e.sum(axis=1, keepdims=True)
    if algorithm == "online":
        m = np.full(x.shape[0], -np.inf); d = np.zeros(x.shape[0])
        for j in range(x.shape[1]):                     # the recurrence, element by element
            m_new = np.maximum(m, x[:, j])
            d = d * np.exp(m - m_new) + np.exp(x[:, j] - m_new)
            m = m_new
        return np.exp(x - m[:, None]) / d[:, None]
    raise ValueError(f"unknown softmax algorithm {algorithm!r}")


# ---- CUDA C

@functools.lru_cache(maxsize=None)
def unit():
    """The CUDA compile unit (also built by the compile-only report)."""
    from .launch import cuda_options
    from .loader import CompileUnit
    return CompileUnit("softmax.cu", tuple(f"softmax_{a}" for a in ALGORITHMS), cuda_options(), {}, label="softmax")


def _cuda(x, algorithm):
    import cupy as cp
    from .launch import i64
    from .loader import launch
    xd = cp.ascontiguousarray(arrays._to_device(x))
    y = cp.empty_like(xd)
    launch(unit(), f"softmax_{algorithm}", (xd.shape[0],), (256,), (xd, y, i64(xd.shape[1])))
    return y


def _numba(x, algorithm):
    from . import numba_support as nb
    from .softmax_numba import THREADS, kernel
    xd = nb.to_backend(x, "x")
    y = nb.empty(xd.shape, np.float32)
    nb.launch(kernel(algorithm), xd.shape[0], THREADS, xd, y)
    return y


def softmax(x, algorithm: str = "online", backend: str = "cuda"):
    """Row-wise softmax of a [rows, n] float32 array with one of the lecture's three algorithms."""
    _check(x, algorithm, backend)
    kind = arrays.kind_of(x)
    y = _cuda(x, algorithm) if backend == "cuda" else _numba(x, algorithm)
    return arrays.like(y, kind)

