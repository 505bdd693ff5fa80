"""numba-rowwise: the straightforward Numba CUDA variant, fp32 (exact tier), one thread per row.

Forward (FA2 paper Algorithm 1 with Br = Bc = 1 and no shared memory): one thread per query row
streams over the visible keys with the online softmax (lecture Algorithm 3): running max m, running
sum l, un-normalised accumulator rescaled by exp(m_old - m_new); O = acc / l and lse = m + log l
written once. Backward (FA2 paper Algorithm 2 without tiling, deterministic): one thread per query
row for dQ (and D = rowsum(dO * O)), one thread per key row for dK and dV, P recomputed from lse,
dropout replayed from (seed, offset) with the same Philox counters as every other backend.

It exists so that the simulator path (no GPU) and the demo run from day one; it is slow by design.
Kernels are made by factories with the head dim and Philox rounds as closure constants.

Score and mask modifiers (sandbox/modifiers.py): the factories also take the modifiers' kernel keys
(their scalar functions, buffer counts and whether there are sinks) and compile the scalar forms in
as device functions (`make_mod_helpers`); the captured buffers travel as extra kernel arguments
(MAX_BUFFERS per modifier, unused ones a dummy array). The score modifier is applied to
scale * q.k wherever a score is formed (forward, and the P recomputed in the backward), its
derivative multiplies dS, the mask modifier joins the visibility test, and sinks add exp(sink_h - m)
to the row sum after the last key. Kernels are cached per (head dim, rounds, modifier keys), so new
buffer values (other ALiBi slopes) reuse a compiled kernel.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from sandbox import numba_support as nb
from sandbox.modifiers import MAX_BUFFERS, host_buffers
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


def _with_buffers(fn, n: int, scored: bool):
    """fn compiled as a device function, wrapped to take all MAX_BUFFERS buffer slots and pass on its
    first n (Numba kernels have a fixed argument list). scored: fn takes the score s first."""
    f = cuda.jit(device=True, inline=True)(fn)
    if scored:
        calls = (lambda s, b, h, i, j, x0, x1, x2, x3: f(s, b, h, i, j),
                 lambda s, b, h, i, j, x0, x1, x2, x3: f(s, b, h, i, j, x0),
                 lambda s, b, h, i, j, x0, x1, x2, x3: f(s, b, h, i, j, x0, x1),
                 lambda s, b, h, i, j, x0, x1, x2, x3: f(s, b, h, i, j, x0, x1, x2),
                 lambda s, b, h, i, j, x0, x1, x2, x3: f(s, b, h, i, j, x0, x1, x2, x3))
    else:
        calls = (lambda b, h, i, j, x0, x1, x2, x3: f(b, h, i, j),
                 lambda b, h, i, j, x0, x1, x2, x3: f(b, h, i, j, x0),
                 lambda b, h, i, j, x0, x1, x2, x3: f(b, h, i, j, x0, x1),
                 lambda b, h, i, j, x0, x1, x2, x3: f(b, h, i, j, x0, x1, x2),
                 lambda b, h, i, j, x0, x1, x2, x3: f(b, h, i, j, x0, x1, x2, x3))
    return cuda.jit(device=True, inline=True)(calls[n])


def _identity_score(s, b, h, i, j):
    return s


def _unit_grad(s, b, h, i, j):
    return 1.0


def _all_visible(b, h, i, j):
    return True


def make_mod_helpers(score_key, mask_key):
    """(score, score_grad, mask) device functions from the modifiers' kernel keys (None: identity,
    derivative 1, everything visible). score and score_grad return float32, mask a bool."""
    scalar, scalar_grad, n_score, _ = score_key or (_identity_score, _unit_grad, 0, False)
    mask_fn, n_mask = mask_key or (_all_visible, 0)
    raw_score = _with_buffers(scalar, n_score, True)
    # a forward-only modifier has no derivative: its backward is refused before launch (registry)
    raw_grad = _with_buffers(scalar_grad, n_score, True) if scalar_grad else _with_buffers(_unit_grad, 0, True)
    raw_mask = _with_buffers(mask_fn, n_mask, False)

    @cuda.jit(device=True, inline=True)
    def score(s, b, h, i, j, x0, x1, x2, x3):
        return np.float32(raw_score(s, b, h, i, j, x0, x1, x2, x3))

    @cuda.jit(device=True, inline=True)
    def score_grad(s, b, h, i, j, x0, x1, x2, x3):
        return np.float32(raw_grad(s, b, h, i, j, x0, x1, x2, x3))

    @cuda.jit(device=True, inline=True)
    def mask(b, h, i, j, x0, x1, x2, x3):
        return bool(raw_mask(b, h, i, j, x0, x1, x2, x3))

    return score, score_grad, mask


def kernel_decorator(score_key, mask_key):
    """nb.kernel (disk-cached) without modifiers; plain cuda.jit with them: a user's scalar form is
    not part of the bytecode Numba's disk cache keys on, so a cached kernel could be stale."""
    return nb.kernel if score_key is None and mask_key is None else cuda.jit


