"""NumPy tile-loop models of the FlashAttention kernels: the same loops, tiles and reductions as
kernels_cu/fa2_exact.cu, in float64, so that CI (no GPU) checks the algorithms themselves (tile
skipping, split-K reductions, online softmax, column-parallel backward) against the oracle.

fa1_forward: FA1 paper Algorithm 1 as kernels_cu/fa1_exact.cu runs it: K/V tiles outer, Q tiles
    inner, O (normalised), l and m read and written back on every step; split-K reduces each step.
fa2_forward: FA2 paper Algorithm 1, with the kernel's warp partitioning (split "q" or "k") and the
    tensor-core kernels' conditional rescaling (FlashAttention-4's: a row's max moves only past a slack).
fa2_backward: FA2 paper Algorithm 2 (column-parallel, dQ accumulated across column blocks); FA1's
    Algorithm 4 is the same loop nest run by one block per head (dQ read-modified-written).
"""
from __future__ import annotations

import numpy as np

from .masks import TILE_EMPTY, Band, classify_tiles, element_mask
from .philox import dropout_mask


def _setup(q, k, v, causal, scale, dropout_p, seed, offset, window, block_mask):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(d) if scale is None else scale
    vis = element_mask(Hq, Nq, Nk, causal, window, block_mask)
    z = (dropout_mask((B, Hq, Nq, Nk), dropout_p, seed, offset) / (1 - dropout_p)) if dropout_p else None
    band = Band.from_options(Nq, Nk, causal, window)
    return q, k, v, B, Hq, Hkv, Nq, Nk, d, scale, vis, z, band


