"""Variable-length (packed) batches in flash-attn's varlen convention, over any registered variant.

    out, lse = sandbox.varlen.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, variant="fa2-tc", causal=True)
    dq, dk, dv = sandbox.varlen.backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal=True)
    out = sandbox.torch.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True)   # autograd

Layout: q (total_q, Hq, d), k and v (total_k, Hkv, d), the S sequences packed one after another;
cu_seqlens_q / cu_seqlens_k: S + 1 non-decreasing offsets from 0 to total (sequence s is rows
cu[s] .. cu[s + 1] - 1); out like q; lse (Hq, total_q) float32 (flash-attn 2's varlen layout).
Every option means what it means for one sequence of the batch API (sandbox.api): causal and window
apply within each sequence, bottom-right aligned where its query and key lengths differ, as in
flash-attn; a query row whose sequence has no keys is a dead row (out 0, lse -inf).

How, two paths:
- single launch (fa2-tc's forward, variants/fa2_tc.py forward_varlen, kernels_cu/fa2_tc.cu FA_VARLEN):
  taken where the variant's impl has that kernel (`varlen_forward`: fa2-tc and fa2-tc-deterministic,
  or variant=None, whose default for fp16 / bf16 is fa2-tc up to d = 128, `default_variant`) and the inputs are CUDA fp16 / bf16 of
  a head dim the kernel takes (a multiple of 8 up to 128), without block_mask. The packed arrays are
  read in place; a host table maps each thread block to (sequence, Q tile), longest band first, and
  carries each sequence's offsets, lengths and band; it goes to the device by one asynchronous copy
  from pinned memory on the caller's stream (no synchronisation). One launch, whatever the number of
  sequences.
- per sequence (every other case, and the reference rung): one call of the chosen variant per
  sequence, on zero-copy (1, H, n, d) views of the packed arrays (the kernels take any strides with
  unit stride along d), results copied into the packed outputs, every launch on the caller's stream.
  The host cost and the launches grow with the number of sequences. `single_launch=False` forces it.
The backward: packed self-attention with its offsets on the GPU (cu_seqlens_q and cu_seqlens_k one contiguous
int32 / int64 array, as flash-attn's callers pass them for it, and as many q rows as k rows) with a CUDA C variant
is one backward over the packed rows under a document mask made on the device (`_backward_document`: no wait); every other call is per sequence (the explicit-form backward of each
sequence with its rows of out and lse: the single launch's out and lse are the same arrays, laid out the same).
cu_seqlens on the host (lists, NumPy arrays, CPU tensors) are checked there (from 0 to the packed length,
non-decreasing, max_seqlen at least the longest). On the GPU (int32 / int64, as flash-attn's callers keep
them), with max_seqlen_q given, the single-launch forward reads them in place and never waits: a small kernel
(fa2_varlen_seqs) makes the sequence table on the device, and the block table holds every sequence's Q tiles
of max_seqlen_q rows, the blocks past a shorter sequence's rows returning at once. Their values cannot be
checked on the host without a wait, so that kernel checks them per sequence (a sequence whose query
offsets decrease, leave the packed array or reach back into an earlier sequence gets no rows; key offsets
are clamped into the array) and sets to NaN the rows no block writes (such a sequence's, those of a
sequence longer than max_seqlen_q, those outside cu_seqlens_q[0] .. cu_seqlens_q[-1]): every output row
is a valid sequence's result or NaN, so a broken contract shows, and nothing is read or written outside
the arrays. Every other use of GPU offsets (the per-sequence path, the backward of different offsets) copies them to the host,
which waits for the caller's stream.

Known gap: dropout. The RNG contract keys an element by (batch, head, row, column) with the batch
index being the sequence index; a per-sequence call is batch 0 of its own problem, so it would
replay another sequence's mask. dropout_p > 0 is refused with a ValueError.
"""
from __future__ import annotations

import functools

import numpy as np

from . import api, arrays
from .precision import dtype_name

SINGLE_LAUNCH_DTYPES = ("float16", "bfloat16")   # the packed-sequence kernel's envelope (fa2-tc's)
SINGLE_LAUNCH_MAX_D = 128
SEQ_INTS = 6                  # VL_SEQ_INTS of kernels_cu/fa2_tc.cu: q offset, Nq, k offset, Nk, band lo, band hi
INT32_MAX = 2 ** 31 - 1


