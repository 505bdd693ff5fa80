"""sandbox.flash_attn (flash-attn's interface) on the CPU: a Numba variant under the simulator against
PyTorch's SDPA in flash-attn's (B, N, H, d) layout, with gradients; what it refuses."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
fa = pytest.importorskip("sandbox.flash_attn")
from sandbox import modifiers  # noqa: E402
F = torch.nn.functional

VARIANT = "numba-rowwise"


def _sdpa(q, k, v, causal=False, mask=None):
    """The reference in (B, N, H, d): SDPA on (B, H, N, d) with GQA expanded."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal).transpose(1, 2)


def _inputs(b=2, nq=9, nk=9, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, hq, d, generator=g, requires_grad=True)
    k, v = (torch.randn(b, nk, hkv, d, generator=g, requires_grad=True) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_with_gradients(causal):
    q, k, v = _inputs()
    out = fa.flash_attn_func(q, k, v, causal=causal, variant=VARIANT)
    ref = _sdpa(q, k, v, causal=causal)
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_window_size_is_flash_attns():
    """Query i sees keys i + Nk - Nq - left .. i + Nk - Nq + right; -1 is unbounded."""
    q, k, v = _inputs(nq=6, nk=10)
    i = torch.arange(6)[:, None]
    j = torch.arange(10)[None, :]
    rel = j - (i + 4)
    mask = (rel >= -2) & (rel <= 1)
    out = fa.flash_attn_func(q, k, v, window_size=(2, 1), variant=VARIANT)
    torch.testing.assert_close(out, _sdpa(q, k, v, mask=mask), rtol=1e-5, atol=1e-5)
    out = fa.flash_attn_func(q, k, v, window_size=(-1, -1), variant=VARIANT)
    torch.testing.assert_close(out, _sdpa(q, k, v), rtol=1e-5, atol=1e-5)


def test_packed_forms():
    q, k, v = _inputs(hq=2, hkv=2)
    qkv = torch.stack([q, k, v], dim=2)
    kv = torch.stack([k, v], dim=2)
    ref = _sdpa(q, k, v, causal=True)
    torch.testing.assert_close(fa.flash_attn_qkvpacked_func(qkv, causal=True, variant=VARIANT), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fa.flash_attn_kvpacked_func(q, kv, causal=True, variant=VARIANT), ref, rtol=1e-5, atol=1e-5)


def test_varlen_is_each_sequence_alone():
    q, k, v = _inputs(b=1, nq=10, nk=10, hq=2, hkv=2)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out = fa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 6, 6, causal=True, variant=VARIANT)
    for a, b in ((0, 4), (4, 10)):
        ref = _sdpa(q[:, a:b], k[:, a:b], v[:, a:b], causal=True)[0]
        torch.testing.assert_close(out[a:b], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [({"softcap": -1.0}, "softcap"), ({"softcap": float("inf")}, "softcap"),
                                          ({"alibi_slopes": torch.ones(3)}, "alibi_slopes"),
                                          ({"alibi_slopes": torch.ones(3, 4)}, "alibi_slopes"),
                                          ({"return_attn_probs": True, "dropout_p": 0.1}, "probabilities"),
                                          ({"return_attn_probs": 1}, "return_attn_probs"),
                                          ({"window_size": 3}, "window_size")])
def test_refusals_name_the_argument(kwargs, match):
    q, k, v = _inputs()
    with pytest.raises((ValueError, TypeError), match=match):
        fa.flash_attn_func(q, k, v, variant=VARIANT, **kwargs)


