"""GPU: flash-attn's `softcap` and `alibi_slopes` through `sandbox.flash_attn` on CUDA tensors, compiled
into the tensor-core kernels (fa2-tc, and the Hopper rung fa3 where the device is sm_90), forward and
gradients, against flash-attn's formulas evaluated in float32 by torch on the same device."""
import pytest

torch = pytest.importorskip("torch")
fa = pytest.importorskip("sandbox.flash_attn")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

VARIANTS = ["fa2-tc"] + (["fa3"] if torch.cuda.get_device_capability() >= (9, 0) else [])


def _reference(q, k, v, causal, softcap, slopes):
    """flash-attn's meaning (B, N, H, d), float32: softcap on the scaled score, then ALiBi (slope * j when
    causal, else -slope * |i + Nk - Nq - j|), the causal mask bottom-right aligned."""
    B, nq, hq, d = q.shape
    nk, rep = k.shape[1], hq // k.shape[2]
    qh, kh, vh = (x.float().transpose(1, 2) for x in (q, k, v))
    kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    s = qh @ kh.transpose(-1, -2) * d ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(nq, device=q.device)[:, None]
    j = torch.arange(nk, device=q.device)[None, :]
    if slopes is not None:
        sl = slopes.float().reshape(-1, hq)[:, :, None, None].expand(B, hq, 1, 1)
        s = s + sl * (j.float() if causal else -(i + nk - nq - j).abs().float())
    if causal:
        s = s.masked_fill(j > i + nk - nq, float("-inf"))
    return (torch.softmax(s, -1) @ vh).transpose(1, 2)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap,alibi", [(30.0, None), (0.0, "heads"), (5.0, "batch-heads")])