def on_device(cu) -> bool:
    """Whether offsets are a GPU array (a CUDA tensor or a CuPy array), as flash-attn's callers keep them."""
    if isinstance(cu, (list, tuple, range, np.ndarray)):
        return False
    kind = arrays.kind_of(cu)
    return kind == "cupy" or (kind == "torch" and cu.device.type != "cpu")


def _lengths(cu, name: str, total: int) -> np.ndarray:
    """Host int64 offsets, checked: 1-D, starts at 0, non-decreasing, ends at `total`. Offsets on the GPU are
    copied to the host: a copy that waits for the work queued on the current stream (module docstring)."""
    if isinstance(cu, (list, tuple, range, np.ndarray)):
        c = np.asarray(cu)
    else:
        kind = arrays.kind_of(cu)
        if kind == "torch":
            c = cu.detach().cpu().numpy()
        elif kind == "cupy":
            c = cu.get()
        else:
            raise TypeError(f"{name} must be a list, a NumPy array, a tensor or a CuPy array of S + 1 offsets; got "
                            f"{type(cu).__name__}")
    if c.ndim != 1 or c.size < 2 or not np.issubdtype(c.dtype, np.integer):
        raise TypeError(f"{name} must be a 1-D integer sequence of S + 1 >= 2 offsets; got dtype {c.dtype}, "
                        f"shape {c.shape}")
    c = c.astype(np.int64)
    if c[0] != 0 or np.any(np.diff(c) < 0) or c[-1] != total:
        raise ValueError(f"{name} must rise from 0 to the packed length {total} without decreasing; got "
                         f"{c[:8].tolist()}{' ...' if c.size > 8 else ''} ending at {int(c[-1])}")
    return c


def _check(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, score_mod=None, mask_mod=None):
    _check_arrays(q, k, v, dropout_p, score_mod, mask_mod)
    lq, lk = _lengths(cu_q, "cu_seqlens_q", q.shape[0]), _lengths(cu_k, "cu_seqlens_k", k.shape[0])
    if lq.size != lk.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences; got {lq.size - 1} and "
                         f"{lk.size - 1}")
    for got, given, nm in ((np.diff(lq).max(), max_q, "max_seqlen_q"), (np.diff(lk).max(), max_k, "max_seqlen_k")):
        if given is not None and (not isinstance(given, (int, np.integer)) or given < got):
            raise ValueError(f"{nm}={given!r} is below the longest sequence ({int(got)}) or not an int")
    return lq, lk


def _check_device_offsets(cu_q, cu_k, max_q, max_k):
    """What the host can check of offsets on the GPU without reading them (their values stay unread here: the
    packed-sequence kernel checks them per sequence, fa2_varlen_seqs): contiguous 1-D int32 / int64 arrays of the
    same S + 1 >= 2 entries, and max_seqlen_q / max_seqlen_k non-negative ints."""
    from .precision import dtype_name
    for cu, nm in ((cu_q, "cu_seqlens_q"), (cu_k, "cu_seqlens_k")):
        if len(cu.shape) != 1 or cu.shape[0] < 2 or dtype_name(cu) not in ("int32", "int64"):
            raise TypeError(f"{nm} must be a 1-D int32 or int64 array of S + 1 >= 2 offsets; got {dtype_name(cu)}, "
                            f"shape {tuple(cu.shape)}")
        if arrays.element_strides(cu)[0] != 1 if arrays.kind_of(cu) == "cupy" else cu.stride(0) != 1:
            raise ValueError(f"{nm} on the GPU must be contiguous (the kernel reads it in place); got a strided "
                             "view: pass .contiguous()")
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences; got {cu_q.shape[0] - 1} "
                         f"and {cu_k.shape[0] - 1}")
    for given, nm in ((max_q, "max_seqlen_q"), (max_k, "max_seqlen_k")):
        if given is not None and (isinstance(given, bool) or not isinstance(given, (int, np.integer)) or given < 0):
            raise ValueError(f"{nm}={given!r} must be a non-negative int")


