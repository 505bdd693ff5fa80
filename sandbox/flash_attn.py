"""flash-attn's Python interface over the sandbox's kernels, for code written against flash-attn 2.

    from sandbox.flash_attn import flash_attn_func, flash_attn_varlen_func
    out = flash_attn_func(q, k, v, causal=True)                 # q (B, N, H, d), as flash-attn takes it
    out = flash_attn_func(q, k, v, causal=True, variant="fa3")   # any registered variant, its params

The functions keep flash-attn's names, argument order and defaults (dropout_p, softmax_scale, causal,
window_size=(-1, -1) with -1 for an unbounded side, deterministic) and its (B, N, H, d) layout: the
arrays are handed to sandbox.torch as zero-copy (B, H, N, d) views, and the output comes back
contiguous in (B, N, H, d) (one copy of O, as code written for flash-attn may `.view` it). GQA / MQA
follow from the head counts as in flash-attn. `variant=None` is sandbox.torch's default for the
dtype (`fa2-tc-deterministic` with deterministic=True). What the kernels do not offer is refused
with a ValueError naming the argument rather than ignored: softcap, alibi_slopes,
return_attn_probs (the probabilities are never materialised), a paged block_table; in the varlen
function, device-resident cu_seqlens and dropout (sandbox/varlen.py says why).
"""
from __future__ import annotations

import numpy as np
import torch

from . import decode
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


def _refuse(softcap, alibi_slopes, return_attn_probs):
    if softcap:
        raise ValueError(f"softcap={softcap!r} is not supported by the sandbox's kernels (only softcap=0.0)")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes is not supported by the sandbox's kernels (pass None)")
    if return_attn_probs:
        raise ValueError("return_attn_probs=True is not supported: the kernels never materialise the probabilities")


def _variant(variant, deterministic, dtype):
    if variant is None and deterministic and dtype in (torch.float16, torch.bfloat16):
        return "fa2-tc-deterministic"
    return variant


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, variant=None, **params):
    """softmax(scale q k^T) v over (B, N, H, d) tensors, differentiable; returns (B, Nq, Hq, d)."""
    _refuse(softcap, alibi_slopes, return_attn_probs)
    for x, nm in ((q, "q"), (k, "k"), (v, "v")):
        if x.dim() != 4:
            raise ValueError(f"{nm} must be (batch, seqlen, heads, d); got shape {tuple(x.shape)}")
    out = st.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                       variant=_variant(variant, deterministic, q.dtype), causal=causal, scale=softmax_scale,
                       dropout_p=dropout_p, window=_window(window_size), enable_gqa=q.shape[2] != k.shape[2],
                       **params)
    return out.transpose(1, 2).contiguous()


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
    """Packed sequences: q (total_q, Hq, d), k and v (total_k, Hkv, d), host cu_seqlens; returns (total_q, Hq, d).
    One launch for the batch where fa2-tc's packed-sequence kernel takes it (sandbox/varlen.py)."""
    _refuse(softcap, alibi_slopes, return_attn_probs)
    if block_table is not None:
        raise ValueError("block_table (a paged KV cache) is not supported yet (pass None)")
    if dropout_p:
        raise ValueError("dropout_p > 0 is not supported for packed sequences yet (sandbox/varlen.py)")
    return st.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                               variant=_variant(variant, deterministic, q.dtype), causal=causal,
                               scale=softmax_scale, window=_window(window_size), **params)


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
    _refuse(softcap, alibi_slopes, False)
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