def _reference(q, k, v, causal, softcap=0.0, slopes=None, scale=None):
    """flash-attn's meaning in plain torch (B, N, H, d): scaled scores, softcap, then ALiBi (slope * j
    when causal, else -slope * |i + Nk - Nq - j|), the causal mask bottom-right aligned; (out, lse)."""
    B, nq, hq, d = q.shape
    nk = k.shape[1]
    rep = hq // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(rep, 1), v.transpose(1, 2).repeat_interleave(rep, 1)
    s = qh @ kh.transpose(-1, -2) * (scale if scale is not None else d ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    if slopes is not None:
        sl = slopes.reshape(-1, hq)[:, :, None, None].expand(B, hq, 1, 1)
        s = s + sl * (j.to(s.dtype) if causal else -(i + nk - nq - j).abs().to(s.dtype))
    if causal:
        s = s.masked_fill(j > i + nk - nq, float("-inf"))
    return (torch.softmax(s, -1) @ vh).transpose(1, 2), torch.logsumexp(s, -1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap,alibi", [(5.0, None), (0.0, "heads"), (3.0, "batch-heads")])
def test_softcap_and_alibi_have_flash_attns_meaning(causal, softcap, alibi):
    """softcap and alibi_slopes run as a compiled score modifier (the Numba variant's scalar form here),
    against flash-attn's formulas, forward and gradients; Nq != Nk so that the alignment shows."""
    q, k, v = _inputs(nq=5, nk=9)
    g = torch.Generator().manual_seed(7)
    slopes = {None: None, "heads": torch.rand(4, generator=g), "batch-heads": torch.rand(2, 4, generator=g)}[alibi]
    out = fa.flash_attn_func(q, k, v, causal=causal, softcap=softcap, alibi_slopes=slopes, variant=VARIANT)
    ref, _ = _reference(q, k, v, causal, softcap, slopes)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    go = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_softcap_and_alibi_lse_is_flash_attns():
    """The modifier's NumPy form (the oracle's) gives flash-attn's lse, causal ALiBi's row constant included."""
    from sandbox import oracle
    q, k, v = _inputs(nq=5, nk=9)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    for causal in (False, True):
        mod = fa.score_modifier(2.0, slopes, 2, 4, 5, 9, causal)
        qn, kn, vn = (x.detach().transpose(1, 2).numpy() for x in (q, k, v))
        out, lse = oracle.forward(qn, kn, vn, causal=causal, score_mod=mod)
        ref_out, ref_lse = _reference(q.detach(), k.detach(), v.detach(), causal, 2.0, slopes)
        np.testing.assert_allclose(out.transpose(0, 2, 1, 3), ref_out.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse, ref_lse.numpy(), rtol=1e-5, atol=1e-6)
    assert fa.score_modifier(0.0, None, 2, 4, 5, 9, False) is None
    assert fa.score_modifier(3.0, None, 2, 4, 5, 9, False).name == "softcap"
    # the soft-cap alone: one modifier per cap value, reused by every call (identity-keyed caches hit)
    assert fa.score_modifier(3.0, None, 2, 4, 5, 9, False) is fa.score_modifier(3.0, None, 1, 8, 7, 7, True)
    assert fa.score_modifier(3.0, None, 2, 4, 5, 9, False) is not fa.score_modifier(4.0, None, 2, 4, 5, 9, False)
    assert modifiers.twin_errors(fa.score_modifier(2.0, slopes, 2, 4, 5, 9, False), B=2, H=4, Nq=5, Nk=9) == []


def test_alibi_form_follows_flash_attns_effective_causality():
    assert fa._alibi_causal_form(True, (-1, -1), 9) and fa._alibi_causal_form(False, (-1, 0), 9)
    assert not fa._alibi_causal_form(True, (3, -1), 9) and not fa._alibi_causal_form(False, (-1, -1), 9)
    assert fa._alibi_causal_form(True, (9, -1), 9)        # a left side >= Nk is unbounded
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    assert fa._host_slopes(slopes) is fa._host_slopes(slopes)    # read once
    slopes.mul_(2.0)                                             # an in-place change is read again
    np.testing.assert_array_equal(fa._host_slopes(slopes), [1.0, 0.5, 0.25, 0.125])


def test_host_slopes_of_a_freed_tensor_are_not_reused():
    """A cached host copy counts only while the tensor it was read from is alive: a new tensor that lands on a
    freed one's address (same version 0, shape and dtype) is read again, not given the old values."""
    import gc
    import weakref
    t = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    gone = torch.tensor([9.0, 9.0, 9.0, 9.0])
    key = (t.data_ptr(), t._version, tuple(t.shape), str(t.dtype), str(t.device))
    fa._HOST_SLOPES.entries[key] = (weakref.ref(gone), np.full(4, 9.0))   # as if gone had lived at t's address
    del gone
    gc.collect()
    np.testing.assert_array_equal(fa._host_slopes(t), [0.5, 0.25, 0.125, 0.0625])
    assert fa._host_slopes(t) is fa._host_slopes(t)                               # alive: read once


@pytest.mark.parametrize("fn", ["varlen", "kvcache"])
def test_softcap_and_alibi_are_refused_where_problems_are_split(fn):
    q, k, v = _inputs(b=1)
    with pytest.raises(ValueError, match="softcap"):
        if fn == "varlen":
            fa.flash_attn_varlen_func(q[0], k[0], v[0], [0, 9], [0, 9], 9, 9, softcap=2.0, variant=VARIANT)
        else:
            fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=[9], softcap=2.0, variant=VARIANT)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_with_kvcache_appends_and_attends(paged):
    """One decoding step: two new keys appended in place at cache_seqlens, then causal attention of
    the last two queries over each sequence's keys, as SDPA on the gathered sequence."""
    g = torch.Generator().manual_seed(3)
    b, hq, hkv, d, page = 2, 4, 2, 8, 4
    lens = [3, 9]
    seqs_k = [torch.randn(n + 2, hkv, d, generator=g) for n in lens]
    seqs_v = [torch.randn(n + 2, hkv, d, generator=g) for n in lens]
    q = torch.randn(b, 2, hq, d, generator=g)
    k_new = torch.stack([s[-2:] for s in seqs_k])
    v_new = torch.stack([s[-2:] for s in seqs_v])
    if paged:
        table = torch.tensor([[5, 0, 2], [1, 4, 3]], dtype=torch.int32)
        k_cache, v_cache = torch.zeros(6, page, hkv, d), torch.zeros(6, page, hkv, d)
        for i, n in enumerate(lens):
            for pos in range(n):
                k_cache[table[i, pos // page], pos % page] = seqs_k[i][pos]
                v_cache[table[i, pos // page], pos % page] = seqs_v[i][pos]
    else:
        table = None
        k_cache, v_cache = torch.zeros(b, 12, hkv, d), torch.zeros(b, 12, hkv, d)
        for i, n in enumerate(lens):
            k_cache[i, :n], v_cache[i, :n] = seqs_k[i][:n], seqs_v[i][:n]
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=torch.tensor(lens),
                                     block_table=table, causal=True, num_splits=2, variant=VARIANT)
    for i in range(b):
        ref = _sdpa(q[i:i + 1], seqs_k[i][None], seqs_v[i][None], causal=False,
                    mask=torch.arange(lens[i] + 2)[None, :] <= torch.arange(2)[:, None] + lens[i])
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-5, atol=1e-5)
    if not paged:
        torch.testing.assert_close(k_cache[1, 9:11], seqs_k[1][-2:])


def test_with_kvcache_follows_flash_attns_argument_order():
    """cache_seqlens is the 8th positional argument (after rotary_cos, rotary_sin), may be an int or a
    NumPy integer, and num_splits=0 means automatic; rotary embeddings are refused by name."""
    import numpy as np
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 1, 4, 8, generator=g)
    k_cache, v_cache = torch.randn(2, 6, 2, 8, generator=g), torch.randn(2, 6, 2, 8, generator=g)
    a = fa.flash_attn_with_kvcache(q, k_cache, v_cache, None, None, None, None, np.int64(4), variant=VARIANT)
    ref = _sdpa(q, k_cache[:, :4], v_cache[:, :4])
    torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rotary_cos"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, rotary_cos=torch.ones(6, 4), cache_seqlens=4, variant=VARIANT)


def test_varlen_refuses_modifiers():
    from sandbox import modifiers
    q, k, v = _inputs(b=1, nq=8, nk=8, hq=2, hkv=2)
    cu = [0, 3, 8]
    with pytest.raises(ValueError, match="score_mod"):
        fa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, variant=VARIANT, score_mod=modifiers.softcap(5.0))


@pytest.mark.parametrize("causal", [False, True])
def test_return_attn_probs_gives_out_lse_and_none_as_flash_attn(causal):
    """flash-attn's return_attn_probs=True without dropout: (out, softmax_lse (B, Hq, Nq) float32, None); the
    output still differentiable, the lse not."""
    q, k, v = _inputs(nq=5, nk=9)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, variant=VARIANT)
    ref, ref_lse = _reference(q, k, v, causal)
    assert s_dmask is None and lse.shape == (2, 4, 5) and lse.dtype == torch.float32 and not lse.requires_grad
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    go = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    q, k, v = _inputs(hq=2, hkv=2)
    out, lse, s_dmask = fa.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), causal=causal,
                                                     return_attn_probs=True, variant=VARIANT)
    ref, ref_lse = _reference(q, k, v, causal)
    assert s_dmask is None
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_varlen_return_attn_probs_gives_lse_per_head_and_token():
    """flash-attn's varlen lse layout: (Hq, total_q), each sequence's rows its own softmax."""
    q, k, v = _inputs(b=1, nq=10, nk=10, hq=2, hkv=2)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out, lse, s_dmask = fa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 6, 6, causal=True,
                                                  return_attn_probs=True, variant=VARIANT)
    assert s_dmask is None and lse.shape == (2, 10)
    for a, b in ((0, 4), (4, 10)):
        ref, ref_lse = _reference(q[:, a:b], k[:, a:b], v[:, a:b], True)
        torch.testing.assert_close(out[a:b], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[:, a:b], ref_lse[0], rtol=1e-5, atol=1e-5)


def test_head_dims_off_the_multiple_of_8_are_padded_for_16_bit_only():
    q16 = torch.randn(1, 3, 2, 59).half()
    padded = fa._pad_head_dim(q16, q16[..., :59])
    assert all(x.shape[-1] == 64 for x in padded)
    torch.testing.assert_close(padded[0][..., :59], q16)
    assert float(padded[0][..., 59:].abs().max()) == 0.0
    q32 = torch.randn(1, 3, 2, 59)
    assert fa._pad_head_dim(q32)[0] is q32
    q64 = torch.randn(1, 3, 2, 64).half()
    assert fa._pad_head_dim(q64)[0] is q64


def test_inference_tensors_are_read_without_a_version_counter():
    """Slopes made under torch.inference_mode have no version counter: read (and kept) by identity."""
    with torch.inference_mode():
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
        np.testing.assert_array_equal(fa._host_slopes(slopes), [0.5, 0.25, 0.125, 0.0625])
        assert fa._host_slopes(slopes) is fa._host_slopes(slopes)
