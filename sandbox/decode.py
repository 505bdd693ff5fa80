"""Decoding against a KV cache, contiguous or paged, with the key range split and merged by
log-sum-exp (split-KV, Flash-Decoding): one kernel for the whole batch on the GPU, or any
registered variant per sequence and split (the reference rung).

    out, lse = sandbox.decode.forward(q, k_cache, v_cache, cache_seqlens, k_new=k1, v_new=v1)

Layout (the sandbox's (B, H, N, d) convention):
  q          (B, Hq, Nq, d): the new query rows of each sequence (decoding: 1-16)
  k_cache    contiguous: (B, Hkv, Nmax, d); paged: (num_pages, Hkv, page_size, d) with
             block_table (B, pages per sequence) of page indices (pages of sequence b in order)
  cache_seqlens  host ints (B,): keys already in the cache for each sequence
  k_new, v_new   (B, Hkv, Nnew, d) or None: appended in place at positions cache_seqlens[b]..
                 (the cache must have room), then attended to like the rest
Sequence b attends to its L_b = cache_seqlens[b] + Nnew keys; with causal=True its Nq queries are
the last Nq positions (query i sees keys j <= L_b - Nq + i, flash-attn's bottom-right alignment);
window=(left, right) (ints or None) keeps keys with -left <= j - (L_b - Nq + i) <= right.
Returns out (B, Hq, Nq, d) like q and lse (B, Hq, Nq) float32.

Two paths, the same semantics (tests/test_decode.py, tests/test_decode_gpu.py):

- The kernel (kernels_cu/decode_splitkv.cu, `splitkv`): CuPy or torch CUDA inputs of float16 /
  bfloat16 with d in KERNEL_HEAD_DIMS, Nq <= KERNEL_MAX_NQ, `variant=None` and no variant
  parameters. Grid (split, K/V head x row tile, batch), or with SANDBOX_DECODE_ORDER=heads (`order`)
  the first two swapped (within 0.5% on the H100): the G query heads of a K/V head times the Nq
  rows are the rows of one tile, so K and V are read once per K/V head (per tile of up to 16 rows);
  pages are read in place through the block table; ragged cache lengths and the table go to the
  device by one asynchronous copy from pinned memory on the caller's stream (no synchronisation;
  equal lengths go by value, so a contiguous call with equal lengths copies nothing); one launch:
  the last block of each sequence and row tile to finish merges the splits (arrival counters kept
  zeroed per stream, sandbox/stream_counters.py; SANDBOX_DECODE_FUSED=0 selects the old split kernel + merge
  kernel). Page sizes: powers of two (ValueError naming page_size otherwise); K/V rows 16-byte
  aligned (ValueError naming the cache otherwise). The number of splits follows from the SM count
  and the longest sequence (`plan_splits`); `num_splits` caps it.
- The reference rung (any other request, or `variant=` given): per sequence, the key range [0, L_b)
  is cut into `num_splits` contiguous chunks; each chunk is one call of the variant on a view of
  the cache (a contiguous cache) or on the chunk's pages gathered into one buffer (a paged cache: a
  copy per chunk), causal and window expressed per chunk as a window; the partial (out, lse) pairs
  are merged in float32 by log-sum-exp:
      lse = log sum_c exp(lse_c),  out = sum_c exp(lse_c - lse) out_c.
  A chunk that a query row cannot see returns lse = -inf for it and weighs nothing. Correct for
  every variant, slow (launches and copies per sequence and chunk).
"""
from __future__ import annotations

import collections
import os

import numpy as np

from . import api, arrays, device, loader, stream_counters
from .masks import UNBOUNDED, Band
from .problem import make_problem


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




# ---- the split-KV kernel (kernels_cu/decode_splitkv.cu)

