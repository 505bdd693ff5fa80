"""GPU suite: the kernels as a PyTorch user calls them (issue 15).

For every registered variant: inputs written on a busy side stream (the call must launch on that
stream and return before the GPU is done: no synchronisation), CUDA-graph capture and replay, fp16 /
bf16 / fp32 tensors in and out (zero-copy, requires_grad inputs read as data), `sandbox.torch`
autograd against SDPA under the tolerance rule, and `torch.compile(fullgraph=True)` of a small module.
"""
import numpy as np
import pytest

import sandbox
from sandbox import oracle, tolerance
from sandbox.registry import all_variants

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

ALL = sorted(all_variants())
CUDA = sorted(n for n, v in all_variants().items() if v.backend == "cuda")
WITH_BACKWARD = sorted(n for n, v in all_variants().items() if v.caps.backward)
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SLEEP_CYCLES = int(3e8)          # ~0.15 s of GPU time queued ahead of the inputs


def _dtype(name, prefer=("float16", "bfloat16", "float32")):
    caps = all_variants()[name].caps
    return next(d for d in prefer if d in caps.dtypes)


def _shape(name, n=160, d=64):
    """(q shape, k shape): n keys, and n query rows or the variant's max_query_rows if fewer."""
    caps = all_variants()[name].caps
    d = d if d in caps.head_dims else caps.head_dims[-1]
    nq = n if caps.max_query_rows is None else min(n, caps.max_query_rows)
    return (2, 4, nq, d), (2, 2 if caps.gqa else 4, n, d)


def _inputs(name, dtype, seed=0, n=160):
    qs, ks = _shape(name, n)
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in (qs, ks, ks, qs)]


def _to_torch(x, dtype, **kw):
    return torch.as_tensor(x, device="cuda").to(TORCH_DTYPES[dtype]).contiguous().requires_grad_(kw.get("grad", False))