def _check_arrays(q, k, v, dropout_p, score_mod=None, mask_mod=None):
    for x, nm in ((q, "q"), (k, "k"), (v, "v")):
        if len(x.shape) != 3:
            raise ValueError(f"{nm} must be packed (total, heads, d); got shape {tuple(x.shape)}")
    if tuple(k.shape) != tuple(v.shape) or k.shape[2] != q.shape[2]:
        raise ValueError(f"k and v must share one shape (total_k, Hkv, d) with q's d; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    for x, nm in ((k, "k"), (v, "v")):
        if dtype_name(x) != dtype_name(q):
            raise TypeError(f"{nm} must have q's dtype {dtype_name(q)}; got {dtype_name(x)}")
    if dropout_p:
        raise ValueError("dropout_p > 0 is not supported for packed batches yet: the RNG contract keys each element by "
                         "its sequence index, which a per-sequence launch does not carry (sandbox/varlen.py)")
    for name, value in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if value is not None:
            raise ValueError(f"{name} is not supported for packed batches yet: a modifier would see positions "
                             "within each sequence, and a sequence without keys would miss its sinks")


def _view(x, a: int, b: int):
    """Rows a..b-1 of a packed (total, H, d) array as a (1, H, b - a, d) view."""
    if arrays.kind_of(x) == "torch":
        return x[a:b].permute(1, 0, 2).unsqueeze(0)
    return x[a:b].transpose(1, 0, 2)[None]


def _put(dst, a: int, b: int, src) -> None:
    """Packed rows a..b-1 of dst (total, H, d) <- src (1, H, b - a, d)."""
    if arrays.kind_of(dst) == "torch":
        dst[a:b].copy_(src[0].permute(1, 0, 2))
    else:
        dst[a:b] = src[0].transpose(1, 0, 2)


def _empty(like, shape, dtype=None):
    kind = arrays.kind_of(like)
    if kind == "torch":
        import torch
        return torch.empty(shape, dtype=like.dtype if dtype is None else getattr(torch, dtype), device=like.device)
    xp = __import__("cupy") if kind == "cupy" else np
    return xp.empty(shape, dtype=like.dtype if dtype is None else dtype)


def _fill(x, value) -> None:
    if arrays.kind_of(x) == "torch":
        x.fill_(value)
    else:
        x[...] = value


def default_variant(q, params=None) -> str:
    """variant=None for a packed batch: the dtype's DEFAULT_VARIANTS entry (fa2-tc for fp16 / bf16, whose
    packed-sequence kernel takes the batch in one launch) up to its head dims, past them api.default_variant
    (fa3 on an sm_90 GPU); one name for the forward and the per-sequence backward of a call (the one-call backward
    of packed self-attention takes api.default_variant's: `backward`)."""
    name = api.DEFAULT_VARIANTS.get(dtype_name(q), api.DEFAULT_VARIANT)
    if name == "fa2-tc" and q.shape[-1] > SINGLE_LAUNCH_MAX_D:
        return api.default_variant(q, params)
    return name


def _single_launch_variant(q, k, v, variant, params):
    """The bound variant whose packed-sequence kernel takes this call, or None (the per-sequence path).
    The variant's parameters are checked here as the per-sequence path's api.forward would check them."""
    from .registry import get_variant
    if params.get("block_mask") is not None or any(arrays.kind_of(x) not in ("cupy", "torch") for x in (q, k, v)):
        return None
    if arrays.kind_of(q) == "torch" and not all(x.is_cuda for x in (q, k, v)):
        return None
    if {dtype_name(x) for x in (q, k, v)} - set(SINGLE_LAUNCH_DTYPES) or len({dtype_name(x) for x in (q, k, v)}) > 1:
        return None
    d = q.shape[2]
    if d % 8 or d > SINGLE_LAUNCH_MAX_D or q.shape[1] % k.shape[1]:
        return None
    rest = {key: val for key, val in params.items() if key not in ("block_mask", "seed", "offset")}
    bound = get_variant(variant if variant is not None else default_variant(q, rest), **rest)
    return bound if getattr(bound.variant.impl, "varlen_forward", False) else None


def _same_device(q, *cus) -> bool:
    """Whether the offsets are arrays of q's kind on q's GPU (the device path reads them in place)."""
    kind = arrays.kind_of(q)
    if any(arrays.kind_of(c) != kind for c in cus):
        return False
    if kind == "torch":
        return all(c.device == q.device for c in cus)
    return all(c.device.id == q.device.id for c in cus)


def _forward_single(q, k, v, lq, lk, bound, causal, scale, window):
    """The one-launch forward (module docstring) on the caller's stream: (out, lse) of q's kind."""
    from .decode import _upload_ints
    from .problem import _causal, _scale, _window
    causal, scale, window = _causal(causal), _scale(scale, q.shape[2]), _window(window)
    impl, cfg = bound.variant.impl, bound.config
    block_r, block_c = impl.varlen_tiles(cfg, q.shape[2])        # ValueError outside the config's envelope
    seqs, blocks = tables(lq, lk, block_r, block_c, causal, window)

    def run(qb, kb, vb, cp):
        table = _upload_ints(np.concatenate([seqs.ravel(), blocks.ravel()]), cp)   # one copy, pinned, async
        return impl.forward_varlen(qb, kb, vb, *split_tables(table, seqs.shape, blocks.shape), scale, cfg)
    return _on_callers_stream(q, k, v, run)


def _on_callers_stream(q, k, v, run):
    """run(q, k, v as CuPy views, cupy) -> (out, lse) on the caller's stream; the results in q's array kind."""
    kind = arrays.kind_of(q)
    with arrays.caller_stream(q):
        import cupy
        out, lse = run(*(arrays.to_device(x, nm) for x, nm in ((q, "q"), (k, "k"), (v, "v"))), cupy)
        return arrays.like(out, kind), arrays.like(lse, kind)


def _check_int32_lengths(total_q: int, total_k: int) -> None:
    if max(total_q, total_k) > INT32_MAX:
        raise ValueError(f"packed lengths {total_q} and {total_k}: the packed-sequence kernel's offsets are int32 (at "
                         f"most {INT32_MAX}); pass single_launch=False for the per-sequence path")


def _forward_device(q, k, v, cu_q, cu_k, max_q, bound, causal, scale, window):
    """The one-launch forward with offsets on the GPU, unread on the host (no wait, no upload): both tables are made
    on the device (fa2_varlen_seqs), the block table from S and max_seqlen_q alone: every sequence's Q tiles of
    max_seqlen_q rows, the last tiles of all sequences first (causal's longest rows); the blocks past a sequence's
    rows return at once. A sequence longer than max_seqlen_q (flash-attn's contract broken) gets NaN rows."""
    from .masks import UNBOUNDED, Band
    from .problem import _causal, _scale, _window
    causal, scale, window = _causal(causal), _scale(scale, q.shape[2]), _window(window)
    impl, cfg = bound.variant.impl, bound.config
    block_r, _ = impl.varlen_tiles(cfg, q.shape[2])
    _check_int32_lengths(q.shape[0], k.shape[0])
    # no sequence is longer than the packed batch (the kernel takes no more rows): a max_seqlen_q past it (a bucket
    # size) launches no useless blocks
    S, T = cu_q.shape[0] - 1, -(-min(int(max_q), q.shape[0]) // block_r)
    if S * T > INT32_MAX:
        raise ValueError(f"{S} sequences of up to {min(int(max_q), q.shape[0])} query rows need {S * T} thread blocks, "
                         f"past the grid's limit ({INT32_MAX}); pass single_launch=False")
    rel = Band.from_options(1, 1, causal, window)
    lo, hi = max(rel.lo, -UNBOUNDED), min(rel.hi, UNBOUNDED)

    def run(qb, kb, vb, cp):
        cq, ck = (arrays.to_device(x, nm) for x, nm in ((cu_q, "cu_seqlens_q"), (cu_k, "cu_seqlens_k")))
        if cq.dtype != ck.dtype:      # one offset type for the kernel: the wider one, converted on the stream
            cq, ck = cq.astype(cp.int64), ck.astype(cp.int64)
        return impl.forward_varlen(qb, kb, vb, None, None, scale, cfg, device_offsets=(cq, ck, lo, hi, T))
    return _on_callers_stream(q, k, v, run)


def split_tables(table, seqs_shape, blocks_shape):
    """The sequence and block tables as views of their one uploaded array (seqs then blocks, raveled),
    in their own shapes ([S, SEQ_INTS], [blocks, 2]): forward_varlen launches blocks.shape[0] blocks,
    so a flat block table would launch twice as many, the second half reading past the table."""
    n = int(np.prod(seqs_shape))
    return table[:n].reshape(seqs_shape), table[n:].reshape(blocks_shape)


def tables(lq, lk, block_r: int, block_c: int, causal: bool, window) -> tuple[np.ndarray, np.ndarray]:
    """(sequence table int32 [S, SEQ_INTS], block table int32 [blocks, 2]) of the packed-sequence kernel
    (kernels_cu/fa2_tc.cu, FA_VARLEN).

    Sequence s: its query offset and length, key offset and length (from the host offsets lq, lk, S + 1
    each) and its band: Band.from_options of its own Nq, Nk, i.e. causal and window bottom-right
    aligned per sequence, what the per-sequence path gives each sequence. Blocks: one per (sequence,
    Q tile of block_r rows) of every sequence with queries (none for an empty one; a sequence without
    keys keeps its blocks, which write its dead rows), ordered by the key tiles of block_c columns
    their band reaches, most first (longest first: causal's bottom tiles and the longest sequences
    start early), ties in (sequence, tile) order."""
    from .masks import UNBOUNDED, Band
    lq, lk = np.asarray(lq, np.int64), np.asarray(lk, np.int64)
    _check_int32_lengths(int(lq[-1]), int(lk[-1]))
    nq, nk = np.diff(lq), np.diff(lk)
    rel = Band.from_options(1, 1, causal, window)       # the band at shift 0, moved by each sequence's Nk - Nq
    shift = nk - nq
    lo = np.full(nq.shape, -UNBOUNDED) if rel.lo <= -UNBOUNDED else np.clip(rel.lo + shift, -UNBOUNDED, UNBOUNDED)
    hi = np.full(nq.shape, UNBOUNDED) if rel.hi >= UNBOUNDED else np.clip(rel.hi + shift, -UNBOUNDED, UNBOUNDED)
    seqs = np.stack([lq[:-1], nq, lk[:-1], nk, lo, hi], axis=1).astype(np.int32)
    ntiles = -(-nq // block_r)
    s = np.repeat(np.arange(nq.size), ntiles)
    t = np.arange(s.size) - np.repeat(np.cumsum(ntiles) - ntiles, ntiles)
    r0 = t * block_r
    r1 = np.minimum(r0 + block_r, nq[s]) - 1
    jlo, jhi = np.maximum(0, r0 + lo[s]), np.minimum(nk[s] - 1, r1 + hi[s])
    work = np.where(jlo <= jhi, jhi // block_c - jlo // block_c + 1, 0)
    order = np.argsort(-work, kind="stable")
    return seqs, np.stack([s[order], t[order]], axis=1).astype(np.int32).reshape(-1, 2)


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, variant=None,
            causal=False, scale=None, dropout_p=0.0, window=None, single_launch=True, **params):
    """(out (total_q, Hq, d) like q, lse (Hq, total_q) float32), every sequence through `variant`: by one
    launch where its packed-sequence kernel takes the call (module docstring), else one per sequence;
    single_launch=False: always per sequence (the reference rung)."""
    if scale is None:
        scale = 1.0 / float(np.sqrt(q.shape[2]))       # one scale for every sequence (the head dim's)
    variant_name = default_variant(q, params) if variant is None else variant
    if single_launch and max_seqlen_q is not None and (on_device(cu_seqlens_q) or on_device(cu_seqlens_k)):
        _check_arrays(q, k, v, dropout_p, params.get("score_mod"), params.get("mask_mod"))
        if on_device(cu_seqlens_q) and on_device(cu_seqlens_k):
            _check_device_offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            bound = _single_launch_variant(q, k, v, variant_name, params)
            if bound is not None and _same_device(q, cu_seqlens_q, cu_seqlens_k):
                return _forward_device(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, bound, causal, scale, window)
    lq, lk = _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                    params.get("score_mod"), params.get("mask_mod"))
    variant = variant_name
    bound = _single_launch_variant(q, k, v, variant, params) if single_launch else None
    if bound is not None:
        return _forward_single(q, k, v, lq, lk, bound, causal, scale, window)
    out = _empty(q, tuple(q.shape))
    lse = _empty(q, (q.shape[1], q.shape[0]), "float32")
    for s in range(lq.size - 1):
        a, b, c, e = int(lq[s]), int(lq[s + 1]), int(lk[s]), int(lk[s + 1])
        if a == b:
            continue
        if c == e:                                       # no keys: dead rows
            _fill(out[a:b], 0)
            _fill(lse[:, a:b], -np.inf)
            continue
        res = api.forward(_view(q, a, b), _view(k, c, e), _view(v, c, e), variant=variant, causal=causal,
                          scale=scale, window=window, **params)
        _put(out, a, b, res.out)
        if arrays.kind_of(lse) == "torch":
            lse[:, a:b].copy_(res.lse[0])
        else:
            lse[:, a:b] = res.lse[0]
    return out, lse


def backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
             variant=None, causal=False, scale=None, dropout_p=0.0, window=None, single_launch=True, **params):
    """(dq, dk, dv) like q, k, v, from either forward path's out and lse (the same layout): with one GPU offsets
    array for queries and keys, one backward under a document mask made on the device (no wait; module
    docstring), else the explicit-form backward of each sequence. single_launch=False: always per sequence.
    variant=None: the packed default (default_variant) per sequence; the one-call backward takes api.default_variant's
    (fa3 on an sm_90 GPU, fa2-tc elsewhere for fp16 / bf16)."""
    named = variant
    variant = default_variant(q, params) if variant is None else variant
    if single_launch and dropout_p == 0 and q.shape[0] == k.shape[0] and _one_offsets_array(q, cu_seqlens_q, cu_seqlens_k):
        # one backward call over the packed rows: variant=None means what it means for api.backward (fa3 on an sm_90
        # GPU, whose wgmma backward under the document mask took 34-60% less time than fa2-tc's at 64 x 256 to
        # 4 x 4096, H100, session 16), not the packed forward's fa2-tc
        doc = api.default_variant(q, params) if named is None else variant
        if _document_variant(q, k, v, doc, params):     # document_inputs checks the arrays before its launch
            return _backward_document(dout, q, k, v, out, lse, cu_seqlens_q, doc, causal, scale, window, params)
    lq, lk = _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                    params.get("score_mod"), params.get("mask_mod"))
    _check_backward_shapes(dout, q, out, lse)
    if scale is None:
        scale = 1.0 / float(np.sqrt(q.shape[2]))
    dq, dk, dv = _empty(q, tuple(q.shape)), _empty(k, tuple(k.shape)), _empty(v, tuple(v.shape))
    _fill(dq, 0)
    _fill(dk, 0)
    _fill(dv, 0)
    for s in range(lq.size - 1):
        a, b, c, e = int(lq[s]), int(lq[s + 1]), int(lk[s]), int(lk[s + 1])
        if a == b or c == e:                             # nothing flows: zero gradients
            continue
        lse_s = lse[:, a:b][None]
        g = api.backward(_view(dout, a, b), q=_view(q, a, b), k=_view(k, c, e), v=_view(v, c, e),
                         out=_view(out, a, b), lse=lse_s, variant=variant, causal=causal, scale=scale,
                         window=window, **params)
        _put(dq, a, b, g[0])
        _put(dk, c, e, g[1])
        _put(dv, c, e, g[2])
    return dq, dk, dv


