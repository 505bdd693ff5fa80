"""flash-attn's Python interface over the sandbox's kernels, for code written against flash-attn 2.

    from sandbox.flash_attn import flash_attn_func, flash_attn_varlen_func
    out = flash_attn_func(q, k, v, causal=True)                 # q (B, N, H, d), as flash-attn takes it
    out = flash_attn_func(q, k, v, causal=True, variant="fa3")   # any registered variant, its params

The functions keep flash-attn's names, argument order and defaults (dropout_p, softmax_scale, causal,
window_size=(-1, -1) with -1 for an unbounded side, deterministic) and its (B, N, H, d) layout: the
arrays are handed to sandbox.torch as zero-copy (B, H, N, d) views, and the output comes back
contiguous in (B, N, H, d) (one copy of O, as code written for flash-attn may `.view` it). GQA / MQA
follow from the head counts as in flash-attn. `variant=None` is sandbox.torch's default for the
dtype (`fa2-tc-deterministic` with deterministic=True). `softcap` and `alibi_slopes` become a score
modifier (sandbox/modifiers.py) with flash-attn's meaning, compiled into the kernels of the variants
that take modifiers (fa2-tc, fa3, the Numba variants; `score_modifier` below): on the scaled score s,
softcap * tanh(s / softcap) first, then ALiBi, slope * j where flash-attn's kernels take the call as
causal (an unbounded left window and right = 0: `_alibi_causal_form`) and -slope * |i + Nk - Nq - j|
otherwise (the two forms differ by a per-row constant, which the softmax ignores but the lse keeps).
Slopes given as a CUDA tensor stay on the GPU (copied there once per tensor and in-place version, on
the caller's stream: no wait; modifiers.DeviceBuffer). A 16-bit
head dim that is not a multiple of 8 (59, 111) is zero-padded to the next multiple and the output cut
back, as flash-attn's own Python layer does (the tensor-core kernels take multiples of 8). What the kernels do not offer is
refused with a ValueError naming the argument rather than ignored: return_attn_probs with dropout
(the probabilities and the dropout pattern are never materialised; without dropout it returns
(out, softmax_lse, None), as flash-attn does), a paged block_table; softcap and alibi_slopes in the
varlen and KV-cache functions (packed and split problems take no modifiers); in the varlen function,
dropout (sandbox/varlen.py says why). The varlen function takes cu_seqlens on the GPU, as flash-attn's
callers pass them: the single-launch forward (fa2-tc, CUDA fp16 / bf16, d <= 128) reads them in place
without waiting; so does the backward where cu_seqlens_q and cu_seqlens_k are one array and q and k have as
many rows (packed self-attention: one call under a document mask). The per-sequence path and the backward of different query and
key offsets copy them to the host, which waits for the caller's stream.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from . import decode, modifiers
from . import torch as st
from .problem import OptionTypeError

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_with_kvcache"]


def _window(window_size):
    """flash-attn's (left, right) with -1 for unbounded -> the sandbox's (left, right) with None, or None."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise OptionTypeError(f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = (None if int(side) < 0 else int(side) for side in window_size)
    return None if left is None and right is None else (left, right)


def _refuse(softcap, alibi_slopes, where=None):
    """where: the function that takes no modifiers (varlen, kvcache), or None (softcap and ALiBi run)."""
    if where is not None and softcap:
        raise ValueError(f"softcap={softcap!r} is not supported by {where} (packed and split problems take "
                         "no modifiers; only softcap=0.0)")
    if where is not None and alibi_slopes is not None:
        raise ValueError(f"alibi_slopes is not supported by {where} (packed and split problems take no "
                         "modifiers; pass None)")


def _probs_refusal(return_attn_probs, dropout_p):
    """flash-attn returns (out, softmax_lse, S_dmask) with return_attn_probs=True, S_dmask None without dropout;
    with dropout it holds the probabilities and the kernel's dropout pattern (for its tests), which these
    kernels never materialise."""
    if not isinstance(return_attn_probs, (bool, np.bool_)):
        raise OptionTypeError(f"return_attn_probs must be a bool, got {return_attn_probs!r}")
    if return_attn_probs and dropout_p:
        raise ValueError("return_attn_probs=True with dropout_p > 0 is not supported: the kernels never materialise "
                         "the probabilities or the dropout pattern (sandbox.philox.dropout_mask gives the pattern); "
                         "with dropout_p = 0 it returns (out, softmax_lse, None), as flash-attn does")