def _host64(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def _check_forward(out, q, k, v, dtype, **kw):
    """out against the oracle under the tolerance rule, on the inputs as rounded to `dtype`."""
    qr, kr, vr = (_host64(_to_torch(x, dtype)) for x in (q, k, v))
    ref, _ = oracle.forward(qr, kr, vr, **kw)
    naive = oracle.forward(qr, kr, vr, precision=dtype, **kw)[0] if dtype != "float32" else None
    verdict = tolerance.compare("out", _host64(out), ref, dtype, naive)
    assert verdict.ok, verdict


def _warm(name, dtype, **kw):
    q, k, v, _ = _inputs(name, dtype, seed=99)
    sandbox.attention(*(_to_torch(x, dtype) for x in (q, k, v)), variant=name, **kw)
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", ALL)
def test_busy_side_stream(name):
    """Inputs written on a side stream behind a long sleep: the kernels must run on that stream
    (else they read the NaN placeholders), and the call must return while the stream is busy."""
    dtype = _dtype(name)
    kw = dict(causal=True)
    _warm(name, dtype, **kw)
    q, k, v, _ = _inputs(name, dtype)
    src = [_to_torch(x, dtype) for x in (q, k, v)]
    dst = [torch.full_like(x, float("nan")) for x in src]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        for d_, s_ in zip(dst, src):
            d_.copy_(s_)
        out = sandbox.attention(*dst, variant=name, **kw)
        busy = not side.query()
    torch.cuda.synchronize()
    assert busy, "the call waited for the GPU (a synchronisation inside the call)"
    _check_forward(out, q, k, v, dtype, **kw)


@pytest.mark.parametrize("name", ALL)
def test_cuda_graph_capture_and_replay(name):
    dtype = _dtype(name)
    q, k, v, _ = _inputs(name, dtype, seed=1)
    static = [_to_torch(x, dtype) for x in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                      # warm-up as torch's graph docs ask
        for _ in range(2):
            sandbox.attention(*static, variant=name, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sandbox.attention(*static, variant=name, causal=True)
    q2, k2, v2, _ = _inputs(name, dtype, seed=2)
    for s_, x in zip(static, (q2, k2, v2)):
        s_.copy_(_to_torch(x, dtype))
    graph.replay()
    torch.cuda.synchronize()
    _check_forward(out, q2, k2, v2, dtype, causal=True)


@pytest.mark.parametrize("name,dtype", [(n, d) for n in ALL for d in all_variants()[n].caps.dtypes])
def test_round_trip_dtypes_and_requires_grad(name, dtype):
    """torch tensors of each supported dtype in, the same dtype and device out; tensors that require
    grad are read as data by the plain API (no error, nothing recorded)."""
    q, k, v, dout = _inputs(name, dtype, seed=3, n=70)
    qt, kt, vt = (_to_torch(x, dtype, grad=True) for x in (q, k, v))
    res = sandbox.forward(qt, kt, vt, variant=name, window=(20, 3))
    assert isinstance(res.out, torch.Tensor) and res.out.dtype == qt.dtype and res.out.device == qt.device
    assert res.lse.dtype == torch.float32 and not res.out.requires_grad
    _check_forward(res.out, q, k, v, dtype, window=(20, 3))
    if all_variants()[name].caps.backward:
        grads = sandbox.backward(_to_torch(dout, dtype), res)
        assert all(g.dtype == qt.dtype and g.shape == x.shape for g, x in zip(grads, (qt, kt, vt)))


@pytest.mark.parametrize("name", CUDA)
def test_strided_inputs_are_not_copied(name):
    """Zero-copy in: q, k, v as strided views of one packed (B, H, N, 3d) tensor cost no more device
    memory at peak than contiguous inputs (a copy would add their size), and give the same result."""
    dtype = _dtype(name)
    q, k, v, _ = _inputs(name, dtype, seed=4)
    d = q.shape[-1]
    packed = torch.cat([_to_torch(a, dtype) for a in (q, q, q)], dim=-1)
    views = packed[..., :d], packed[..., d:2 * d], packed[..., 2 * d:]
    plain = [x.contiguous() for x in views]

    def peak(xs):
        sandbox.attention(*xs, variant=name)          # warm: compile, plans, tile tables
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = sandbox.attention(*xs, variant=name)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, out

    grown_views, out_views = peak(views)
    grown_plain, out_plain = peak(plain)
    assert grown_views <= grown_plain + (64 << 10), (grown_views, grown_plain)
    torch.testing.assert_close(out_views, out_plain, rtol=0, atol=0)


def _sdpa_ref(q, k, v, causal, gqa):
    """SDPA's math backend in float64: the reference both are measured against."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def _grads(fn, q, k, v, dout):
    qs, ks, vs = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = fn(qs, ks, vs)
    out.backward(dout)
    return out.detach(), qs.grad, ks.grad, vs.grad


@pytest.mark.parametrize("name", WITH_BACKWARD)
@pytest.mark.parametrize("causal", [False, True])
def test_autograd_against_sdpa(name, causal):
    """sandbox.torch.attention's out and gradients against SDPA's, both measured against SDPA math in
    float64: 16-bit errors within the tolerance rule's factors of SDPA's own (2x out, 3x grads, plus
    the dtype's rounding at the output's magnitude). fp32 (exact tier): within 2e-5 relative, the
    kernels' fuzzed exact-tier bound (1e-5) with room for d = 64 sums of unit-scale terms."""
    import sandbox.torch as st
    dtype = _dtype(name)
    caps = all_variants()[name].caps
    q, k, v, dout = (_to_torch(x, dtype) for x in _inputs(name, dtype, seed=5))
    gqa = q.shape[1] != k.shape[1]
    ours = _grads(lambda a, b, c: st.attention(a, b, c, variant=name, causal=causal, enable_gqa=gqa), q, k, v, dout)
    ref = _grads(lambda a, b, c: _sdpa_ref(a, b, c, causal, gqa), *(x.double() for x in (q, k, v, dout)))
    base = ours if dtype == "float32" else _grads(
        lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=gqa),
        q, k, v, dout)
    eps = {"float32": 2**-23, "float16": 2**-10, "bfloat16": 2**-7}[dtype]
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        r = ref[i]
        err = (ours[i].double() - r).abs().max().item()
        mag = r.abs().max().item()
        if dtype == "float32":
            tol = 2e-5 * max(1.0, mag)
        else:
            factor, ulps = (2.0, 1.0) if what == "out" else (3.0, 2.0)
            tol = factor * (base[i].double() - r).abs().max().item() + ulps * eps * mag
        assert err <= tol, f"{name} {dtype} {what}: err {err:.3g} > tol {tol:.3g} (caps {caps.summary()})"


@pytest.mark.parametrize("name", WITH_BACKWARD)
def test_autograd_dropout_replays_the_mask(name):
    """Gradients with dropout equal the plain API's backward with the same seed, and
    torch.manual_seed makes the sandbox.torch call repeatable."""
    import sandbox.torch as st
    dtype = _dtype(name)
    q, k, v, dout = (_to_torch(x, dtype) for x in _inputs(name, dtype, seed=6))
    gqa = q.shape[1] != k.shape[1]
    torch.manual_seed(123)
    a = _grads(lambda x, y, z: st.attention(x, y, z, variant=name, dropout_p=0.25, enable_gqa=gqa), q, k, v, dout)
    torch.manual_seed(123)
    b = _grads(lambda x, y, z: st.attention(x, y, z, variant=name, dropout_p=0.25, enable_gqa=gqa), q, k, v, dout)
    torch.manual_seed(123)
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    res = sandbox.forward(q, k, v, variant=name, dropout_p=0.25, seed=seed)
    plain = (res.out, *sandbox.backward(dout, res))
    assert torch.equal(a[0], b[0]) and torch.equal(a[0], plain[0])     # the same seed, the same mask
    for x, y, z in zip(a[1:], b[1:], plain[1:]):      # gradients: atomic dQ adds in any order
        torch.testing.assert_close(x.float(), y.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(x.float(), z.float(), rtol=1e-2, atol=1e-2)


def test_variant_without_backward_fails_at_backward_time():
    import sandbox.torch as st
    name = next(n for n, v in sorted(all_variants().items()) if not v.caps.backward and v.backend == "cuda")
    dtype = _dtype(name)
    q, k, v, dout = (_to_torch(x, dtype, grad=True) for x in _inputs(name, dtype, seed=7))
    out = st.attention(q, k, v, variant=name, enable_gqa=q.shape[1] != k.shape[1])
    with pytest.raises(ValueError, match="backward"):
        out.sum().backward()


class _Block(torch.nn.Module):
    def __init__(self, d_model, heads, kv_heads, variant):
        super().__init__()
        self.h, self.kvh, self.dh, self.variant = heads, kv_heads, d_model // heads, variant
        self.q = torch.nn.Linear(d_model, d_model)
        self.kv = torch.nn.Linear(d_model, 2 * kv_heads * self.dh)
        self.o = torch.nn.Linear(d_model, d_model)

    def forward(self, x):
        import sandbox.torch as st
        B, N, _ = x.shape
        q = self.q(x).view(B, N, self.h, self.dh).transpose(1, 2)
        k, v = self.kv(x).view(B, N, 2, self.kvh, self.dh).permute(2, 0, 3, 1, 4).unbind(0)
        y = st.attention(q, k.contiguous(), v.contiguous(), variant=self.variant, causal=True,
                         enable_gqa=self.h != self.kvh)
        return self.o(y.transpose(1, 2).reshape(B, N, -1))


@pytest.mark.parametrize("name", WITH_BACKWARD)
def test_torch_compile_fullgraph(name):
    """A small attention block compiled with fullgraph=True (no graph breaks) matches eager, forward
    and backward; inductor for the default variant, aot_eager (the same tracing, fake kernels and
    autograd formula, without codegen) for the others to keep the suite's compile time down."""
    dtype = _dtype(name)
    # every parameter compiles the same forward code object: without a reset, the ninth variant hits
    # dynamo's recompile limit (8), which fullgraph=True turns into a failure
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = _Block(256, 4, 2 if all_variants()[name].caps.gqa else 4, name).cuda().to(TORCH_DTYPES[dtype])
    x = torch.randn(2, 96, 256, device="cuda", dtype=TORCH_DTYPES[dtype], requires_grad=True)
    backend = "inductor" if name == "fa2-tc" else "aot_eager"
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    y_eager = block(x)
    g_eager = torch.autograd.grad(y_eager.float().square().mean(), x)[0]
    y_comp = compiled(x)
    g_comp = torch.autograd.grad(y_comp.float().square().mean(), x)[0]
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(y_comp, y_eager, rtol=tol, atol=tol)
    torch.testing.assert_close(g_comp, g_eager, rtol=tol * 5, atol=tol)


@pytest.mark.parametrize("name", ["fa3", "fa2-tc"])
def test_new_mask_modifier_on_a_busy_side_stream(name):
    """A mask modifier never seen before, called from torch on a side stream behind a long sleep, in bf16 with
    autograd: its buffers' upload and its tile classes (variants/mask_tiles.py) run on that stream without a
    synchronisation (the call returns while the stream is busy), and the output matches the oracle."""
    from sandbox import modifiers
    import sandbox.torch as st
    dtype = "bfloat16"
    q, k, v, _ = _inputs(name, dtype, seed=5)
    warm = modifiers.document(np.arange(q.shape[2]) // 37)
    st.attention(*(_to_torch(x, dtype) for x in (q, k, v)), variant=name, causal=True, enable_gqa=True, mask_mod=warm)
    torch.cuda.synchronize()                                  # modules built: the call under test compiles nothing
    mm = modifiers.document(np.arange(q.shape[2]) // 41)      # a new mask: new buffers, a new tile table
    src = [_to_torch(x, dtype) for x in (q, k, v)]
    dst = [torch.full_like(x, float("nan")).requires_grad_(True) for x in src]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        with torch.no_grad():
            for d_, s_ in zip(dst, src):
                d_.copy_(s_)
        out = st.attention(*dst, variant=name, causal=True, enable_gqa=True, mask_mod=mm)
        busy = not side.query()
        out.float().sum().backward()
    torch.cuda.synchronize()
    assert busy, "the call waited for the GPU (a synchronisation inside the call)"
    assert out.dtype == torch.bfloat16 and all(x.grad is not None and x.grad.dtype == torch.bfloat16 for x in dst)
    _check_forward(out, q, k, v, dtype, causal=True, mask_mod=mm)


@pytest.mark.parametrize("name", ["fa3", "fa2-tc"])
def test_masks_built_on_the_gpu_never_cross_to_the_host(name):
    """Mask modifiers made from GPU tensors on a busy side stream (document ids as int32, a boolean padding mask
    through the transformers translation): their buffers stay on the device (modifiers.DeviceBuffer), copied on
    that stream, so neither making them nor the call waits for the GPU (the stream is still busy when both
    return), and the output matches the oracle on the same mask."""
    from sandbox import modifiers
    import sandbox.torch as st
    dtype = "bfloat16"
    q, k, v, _ = _inputs(name, dtype, seed=7)
    B, _, N, _ = q.shape
    src = [_to_torch(x, dtype) for x in (q, k, v)]

    def masks_and_calls(group):
        ids = (torch.arange(N, device="cuda", dtype=torch.int32) // group)
        first = torch.arange(B, device="cuda")[:, None] * 29                     # (no host tensor: its copy waits)
        keep = torch.arange(N, device="cuda")[None, :] >= first                   # left padding, per batch row
        pad = (keep[:, None, None, :] & torch.ones(N, N, dtype=torch.bool, device="cuda").tril())
        doc = modifiers.document(ids)
        spec = st._mask_spec(pad, N, N)
        out_doc = st.attention(*src, variant=name, causal=True, enable_gqa=True, mask_mod=doc)
        out_pad = st.attention(*src, variant=name, enable_gqa=True, mask_mod=spec[2])
        return pad, doc, spec, out_doc, out_pad

    masks_and_calls(41)            # every module (ours, torch's, CuPy's copy) loaded: a first load may wait
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        pad, doc, (causal, window, dense), out_doc, out_pad = masks_and_calls(37)    # written behind the sleep
        busy = not side.query()
    torch.cuda.synchronize()
    assert busy, "making a mask from GPU tensors, or the call, waited for the GPU (a synchronisation)"
    assert (causal, window) == (False, None)
    assert isinstance(doc.buffers["q_ids"], modifiers.DeviceBuffer)
    assert isinstance(dense.buffers["allowed"], modifiers.DeviceBuffer)
    np.testing.assert_array_equal(dense.buffers["allowed"].host(), pad.cpu().numpy())
    _check_forward(out_doc, q, k, v, dtype, causal=True, mask_mod=doc)
    # padded query rows see no key (out = 0) in both; the visible ones match the oracle
    _check_forward(out_pad, q, k, v, dtype, mask_mod=dense)


def test_device_buffers_keep_their_copy_and_their_gpu():
    """A device buffer is a copy (a later in-place change of the caller's tensor does not reach the modifier, whose
    tile classes are cached), and the kernels' type: int64 ids become int32, a bool mask stays bool (read as bytes)."""
    from sandbox import modifiers
    ids = torch.arange(64, device="cuda") // 10                       # int64
    mm = modifiers.document(ids)
    ids.zero_()
    buf = mm.buffers["q_ids"]
    assert buf.dtype == np.int32 and buf.shape == (1, 64)
    np.testing.assert_array_equal(buf.host()[0], np.arange(64) // 10)
    assert modifiers.cuda_buffers(mm)[0] is buf.array
    big = torch.full((3,), 2**40, device="cuda")
    with pytest.raises(ValueError, match="int32"):
        modifiers.document(big)
    with pytest.raises(TypeError, match="boolean"):
        modifiers.dense(torch.zeros(1, 1, 4, 4, device="cuda"))


def test_a_models_mask_is_read_in_place_and_let_go_with_it():
    """Without a gradient being recorded, the transformers translation reads a contiguous boolean mask in place (no
    second B Nq Nk bytes); with one it copies it (an in-place change before the backward must not reach it). The
    entry goes when the model frees the mask tensor, although the modifier holds the memory."""
    import gc
    import sandbox.torch as st
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool, device="cuda").tril_()
    mask[1, ..., 0] = False
    assert st._mask_spec(mask, 8, 8)[2].buffers["allowed"].array.data.ptr != mask.data_ptr()      # grad enabled
    n0 = len(st._MASK_SPECS.entries)
    with torch.no_grad():
        dense = st._mask_spec(mask, 8, 8)[2]
    assert dense.buffers["allowed"].array.data.ptr == mask.data_ptr() and len(st._MASK_SPECS.entries) == n0 + 1
    want = mask.cpu().numpy()
    del mask
    gc.collect()
    assert len(st._MASK_SPECS.entries) == n0 - 1              # both entries (with and without a gradient) gone
    np.testing.assert_array_equal(dense.buffers["allowed"].host(), want)       # the memory lives on with it



@pytest.mark.parametrize("name", ["fa3", "fa2-tc"])
def test_modifier_calls_take_a_plan_that_goes_with_them(name):
    """A torch call with a score and a mask modifier is resolved once into a fastpath plan (sandbox/fastpath.py
    mods_key: the generic path cost about 0.6 ms of host time per call), a repeated call reuses it with the same
    result, its backward (fa3: wgmma2's plan) matches the generic path's (CuPy arrays take that), and the plan
    holds neither modifier: when the caller drops them, the plan (and the buffers it holds) goes too."""
    import gc
    import weakref
    import cupy as cp
    from sandbox import fastpath, modifiers
    import sandbox.torch as st
    dtype = "float16"
    q, k, v, _ = _inputs(name, dtype, seed=11)
    src = [_to_torch(x, dtype) for x in (q, k, v)]
    sm, mm = modifiers.softcap(20.0), modifiers.document(np.arange(q.shape[2]) // 37)
    before = set(fastpath._PLANS)
    out1 = st.attention(*src, variant=name, causal=True, enable_gqa=True, score_mod=sm, mask_mod=mm)
    new = [key for key in fastpath._PLANS if key not in before]
    assert len(new) == 1
    plan = fastpath._PLANS[new[0]]
    assert plan.forward is not None and plan.mods is not None and plan.problem.mask_mod is None
    out2 = st.attention(*src, variant=name, causal=True, enable_gqa=True, score_mod=sm, mask_mod=mm)
    assert [key for key in fastpath._PLANS if key not in before] == new
    torch.cuda.synchronize()
    assert torch.equal(out1, out2)
    _check_forward(out2, q, k, v, dtype, causal=True, score_mod=sm, mask_mod=mm)
    # the backward through the plan path against the generic path on the same kernels
    grad = [x.clone().requires_grad_() for x in src]
    out = st.attention(*grad, variant=name, causal=True, enable_gqa=True, score_mod=sm, mask_mod=mm)
    dout = torch.randn_like(out)
    out.backward(dout)
    res = sandbox.forward(*(cp.from_dlpack(x) for x in src), variant=name, causal=True, score_mod=sm, mask_mod=mm)
    generic = sandbox.backward(cp.from_dlpack(dout), res)
    for nm, a, b in zip("qkv", (x.grad for x in grad), generic):
        b = torch.from_dlpack(b).float()
        assert float((a.float() - b).abs().max()) <= 1e-2 * float(b.abs().max()) + 1e-3, f"d{nm}"
    # the same call with another mask: its own plan, its own result
    other = modifiers.document(np.arange(q.shape[2]) // 53)
    out3 = st.attention(*src, variant=name, causal=True, enable_gqa=True, score_mod=sm, mask_mod=other)
    _check_forward(out3, q, k, v, dtype, causal=True, score_mod=sm, mask_mod=other)
    gone, plan_gone = weakref.ref(mm), weakref.ref(plan)
    del mm, plan, res, out
    gc.collect()
    # gone with the mask although the soft-cap (sm) lives on: not held by sm's finalizer either
    assert gone() is None and new[0] not in fastpath._PLANS and plan_gone() is None


def test_a_mask_modifier_under_graph_capture_replays_right():
    """A mask modifier inside a captured CUDA graph: no plan is made or used while capturing (its tile table is
    filled only when the graph runs), and the replay on new inputs matches the oracle."""
    from sandbox import modifiers
    import sandbox.torch as st
    name, dtype = "fa3", "float16"
    q, k, v, _ = _inputs(name, dtype, seed=12)
    mm = modifiers.document(np.arange(q.shape[2]) // 29)
    static = [_to_torch(x, dtype) for x in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            st.attention(*static, variant=name, causal=True, enable_gqa=True, mask_mod=mm)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = st.attention(*static, variant=name, causal=True, enable_gqa=True, mask_mod=mm)
    q2, k2, v2, _ = _inputs(name, dtype, seed=13)
    for s_, x in zip(static, (q2, k2, v2)):
        s_.copy_(_to_torch(x, dtype))
    graph.replay()
    torch.cuda.synchronize()
    _check_forward(out, q2, k2, v2, dtype, causal=True, mask_mod=mm)


def test_inspected_masks_run_as_the_kernels_options():
    """register_transformers(inspect_masks=True): a boolean mask on the GPU is read once (a wait) and a plain causal or
    sliding-window one runs as the kernels' options; uninspected (the default) it is the dense modifier, no wait."""
    import sandbox.torch as st
    n = 64
    tril = torch.ones(2, 1, n, n, dtype=torch.bool, device="cuda").tril_()
    window = tril & ~torch.ones(n, n, dtype=torch.bool, device="cuda").tril(-8)        # the last 8 keys, causal
    assert st._mask_spec(tril, n, n, None, True) == (True, None, None)
    assert st._mask_spec(window, n, n, 8, True) == (True, (7, 0), None)
    causal, win, dense = st._mask_spec(tril, n, n)
    assert (causal, win) == (False, None) and dense.name == "dense"
    padded = tril.clone()
    padded[1, ..., :3] = False
    causal, win, dense = st._mask_spec(padded, n, n, None, True)
    assert (causal, win) == (False, None) and dense.name == "dense"


@pytest.mark.parametrize("name", ["fa3", "fa2-tc"])
@pytest.mark.parametrize("nq", [160, 97])
def test_a_causal_mask_given_densely_matches_causal(name, nq):
    """A bottom-right causal mask given as a dense boolean mask (a model's mask, uninspected): its diagonal tiles are
    TILE_CAUSAL, where the kernels test j - i <= Nk - Nq instead of the mask's bytes; output and gradients match
    causal=True (forward and backward)."""
    from sandbox import modifiers
    import sandbox.torch as st
    g = torch.Generator(device="cuda").manual_seed(21)
    nk = 160
    q = torch.randn(2, 4, nq, 64, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(2, 2, nk, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    tril = (torch.arange(nk, device="cuda")[None, :] - torch.arange(nq, device="cuda")[:, None] <= nk - nq)
    mm = modifiers.dense(tril[None, None])
    go = torch.randn(2, 4, nq, 64, device="cuda", dtype=torch.float16, generator=g)
    res = []
    for kw in (dict(mask_mod=mm), dict(causal=True)):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = st.attention(*xs, variant=name, enable_gqa=True, **kw)
        out.backward(go)
        res.append((out, *(x.grad for x in xs)))
    for nm, a, b in zip(("out", "dq", "dk", "dv"), *res):
        err = float((a.float() - b.float()).abs().max())
        assert err <= 2e-3 * max(1.0, float(b.float().abs().max())), f"{nm}: {err}"


@pytest.mark.parametrize("name", ["fa3", "fa2-tc"])
def test_backward_launches_from_the_forwards_plan(name, monkeypatch):
    """A training call's backward launches from the plan its forward ran on (sandbox.torch._fast_backward), not
    through the generic route (api.backward, about 50 us more host time per call): with the generic route made
    to fail, plain, soft-capped, dropout and expanded-gradient (out.sum()) calls still get the generic route's
    gradients (fa3's soft-cap too); a call the plans do not take (a block mask) still falls back to it."""
    import sandbox.torch as st
    from sandbox import modifiers
    from sandbox.masks import BlockSparse
    dtype = "float16"
    q, k, v, dout = (_to_torch(x, dtype) for x in _inputs(name, dtype, seed=8))
    gqa = q.shape[1] != k.shape[1]
    cases = {"plain": dict(causal=True), "dropout": dict(dropout_p=0.2)}
    if name == "fa3":                 # fa2-tc's backward plans take no modifiers (its generic route does)
        cases["softcap"] = dict(causal=True, score_mod=modifiers.softcap(20.0))
    expected = {}
    for case, kw in cases.items():            # the generic route's gradients (the fast route switched off)
        with monkeypatch.context() as m:
            m.setattr(st, "_fast_backward", lambda *a: None)
            torch.manual_seed(11)
            expected[case] = _grads(lambda a, b, c: st.attention(a, b, c, variant=name, enable_gqa=gqa, **kw),
                                    q, k, v, dout)

    def refuse(*a, **kw):
        raise AssertionError("the generic backward ran")
    with monkeypatch.context() as m:
        m.setattr(st, "_backward", refuse)
        for case, kw in cases.items():
            torch.manual_seed(11)
            got = _grads(lambda a, b, c: st.attention(a, b, c, variant=name, enable_gqa=gqa, **kw), q, k, v, dout)
            assert torch.equal(got[0], expected[case][0]), case
            for x, y in zip(got[1:], expected[case][1:]):       # dQ: atomic adds in any order
                torch.testing.assert_close(x.float(), y.float(), rtol=1e-2, atol=1e-2)
        qs = q.detach().clone().requires_grad_(True)
        out, lse = st.attention(qs, k, v, variant=name, causal=True, enable_gqa=gqa, return_lse=True)
        (out.sum() + lse.sum()).backward()         # an expanded dout; lse takes no gradient and makes none
        ref = _grads(lambda a, b, c: _sdpa_ref(a, b, c, True, gqa), *(x.double() for x in (q, k, v, torch.ones_like(q))))
        torch.testing.assert_close(qs.grad.double(), ref[1], rtol=2e-2, atol=2e-2)
    layout = np.ones((-(-q.shape[2] // 32), -(-k.shape[2] // 32)), bool)
    layout[0, 1:] = False
    bm = BlockSparse(layout, (32, 32))
    got = _grads(lambda a, b, c: st.attention(a, b, c, variant=name, block_mask=bm, enable_gqa=gqa), q, k, v, dout)
    dense = torch.as_tensor(np.repeat(np.repeat(layout, 32, 0), 32, 1)[:q.shape[2], :k.shape[2]], device="cuda")
    ref = _grads(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, attn_mask=dense,
                                                                                   enable_gqa=gqa),
                 *(x.double() for x in (q, k, v, dout)))
    for x, y in zip(got, ref):
        torch.testing.assert_close(x.double(), y, rtol=2e-2, atol=2e-2)


def test_backward_after_a_saved_tensor_hook_changed_the_layout():
    """Activation offloading (torch.autograd.graph.save_on_cpu) gives the saved q, k, v back contiguous, while the
    forward's plan was made for a transposed (B, N, H, d) view: the backward must take the generic path for the
    layout it gets, not launch the plan's kernels with the forward's strides."""
    import sandbox.torch as st
    g = torch.Generator(device="cuda").manual_seed(12)
    q, k, v, dout = (torch.randn(2, 160, 4, 64, device="cuda", dtype=torch.float16, generator=g).transpose(1, 2)
                     for _ in range(4))
    for name in ("fa3", "fa2-tc"):
        want = _grads(lambda a, b, c: st.attention(a.transpose(1, 2).contiguous().transpose(1, 2), b, c, variant=name,
                                                   causal=True), q, k, v, dout)
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            got = _grads(lambda a, b, c: st.attention(a, b, c, variant=name, causal=True), q, k, v, dout)
        for x, y in zip(got, want):
            torch.testing.assert_close(x.float(), y.float(), rtol=1e-2, atol=1e-2)
        ref = _grads(lambda a, b, c: _sdpa_ref(a, b, c, True, False), *(x.double() for x in (q, k, v, dout)))
        for x, y in zip(got[1:], ref[1:]):
            torch.testing.assert_close(x.double(), y, rtol=2e-2, atol=2e-2)


def test_a_double_backward_is_refused_not_silently_wrong():
    """The backward is not differentiable: where a second-order graph would pass through it (an incoming gradient
    that itself requires grad), differentiating again raises (once_differentiable) instead of dropping the
    attention's second-order terms."""
    import sandbox.torch as st
    q, k, v = (torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    w = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    out = st.attention(q, k, v, variant="fa3", causal=True)
    (gq,) = torch.autograd.grad((out * w).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (gq.float().sum() + (q.float() ** 2).sum()).backward()