def _check_backward_shapes(dout, q, out, lse) -> None:
    if tuple(dout.shape) != tuple(q.shape) or tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"dout and out must be shaped like q {tuple(q.shape)}; got {tuple(dout.shape)} and "
                         f"{tuple(out.shape)}")
    for x, nm in ((dout, "dout"), (out, "out")):     # before any launch: the row kernels size rows by q's dtype
        if dtype_name(x) != dtype_name(q):
            raise TypeError(f"{nm} must have q's dtype {dtype_name(q)}; got {dtype_name(x)}")
    if tuple(lse.shape) != (q.shape[1], q.shape[0]) or dtype_name(lse) != "float32":
        raise ValueError(f"lse must be float32 (Hq, total_q) = {(q.shape[1], q.shape[0])}; got {dtype_name(lse)} "
                         f"{tuple(lse.shape)}")


# ---- the backward of packed self-attention with its offsets on the GPU: one call under a document mask

def _one_offsets_array(q, cu_q, cu_k) -> bool:
    """Whether cu_seqlens_q and cu_seqlens_k are one GPU array (the same memory, type, length and strides) on q's
    device, a contiguous 1-D int32 / int64 array of S + 1 >= 2 offsets: packed self-attention as flash-attn's callers
    pass it (transformers' padding-free batches). Decided from the arrays' descriptions; their values stay unread.
    Anything else takes the per-sequence backward, which checks the offsets on the host."""
    if not (on_device(cu_q) and on_device(cu_k)) or not _same_device(q, cu_q, cu_k):
        return False
    if tuple(cu_q.shape) != tuple(cu_k.shape) or dtype_name(cu_q) != dtype_name(cu_k):
        return False
    if len(cu_q.shape) != 1 or cu_q.shape[0] < 2 or dtype_name(cu_q) not in ("int32", "int64"):
        return False
    if arrays.kind_of(cu_q) == "torch":
        return cu_q.data_ptr() == cu_k.data_ptr() and cu_q.stride() == cu_k.stride() == (1,)
    return cu_q.data.ptr == cu_k.data.ptr and cu_q.strides == cu_k.strides == (cu_q.itemsize,)


