"""sandbox.flash_attn (flash-attn's interface) on the CPU: a Numba variant under the simulator against
PyTorch's SDPA in flash-attn's (B, N, H, d) layout, with gradients; what it refuses."""
import pytest

torch = pytest.importorskip("torch")
fa = pytest.importorskip("sandbox.flash_attn")
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


@pytest.mark.parametrize("kwargs,match", [({"softcap": 30.0}, "softcap"), ({"alibi_slopes": torch.ones(4)}, "alibi"),
                                          ({"return_attn_probs": True}, "probabilities"),
                                          ({"window_size": 3}, "window_size")])
def test_refusals_name_the_argument(kwargs, match):
    q, k, v = _inputs()
    with pytest.raises((ValueError, TypeError), match=match):
        fa.flash_attn_func(q, k, v, variant=VARIANT, **kwargs)


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
