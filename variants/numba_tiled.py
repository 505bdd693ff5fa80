"""numba-fa2, numba-fa1: tiled FlashAttention in Numba CUDA, fp32 (exact tier).

Seeds: FA2 paper Algorithm 1 (forward) and Algorithm 2 (backward); FA1 paper Algorithm 1 (forward,
K/V-outer with O, l, m in HBM). Kernel factories: the head dim, Br, Bc and the thread count are
closure constants, so every shared array has a compile-time shape and Numba compiles one kernel per
configuration (cached).

Each K/V tile is processed in three phases separated by block barriers, because the CUDA simulator
(which CI runs these kernels under) has neither warp shuffles nor __syncwarp:
  1. scores: every thread computes Br*Bc/threads dot products S = scale * Q_i K_j^T from shared
     memory (padded rows, stride d + 1: no bank conflicts), masked, into shared S;
  2. row statistics: one thread per query row updates m and l (online softmax), turns its row of
     S into P in place and applies the replayed dropout mask;
  3. P V: every thread owns Br*d/threads output elements and folds in P V_j.
FA2 keeps O un-normalised in registers and rescales once at the end (grid: Q tiles x batch*heads).
FA1 (one block per (batch, head), K/V tiles outer) reads O_i, l_i, m_i from HBM and writes them
back on every step, as the paper's Algorithm 1 does. The FA2 backward is column-parallel (one
block per K/V tile and K/V head, GQA summed in the block) with dQ added by float atomics.
Static shared memory is capped at 48 KB per block (Numba declares it statically): each variant
checks its (d, Br, Bc) against that before launching. Warp partitioning is not a parameter here:
phase 1 and 3 spread elements over all threads (neither split-Q nor split-K).

Status (bench/results/h100/2026-11-22-8df9aae.md): numba-fa2 forward 2.0-2.1 TFLOP/s at d = 64,
0.12x the CUDA C fa2 (the issue's target was 0.5x). Why, from the sm_90 build of the d = 64 kernel
(Br = 64, Bc = 32, 128 threads; numba-cuda compile_ptx + ptxas -v): 112 registers, no spills, but
a 128-byte stack frame: `acc` (32 floats a thread, indexed in loops Numba does not unroll) lives in
local memory, so every P V update is a local load and store; phases 1 and 3 read both operands of
every FMA from shared memory (the CUDA C kernel holds a 4 x 32 register tile and reads float4s);
phase 2 runs one thread per query row (64 of 128 busy) and adds two barriers per K/V tile. These
follow from running under the simulator (no shuffles, no __syncwarp); a GPU-only rung with
register tiling and warp reductions is the next step.

Score and mask modifiers (sandbox/modifiers.py) as in numba-rowwise (`make_mod_helpers`): the score
modifier in phase 1 (and where the backward recomputes P), its derivative on dS, sinks folded into
l (and O rescaled) after the last tile. With a mask modifier the tile table is the exact
classification of causal / window / block-sparse AND the modifier (masks.classify_tiles_mod, one
per batch entry and head where the mask depends on them): EMPTY tiles are skipped, FULL tiles
evaluate no predicate, PARTIAL tiles evaluate it per element. Tile tables are 4-D [Tb, Th, nr, nc]
(Tb, Th = 1 where the mask does not depend on the batch entry or head).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from sandbox import numba_support as nb
from sandbox.masks import classify_tiles, classify_tiles_mod
from sandbox.numba_support import cuda
from sandbox.launch import tile_table
from sandbox.registry import Capabilities, Param, Variant, philox_rounds_param, register

from .numba_rowwise import _common_args, kernel_decorator, make_mask_helpers, make_mod_helpers, mod_keys

SMEM_STATIC = 48 * 1024
f32 = np.float32


# ---- kernels (factories)

@functools.lru_cache(maxsize=None)
def fa2_forward_kernel(D: int, BR: int, BC: int, THREADS: int, rounds: int, score_key=None, mask_key=None):
    visible, keep_factor = make_mask_helpers(rounds)
    score, _, mask = make_mod_helpers(score_key, mask_key)
    sinks = score_key is not None and score_key[3]
    LD, LDS = D + 1, BC + 1
    NS, NO = -(-BR * BC // THREADS), -(-BR * D // THREADS)     # scores / outputs per thread

    @kernel_decorator(score_key, mask_key)
    def fwd(q, k, v, out, lse, tiles, scale, group, band_lo, band_hi, layout, layout_heads, bq, bk,
            threshold, inv_keep, seed_lo, seed_hi, offset, s0, s1, s2, s3, m0, m1, m2, m3, sink):
        sQ = cuda.shared.array((BR, LD), np.float32)
        sKV = cuda.shared.array((BC, LD), np.float32)          # K_j, then V_j
        sS = cuda.shared.array((BR, LDS), np.float32)           # S, then P
        sM = cuda.shared.array(BR, np.float32)
        sL = cuda.shared.array(BR, np.float32)
        sC = cuda.shared.array(BR, np.float32)                  # this tile's rescale exp(m_old - m_new)
        acc = cuda.local.array(NO, np.float32)
        t = cuda.threadIdx.x
        tr, bh = cuda.blockIdx.x, cuda.blockIdx.y
        H, Nq, Nk = q.shape[1], q.shape[2], k.shape[2]
        b, h = bh // H, bh % H
        hk = h // group
        row0 = tr * BR
        tb = 0 if tiles.shape[0] == 1 else b
        th = 0 if tiles.shape[1] == 1 else h
        for e in range(t, BR * D, THREADS):
            r, c = e // D, e % D
            sQ[r, c] = q[b, h, row0 + r, c] if row0 + r < Nq else f32(0.0)
        for r in range(t, BR, THREADS):
            sM[r] = -math.inf
            sL[r] = 0.0
        for x in range(NO):
            acc[x] = 0.0
        for tc in range(tiles.shape[3]):
            cls = tiles[tb, th, tr, tc]
            if cls == 0:                                         # empty: never loaded
                continue
            col0 = tc * BC
            cuda.syncthreads()
            for e in range(t, BC * D, THREADS):
                c, x = e // D, e % D
                sKV[c, x] = k[b, hk, col0 + c, x] if col0 + c < Nk else f32(0.0)
            cuda.syncthreads()
            for y in range(NS):                                  # phase 1: scores
                e = t + THREADS * y
                if e < BR * BC:
                    r, c = e // BC, e % BC
                    s = f32(0.0)
                    for x in range(D):
                        s += sQ[r, x] * sKV[c, x]
                    i, j = row0 + r, col0 + c
                    ok = i < Nq and j < Nk and (cls == 1 or (visible(h, i, j, band_lo, band_hi, layout, layout_heads,
                                                                       bq, bk) and mask(b, h, i, j, m0, m1, m2, m3)))
                    sS[r, c] = score(s * scale, b, h, i, j, s0, s1, s2, s3) if ok else -math.inf
            cuda.syncthreads()
            for e in range(t, BC * D, THREADS):                  # V_j over K_j
                c, x = e // D, e % D
                sKV[c, x] = v[b, hk, col0 + c, x] if col0 + c < Nk else f32(0.0)
            for r in range(t, BR, THREADS):                      # phase 2: one thread per row
                m_old = sM[r]
                m_new = m_old
                for c in range(BC):
                    m_new = max(m_new, sS[r, c])
                m_use = f32(0.0) if m_new == -math.inf else m_new
                corr = math.exp(m_old - m_use)
                rowsum = f32(0.0)
                for c in range(BC):
                    p = math.exp(sS[r, c] - m_use)
                    rowsum += p
                    if threshold != 0 and p != 0:
                        p *= keep_factor(bh, row0 + r, col0 + c, threshold, inv_keep, seed_lo, seed_hi, offset)
                    sS[r, c] = p
                sL[r] = sL[r] * corr + rowsum
                sM[r] = m_new
                sC[r] = corr
            cuda.syncthreads()
            for y in range(NO):                                  # phase 3: O = O * corr + P V
                e = t + THREADS * y
                if e < BR * D:
                    r, x = e // D, e % D
                    a = acc[y] * sC[r]
                    for c in range(BC):
                        a += sS[r, c] * sKV[c, x]
                    acc[y] = a
        cuda.syncthreads()
        if sinks:                                                # the sink joins l, with no value row
            for r in range(t, BR, THREADS):
                sk = sink[min(h, sink.shape[0] - 1)]
                m_new = max(sM[r], sk)
                sC[r] = math.exp(sM[r] - m_new)
                sL[r] = sL[r] * sC[r] + math.exp(sk - m_new)
                sM[r] = m_new
            cuda.syncthreads()
        for y in range(NO):
            e = t + THREADS * y
            if e < BR * D:
                r, x = e // D, e % D
                i = row0 + r
                if i < Nq:
                    l = sL[r]
                    a = acc[y] * sC[r] if sinks else acc[y]
                    out[b, h, i, x] = a / l if l != 0 else f32(0.0)   # NaN is not a dead row: only l == 0 is
        for r in range(t, BR, THREADS):
            i = row0 + r
            if i < Nq:
                lse[b, h, i] = sM[r] + math.log(sL[r]) if sL[r] != 0 else -math.inf

    return fwd


@functools.lru_cache(maxsize=None)
def fa1_forward_kernel(D: int, BR: int, BC: int, THREADS: int, rounds: int, score_key=None, mask_key=None):
    visible, keep_factor = make_mask_helpers(rounds)
    score, _, mask = make_mod_helpers(score_key, mask_key)
    sinks = score_key is not None and score_key[3]
    LD, LDS = D + 1, BC + 1
    NS = -(-BR * BC // THREADS)

    @kernel_decorator(score_key, mask_key)
    def fwd(q, k, v, out, M, L, lse, tiles, scale, group, band_lo, band_hi, layout, layout_heads, bq, bk,
            threshold, inv_keep, seed_lo, seed_hi, offset, s0, s1, s2, s3, m0, m1, m2, m3, sink):
        # out zeroed, M = -inf, L = 0 on entry; one block per (batch, head)
        sQ = cuda.shared.array((BR, LD), np.float32)
        sK = cuda.shared.array((BC, LD), np.float32)
        sV = cuda.shared.array((BC, LD), np.float32)
        sS = cuda.shared.array((BR, LDS), np.float32)
        sA = cuda.shared.array(BR, np.float32)                  # O_i <- A O_i + Bt (P~ V_j)
        sB = cuda.shared.array(BR, np.float32)
        t = cuda.threadIdx.x
        bh = cuda.blockIdx.y
        H, Nq, Nk = q.shape[1], q.shape[2], k.shape[2]
        b, h = bh // H, bh % H
        hk = h // group
        tb = 0 if tiles.shape[0] == 1 else b
        th = 0 if tiles.shape[1] == 1 else h
        for tc in range(tiles.shape[3]):                         # outer: K_j, V_j
            col0 = tc * BC
            loaded = False
            for tr in range(tiles.shape[2]):                     # inner: Q_i, O_i, l_i, m_i
                cls = tiles[tb, th, tr, tc]
                if cls == 0:
                    continue
                row0 = tr * BR
                cuda.syncthreads()
                if not loaded:
                    for e in range(t, BC * D, THREADS):
                        c, x = e // D, e % D
                        sK[c, x] = k[b, hk, col0 + c, x] if col0 + c < Nk else f32(0.0)
                        sV[c, x] = v[b, hk, col0 + c, x] if col0 + c < Nk else f32(0.0)
                    loaded = True
                for e in range(t, BR * D, THREADS):
                    r, x = e // D, e % D
                    sQ[r, x] = q[b, h, row0 + r, x] if row0 + r < Nq else f32(0.0)
                cuda.syncthreads()
                for y in range(NS):
                    e = t + THREADS * y
                    if e < BR * BC:
                        r, c = e // BC, e % BC
                        s = f32(0.0)
                        for x in range(D):
                            s += sQ[r, x] * sK[c, x]
                        i, j = row0 + r, col0 + c
                        ok = i < Nq and j < Nk and (cls == 1 or (visible(h, i, j, band_lo, band_hi, layout, layout_heads,
                                                                           bq, bk) and mask(b, h, i, j, m0, m1, m2, m3)))
                        sS[r, c] = score(s * scale, b, h, i, j, s0, s1, s2, s3) if ok else -math.inf
                cuda.syncthreads()
                for r in range(t, BR, THREADS):                  # m~, P~, l~ and the HBM statistics
                    i = row0 + r
                    mt = -math.inf
                    for c in range(BC):                      # a NaN max (max() drops NaN): not a dead row
                        mt = sS[r, c] if sS[r, c] > mt or sS[r, c] != sS[r, c] else mt
                    if i >= Nq or mt == -math.inf:               # nothing visible: O_i unchanged
                        sA[r] = 1.0
                        sB[r] = 0.0
                        continue
                    lt = f32(0.0)
                    for c in range(BC):
                        p = math.exp(sS[r, c] - mt)
                        lt += p
                        if threshold != 0 and p != 0:
                            p *= keep_factor(bh, i, col0 + c, threshold, inv_keep, seed_lo, seed_hi, offset)
                        sS[r, c] = p
                    m_old, l_old = M[b, h, i], L[b, h, i]
                    m_new = max(m_old, mt)
                    a, bt = math.exp(m_old - m_new), math.exp(mt - m_new)
                    l_new = a * l_old + bt * lt
                    sA[r] = l_old * a / l_new
                    sB[r] = bt / l_new
                    M[b, h, i] = m_new
                    L[b, h, i] = l_new
                cuda.syncthreads()
                for e in range(t, BR * D, THREADS):              # O_i <- HBM, update, -> HBM
                    r, x = e // D, e % D
                    i = row0 + r
                    if i < Nq and sB[r] != 0:
                        pv = f32(0.0)
                        for c in range(BC):
                            pv += sS[r, c] * sV[c, x]
                        out[b, h, i, x] = sA[r] * out[b, h, i, x] + sB[r] * pv
        cuda.syncthreads()
        for i in range(t, Nq, THREADS):
            if sinks:                                            # the sink joins L; O_i shrinks by L / L_new
                sk = sink[min(h, sink.shape[0] - 1)]
                m_new = max(M[b, h, i], sk)
                l_old = L[b, h, i] * math.exp(M[b, h, i] - m_new)
                l_new = l_old + math.exp(sk - m_new)
                for x in range(D):
                    out[b, h, i, x] = out[b, h, i, x] * (l_old / l_new)
                M[b, h, i] = m_new
                L[b, h, i] = l_new
            lse[b, h, i] = M[b, h, i] + math.log(L[b, h, i]) if L[b, h, i] != 0 else -math.inf   # NaN: not dead

    return fwd


@functools.lru_cache(maxsize=None)
def fa2_backward_kernels(D: int, BR: int, BC: int, THREADS: int, rounds: int, score_key=None, mask_key=None):
    visible, keep_factor = make_mask_helpers(rounds)
    score, score_grad, mask = make_mod_helpers(score_key, mask_key)
    LD, LDS = D + 1, BC + 1
    NS, NKV = -(-BR * BC // THREADS), -(-BC * D // THREADS)

    @nb.kernel
    def preprocess(dout, out, Dv):
        # D_i = dO_i . O_i, one thread per row
        t = cuda.grid(1)
        B, H, Nq = out.shape[0], out.shape[1], out.shape[2]
        if t < B * H * Nq:
            i, bh = t % Nq, t // Nq
            b, h = bh // H, bh % H
            a = f32(0.0)
            for x in range(D):
                a += dout[b, h, i, x] * out[b, h, i, x]
            Dv[b, h, i] = a

    @kernel_decorator(score_key, mask_key)
    def dkdv(q, k, v, dout, lse, Dv, dq, dk, dv, tiles, scale, group, band_lo, band_hi, layout,
             layout_heads, bq, bk, threshold, inv_keep, seed_lo, seed_hi, offset,
             s0, s1, s2, s3, m0, m1, m2, m3, sink):
        # dq zeroed on entry; one block per (K/V tile, batch * K/V head)
        sK = cuda.shared.array((BC, LD), np.float32)
        sV = cuda.shared.array((BC, LD), np.float32)
        sQ = cuda.shared.array((BR, LD), np.float32)
        sdO = cuda.shared.array((BR, LD), np.float32)
        sP = cuda.shared.array((BR, LDS), np.float32)           # P_drop
        sdS = cuda.shared.array((BR, LDS), np.float32)
        ak = cuda.local.array(NKV, np.float32)
        av = cuda.local.array(NKV, np.float32)
        t = cuda.threadIdx.x
        tc, bhk = cuda.blockIdx.x, cuda.blockIdx.y
        Hkv, Nk = k.shape[1], k.shape[2]
        H, Nq = q.shape[1], q.shape[2]
        b, hk = bhk // Hkv, bhk % Hkv
        col0 = tc * BC
        for e in range(t, BC * D, THREADS):
            c, x = e // D, e % D
            sK[c, x] = k[b, hk, col0 + c, x] if col0 + c < Nk else f32(0.0)
            sV[c, x] = v[b, hk, col0 + c, x] if col0 + c < Nk else f32(0.0)
        for y in range(NKV):
            ak[y] = 0.0
            av[y] = 0.0
        for g in range(group):
            h = hk * group + g
            bh = b * H + h
            tb = 0 if tiles.shape[0] == 1 else b
            th = 0 if tiles.shape[1] == 1 else h
            for tr in range(tiles.shape[2]):
                cls = tiles[tb, th, tr, tc]
                if cls == 0:
                    continue
                row0 = tr * BR
                cuda.syncthreads()
                for e in range(t, BR * D, THREADS):
                    r, x = e // D, e % D
                    ok = row0 + r < Nq
                    sQ[r, x] = q[b, h, row0 + r, x] if ok else f32(0.0)
                    sdO[r, x] = dout[b, h, row0 + r, x] if ok else f32(0.0)
                cuda.syncthreads()
                for y in range(NS):                              # P, dS from the saved logsumexp
                    e = t + THREADS * y
                    if e < BR * BC:
                        r, c = e // BC, e % BC
                        i, j = row0 + r, col0 + c
                        p = f32(0.0)
                        ds = f32(0.0)
                        if i < Nq and j < Nk:
                            Li = lse[b, h, i]
                            if Li != -math.inf and (cls == 1 or (visible(h, i, j, band_lo, band_hi, layout,
                                                                           layout_heads, bq, bk)
                                                                   and mask(b, h, i, j, m0, m1, m2, m3))):
                                s = f32(0.0)
                                dp = f32(0.0)
                                for x in range(D):
                                    s += sQ[r, x] * sK[c, x]
                                    dp += sdO[r, x] * sV[c, x]
                                s *= scale
                                p = math.exp(score(s, b, h, i, j, s0, s1, s2, s3) - Li)
                                z = keep_factor(bh, i, j, threshold, inv_keep, seed_lo, seed_hi, offset)
                                ds = p * (dp * z - Dv[b, h, i]) * score_grad(s, b, h, i, j, s0, s1, s2, s3)
                                p *= z
                        sP[r, c] = p
                        sdS[r, c] = ds
                cuda.syncthreads()
                for y in range(NKV):                             # dV += P_drop^T dO, dK += dS^T Q
                    e = t + THREADS * y
                    if e < BC * D:
                        c, x = e // D, e % D
                        a_v = av[y]
                        a_k = ak[y]
                        for r in range(BR):
                            a_v += sP[r, c] * sdO[r, x]
                            a_k += sdS[r, c] * sQ[r, x]
                        av[y] = a_v
                        ak[y] = a_k
                for e in range(t, BR * D, THREADS):              # dQ += scale * dS K (atomics)
                    r, x = e // D, e % D
                    i = row0 + r
                    if i < Nq:
                        a = f32(0.0)
                        for c in range(BC):
                            a += sdS[r, c] * sK[c, x]
                        if a != 0:
                            cuda.atomic.add(dq, (b, h, i, x), a * scale)
        for y in range(NKV):
            e = t + THREADS * y
            if e < BC * D:
                c, x = e // D, e % D
                if col0 + c < Nk:
                    dk[b, hk, col0 + c, x] = ak[y] * scale
                    dv[b, hk, col0 + c, x] = av[y]

    return preprocess, dkdv


# ---- configs and launch

@dataclass(frozen=True)
class TiledConfig:
    block_r: object          # an int, or "auto": the largest that fits 48 KB at the call's head dim
    block_c: object
    threads: int = 128
    philox_rounds: int = 10

    def resolved(self, d: int, fa1: bool) -> "TiledConfig":
        if self.block_r != "auto" and self.block_c != "auto":
            return self
        brs = (64, 32, 16, 8) if self.block_r == "auto" else (self.block_r,)
        bcs = (32, 16, 8) if self.block_c == "auto" else (self.block_c,)
        fits = [TiledConfig(br, bc, self.threads, self.philox_rounds) for br in brs for bc in bcs]
        fits = [c for c in fits if c.fwd_smem(d, fa1) <= SMEM_STATIC]
        return fits[0] if fits else TiledConfig(brs[-1], bcs[-1], self.threads, self.philox_rounds)

    def fwd_smem(self, d: int, fa1: bool) -> int:
        ld = d + 1
        kv = 2 if fa1 else 1
        return 4 * (self.block_r * ld + kv * self.block_c * ld + self.block_r * (self.block_c + 1) + 3 * self.block_r)

    def bwd_smem(self, d: int, br: int, bc: int) -> int:
        return 4 * (2 * bc * (d + 1) + 2 * br * (d + 1) + 2 * br * (bc + 1))


def bwd_tiles(d: int) -> tuple[int, int]:
    """(Br, Bc) of the Numba FA2 backward: the largest that keeps six tiles under 48 KB."""
    for br, bc in ((32, 32), (16, 32), (16, 16), (8, 8)):
        if TiledConfig(br, bc).bwd_smem(d, br, bc) <= SMEM_STATIC:
            return br, bc
    return 8, 8


class NumbaTiled:
    def __init__(self, name: str, fa1: bool):
        self.name, self.fa1 = name, fa1

    def configure(self, block_r="auto", block_c="auto", threads=128, philox_rounds=10):
        return TiledConfig(block_r, block_c, threads, philox_rounds)

    def to_backend(self, x, name="array"):
        return nb.to_backend(x, name)

    # small tiles keep the simulator quick (each simulated thread is a Python thread)
    SIMULATOR_PARAMS = {"block_r": 8, "block_c": 8, "threads": 32}

    def check(self, problem, config, direction):
        config = config.resolved(problem.d, self.fa1)
        smem = config.fwd_smem(problem.d, self.fa1)
        if smem > SMEM_STATIC:
            raise ValueError(f"variant {self.name!r} with {config}: head dim {problem.d} needs {smem} B of static "
                             f"shared memory (> {SMEM_STATIC} B in Numba): lower block_r or block_c")

    def _tiles(self, p, br, bc):
        """The 4-D tile table [Tb, Th, nr, nc]. Without a mask modifier, on a GPU, the device copy cached
        by content (sandbox.launch.tile_table), so a repeated call uploads nothing (no host wait, and
        nothing to copy inside a CUDA-graph capture). With one, the exact classification including the
        modifier (cached on the host per mask and shape; uploaded per call)."""
        if p.mask_mod is not None:     # a writable copy: the simulator copies kernel arguments back
            tiles = classify_tiles_mod(p.mask_mod, p.B, p.Hq, p.Nq, p.Nk, br, bc, p.band, p.block_mask)
            return nb.asarray(np.array(tiles))
        if nb.SIMULATOR:
            return classify_tiles(p.Nq, p.Nk, br, bc, p.band, p.block_mask)[None]
        import cupy
        return tile_table(p, br, bc, cupy)[0][None]

    def forward(self, p, q, k, v, config):
        c = config.resolved(p.d, self.fa1)
        out = nb.empty((p.B, p.Hq, p.Nq, p.d), np.float32)
        lse = nb.empty((p.B, p.Hq, p.Nq), np.float32)
        tiles = self._tiles(p, c.block_r, c.block_c)
        if self.fa1:
            out = nb.zeros((p.B, p.Hq, p.Nq, p.d), np.float32)
            M = nb.full((p.B, p.Hq, p.Nq), -np.inf, np.float32)
            L = nb.zeros((p.B, p.Hq, p.Nq), np.float32)
            kernel = fa1_forward_kernel(p.d, c.block_r, c.block_c, c.threads, c.philox_rounds, *mod_keys(p))
            nb.launch(kernel, (1, p.B * p.Hq), c.threads, q, k, v, out, M, L, lse, tiles, *_common_args(p))
        else:
            kernel = fa2_forward_kernel(p.d, c.block_r, c.block_c, c.threads, c.philox_rounds, *mod_keys(p))
            nb.launch(kernel, (-(-p.Nq // c.block_r), p.B * p.Hq), c.threads, q, k, v, out, lse, tiles, *_common_args(p))
        return out, lse

    def backward(self, p, dout, q, k, v, out, lse, config):
        c = config
        explicit = isinstance(c.block_r, int) and isinstance(c.block_c, int)
        br, bc = (c.block_r, c.block_c) if explicit and c.bwd_smem(p.d, c.block_r, c.block_c) <= SMEM_STATIC \
            else bwd_tiles(p.d)
        threads = min(config.threads, 128)
        preprocess, dkdv = fa2_backward_kernels(p.d, br, bc, threads, config.philox_rounds, *mod_keys(p))
        Dv = nb.empty((p.B, p.Hq, p.Nq), np.float32)
        n = p.B * p.Hq * p.Nq
        nb.launch(preprocess, (-(-n // 128),), 128, dout, out, Dv)
        dq = nb.zeros((p.B, p.Hq, p.Nq, p.d), np.float32)
        dk = nb.empty((p.B, p.Hkv, p.Nk, p.d), np.float32)
        dv = nb.empty((p.B, p.Hkv, p.Nk, p.d), np.float32)
        tiles = self._tiles(p, br, bc)
        nb.launch(dkdv, (-(-p.Nk // bc), p.B * p.Hkv), threads, q, k, v, dout, lse, Dv, dq, dk, dv, tiles, *_common_args(p))
        return dq, dk, dv


def _params():
    return (
        Param("block_r", ("auto", 8, 16, 32, 64), "auto", "Br: query rows per tile (auto: largest within 48 KB)"),
        Param("block_c", ("auto", 8, 16, 32, 64), "auto", "Bc: keys per tile (auto: largest within 48 KB)"),
        Param("threads", (32, 64, 128, 256), 128, "threads per block"),
        philox_rounds_param(),
    )


register(Variant(
    name="numba-fa2", family="fa2", backend="numba",
    description="FA2 tiled in Numba: Q-outer tiles, deferred rescaling; column-parallel backward, atomic dQ",
    impl=NumbaTiled("numba-fa2", fa1=False), params=_params(),
    caps=Capabilities(dtypes=("float32",), head_dims=tuple(range(1, 129)), score_mod=True, mask_mod=True),
    seed_ref="FA2 paper Algorithms 1 and 2",
    tags=("exact-ladder",)))

register(Variant(
    name="numba-fa1", family="fa1", backend="numba",
    description="FA1 tiled in Numba: K/V-outer tiles, O/l/m through HBM each step (backward: numba-fa2's)",
    impl=NumbaTiled("numba-fa1", fa1=True), params=_params(),
    caps=Capabilities(dtypes=("float32",), head_dims=tuple(range(1, 129)), score_mod=True, mask_mod=True),
    seed_ref="FA1 paper Algorithm 1 (forward); FA2 paper Algorithm 2 (backward)",
    tags=("exact-ladder",)))