# ---- kernels (factories)

@functools.lru_cache(maxsize=None)
def forward_kernel(D: int, rounds: int, score_key=None, mask_key=None):
    visible, keep_factor = make_mask_helpers(rounds)
    score, _, mask = make_mod_helpers(score_key, mask_key)
    sinks = score_key is not None and score_key[3]

    @kernel_decorator(score_key, mask_key)
    def fwd(q, k, v, out, lse, scale, group, band_lo, band_hi, layout, layout_heads, bq, bk,
            threshold, inv_keep, seed_lo, seed_hi, offset, s0, s1, s2, s3, m0, m1, m2, m3, sink):
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
            if not (visible(h, i, j, band_lo, band_hi, layout, layout_heads, bq, bk)
                    and mask(b, h, i, j, m0, m1, m2, m3)):
                continue
            s = np.float32(0.0)
            for c in range(D):
                s += q[b, h, i, c] * k[b, hk, j, c]
            s = score(s * scale, b, h, i, j, s0, s1, s2, s3)
            m_new = max(m, s)
            correction = math.exp(m - m_new)          # exp(-inf) = 0 on the first visible key
            p = math.exp(s - m_new)
            l = l * correction + p
            pd = p * keep_factor(bh, i, j, threshold, inv_keep, seed_lo, seed_hi, offset)
            for c in range(D):
                acc[c] = acc[c] * correction + pd * v[b, hk, j, c]
            m = m_new
        if sinks:                                      # the sink joins the denominator, with no value row
            sk = sink[min(h, sink.shape[0] - 1)]
            m_new = max(m, sk)
            correction = math.exp(m - m_new)
            l = l * correction + math.exp(sk - m_new)
            for c in range(D):
                acc[c] = acc[c] * correction
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
def backward_kernels(D: int, rounds: int, score_key=None, mask_key=None):
    visible, keep_factor = make_mask_helpers(rounds)
    score, score_grad, mask = make_mod_helpers(score_key, mask_key)
    jit = kernel_decorator(score_key, mask_key)

    @jit
    def dq_kernel(q, k, v, out, dout, lse, dq, Dbuf, scale, group, band_lo, band_hi, layout,
                  layout_heads, bq, bk, threshold, inv_keep, seed_lo, seed_hi, offset,
                  s0, s1, s2, s3, m0, m1, m2, m3, sink):
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
                if not (visible(h, i, j, band_lo, band_hi, layout, layout_heads, bq, bk)
                        and mask(b, h, i, j, m0, m1, m2, m3)):
                    continue
                s = np.float32(0.0)
                dp = np.float32(0.0)
                for c in range(D):
                    s += q[b, h, i, c] * k[b, hk, j, c]
                    dp += dout[b, h, i, c] * v[b, hk, j, c]
                s *= scale
                p = math.exp(score(s, b, h, i, j, s0, s1, s2, s3) - L)
                z = keep_factor(bh, i, j, threshold, inv_keep, seed_lo, seed_hi, offset)
                ds = p * (dp * z - Di) * score_grad(s, b, h, i, j, s0, s1, s2, s3)
                for c in range(D):
                    acc[c] += ds * k[b, hk, j, c]
        for c in range(D):
            dq[b, h, i, c] = acc[c] * scale

    @jit
    def dkdv_kernel(q, k, v, dout, lse, Dbuf, dk, dv, scale, group, band_lo, band_hi, layout,
                    layout_heads, bq, bk, threshold, inv_keep, seed_lo, seed_hi, offset,
                    s0, s1, s2, s3, m0, m1, m2, m3, sink):
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
                if L == -math.inf or not (visible(h, i, j, band_lo, band_hi, layout, layout_heads, bq, bk)
                                          and mask(b, h, i, j, m0, m1, m2, m3)):
                    continue
                s = np.float32(0.0)
                dp = np.float32(0.0)
                for c in range(D):
                    s += q[b, h, i, c] * k[b, hk, j, c]
                    dp += dout[b, h, i, c] * v[b, hk, j, c]
                s *= scale
                p = math.exp(score(s, b, h, i, j, s0, s1, s2, s3) - L)
                z = keep_factor(bh, i, j, threshold, inv_keep, seed_lo, seed_hi, offset)
                ds = p * (dp * z - Dbuf[b, h, i]) * score_grad(s, b, h, i, j, s0, s1, s2, s3)
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
            np.float32(1.0 / (1.0 - p.dropout_p)), np.uint32(lo), np.uint32(hi), np.uint32(p.offset),
            *_mod_args(p))


