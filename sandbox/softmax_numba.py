"""Numba CUDA versions of the lecture's softmax algorithms (see sandbox/softmax.py): one thread
block of THREADS threads per row, tree reductions in shared memory; the online kernel merges the
threads' (max, sum) pairs with the same rescaling rule as its element loop. Runs under the CUDA
simulator without a GPU."""
from __future__ import annotations

import functools
import math

import numpy as np

from . import numba_support as nb
from .numba_support import cuda

THREADS = 128


@functools.lru_cache(maxsize=None)
def kernel(algorithm: str):
    """The Numba kernel of one algorithm: launch [rows, THREADS](x, y)."""
    T = THREADS
    f32 = np.float32

    @cuda.jit(device=True)
    def reduce(v, buf, is_max):
        t = cuda.threadIdx.x
        buf[t] = v
        cuda.syncthreads()
        s = T // 2
        while s > 0:
            if t < s:
                buf[t] = max(buf[t], buf[t + s]) if is_max else buf[t] + buf[t + s]
            cuda.syncthreads()
            s //= 2
        out = buf[0]
        cuda.syncthreads()
        return out

    @nb.kernel
    def naive(x, y):
        row, t = cuda.blockIdx.x, cuda.threadIdx.x
        buf = cuda.shared.array(T, np.float32)
        n = x.shape[1]
        d = f32(0.0)
        for j in range(t, n, T):
            d += math.exp(x[row, j])
        d = reduce(d, buf, False)
        for j in range(t, n, T):
            y[row, j] = math.exp(x[row, j]) / d

    @nb.kernel
    def safe(x, y):
        row, t = cuda.blockIdx.x, cuda.threadIdx.x
        buf = cuda.shared.array(T, np.float32)
        n = x.shape[1]
        m = f32(-math.inf)
        for j in range(t, n, T):
            m = max(m, x[row, j])
        m = reduce(m, buf, True)
        d = f32(0.0)
        for j in range(t, n, T):
            d += math.exp(x[row, j] - m)
        d = reduce(d, buf, False)
        for j in range(t, n, T):
            y[row, j] = math.exp(x[row, j] - m) / d

    @nb.kernel
    def online(x, y):
        row, t = cuda.blockIdx.x, cuda.threadIdx.x
        bm = cuda.shared.array(T, np.float32)
        bd = cuda.shared.array(T, np.float32)
        n = x.shape[1]
        m = f32(-math.inf)
        d = f32(0.0)
        for j in range(t, n, T):
            v = x[row, j]
            if v > m:
                d = d * math.exp(m - v) + f32(1.0)
                m = v
            else:
                d += math.exp(v - m)
        bm[t] = m
        bd[t] = d
        cuda.syncthreads()
        s = T // 2
        while s > 0:                                    # merge (m, d) pairs with the same rule
            if t < s:
                m1, d1, m2, d2 = bm[t], bd[t], bm[t + s], bd[t + s]
                mn = max(m1, m2)
                if mn != -math.inf:
                    bd[t] = d1 * math.exp(m1 - mn) + d2 * math.exp(m2 - mn)
                    bm[t] = mn
            cuda.syncthreads()
            s //= 2
        m, d = bm[0], bd[0]
        for j in range(t, n, T):
            y[row, j] = math.exp(x[row, j] - m) / d

    return {"naive": naive, "safe": safe, "online": online}[algorithm]