def _document_variant(q, k, v, variant, params) -> bool:
    """Whether the document-mask backward takes the call: no modifier or block mask of the caller's (the document
    mask is the call's one mask modifier), CUDA arrays, and a CUDA C variant whose backward takes mask modifiers
    (the Numba variants read a mask's buffers and classify its tiles on the host)."""
    from .registry import get_variant
    if any(params.get(key) is not None for key in ("block_mask", "score_mod", "mask_mod")):
        return False
    if any(arrays.kind_of(x) not in ("cupy", "torch") for x in (q, k, v)):
        return False
    rest = {key: val for key, val in params.items() if key not in ("block_mask", "score_mod", "mask_mod", "seed", "offset")}
    bound = get_variant(variant, **rest)
    return bool(bound.variant.backend == "cuda" and bound.caps.backward and bound.caps.mask_mod)


def _backward_document(dout, q, k, v, out, lse, cu, variant, causal, scale, window, params):
    """(dq, dk, dv) of packed self-attention (one offsets array for queries and keys) with the offsets on the GPU,
    unread on the host (no wait): one backward over the packed rows as a single sequence, under a document mask
    whose per-token ids are made from the offsets on the device (token t of sequence s: id s, by a binary search).
    Within a sequence the packed positions differ from the sequence's own by one offset, for queries and keys
    alike, and q and k have as many packed rows (the caller checks), so the single problem's bottom-right alignment
    shifts nothing and causal and window mean what they mean per sequence; other sequences' tiles are skipped by the mask's
    tile table, made from each tile's first and last ids (the ids never decrease: document(sorted_ids=True), O(tiles)
    where testing every element took 1.0 ms at 16k packed tokens on the H100). Tokens before cu[0] get id -1 as
    queries and -2 as keys, those past cu[S] S and S + 1: they see nothing and nothing sees them. Such rows, and rows
    the forward left NaN (a sequence past max_seqlen_q: a broken contract), are zeroed in copies of q, k, v, out and
    dout and get a dead row's lse (-inf): their P is 0, but the GEMMs multiply it by their values (0 NaN = NaN) and
    dK / dQ would sum NaN into the other sequences' keys and rows of their tiles. They get zero gradients.
    The ids, the lse and the five copies are one launch (kernels_cu/varlen_rows.cu), and the backward is called with
    CuPy views, so it takes the generic path: a torch call's plan would be made per mask, that is per call, and
    thrown away (the plan path has no backward launch for a mask modifier)."""
    from . import modifiers
    kind = arrays.kind_of(q)
    with arrays.caller_stream(q):
        (q_c, out_c, dout_c, k_c, v_c), q_ids, k_ids, lse_c = document_inputs(cu, q, out, dout, k, v, lse)
        mask = modifiers.document(q_ids, k_ids, sorted_ids=True)
        n = q.shape[0]
        g = api.backward(_view(dout_c, 0, n), q=_view(q_c, 0, n), k=_view(k_c, 0, n), v=_view(v_c, 0, n),
                         out=_view(out_c, 0, n), lse=lse_c[None], variant=variant, causal=causal, scale=scale,
                         window=window, mask_mod=mask, **params)
        # in the caller's stream's scope: the gradients' packing copy is ordered after the backward's kernels, and
        # torch's allocator holds its memory (outside, CuPy's own stream and pool would race them)
        return tuple(_packed(arrays.like(x, kind)) for x in g)