def fa1_forward(q, k, v, block_r=16, block_c=128, split="k", warps=4, causal=False, scale=None,
                dropout_p=0.0, seed=0, offset=0, window=None, block_mask=None):
    q, k, v, B, Hq, Hkv, Nq, Nk, d, scale, vis, z, band = _setup(q, k, v, causal, scale, dropout_p, seed,
                                                                  offset, window, block_mask)
    tiles = classify_tiles(Nq, Nk, block_r, block_c, band, block_mask)
    O = np.zeros((B, Hq, Nq, d)); m_hbm = np.full((B, Hq, Nq), -np.inf); l_hbm = np.zeros((B, Hq, Nq))
    parts = [slice(w * block_c // warps, (w + 1) * block_c // warps) for w in range(warps)] if split == "k" \
        else [slice(0, block_c)]
    for b in range(B):
        for h in range(Hq):                               # one thread block per (batch, head)
            hk = h // (Hq // Hkv)
            for tc in range(-(-Nk // block_c)):           # outer: K_j, V_j
                c0 = tc * block_c
                for tr in range(-(-Nq // block_r)):       # inner: Q_i, O_i, l_i, m_i
                    if tiles[min(h, tiles.shape[0] - 1), tr, tc] == TILE_EMPTY:
                        continue
                    rows = slice(tr * block_r, min((tr + 1) * block_r, Nq))
                    s_parts, mt = [], np.full(rows.stop - rows.start, -np.inf)
                    for part in parts:
                        cols = np.arange(c0 + part.start, min(c0 + part.stop, Nk))
                        s = scale * q[b, h, rows] @ k[b, hk, cols].T
                        s = np.where(vis[min(h, vis.shape[0] - 1), rows][:, cols], s, -np.inf)
                        s_parts.append((cols, s))
                        mt = np.maximum(mt, s.max(axis=1, initial=-np.inf))
                    m_use = np.where(np.isfinite(mt), mt, 0.0)
                    lt, pv = 0.0, 0.0
                    for cols, s in s_parts:               # split-K: partial sums added in warp order
                        p = np.exp(s - m_use[:, None])
                        lt = lt + p.sum(axis=1)
                        pd = p if z is None else p * z[b, h, rows][:, cols]
                        pv = pv + pd @ v[b, hk, cols]
                    live = np.isfinite(mt)                # rows with something visible in this tile
                    m_old, l_old = m_hbm[b, h, rows], l_hbm[b, h, rows]
                    m_new = np.where(live, np.maximum(m_old, mt), m_old)
                    mn = np.where(live, m_new, 0)
                    a = np.exp(np.where(live, m_old, 0) - mn)                      # exp(m_old - m_new)
                    bt = np.where(live, np.exp(m_use - mn), 0)                     # exp(m~ - m_new)
                    l_new = np.where(live, a * l_old + bt * lt, l_old)
                    upd = (l_old * a)[:, None] * O[b, h, rows] + bt[:, None] * pv
                    O[b, h, rows] = np.where(live[:, None], upd / np.where(live, l_new, 1)[:, None], O[b, h, rows])
                    m_hbm[b, h, rows], l_hbm[b, h, rows] = m_new, l_new
    alive = l_hbm > 0
    lse = np.where(alive, m_hbm + np.log(np.where(alive, l_hbm, 1)), -np.inf)
    return O, lse


def fa2_forward(q, k, v, block_r=64, block_c=64, split="q", warps=4, causal=False, scale=None,
                dropout_p=0.0, seed=0, offset=0, window=None, block_mask=None, rescale_slack=8.0, p_max=None):
    """`rescale_slack` (log2 units, kernels_cu/tc_softmax.cuh FA_RESCALE_SLACK): a row keeps its running max
    while a tile's max exceeds it by at most this much (conditional rescaling); 0 updates it on every rise.
    `p_max`, a list, gets the largest P of every tile (at most 2^rescale_slack)."""
    q, k, v, B, Hq, Hkv, Nq, Nk, d, scale, vis, z, band = _setup(q, k, v, causal, scale, dropout_p, seed,
                                                                  offset, window, block_mask)
    tiles = classify_tiles(Nq, Nk, block_r, block_c, band, block_mask)
    out = np.zeros((B, Hq, Nq, d)); lse = np.full((B, Hq, Nq), -np.inf)
    # split-K: warp w sees keys [w*Bc/W, (w+1)*Bc/W) of each tile; split-Q: one "warp" sees all.
    parts = [slice(w * block_c // warps, (w + 1) * block_c // warps) for w in range(warps)] if split == "k" \
        else [slice(0, block_c)]
    for b in range(B):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for tr in range(-(-Nq // block_r)):
                rows = slice(tr * block_r, min((tr + 1) * block_r, Nq))
                n = rows.stop - rows.start
                m = np.full(n, -np.inf); l = [np.zeros(n) for _ in parts]; acc = [np.zeros((n, d)) for _ in parts]
                for tc in range(-(-Nk // block_c)):
                    if tiles[min(h, tiles.shape[0] - 1), tr, tc] == TILE_EMPTY:
                        continue
                    c0 = tc * block_c
                    s_parts, mx = [], np.full(n, -np.inf)
                    for part in parts:
                        cols = np.arange(c0 + part.start, min(c0 + part.stop, Nk))
                        s = scale * q[b, h, rows] @ k[b, hk, cols].T
                        s = np.where(vis[min(h, vis.shape[0] - 1), rows][:, cols], s, -np.inf)
                        s_parts.append((cols, s))
                        mx = np.maximum(mx, s.max(axis=1, initial=-np.inf))   # warps agree on the max
                    m_new = np.maximum(m, mx)
                    with np.errstate(invalid="ignore"):      # -inf - -inf: a row with nothing visible yet
                        m_new = np.where(m_new - m <= rescale_slack * np.log(2.0), m, m_new)
                    m_use = np.where(np.isfinite(m_new), m_new, 0.0)
                    corr = np.exp(m - m_use)
                    for w, (cols, s) in enumerate(s_parts):
                        p = np.exp(s - m_use[:, None])
                        if p_max is not None and p.size:
                            p_max.append(p.max())
                        l[w] = l[w] * corr + p.sum(axis=1)
                        pd = p if z is None else p * z[b, h, rows][:, cols]
                        acc[w] = acc[w] * corr[:, None] + pd @ v[b, hk, cols]
                    m = m_new
                l_tot, acc_tot = sum(l), sum(acc)           # split-K: the end-of-loop reduction
                alive = l_tot > 0
                out[b, h, rows] = np.where(alive[:, None], acc_tot / np.where(alive, l_tot, 1)[:, None], 0)
                lse[b, h, rows] = np.where(alive, m + np.log(np.where(alive, l_tot, 1)), -np.inf)
    return out, lse


def fa2_backward(dout, q, k, v, block_r=64, block_c=64, causal=False, scale=None, dropout_p=0.0, seed=0,
                 offset=0, window=None, block_mask=None):
    q, k, v, B, Hq, Hkv, Nq, Nk, d, scale, vis, z, band = _setup(q, k, v, causal, scale, dropout_p, seed,
                                                                  offset, window, block_mask)
    out, lse = fa2_forward(q, k, v, block_r, block_c, "q", 1, causal, scale, dropout_p, seed, offset, window,
                           block_mask)
    dout = np.asarray(dout, np.float64)
    D = np.sum(dout * out, axis=-1)                     # preprocessing
    tiles = classify_tiles(Nq, Nk, block_r, block_c, band, block_mask)
    g = Hq // Hkv
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(B):
        for hk in range(Hkv):
            for tc in range(-(-Nk // block_c)):         # one thread block per K/V tile
                cols = slice(tc * block_c, min((tc + 1) * block_c, Nk))
                for h in range(hk * g, (hk + 1) * g):
                    for tr in range(-(-Nq // block_r)):
                        if tiles[min(h, tiles.shape[0] - 1), tr, tc] == TILE_EMPTY:
                            continue
                        rows = slice(tr * block_r, min((tr + 1) * block_r, Nq))
                        s = scale * q[b, h, rows] @ k[b, hk, cols].T
                        L = lse[b, h, rows][:, None]
                        ok = vis[min(h, vis.shape[0] - 1), rows][:, cols] & np.isfinite(L)
                        p = np.where(ok, np.exp(np.where(ok, s - np.where(np.isfinite(L), L, 0), -np.inf)), 0)
                        zz = 1.0 if z is None else z[b, h, rows][:, cols]
                        dv[b, hk, cols] += (p * zz).T @ dout[b, h, rows]
                        dp = dout[b, h, rows] @ v[b, hk, cols].T * zz
                        ds = p * (dp - D[b, h, rows][:, None])
                        dk[b, hk, cols] += scale * ds.T @ q[b, h, rows]
                        dq[b, h, rows] += scale * ds @ k[b, hk, cols]      # the kernel's atomic add
    return dq, dk, dv
