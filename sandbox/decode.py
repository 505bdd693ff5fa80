"""Decoding against a KV cache, contiguous or paged, with the key range split and merged by
log-sum-exp (split-KV, FlashDecoding), over any registered variant.

    out, lse = sandbox.decode.forward(q, k_cache, v_cache, cache_seqlens, k_new=k1, v_new=v1, num_splits=4)

Layout (the sandbox's (B, H, N, d) convention):
  q          (B, Hq, Nq, d): the new query rows of each sequence (decoding: 1-16)
  k_cache    contiguous: (B, Hkv, Nmax, d); paged: (num_pages, Hkv, page_size, d) with
             block_table (B, pages per sequence) of page indices (pages of sequence b in order)
  cache_seqlens  host ints (B,): keys already in the cache for each sequence
  k_new, v_new   (B, Hkv, Nnew, d) or None: appended in place at positions cache_seqlens[b]..
                 (the cache must have room), then attended to like the rest
Sequence b attends to its L_b = cache_seqlens[b] + Nnew keys; with causal=True its Nq queries are
the last Nq positions (query i sees keys j <= L_b - Nq + i, flash-attn's bottom-right alignment).
Returns out (B, Hq, Nq, d) like q and lse (B, Hq, Nq) float32.

How: per sequence, the key range [0, L_b) is cut into `num_splits` contiguous chunks; each chunk is
one call of the variant on a view of the cache (a contiguous cache) or on the chunk's pages
gathered into one buffer (a paged cache: a copy per chunk), causal expressed per chunk as a window;
the partial (out, lse) pairs are merged in float32 by log-sum-exp:
    lse = log sum_c exp(lse_c),  out = sum_c exp(lse_c - lse) out_c.
A chunk that a query row cannot see returns lse = -inf for it and weighs nothing. This is the
reference rung: correct for every variant, slow (launches and copies per sequence and chunk). The
fast rung, one kernel that reads pages in place with the splits in its grid, is still to build.
"""
from __future__ import annotations

import numpy as np

from . import api, arrays


def _xp(x):
    kind = arrays.kind_of(x)
    if kind == "torch":
        import torch
        return torch
    return __import__("cupy") if kind == "cupy" else np


def _host_ints(x, name: str, n: int) -> np.ndarray:
    if isinstance(x, (list, tuple, range, np.ndarray)):
        c = np.asarray(x)
    elif arrays.kind_of(x) == "torch" and x.device.type == "cpu":
        c = x.numpy()
    else:
        raise TypeError(f"{name} must be on the host (a list, a NumPy array or a CPU tensor): reading a device "
                        "array would synchronise the device")
    if c.shape != (n,) or not np.issubdtype(c.dtype, np.integer) or np.any(c < 0):
        raise ValueError(f"{name} must hold {n} non-negative ints; got {c!r}")
    return c.astype(np.int64)


def merge(outs, lses):
    """Merge partial attention results over disjoint key sets by log-sum-exp, in float32: outs
    [(..., Nq, d)], lses [(..., Nq)] -> (out, lse); a part with lse = -inf contributes nothing, and a
    row every part saw nothing of keeps out 0, lse -inf."""
    xp = _xp(lses[0])
    ls = [(l.float() if xp.__name__ == "torch" else l.astype(np.float32)) for l in lses]
    m = ls[0]
    for l in ls[1:]:
        m = xp.maximum(m, l)
    finite = xp.isfinite(m)
    m0 = xp.where(finite, m, xp.zeros_like(m))
    weights = [xp.exp(l - m0) for l in ls]          # 0 where a part saw nothing
    total = weights[0]
    for w in weights[1:]:
        total = total + w
    safe = xp.where(total > 0, total, xp.ones_like(total))
    out = None
    for o, w in zip(outs, weights):
        of = o.float() if xp.__name__ == "torch" else o.astype(np.float32)
        part = of * (w / safe)[..., None]
        out = part if out is None else out + part
    dead = xp.where(xp.isnan(total), xp.full_like(m0, np.nan), xp.full_like(m0, -np.inf))   # NaN stays NaN
    lse = xp.where(total > 0, m0 + xp.log(safe), dead)
    return out, lse