def document_inputs(cu, q, out, dout, k, v, lse):
    """The document backward's inputs, made by one launch on the current stream (kernels_cu/varlen_rows.cu): C-contiguous
    CuPy copies of q, out, dout (n, Hq, d) and k, v (n, Hkv, d) with the rows that take no part zeroed, the query and
    key ids (int32 [n]) and lse [Hq, n] with -inf in those query rows (_backward_document). cu: the S + 1 offsets on
    the device (contiguous int32 / int64), q and k of n rows each; checked here (before the launch, whose rows are
    sized by q's dtype and k's heads) with the checks the varlen entry points run."""
    _check_device_offsets(cu, cu, None, None)
    _check_arrays(q, k, v, 0.0)
    _check_backward_shapes(dout, q, out, lse)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"document_inputs: q and k must have as many packed rows; got {q.shape[0]} and {k.shape[0]}")
    import cupy as cp
    from .launch import i32, i64
    from .loader import launch
    c = arrays.to_device(cu, "cu_seqlens_q")
    n, S, H = q.shape[0], cu.shape[0] - 1, q.shape[1]
    ds = [arrays.to_device(x, nm) for x, nm in ((q, "q"), (out, "out"), (dout, "dout"), (k, "k"), (v, "v"))]
    xs = [cp.ascontiguousarray(x.view(f"uint{8 * x.dtype.itemsize}")) for x in ds]   # bits: CuPy copies no bf16
    lse_d = cp.ascontiguousarray(arrays.to_device(lse, "lse"))
    ys = [cp.empty_like(x) for x in xs]
    q_ids, k_ids, lse_c = cp.empty(n, cp.int32), cp.empty(n, cp.int32), cp.empty_like(lse_d)
    qrow, krow = (x.itemsize * x.shape[1] * x.shape[2] for x in (xs[0], xs[3]))
    width = _copy_width((qrow, krow, *(x.data.ptr for x in xs + ys)))
    launch(rows_unit(), _rows_kernel(c.dtype, width), (n,), (ROWS_THREADS,),
           (c, i32(S), lse_d, i32(H), i32(n), q_ids, k_ids, lse_c, *xs[:3], *ys[:3], i64(qrow // width),
            *xs[3:], *ys[3:], i64(krow // width)))
    return [y.view(d.dtype) for y, d in zip(ys, ds)], q_ids, k_ids, lse_c


ROWS_THREADS = 256
_VECTORS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short"}
_OFFSET_TYPES = {"int32": "int", "int64": "long long"}


def _copy_width(sizes) -> int:
    """The widest copy vector (bytes) that divides every row size and pointer (2 at least: fp16 / bf16 / fp32)."""
    return next(w for w in _VECTORS if all(s % w == 0 for s in sizes))


def _rows_kernel(offset_dtype, width: int) -> str:
    return f"document_rows<{_OFFSET_TYPES[str(offset_dtype)]}, {_VECTORS[width]}>"


@functools.lru_cache(maxsize=None)
def rows_unit():
    """kernels_cu/varlen_rows.cu: every (offset type, copy vector) instantiation (also built by the compile check)."""
    from .launch import cuda_options
    from .loader import CompileUnit
    names = tuple(f"document_rows<{i}, {v}>" for i in _OFFSET_TYPES.values() for v in _VECTORS.values())
    return CompileUnit("varlen_rows.cu", names, cuda_options(), {}, label="varlen_rows")


def _packed(x):
    """A (1, H, n, d) result as a C-contiguous packed (n, H, d) array (a view where it already is one)."""
    if arrays.kind_of(x) == "torch":
        return x[0].permute(1, 0, 2).contiguous()
    import cupy as cp
    return cp.ascontiguousarray(x[0].transpose(1, 0, 2))