def mod_keys(p):
    """(score_key, mask_key) of the problem's modifiers: what their kernels are compiled and cached by."""
    return (None if p.score_mod is None else p.score_mod.kernel_key,
            None if p.mask_mod is None else p.mask_mod.kernel_key)


def _device_buffer(arr):
    """A captured buffer on the device: floats as float32, integers as int32, bools as uint8."""
    kind = arr.dtype.kind
    dtype = np.float32 if kind == "f" else (np.uint8 if kind == "b" else np.int32)
    return nb.asarray(np.ascontiguousarray(arr, dtype=dtype))


def _buffer_slots(mod, dummy):
    """MAX_BUFFERS device arrays: the modifier's buffers in order, then the dummy (never read)."""
    bufs = [] if mod is None else [_device_buffer(a) for a in host_buffers(mod.buffers).values()]
    return tuple(bufs) + (dummy,) * (MAX_BUFFERS - len(bufs))


def _mod_args(p):
    """The kernels' trailing arguments: score buffers, mask buffers, sink logits (unused slots share
    one dummy array, so a call without modifiers allocates one)."""
    dummy = nb.zeros((1,), np.float32)
    sm = p.score_mod
    sink = dummy if sm is None or sm.sink is None else _device_buffer(sm.sink)
    return (*_buffer_slots(sm, dummy), *_buffer_slots(p.mask_mod, dummy), sink)


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
        kernel = forward_kernel(p.d, config.philox_rounds, *mod_keys(p))
        nb.launch(kernel, grid, block, q, k, v, out, lse, *_common_args(p))
        return out, lse

    def backward(self, p, dout, q, k, v, out, lse, config):
        dq_kernel, dkdv_kernel = backward_kernels(p.d, config.philox_rounds, *mod_keys(p))
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
    caps=Capabilities(dtypes=("float32",), head_dims=tuple(range(1, 257)), score_mod=True, mask_mod=True),
    seed_ref="FA2 paper Algorithms 1-2 with Br = Bc = 1; lecture Algorithm 3 (online softmax)",
    tags=("exact-ladder",),
))