# ---- softcap and ALiBi as one score modifier, in flash-attn's meaning (module docstring)

def _slope_np(slopes, b, h):
    return slopes[np.minimum(b, slopes.shape[0] - 1), h]


def _capped_np(s, cap):
    return s if cap[0] == 0 else cap[0] * np.tanh(s / cap[0])


def _fa_np(s, b, h, i, j, cap, slopes, geom):
    """geom = [Nk - Nq, causal]: causal adds slope * j, else -slope * |i + Nk - Nq - j|."""
    bias = np.where(geom[1] != 0, 1.0 * j, -np.abs(i + geom[0] - j))
    return _capped_np(s, cap) + _slope_np(slopes, b, h) * bias


def _fa_grad_np(s, b, h, i, j, cap, slopes, geom):
    return np.ones_like(s) if cap[0] == 0 else 1.0 - np.tanh(s / cap[0]) ** 2


def _fa_scalar(s, b, h, i, j, cap, slopes, geom):
    c = s if cap[0] == 0 else cap[0] * math.tanh(s / cap[0])
    bias = 1.0 * j if geom[1] != 0 else -abs(i + geom[0] - j)
    return c + slopes[min(b, slopes.shape[0] - 1), h] * bias


def _fa_grad_scalar(s, b, h, i, j, cap, slopes, geom):
    if cap[0] == 0:
        return 1.0
    t = math.tanh(s / cap[0])
    return 1.0 - t * t


_FA_SLOPE = "slopes[min(b, slopes_shape0 - 1) * slopes_shape1 + h]"
_HOST_SLOPES = st.TensorDerived(64)      # slopes tensor -> its host copy (float64)


def _host_slopes(t) -> np.ndarray:
    """The host values of an ALiBi slopes tensor on the CPU (a CUDA one stays there: _device_slopes), read once
    per tensor (same storage, shape and in-place version), not on every call. An entry
    counts only while the tensor it was read from is alive: once that tensor is freed, its address (and
    version 0) may come back with another tensor's values (seen in CI: a later test's slopes read as an
    earlier test's)."""
    return _HOST_SLOPES.get(t, lambda: t.detach().cpu().numpy().astype(np.float64))


_DEVICE_SLOPES = st.TensorDerived(64)    # CUDA slopes tensor -> modifiers.DeviceBuffer (float32, (1 or B, Hq))


def _device_slopes(t) -> "modifiers.DeviceBuffer":
    """A CUDA slopes tensor as the kernels read it, on its GPU: a float32 copy made on the caller's stream once per
    tensor and in-place version (models pass one fixed slopes buffer), with no wait and no host copy (the
    oracle's NumPy form reads DeviceBuffer.host(), which waits, only when it runs)."""
    return _DEVICE_SLOPES.get(t, lambda: modifiers.device_buffer(t.detach()[None] if t.dim() == 1 else t.detach(),
                                                                  "alibi_slopes"))


def _alibi_causal_form(causal, window_size, Nk: int) -> bool:
    """flash-attn's choice of ALiBi form: its kernels treat a call as causal when the window's left
    side is unbounded and its right side is 0 (causal sets right = 0; a side >= Nk counts as unbounded),
    so causal with a finite left window takes the |i + Nk - Nq - j| form and window (-1, 0) the
    causal one. The two differ by a per-row constant: the same out and gradients, another lse."""
    left, right = (int(x) for x in window_size) if isinstance(window_size, (tuple, list)) else (-1, -1)
    if causal:
        right = 0
    left, right = (-1 if x >= Nk else x for x in (left, right))
    return left < 0 and right == 0