KERNEL_CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
KERNEL_HEAD_DIMS = (64, 128, 256)
KERNEL_MAX_NQ = 16
ROW_TILES = (4, 8, 16)            # ROWS of decode_splitkv: query rows (G * Nq, GQA packed) per block
PIPES = (1, 0)                    # PIPE of decode_splitkv: 1 the cp.async ring (default), 0 the register path
DEFAULT_PIPE = int(os.environ.get("SANDBOX_DECODE_PIPE", "1"))   # 0: fall back to the register path
DEFAULT_FUSED = int(os.environ.get("SANDBOX_DECODE_FUSED", "1"))  # 0: split kernel + decode_merge (two launches)
L2_POLICIES = ("first", "normal")  # the L2 eviction priority of the streamed K/V (kernel argument evict_first)
# "normal" by default: measured on the H100 (B = 8, Hq 32 / Hkv 8, d = 128, fp16, one run each), 0.373 vs
# 0.384 ms at N = 32k and 2.844 vs 2.868 ms at 256k, and 0.372 vs 0.384 ms at B = 1, 256k (session 4):
# the evict-first hint costs 1-3% where nothing else wants the L2 (bench/results/h200/2026-11-26-session-6.md)
DEFAULT_L2 = os.environ.get("SANDBOX_DECODE_L2", "normal")
GRID_ORDERS = ("splits", "heads")   # which of (splits, row tiles) is the grid's x: the blocks scheduled together
DEFAULT_ORDER = os.environ.get("SANDBOX_DECODE_ORDER", "splits")
WARPS = 4                         # DEC_WARPS: 128 threads per block
LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = 128          # below this a split's fixed cost (q load, block merge, partial write) dominates
MAX_SPLITS = 256
# The plan's two constants, fitted to a sweep of S on the H100 (Nq = 1, Hq 32 / Hkv 8, d = 128, fp16, B 1 / 8 /
# 64, 4k-256k keys; session 11, bench/results/h100/2026-11-26-session-11.md): two resident blocks per SM already
# draw the copy bandwidth, and each extra wave cost ~130-220 keys' worth of streaming in the sweep; the overhead
# constant is set higher, at 512, because that is what picks the fastest measured S at B = 8, 256k (a smaller
# one trades one wave of 4-split blocks for 8 waves of 33). The old plan filled waves of all 4 resident blocks
# with short splits; one wave at 2 per SM with long splits was 1-2% faster wherever the cache is long (B = 8,
# 256k: S = 4, 2.777 ms, against S = 33, 2.843 ms; SDPA flash 2.777 ms in the same run). Batches the sweep did
# not cover (B = 24: S = 11, B = 32: S = 1 at 256k) follow the same model unmeasured.
SPLIT_OVERHEAD_KEYS = 512         # a wave's fixed cost (launch, q, pipeline fill, merge) in keys streamed
SATURATING_BLOCKS_PER_SM = 2      # resident blocks per SM that reach the memory bandwidth
BLOCKS_PER_SM_TARGET = 3          # resident blocks per SM assumed without a compiled kernel to ask (capped at 2)
DEFAULT_SM_COUNT = 132            # an H100 SXM's, for planning without a GPU


