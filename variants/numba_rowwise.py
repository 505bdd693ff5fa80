"""numba-rowwise: the straightforward Numba CUDA variant, fp32 (exact tier), one thread per row.

Forward (FA2 paper Algorithm 1 with Br = Bc = 1 and no shared memory): one thread per query row
streams over the visible keys with the online softmax (lecture Algorithm 3): running max m, running
sum l, un-normalised accumulator rescaled by exp(m_old - m_new); O = acc / l and lse = m + log l
written once. Backward (FA2 paper Algorithm 2 without tiling, deterministic): one thread per query
row for dQ (and D = rowsum(dO * O)), one thread per key row for dK and dV, P recomputed from lse,
dropout replayed from (seed, offset) with the same Philox counters as every other backend.

It exists so that the simulator path (no GPU) and the demo run from day one; it is slow by design.
Kernels are made by factories with the head dim and Philox rounds as closure constants.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from sandbox import numba_support as nb
from sandbox.numba_support import cuda
from sandbox.registry import Capabilities, Variant, philox_rounds_param, register

THREADS = 128


# ---- device helpers

def make_mask_helpers(rounds: int):
    philox = nb.make_philox(rounds)

    @cuda.jit(device=True, inline=True)
    def visible(h, i, j, band_lo, band_hi, layout, layout_heads, bq, bk):
        dij = j - i
        if dij < band_lo or dij > band_hi:
            return False
        if layout_heads == 0:
            return True
        hm = 0 if layout_heads == 1 else h
        return layout[hm, i // bq, j // bk] != 0

    @cuda.jit(device=True, inline=True)
    def keep_factor(bh, i, j, threshold, inv_keep, seed_lo, seed_hi, offset):
        if threshold == 0:
            return np.float32(1.0)
        w = philox(j // 4, i, bh, offset, seed_lo, seed_hi)
        t = j % 4
        word = w[0] if t == 0 else (w[1] if t == 1 else (w[2] if t == 2 else w[3]))
        return inv_keep if word >= threshold else np.float32(0.0)

    return visible, keep_factor


# ---- kernels (factories)

@functools.lru_cache(maxsize=None)
def forward_kernel(D: int, rounds: int):
    visible, keep_factor = make_mask_helpers(rounds)

    @nb.kernel
    def fwd(q, k, v, out, lse, scale, group, band_lo, band_hi, layout, layout_heads, bq, bk,
            threshold, inv_keep, seed_lo, seed_hi, offset):
        # q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D], out [B, Hq, Nq, D], lse [B, Hq, Nq]
        t = cuda.grid(1)
        B, H, Nq = q.shape[0], q.shape[1], q.shape[2]
        Nk = k.shape[2]
        if t >= B * H * Nq:
            return
        i, bh = t % Nq, t // Nq
        h, b = bh % H, bh // H
        hk = h // group
        acc = cuda.local.array(D, np.float32)
        for c in range(D):
            acc[c] = 0.0
        m = np.float32(-math.inf)
        l = np.float32(0.0)
        for j in range(Nk):
            if not visible(h, i, j, band_lo, band_hi, layout, layout_heads, bq, bk):
                continue
            s = np.float32(0.0)
            for c in range(D):
                s += q[b, h, i, c] * k[b, hk, j, c]
            s *= scale
            m_new = max(m, s)
            correction = math.exp(m - m_new)          # exp(-inf) = 0 on the first visible key
            p = math.exp(s - m_new)
            l = l * correction + p
            pd = p * keep_factor(bh, i, j, threshold, inv_keep, seed_lo, seed_hi, offset)
            for c in range(D):
                acc[c] = acc[c] * correction + pd * v[b, hk, j, c]
            m = m_new
        if l != 0:                                     # NaN is not a dead row: only an exactly zero sum is
            inv_l = np.float32(1.0) / l
            for c in range(D):
                out[b, h, i, c] = acc[c] * inv_l
            lse[b, h, i] = m + math.log(l)
        else:                                          # the row sees no key
            for c in range(D):
                out[b, h, i, c] = 0.0
            lse[b, h, i] = -math.inf

    return fwd


@functools.lru_cache(maxsize=None)
def backward_kernels(D: int, rounds: int):
    visible, keep_factor = make_mask_helpers(rounds)

    @nb.kernel
    def dq_kernel(q, k, v, out, dout, lse, dq, Dbuf, scale, group, band_lo, band_hi, layout,
                  layout_heads, bq, bk, threshold, inv_keep, seed_lo, seed_hi, offset):
        # one thread per query row: D_i = dO_i . O_i, dQ_i = scale * sum_j dS_ij K_j
        t = cuda.grid(1)
        B, H, Nq = q.shape[0], q.shape[1], q.shape[2]
        Nk = k.shape[2]
        if t >= B * H * Nq:
            return
        i, bh = t % Nq, t // Nq
        h, b = bh % H, bh // H
        hk = h // group
        Di = np.float32(0.0)
        for c in range(D):
            Di += dout[b, h, i, c] * out[b, h, i, c]
        Dbuf[b, h, i] = Di
        acc = cuda.local.array(D, np.float32)
        for c in range(D):
            acc[c] = 0.0
        L = lse[b, h, i]
        if L != -math.inf:
            for j in range(Nk):
                if not visible(h, i, j, band_lo, band_hi, layout, layout_heads, bq, bk):
                    continue
                s = np.float32(0.0)
                dp = np.float32(0.0)
                for c in range(D):
                    s += q[b, h, i, c] * k[b, hk, j, c]
                    dp += dout[b, h, i, c] * v[b, hk, j, c]
                p = math.exp(s * scale - L)
                z = keep_factor(bh, i, j, threshold, inv_keep, seed_lo, seed_hi, offset)
                ds = p * (dp * z - Di)
                for c in range(D):
                    acc[c] += ds * k[b, hk, j, c]
        for c in range(D):
            dq[b, h, i, c] = acc[c] * scale

    @nb.kernel
    def dkdv_kernel(q, k, v, dout, lse, Dbuf, dk, dv, scale, group, band_lo, band_hi, layout,
                    layout_heads, bq, bk, threshold, inv_keep, seed_lo, seed_hi, offset):
        # one thread per key row of a K/V head: sums over the query heads of its group
        t = cuda.grid(1)
        B, Hkv, Nk = k.shape[0], k.shape[1], k.shape[2]
        H, Nq = q.shape[1], q.shape[2]
        if t >= B * Hkv * Nk:
            return
        j, bhk = t % Nk, t // Nk
        hk, b = bhk % Hkv, bhk // Hkv
        ak = cuda.local.array(D, np.float32)
        av = cuda.local.array(D, np.float32)
        for c in range(D):
            ak[c] = 0.0
            av[c] = 0.0
        for g in range(group):
            h = hk * group + g
            bh = b * H + h
            for i in range(Nq):
                L = lse[b, h, i]
                if L == -math.inf or not visible(h, i, j, band_lo, band_hi, layout, layout_heads, bq, bk):
                    continue
                s = np.float32(0.0)
                dp = np.float32(0.0)
                for c in range(D):
                    s += q[b, h, i, c] * k[b, hk, j, c]
                    dp += dout[b, h, i, c] * v[b, hk, j, c]
                p = math.exp(s * scale - L)
                z = keep_factor(bh, i, j, threshold, inv_keep, seed_lo, seed_hi, offset)
                ds = p * (dp * z - Dbuf[b, h, i])
                for c in range(D):
                    av[c] += p * z * dout[b, h, i, c]
                    ak[c] += ds * q[b, h, i, c]
        for c in range(D):
            dk[b, hk, j, c] = ak[c] * scale
            dv[b, hk, j, c] = av[c]

    return dq_kernel, dkdv_kernel


# ---- config and launch

@dataclass(frozen=True)
class RowwiseConfig:
    philox_rounds: int = 10


def _common_args(p):
    bm = p.block_mask
    if bm is None:
        layout, heads, bq, bk = nb.zeros((1, 1, 1), np.uint8), 0, 1, 1      # on the device: no host copy
    else:
        layout, heads, (bq, bk) = nb.asarray(bm.layout.astype(np.uint8)), bm.layout.shape[0], bm.block
    lo, hi = p.seed_words
    return (np.float32(p.scale), np.int32(p.group), np.int32(p.band.lo), np.int32(p.band.hi), layout,
            np.int32(heads), np.int32(bq), np.int32(bk), np.uint32(p.dropout_threshold),
            np.float32(1.0 / (1.0 - p.dropout_p)), np.uint32(lo), np.uint32(hi), np.uint32(p.offset))


def _grid(n):
    return (max(1, -(-n // THREADS)),), (THREADS,)


class Rowwise:
    def configure(self, philox_rounds=10):
        return RowwiseConfig(philox_rounds)

    def to_backend(self, x, name="array"):
        return nb.to_backend(x, name)

    def forward(self, p, q, k, v, config):
        out = nb.empty((p.B, p.Hq, p.Nq, p.d), np.float32)
        lse = nb.empty((p.B, p.Hq, p.Nq), np.float32)
        grid, block = _grid(p.B * p.Hq * p.Nq)
        nb.launch(forward_kernel(p.d, config.philox_rounds), grid, block, q, k, v, out, lse, *_common_args(p))
        return out, lse

    def backward(self, p, dout, q, k, v, out, lse, config):
        dq_kernel, dkdv_kernel = backward_kernels(p.d, config.philox_rounds)
        dq = nb.empty(q.shape, np.float32)
        dk = nb.empty(k.shape, np.float32)
        dv = nb.empty(v.shape, np.float32)
        Dbuf = nb.empty((p.B, p.Hq, p.Nq), np.float32)
        args = _common_args(p)
        grid, block = _grid(p.B * p.Hq * p.Nq)
        nb.launch(dq_kernel, grid, block, q, k, v, out, dout, lse, dq, Dbuf, *args)
        grid, block = _grid(p.B * p.Hkv * p.Nk)
        nb.launch(dkdv_kernel, grid, block, q, k, v, dout, lse, Dbuf, dk, dv, *args)
        return dq, dk, dv


register(Variant(
    name="numba-rowwise", family="fa2", backend="numba",
    description="one thread per row, online softmax, no tiling (Numba CUDA; runs under the simulator)",
    impl=Rowwise(),
    params=(philox_rounds_param(),),
    caps=Capabilities(dtypes=("float32",), head_dims=tuple(range(1, 257))),
    seed_ref="FA2 paper Algorithms 1-2 with Br = Bc = 1; lecture Algorithm 3 (online softmax)",
    tags=("exact-ladder",),
))