def score_modifier(softcap, alibi_slopes, B: int, Hq: int, Nq: int, Nk: int, causal: bool):
    """flash-attn's softcap (a float, 0 for none) and alibi_slopes ((Hq,) or (B, Hq), fp32, a tensor or
    array; None for none) as one ScoreMod, or None when neither is given. The CUDA text has the
    softcap and the causal / non-causal ALiBi form fixed (one module each), the values in buffers."""
    cap = float(softcap) if softcap else 0.0
    if not (math.isfinite(cap) and cap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0, got {softcap!r}")
    if not cap and alibi_slopes is None:
        return None
    if alibi_slopes is None:
        return st._softcap_mod(cap)      # one ScoreMod per cap: no new modifier (and its checks) on every call
    if torch.is_tensor(alibi_slopes) and alibi_slopes.is_cuda:
        slopes = _device_slopes(alibi_slopes)
    else:
        slopes = np.asarray(_host_slopes(alibi_slopes) if torch.is_tensor(alibi_slopes) else alibi_slopes,
                            dtype=np.float64)
    if slopes.ndim == 1:
        slopes = slopes[None]
    if slopes.ndim != 2 or slopes.shape[1] != Hq or slopes.shape[0] not in (1, B):
        raise ValueError(f"alibi_slopes must have shape ({Hq},) or ({B}, {Hq}) (batch, query heads); "
                         f"got {tuple(np.shape(alibi_slopes))}")
    capped = "cap[0] * fa_tanh(s * cap[1])" if cap else "s"
    bias = "fj" if causal else "(-fabsf(fi + geom[0] - fj))"
    # the derivative of the soft-cap part: fa_sech2, accurate where tanh saturates (1 - fa_tanh^2 is not:
    # modifiers.softcap)
    grad = "fa_sech2(s * cap[1])" if cap else "1.0f"
    return modifiers.ScoreMod(
        "flash_attn_bias", _fa_np, _fa_scalar, f"{capped} + {_FA_SLOPE} * {bias}", _fa_grad_np, _fa_grad_scalar,
        grad, buffers={"cap": np.array([cap, 1.0 / cap if cap else 0.0]), "slopes": slopes,
                       "geom": np.array([float(Nk - Nq), 1.0 if causal else 0.0])},
        params={"softcap": cap, "causal": bool(causal)})


def _variant(variant, deterministic, dtype):
    if variant is None and deterministic and dtype in (torch.float16, torch.bfloat16):
        return "fa2-tc-deterministic"
    return variant


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, variant=None, **params):
    """softmax(scale q k^T) v over (B, N, H, d) tensors, differentiable; returns (B, Nq, Hq, d), or with
    return_attn_probs=True (out, softmax_lse (B, Hq, Nq) float32, None), as flash-attn 2 without dropout.
    A row that sees no key has out 0 and lse -inf (the sandbox's contract; flash-attn 2 writes +inf there)."""
    _refuse(softcap, alibi_slopes)
    _probs_refusal(return_attn_probs, dropout_p)
    for x, nm in ((q, "q"), (k, "k"), (v, "v")):
        if x.dim() != 4:
            raise ValueError(f"{nm} must be (batch, seqlen, heads, d); got shape {tuple(x.shape)}")
    mod = score_modifier(softcap, alibi_slopes, q.shape[0], q.shape[2], q.shape[1], k.shape[1],
                         _alibi_causal_form(causal, window_size, k.shape[1]))
    if mod is not None:
        if "score_mod" in params:
            raise ValueError("pass either softcap / alibi_slopes or score_mod, not both")
        params = dict(params, score_mod=mod)
    d = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    q, k, v = _pad_head_dim(q, k, v)
    out, lse = st.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            variant=_variant(variant, deterministic, q.dtype), causal=causal, scale=softmax_scale,
                            dropout_p=dropout_p, window=_window(window_size), enable_gqa=q.shape[2] != k.shape[2],
                            return_lse=True, **params)
    out = out.transpose(1, 2)[..., :d].contiguous()
    return (out, lse, None) if return_attn_probs else out