def test_softcap_and_alibi_on_the_gpu(variant, dtype, causal, softcap, alibi):
    g = torch.Generator(device="cuda").manual_seed(3)
    B, nq, nk, hq, hkv, d = 2, 200, 333, 4, 2, 64
    q = torch.randn(B, nq, hq, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(B, nk, hkv, d, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(2))
    slopes = {None: None, "heads": torch.rand(hq, device="cuda", generator=g),
              "batch-heads": torch.rand(B, hq, device="cuda", generator=g)}[alibi]
    out = fa.flash_attn_func(q, k, v, causal=causal, softcap=softcap, alibi_slopes=slopes, variant=variant)
    assert out.dtype == dtype and out.is_cuda and out.shape == q.shape
    ref = _reference(q, k, v, causal, softcap, slopes)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(out.float(), ref, **tol)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), go)
    want = torch.autograd.grad(ref, (q, k, v), go.float())
    for name, a, b in zip("qkv", got, want):
        scale = b.abs().max().item() + 1e-6
        err = (a.float() - b).abs().max().item() / scale
        assert err < (3e-2 if dtype == torch.bfloat16 else 1e-2), f"d{name}: relative error {err:.3g}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_device_alibi_slopes_are_read_on_the_gpu_without_a_wait(variant):
    """Slopes written on a busy side stream: the call neither waits for them (they stay on the GPU, copied on that
    stream: the stream is still busy when it returns) nor reads them early (the output matches the reference)."""
    g = torch.Generator(device="cuda").manual_seed(4)
    B, n, hq, d = 2, 160, 4, 64
    q, k, v = (torch.randn(B, n, hq, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    fa.flash_attn_func(q, k, v, causal=True, alibi_slopes=torch.linspace(0.1, 0.4, hq, device="cuda"), variant=variant)
    torch.cuda.synchronize()             # every module (ours, torch's linspace) loaded: a first load may wait
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(3e8))
        slopes = torch.linspace(0.05, 0.5, hq, device="cuda")                   # written behind the sleep
        out = fa.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, variant=variant)
        busy = not side.query()
    torch.cuda.synchronize()
    assert busy, "the call waited for the GPU (the slopes were read to the host)"
    torch.testing.assert_close(out.float(), _reference(q, k, v, True, 0.0, slopes), rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_takes_device_cu_seqlens_and_returns_lse(dtype):
    """As flash-attn's callers call it: cu_seqlens as CUDA int32 tensors, return_attn_probs=True ->
    (out, lse (Hq, total_q), None); each sequence against the float32 reference alone, gradients too."""
    g = torch.Generator("cuda").manual_seed(3)
    lens = [5, 130, 64, 1]
    total, hq, hkv, d = sum(lens), 4, 2, 64
    q = torch.randn(total, hq, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(total, hkv, d, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(2))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    out, lse, s_dmask = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                  return_attn_probs=True)
    assert s_dmask is None and out.dtype == dtype and lse.shape == (hq, total) and lse.dtype == torch.float32
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), go)
    eps = 2**-7 if dtype == torch.bfloat16 else 2**-10
    offs = [0] + torch.tensor(lens).cumsum(0).tolist()
    for a, b in zip(offs[:-1], offs[1:]):
        qs, ks, vs = (x.detach()[a:b][None].float().requires_grad_() for x in (q, k, v))
        ref = _reference(qs, ks, vs, True, 0.0, None)
        torch.testing.assert_close(out[a:b].float(), ref[0], rtol=8 * eps, atol=8 * eps)
        rg = torch.autograd.grad(ref, (qs, ks, vs), go[a:b][None].float())
        for mine, theirs in zip(grads, rg):
            torch.testing.assert_close(mine[a:b].float(), theirs[0], rtol=16 * eps, atol=16 * eps)
        s = (qs[0].transpose(0, 1) @ ks[0].repeat_interleave(hq // hkv, 1).permute(1, 2, 0)) * d ** -0.5
        s = s.masked_fill(torch.ones(b - a, b - a, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(lse[:, a:b], torch.logsumexp(s, -1).detach(), rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(torch.cuda.get_device_capability() != (9, 0), reason="the default takes fa3 on sm_90 only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_default_variant_takes_gemma_shapes_on_hopper(dtype):
    """A Gemma-2-like call with no variant named: d = 256, GQA, softcap 50, causal: variant=None resolves to
    fa3 on sm_90 (fa2-tc stops at d = 128); out and gradients against the float32 formulas."""
    import sandbox.torch as st
    from sandbox import api
    g = torch.Generator("cuda").manual_seed(5)
    q = torch.randn(2, 300, 8, 256, device="cuda", dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(2, 300, 4, 256, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(2))
    assert api.default_variant(q) == "fa3"
    out = fa.flash_attn_func(q, k, v, causal=True, softcap=50.0)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = _reference(qf, kf, vf, True, 50.0, None)
    eps = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(out.float(), ref, rtol=8 * eps, atol=8 * eps)
    go = torch.randn_like(out)
    for mine, theirs in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (qf, kf, vf), go.float())):
        torch.testing.assert_close(mine.float(), theirs, rtol=16 * eps, atol=16 * eps)
    plain = st.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
    assert plain.shape == (2, 8, 300, 256)


@pytest.mark.parametrize("d", [59, 111])
def test_head_dims_off_the_multiple_of_8_run_padded(d):
    """flash-attn's test suite draws d = 59 and 111: padded to 64 / 112 here as flash-attn pads them, with the
    scale of the true d; out (cut back to d) and gradients against the float32 formulas."""
    g = torch.Generator("cuda").manual_seed(d)
    q, k, v = (torch.randn(2, 97, 4, d, device="cuda", dtype=torch.float16, generator=g).requires_grad_()
               for _ in range(3))
    out, lse, none = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and none is None and lse.shape == (2, 4, 97)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = _reference(qf, kf, vf, True, 0.0, None)
    torch.testing.assert_close(out.float(), ref, rtol=8e-3, atol=8e-3)
    go = torch.randn_like(out)
    for mine, theirs in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (qf, kf, vf), go.float())):
        assert mine.shape[-1] == d
        torch.testing.assert_close(mine.float(), theirs, rtol=2e-2, atol=2e-2)