def _append(cache, new, b, start, pages, page_size):
    """Write new[b] (Hkv, Nnew, d) at positions start.. of sequence b's keys in the cache, in place."""
    n = new.shape[2]
    if pages is None:
        cache[b, :, start:start + n] = new[b]
        return
    for t in range(n):
        pos = start + t
        cache[int(pages[pos // page_size]), :, pos % page_size] = new[b, :, t]


def _keys(cache, b, c0, c1, pages, page_size):
    """Keys c0..c1-1 of sequence b as a (1, Hkv, c1 - c0, d) array: a view of a contiguous cache,
    the pages gathered (a copy) for a paged one."""
    if pages is None:
        return cache[b:b + 1, :, c0:c1]
    parts = []
    pos = c0
    while pos < c1:
        page, off = int(pages[pos // page_size]), pos % page_size
        take = min(page_size - off, c1 - pos)
        parts.append(cache[page:page + 1, :, off:off + take])
        pos += take
    xp = _xp(cache)
    return xp.cat(parts, dim=2) if xp.__name__ == "torch" else xp.concatenate(parts, axis=2)


def forward(q, k_cache, v_cache, cache_seqlens, block_table=None, k_new=None, v_new=None, causal=False,
            scale=None, num_splits=1, variant=None, **params):
    """(out (B, Hq, Nq, d), lse (B, Hq, Nq) float32); see the module docstring."""
    B, Hq, Nq, d = q.shape
    for name in ("score_mod", "mask_mod"):
        if params.get(name) is not None:
            raise ValueError(f"{name} is not supported by sandbox.decode yet: each split is its own problem, so a "
                             "modifier would see chunk-local key positions (and sinks once per split)")
    if params.get("dropout_p"):
        raise ValueError("dropout_p > 0 is not supported by sandbox.decode: every sequence and split runs as batch 0 "
                         "of its own problem, which is not the RNG contract")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new come together (both or neither)")
    if not isinstance(num_splits, (int, np.integer)) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    lens = _host_ints(cache_seqlens, "cache_seqlens", B)
    nnew = 0 if k_new is None else k_new.shape[2]
    paged = block_table is not None
    table = _host_ints_2d(block_table, B) if paged else None
    page_size = k_cache.shape[2] if paged else None
    capacity = table.shape[1] * page_size if paged else k_cache.shape[2]
    if tuple(k_cache.shape) != tuple(v_cache.shape) or k_cache.shape[-1] != d:
        raise ValueError(f"k_cache and v_cache must share one shape with q's d; got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    Hkv = k_cache.shape[1]
    if k_new is not None:
        for x, nm in ((k_new, "k_new"), (v_new, "v_new")):
            if len(x.shape) != 4 or tuple(x.shape) != (B, Hkv, nnew, d) or x.dtype != k_cache.dtype:
                raise ValueError(f"{nm} must be ({B}, {Hkv}, Nnew, {d}) of the cache's dtype {k_cache.dtype}; got "
                                 f"{tuple(x.shape)} {x.dtype}")
    if not paged and k_cache.shape[0] != B:
        raise ValueError(f"a contiguous cache holds one sequence per batch row: k_cache.shape[0] must be {B}")
    if np.any(lens + nnew > capacity):
        raise ValueError(f"cache_seqlens + new keys exceed the cache's room of {capacity} keys per sequence")
    if paged:
        used = -(-(lens + nnew) // page_size)             # the pages each sequence reads; padding may be anything
        for b in range(B):
            if np.any(table[b, :used[b]] < 0) or np.any(table[b, :used[b]] >= k_cache.shape[0]):
                raise ValueError(f"block_table row {b} holds page indices outside 0..{k_cache.shape[0] - 1} among "
                                 f"its first {used[b]} (the pages its keys use)")
    if scale is None:
        scale = 1.0 / float(np.sqrt(d))
    # every rejection (variant, dtype, head dim, options) before the cache is written
    probe_k = k_cache[:1, :, :1]                         # (1, Hkv, 1, d): dtype, heads and d as every call's
    api.forward_checks(q[:1], probe_k, probe_k, variant=variant, scale=scale, **params)
    outs, lses = [], []
    for b in range(B):
        pages = table[b] if paged else None
        if nnew:
            _append(k_cache, k_new, b, int(lens[b]), pages, page_size)
            _append(v_cache, v_new, b, int(lens[b]), pages, page_size)
        L = int(lens[b]) + nnew
        bounds = np.linspace(0, L, min(num_splits, max(L, 1)) + 1).astype(int)
        part_out, part_lse = [], []
        for c0, c1 in zip(bounds[:-1], bounds[1:]):
            if c1 <= c0:
                continue
            # causal within the sequence as a window on the chunk: query i sees j' - i <= shift + (L - c1)
            window = (None, L - int(c1)) if causal else None
            res = api.forward(q[b:b + 1], _keys(k_cache, b, c0, c1, pages, page_size),
                              _keys(v_cache, b, c0, c1, pages, page_size), variant=variant, scale=scale,
                              window=window, **params)
            part_out.append(res.out)
            part_lse.append(res.lse)
        if not part_out:                                 # no keys at all: dead rows
            xp = _xp(q)
            part_out = [xp.zeros_like(q[b:b + 1])]
            part_lse = [xp.full_like(q[b:b + 1, :, :, 0], -np.inf)]
        o, lse = merge(part_out, part_lse)
        outs.append(o)
        lses.append(lse)
    xp = _xp(q)
    cat = (lambda xs: xp.cat(xs, dim=0)) if xp.__name__ == "torch" else (lambda xs: xp.concatenate(xs, axis=0))
    out, lse = cat(outs), cat(lses)
    return (out.to(q.dtype) if xp.__name__ == "torch" else out.astype(q.dtype)), lse


def _host_ints_2d(table, B: int) -> np.ndarray:
    if isinstance(table, (list, tuple, np.ndarray)):
        t = np.asarray(table)
    elif arrays.kind_of(table) == "torch" and table.device.type == "cpu":
        t = table.numpy()
    else:
        raise TypeError("block_table must be on the host (a list, a NumPy array or a CPU tensor)")
    if t.ndim != 2 or t.shape[0] != B or not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"block_table must be ints of shape ({B}, pages per sequence); got {t.dtype} {t.shape}")
    return t.astype(np.int64)