def _pad_head_dim(*xs):
    """flash-attn's own answer to a 16-bit head dim that is not a multiple of 8 (its Python layer pads): zero
    columns up to the next multiple, which add nothing to q k^T and give output columns that are cut off; the
    tensor-core kernels take multiples of 8. Other dtypes and head dims are returned as they are."""
    d = xs[0].shape[-1]
    if d % 8 == 0 or xs[0].dtype not in (torch.float16, torch.bfloat16):
        return xs
    return tuple(torch.nn.functional.pad(x, (0, 8 - d % 8)) for x in xs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, **kw):
    """kv (B, Nk, 2, Hkv, d)."""
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, **kw)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, **kw):
    """qkv (B, N, 3, H, d)."""
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs, **kw)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, variant=None,
                           **params):
    """Packed sequences: q (total_q, Hq, d), k and v (total_k, Hkv, d), cu_seqlens on the host or the GPU (read in
    place by the single launch's forward and by the backward of one offsets array for queries and keys, else copied
    to the host: sandbox/varlen.py); returns (total_q, Hq, d),
    or with return_attn_probs=True (out, softmax_lse (Hq, total_q), None). One launch for the batch where
    fa2-tc's packed-sequence kernel takes it (sandbox/varlen.py)."""
    _refuse(softcap, alibi_slopes, "flash_attn_varlen_func")
    _probs_refusal(return_attn_probs, dropout_p)
    if block_table is not None:
        raise ValueError("block_table (a paged KV cache) is not supported yet (pass None)")
    if dropout_p:
        raise ValueError("dropout_p > 0 is not supported for packed sequences yet (sandbox/varlen.py)")
    d = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    q, k, v = _pad_head_dim(q, k, v)
    out, lse = st.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                   int(max_seqlen_q), int(max_seqlen_k),
                                   variant=_variant(variant, deterministic, q.dtype), causal=causal,
                                   scale=softmax_scale, window=_window(window_size), return_lse=True, **params)
    out = out[..., :d]
    return (out, lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, variant=None, **params):
    """Decoding against a KV cache in flash-attn 2's argument order (sandbox/decode.py: the split-KV
    kernel for CUDA fp16 / bf16 tensors with variant=None, else split-KV over any variant):
    q (B, Nq, Hq, d); k_cache, v_cache (B, Nmax, Hkv, d) or paged (pages, page_size, Hkv, d) with
    block_table (B, pages per sequence); k, v (B, Nnew, Hkv, d) appended in place at cache_seqlens
    (an int or B host ints; None: the whole cache). window_size as flash-attn's (bottom-right
    aligned). num_splits=0 is automatic (decode.forward's num_splits=None). Rotary embeddings,
    cache_batch_idx and cache_leftpad are refused by name. Returns out (B, Nq, Hq, d) [, lse
    (B, Hq, Nq)]; no autograd."""
    _refuse(softcap, alibi_slopes, "flash_attn_with_kvcache")
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("cache_batch_idx", cache_batch_idx),
                        ("cache_leftpad", cache_leftpad)):
        if value is not None:
            raise ValueError(f"{name} is not supported by the sandbox's KV-cache path (pass None)")
    B = q.shape[0]
    nnew = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        if block_table is not None:
            raise ValueError("a paged cache needs cache_seqlens")
        cache_seqlens = k_cache.shape[1] - nnew
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dim() == 0:
        cache_seqlens = int(cache_seqlens)
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        cache_seqlens = [int(cache_seqlens)] * B
    if not isinstance(num_splits, (int, np.integer)) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: automatic), got {num_splits!r}")
    t = lambda x: None if x is None else x.transpose(1, 2)  # noqa: E731  (B, N, H, d) <-> (B, H, N, d)
    with torch.no_grad():
        out, lse = decode.forward(t(q), t(k_cache), t(v_cache), cache_seqlens, block_table=block_table, k_new=t(k),
                                  v_new=t(v), causal=causal, scale=softmax_scale, num_splits=int(num_splits) or None,
                                  variant=variant, window=_window(window_size), **params)
    out = out.transpose(1, 2).contiguous()
    return (out, lse) if return_softmax_lse else out