def keys_per_iter(d: int, rows: int, pipe: int = 1) -> int:
    """Keys one block consumes per loop iteration (DecodeShape::KEYS_PER_ITER): 4 warps x
    32 / (d / 8) keys per step x UNROLL steps."""
    if pipe and rows < 16:
        unroll = 2
    else:
        unroll = 4 if rows <= 4 else (2 if rows == 8 else 1)
    return WARPS * (32 // (d // 8)) * unroll


def row_tile(rows: int) -> int:
    """ROWS for G * Nq query rows: the smallest tile holding them, else 16 (several tiles)."""
    return next((t for t in ROW_TILES if rows <= t), ROW_TILES[-1])


def plan_splits(B: int, Hkv: int, rows: int, d: int, max_len: int, sm_count: int | None = None,
                num_splits: int | None = None, blocks_per_sm: int | None = None,
                pipe: int = 1) -> tuple[int, int]:
    """(splits S, keys per split `chunk`) for the kernel's grid (S, Hkv * row tiles, B) (or its x and y
    swapped: `splitkv`'s order).

    Decoding is memory-bound: the grid must fill the GPU even when B * Hkv is small (B = 1: 8 blocks
    for 132 SMs without splits), and every wave of resident blocks should be full: blocks of one
    split length finish together, so a last wave of 132 blocks on 396 slots (the old plan at B = 1,
    N = 256k: 528 blocks at 3 per SM) runs the GPU a third full for a third of the time. A wave is
    `wave_blocks_per_sm(blocks_per_sm)` blocks per SM (the compiled kernel's occupancy, at most the 2
    that reach the bandwidth), and S minimises waves x (chunk + SPLIT_OVERHEAD_KEYS), waves = ceil(blocks / slots),
    over 1 .. min(MAX_SPLITS, max_len / MIN_KEYS_PER_SPLIT) (the smallest such S on ties);
    `num_splits`, if given, caps S instead. The chunk is rounded up to a whole number of the block's
    loop iterations and S recomputed from it, so no split is empty for the longest sequence (shorter
    ones leave their last splits empty: lse = -inf, weight 0)."""
    tile = row_tile(rows)
    per_iter = keys_per_iter(d, tile, pipe)
    if max_len <= 0:
        return 1, per_iter

    def shape(s):
        chunk = -(-max_len // max(1, s))
        chunk = -(-chunk // per_iter) * per_iter
        return -(-max_len // chunk), chunk

    base = B * Hkv * -(-rows // tile)
    if num_splits is not None:
        return shape(min(int(num_splits), MAX_SPLITS))
    slots = (sm_count or DEFAULT_SM_COUNT) * wave_blocks_per_sm(blocks_per_sm)
    best = None
    for s in range(1, max(1, min(MAX_SPLITS, max_len // MIN_KEYS_PER_SPLIT)) + 1):
        S, chunk = shape(s)
        cost = -(-base * S // slots) * (chunk + SPLIT_OVERHEAD_KEYS)
        if best is None or cost < best[0]:
            best = (cost, S, chunk)
    return best[1], best[2]


def wave_blocks_per_sm(blocks_per_sm: int | None) -> int:
    """Blocks per SM in one wave of the plan: the resident ones (BLOCKS_PER_SM_TARGET without a kernel to
    ask), at most SATURATING_BLOCKS_PER_SM."""
    return max(1, min(blocks_per_sm or BLOCKS_PER_SM_TARGET, SATURATING_BLOCKS_PER_SM))


def kernel_name(dtype: str, d: int, rows: int, pipe: int = 1) -> str:
    """The instantiation for a row tile and load path: ROWS = 16 has the register path only (its
    cp.async form spills at 255 registers)."""
    pipe = int(pipe) if rows < 16 else 0
    return f"decode_splitkv<{KERNEL_CTYPE[dtype]}, {d}, {rows}, {int(pipe)}>"


def kernel_names(dtype: str, d: int) -> tuple:
    return (tuple(dict.fromkeys(kernel_name(dtype, d, r, p) for p in PIPES for r in ROW_TILES))
            + (f"decode_merge<{KERNEL_CTYPE[dtype]}, {d}>",))


def resident_blocks(kernel) -> int | None:
    """Blocks of 128 threads one SM holds for a compiled kernel, from its registers and static shared
    memory (None if the kernel does not say): registers are allocated per warp in units of 256 out of
    16384 per SM sub-partition, one warp of the block per sub-partition."""
    try:
        regs = int(kernel.num_regs)
        smem = int(kernel.shared_size_bytes)
    except Exception:
        return None
    if regs <= 0:
        return None
    by_regs = 16384 // (-(-regs * 32 // 256) * 256)
    by_smem = (228 * 1024) // (smem + 1024) if smem else 32
    return max(1, min(by_regs, by_smem, 2048 // (WARPS * 32), 32))


def compile_unit(dtype: str, d: int):
    """The module of one dtype and head dim: its three row tiles and its merge (a run compiles only
    the head dims it uses)."""
    from .launch import cuda_options
    return loader.CompileUnit("decode_splitkv.cu", kernel_names(dtype, d), cuda_options(),
                              label=f"decode-splitkv[{dtype}, D={d}]")


def compile_units() -> list:
    """Every kernel instantiation (the compile gate builds each name alone)."""
    return [compile_unit(dt, d) for dt in KERNEL_CTYPE for d in KERNEL_HEAD_DIMS]


def kernel_refusal(dtype: str, d: int, Nq: int) -> str | None:
    """Why the kernel cannot run a problem (dtype, head dim, query rows), or None."""
    if dtype not in KERNEL_CTYPE:
        return f"dtype {dtype} (the kernel takes {', '.join(KERNEL_CTYPE)})"
    if d not in KERNEL_HEAD_DIMS:
        return f"head dim {d} (the kernel takes {', '.join(map(str, KERNEL_HEAD_DIMS))})"
    if Nq > KERNEL_MAX_NQ:
        return f"Nq={Nq} query rows (the kernel takes at most {KERNEL_MAX_NQ})"
    return None


def relative_band(causal: bool, window) -> tuple[int, int]:
    """(lo, hi): key j is visible to query i of a sequence of L keys and Nq queries iff
    lo <= j - i - (L - Nq) <= hi (the band of a 1 x 1 problem: shift 0), clamped like every band."""
    band = Band.from_options(1, 1, causal, window)
    return band.lo, band.hi


def check_kv_alignment(x, name: str) -> None:
    """The kernel loads 16-byte vectors of K and V rows: base and every stride (in elements) of the
    axes with more than one entry must be multiples of 8 elements, d unit-strided."""
    arrays.check_unit_stride_d(x, name)
    strides = arrays.element_strides(x)
    bad = [s for s, n in zip(strides[:-1], x.shape[:-1]) if n > 1 and s % 8]
    if x.data.ptr % 16 or bad:
        raise ValueError(f"{name}: the decode kernel needs 16-byte aligned rows (base address and strides in "
                         f"multiples of 8 elements); got address {x.data.ptr:#x}, element strides {strides}")


_PINNED_IN_FLIGHT: collections.deque = collections.deque()


def _upload_ints(host: np.ndarray, xp):
    """int32 copy of host on the device, by an asynchronous copy from pinned memory on the current
    stream: no synchronisation, unlike a copy from pageable memory. The pinned buffer is held until
    an event after the copy has completed (checked, never waited for). One copy per call: callers
    pack what the kernel reads (lengths and block table) into one array."""
    import cupyx
    while _PINNED_IN_FLIGHT and _PINNED_IN_FLIGHT[0][0].done:
        _PINNED_IN_FLIGHT.popleft()
    src = np.ascontiguousarray(host, dtype=np.int32)
    pinned = cupyx.empty_pinned(src.shape, np.int32)
    pinned[...] = src
    dev = xp.empty(src.shape, dtype=xp.int32)
    stream = xp.cuda.get_current_stream()
    dev.set(pinned, stream=stream)
    event = xp.cuda.Event(block=False, disable_timing=True)
    event.record(stream)
    _PINNED_IN_FLIGHT.append((event, pinned))
    return dev


def _int_dummy(xp):
    from .launch import _cached
    return _cached(("decode-int-dummy",), lambda: xp.zeros(1, dtype=xp.int32), xp)


def launch_plan(B: int, Hq: int, Hkv: int, Nq: int, d: int, dtype: str, max_len: int, num_splits=None, pipe=None):
    """(compile unit, kernel name, splits S, keys per split) of the launch `splitkv` makes for a
    problem: the split plan takes the compiled kernel's occupancy (a GPU is needed)."""
    rows = (Hq // Hkv) * Nq
    tile = row_tile(rows)
    pipe = DEFAULT_PIPE if pipe is None else int(pipe)
    unit = compile_unit(dtype, d)
    name = kernel_name(dtype, d, tile, pipe)
    S, chunk = plan_splits(B, Hkv, rows, d, max_len, device.sm_count(), num_splits,
                           resident_blocks(loader.get_kernel(unit, name)), pipe)
    return unit, name, S, chunk


def splitkv(q, k, v, lens, max_len: int, scale: float, band: tuple, block_table=None, num_splits=None, pipe=None,
            uniform_len=None, fused=None, l2=None, order=None):
    """The kernel on CuPy arrays, on CuPy's current stream: q (B, Hq, Nq, d); k, v the cache
    (contiguous (B, Hkv, Nmax, d) or pages (P, Hkv, page_size, d) with block_table, a device int32
    (B, pages per sequence)); lens a device int32 (B,) of keys per sequence (None with uniform_len),
    max_len their maximum (host); uniform_len: None, or the one length of every sequence (the kernel
    then reads no lens); band as relative_band gives it. Returns (out like q's dtype, lse float32),
    both fresh contiguous CuPy arrays. The caller has validated lengths and page indices. pipe: 1 the
    cp.async ring, 0 the register path (None: DEFAULT_PIPE, the environment's SANDBOX_DECODE_PIPE or
    1). fused: 1 one launch (the last block of each sequence and row tile merges the splits; one split
    writes out directly), 0 the split kernel and decode_merge (None: DEFAULT_FUSED,
    SANDBOX_DECODE_FUSED or 1). l2: the L2 priority of the K/V stream, "first" (evict-first) or
    "normal" (None: DEFAULT_L2, SANDBOX_DECODE_L2 or "normal"). order: the grid's x axis, "splits"
    (blocks that start together are the splits of one K/V head) or "heads" (the K/V heads and row
    tiles of one split: they read the same keys) (None: DEFAULT_ORDER, SANDBOX_DECODE_ORDER)."""
    import cupy as xp
    from .launch import f32, i32, i64, strides4
    B, Hq, Nq, d = q.shape
    Hkv = k.shape[1]
    dtype = str(q.dtype)
    rows = (Hq // Hkv) * Nq
    tile = row_tile(rows)
    pipe = DEFAULT_PIPE if pipe is None else int(pipe)
    fused = DEFAULT_FUSED if fused is None else int(fused)
    if pipe not in PIPES:
        raise ValueError(f"pipe must be one of {PIPES}, got {pipe!r}")
    if fused not in (0, 1):
        raise ValueError(f"fused must be 0 or 1, got {fused!r}")
    l2 = DEFAULT_L2 if l2 is None else l2
    if l2 not in L2_POLICIES:
        raise ValueError(f"l2 must be one of {L2_POLICIES}, got {l2!r}")
    order = DEFAULT_ORDER if order is None else order
    if order not in GRID_ORDERS:
        raise ValueError(f"order must be one of {GRID_ORDERS}, got {order!r}")
    if lens is None and uniform_len is None:
        raise ValueError("splitkv needs lens or uniform_len")
    unit, name, S, chunk = launch_plan(B, Hq, Hkv, Nq, d, dtype, max_len, num_splits, pipe)
    paged = block_table is not None
    ints = _int_dummy(xp) if lens is None else lens                        # never read with uniform_len
    if paged:
        page_size = k.shape[2]
        table, table_stride, num_pages, shift = block_table, block_table.shape[1], k.shape[0], page_size.bit_length() - 1
    else:
        table, table_stride, num_pages, shift = ints, 0, 1, 0                # never read
    tiles = Hkv * -(-rows // tile)
    grid = (tiles, S, B) if order == "heads" else (S, tiles, B)
    out = xp.empty((B, Hq, Nq, d), dtype=q.dtype)
    lse = xp.empty((B, Hq, Nq), dtype=xp.float32)
    if fused and S == 1:                                                     # written directly: no partials
        o_part, lse_part, counters = lse, lse, ints
    else:
        o_part = xp.empty((B, Hq, Nq, S, d), dtype=xp.float32)
        lse_part = xp.empty((B, Hq, Nq, S), dtype=xp.float32)
        counters = stream_counters.zeroed(xp, B * tiles) if fused else ints
    loader.launch(unit, name, grid, (WARPS * 32,),
                  (q, *strides4(q)[:3], k, *strides4(k)[:3], v, *strides4(v)[:3], ints,
                   i32(-1 if uniform_len is None else uniform_len), i32(paged), table, i64(table_stride),
                   i32(num_pages), i32(shift), o_part, lse_part, counters, i32(fused), out, lse, i32(Hq), i32(Hkv),
                   i32(Nq), i32(chunk), f32(scale * LOG2E), i32(band[0]), i32(band[1]), i32(l2 == "first"),
                   i32(order == "heads")))
    if not fused:
        loader.launch(unit, f"decode_merge<{KERNEL_CTYPE[dtype]}, {d}>", (B * Hq * Nq,), (WARPS * 32,),
                      (o_part, lse_part, out, lse, i32(S)))
    return out, lse


def _kernel_path(q, others, variant, params) -> bool:
    """Whether a call takes the kernel: device arrays (CuPy, torch CUDA) of a dtype, head dim and
    query count it runs, no variant named, no variant parameters (the refused options aside).
    others: k_cache, v_cache, k_new, v_new (None where absent); when q is on a GPU, each must be the
    same kind of array on q's device (ValueError naming it): the kernel reads them by pointer there."""
    if variant is not None or any(k not in ("dropout_p", "score_mod", "mask_mod", "seed", "offset") for k in params):
        return False
    kind = arrays.kind_of(q)
    if kind == "torch" and not q.is_cuda or kind not in ("torch", "cupy"):
        return False
    from .precision import dtype_name
    if kernel_refusal(dtype_name(q), q.shape[-1], q.shape[2]) is not None:
        return False
    device = q.device.index if kind == "torch" else q.device.id
    for x, nm in zip(others, ("k_cache", "v_cache", "k_new", "v_new")):
        if x is None:
            continue
        where = (arrays.kind_of(x), x.device.index if arrays.kind_of(x) == "torch" and x.is_cuda else
                 x.device.id if arrays.kind_of(x) == "cupy" else None)
        if where != (kind, device):
            raise ValueError(f"{nm} must be a {kind} array on q's CUDA device {device} (the decode kernel reads it "
                             f"there); got a {where[0]} array on {getattr(x, 'device', 'the host')}")
    return True


def forward(q, k_cache, v_cache, cache_seqlens, block_table=None, k_new=None, v_new=None, causal=False,
            scale=None, num_splits=None, variant=None, window=None, **params):
    """(out (B, Hq, Nq, d), lse (B, Hq, Nq) float32); see the module docstring. num_splits: None
    (automatic: the kernel plans it from the SM count, the reference rung takes one split per 8192
    keys of the longest sequence, at most 8) or an int >= 1 (the kernel: at most that many)."""
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
    if num_splits is not None and (not isinstance(num_splits, (int, np.integer)) or isinstance(num_splits, bool)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be None (automatic) or an int >= 1, got {num_splits!r}")
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
    if np.any(lens + nnew >= 2**29):
        raise ValueError("cache_seqlens + new keys must stay below 2**29 keys per sequence")
    if paged:
        used = -(-(lens + nnew) // page_size)             # the pages each sequence reads; padding may be anything
        for b in range(B):
            if np.any(table[b, :used[b]] < 0) or np.any(table[b, :used[b]] >= k_cache.shape[0]):
                raise ValueError(f"block_table row {b} holds page indices outside 0..{k_cache.shape[0] - 1} among "
                                 f"its first {used[b]} (the pages its keys use)")
    if scale is None:
        scale = 1.0 / float(np.sqrt(d))
    probe_k = k_cache[:1, :, :1]                         # (1, Hkv, 1, d): dtype, heads and d as every call's
    probe_v = v_cache[:1, :, :1]                         # v_cache's dtype checked too (a bf16 V beside fp16 K)
    if _kernel_path(q, (k_cache, v_cache, k_new, v_new), variant, params):
        return _forward_kernel(q, k_cache, v_cache, lens, nnew, table, k_new, v_new, causal, scale, window,
                               num_splits, probe_k, probe_v)
    # every rejection (variant, dtype, head dim, options) before the cache is written
    api.forward_checks(q[:1], probe_k, probe_v, variant=variant, scale=scale, causal=causal, window=window, **params)
    lo, hi = relative_band(causal, window)
    if num_splits is None:                               # one split per 8192 keys of the longest sequence, <= 8
        num_splits = max(1, min(8, int((lens + nnew).max()) // 8192))
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
            res = api.forward(q[b:b + 1], _keys(k_cache, b, c0, c1, pages, page_size),
                              _keys(v_cache, b, c0, c1, pages, page_size), variant=variant, scale=scale,
                              window=_chunk_window(lo, hi, L - int(c1)), **params)
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


def oracle_verdicts(out, lse, q, k, v, dtype: str, causal=False, window=None, scale=None) -> list:
    """[out verdict, lse verdict] of one sequence's result under the tolerance rule (sandbox/tolerance.py),
    as fuzz.check_case compares every variant: out (1, Hq, Nq, d), lse (1, Hq, Nq) on the host, against
    the float64 oracle on the host inputs q (1, Hq, Nq, d) and the sequence's L keys k, v (1, Hkv, L, d);
    16-bit dtypes with the oracle in the same precision as the naive reference (tensor-core tier),
    float32 with the bound of the terms (exact tier)."""
    from . import oracle, tolerance
    kw = dict(causal=causal, window=window, scale=scale)
    refs = oracle.forward(q, k, v, **kw)
    if dtype == "float32":
        naives, terms = (None, None), oracle.term_bounds(np.zeros(np.shape(q)), q, k, v, **kw)
    else:
        naives, terms = oracle.forward(q, k, v, precision=dtype, **kw), {}
    return [tolerance.compare(name, np.asarray(got, np.float64), ref, dtype, naive, name, terms.get(name, 0.0))
            for name, got, ref, naive in zip(("out", "lse"), (out, lse), refs, naives)]


def _chunk_window(lo: int, hi: int, delta: int):
    """The sequence's band (relative_band) as the window of a chunk whose last key is `delta` keys
    before the sequence's end: with the chunk's own bottom-right alignment the band moves by delta."""
    left = None if lo <= -UNBOUNDED else -(lo + delta)
    right = None if hi >= UNBOUNDED else hi + delta
    return None if left is None and right is None else (left, right)


def _forward_kernel(q, k_cache, v_cache, lens, nnew, table, k_new, v_new, causal, scale, window, num_splits,
                    probe_k, probe_v):
    """The kernel path of `forward`: checks (options, page size, alignment) before the append, then
    the append, the uploads and the two launches on the caller's stream."""
    make_problem(q[:1], probe_k, probe_v, causal, scale, 0.0, 0, 0, window)      # dtypes, options' types and ranges
    paged = table is not None
    if paged:
        page_size = k_cache.shape[2]
        if page_size & (page_size - 1) or page_size > 2**20:
            raise ValueError(f"page_size={page_size} (k_cache.shape[1] in flash-attn's layout): the decode kernel "
                             "takes power-of-two page sizes up to 2**20 (16-256 are the usual ones); pass variant= "
                             "for the reference rung, which takes any")
    kind = arrays.kind_of(q)
    band = relative_band(causal, window)
    with arrays.caller_stream(q):
        import cupy as cp
        qb = arrays.to_device(q, "q")
        kb, vb = arrays.to_device(k_cache, "k_cache"), arrays.to_device(v_cache, "v_cache")
        check_kv_alignment(kb, "k_cache")
        check_kv_alignment(vb, "v_cache")
        if nnew:
            for b in range(q.shape[0]):
                pages = table[b] if paged else None
                _append(k_cache, k_new, b, int(lens[b]), pages, k_cache.shape[2] if paged else None)
                _append(v_cache, v_new, b, int(lens[b]), pages, k_cache.shape[2] if paged else None)
        total = lens + nnew
        lens_dev, table_dev, uniform = _device_ints(total, table, lambda a: _upload_ints(a, cp))
        out, lse = splitkv(qb, kb, vb, lens_dev, int(total.max()), scale, band, table_dev, num_splits,
                           uniform_len=uniform)
        return arrays.like(out, kind), arrays.like(lse, kind)


def _device_ints(total: np.ndarray, table, upload):
    """(lens, block table, uniform length) for the kernel, with at most one upload (`upload`: host
    int array -> device int32 copy) per call: equal lengths go by value (uniform_len, no lens array),
    and a paged call's lengths and table share one pinned copy (table padding clipped into int32:
    never read). Each copy is one more operation ahead of the kernel on the caller's stream."""
    uniform = int(total[0]) if total.size and np.all(total == total[0]) else None
    if table is None:
        return (None if uniform is not None else upload(total)), None, uniform
    t = np.clip(table, -1, 2**31 - 1)
    if uniform is not None:
        return None, upload(t), uniform
    both = upload(np.concatenate([total, t.ravel()]))
    B = total.size
    return both[:B], both[B:].reshape(t.shape), None


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
