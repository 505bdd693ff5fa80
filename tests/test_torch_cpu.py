"""sandbox.torch without a GPU: the custom ops' fake (meta) kernels, the entry point's checks (all
raised before anything launches) and the transformers mask translation. Skipped without PyTorch."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("sandbox.torch")


def _meta(*shape, dtype=torch.float16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_fake_kernels_give_shapes_and_dtypes():
    q, k = _meta(2, 4, 10, 64), _meta(2, 2, 12, 64)
    out, lse = torch.ops.sandbox.attention_fwd(q, k, k, None, "", "", True, 0.125, 0.0, False, None, None, None, 0, 0)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 4, 10) and lse.dtype == torch.float32
    dq, dk, dv = torch.ops.sandbox.attention_bwd(out, q, k, k, out, lse, None, "", "", True, 0.125, 0.0, False, None,
                                                 None, None, 0, 0)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)


@pytest.mark.parametrize("kwargs,err,match", [
    ({"enable_gqa": 1}, TypeError, "enable_gqa"),
    ({"variant": object()}, TypeError, "variant"),
    ({"dropout_p": "0.1"}, TypeError, "dropout_p"),
    ({"dropout_store": "packed", "dropout_p": 0.1}, ValueError, "packed"),
    ({"block_mask": np.ones((1, 1, 1), bool)}, TypeError, "BlockSparse"),
])
def test_entry_point_checks(kwargs, err, match):
    q = torch.zeros(1, 2, 8, 16, dtype=torch.float16)
    with pytest.raises(err, match=match):
        st.attention(q, q, q, **kwargs)


def test_gqa_needs_enable_gqa_as_in_sdpa():
    q, k = torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="enable_gqa"):
        st.attention(q, k, k)


def test_transformers_masks_translate_or_are_refused():
    nq, nk = 3, 5
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    causal = (j <= i + nk - nq)[None, None]
    assert st._causal_from_mask(causal, nq, nk) == (True, None)
    assert st._causal_from_mask(torch.ones(1, 1, nq, nk, dtype=torch.bool), nq, nk) == (False, None)
    additive = torch.where(causal, 0.0, float("-inf"))
    assert st._causal_from_mask(additive, nq, nk) == (True, None)
    padded = causal.clone()
    padded[..., 0] = False
    with pytest.raises(ValueError, match="neither causal"):
        st._causal_from_mask(padded, nq, nk)
    # transformers' sliding window (Mistral, Gemma 2): key j seen from query i iff i' - w < j <= i'
    sliding = causal & (j > i + nk - nq - 2)[None, None]
    assert st._causal_from_mask(sliding, nq, nk, sliding_window=2) == (True, (1, 0))
    with pytest.raises(ValueError, match="neither causal"):
        st._causal_from_mask(sliding, nq, nk)                    # a window the model did not declare
    with pytest.raises(ValueError, match="neither causal"):
        st._causal_from_mask(sliding, nq, nk, sliding_window=3)  # nor one of another width
    # anything else is a dense mask modifier of exactly the visible pairs, one object per mask tensor
    padded4 = padded.expand(2, 1, nq, nk).clone()
    padded4[1, ..., :2] = False
    causal_flag, window, mod = st._mask_spec(padded4, nq, nk)
    assert (causal_flag, window) == (False, None) and mod.name == "dense"
    np.testing.assert_array_equal(mod.buffers["allowed"] != 0, padded4.numpy())
    assert st._mask_spec(padded4, nq, nk)[2] is mod
    additive4 = torch.where(padded4, 0.0, torch.finfo(torch.float32).min)
    np.testing.assert_array_equal(st._mask_spec(additive4, nq, nk)[2].buffers["allowed"] != 0, padded4.numpy())
    assert st._mask_spec(causal, nq, nk) == (True, None, None)
    # transformers' attention functions take a wider mask's first nk columns (cache room after them)
    wide = torch.cat([causal, torch.zeros(1, 1, nq, 3, dtype=torch.bool)], -1)
    assert st._causal_from_mask(wide, nq, nk) == (True, None)
    # an additive mask is 0 / very negative; a bias folded into it would be dropped: refused
    assert st._causal_from_mask(torch.where(causal, 0.0, float("-inf")), nq, nk) == (True, None)
    with pytest.raises(ValueError, match="bias"):
        st._mask_spec(torch.where(causal, 0.5, torch.finfo(torch.float32).min), nq, nk)
    with pytest.raises(ValueError, match="does not cover"):
        st._mask_spec(causal[..., :nk - 1], nq, nk)
    # a (B, 1, 1, nk) key-padding mask broadcasts over the queries; inference tensors (no version counter) work
    with torch.inference_mode():
        keys = torch.ones(2, 1, 1, nk, dtype=torch.bool)
        keys[0, ..., :2] = False
        _, _, mod = st._mask_spec(keys, nq, nk)
        assert mod.buffers["allowed"].shape == (2, 1, nq, nk) and st._mask_spec(keys, nq, nk)[2] is mod
        np.testing.assert_array_equal(mod.buffers["allowed"], keys.expand(2, 1, nq, nk).numpy())


def test_mask_translations_go_with_their_mask_tensor():
    """A mask's translation (a dense modifier: on the GPU, a device copy of B Nq Nk bytes) is dropped when the model
    frees the mask tensor, not held until seven newer masks push it out."""
    import gc
    nq = nk = 4
    mask = torch.ones(2, 1, nq, nk, dtype=torch.bool).tril_()
    mask[1, ..., 0] = False
    before = len(st._MASK_SPECS.entries)
    st._mask_spec(mask, nq, nk)
    assert len(st._MASK_SPECS.entries) == before + 1
    del mask
    gc.collect()
    assert len(st._MASK_SPECS.entries) == before


def test_transformers_registration_honours_softcap_and_sliding_window(monkeypatch):
    """The registered attention function takes what Gemma 2 / Mistral pass beside the mask: softcap becomes the
    soft-cap modifier (one object per value), sliding_window a causal window; a sink or head mask is refused."""
    transformers = pytest.importorskip("transformers")
    calls = []
    monkeypatch.setattr(st, "attention", lambda q, k, v, **kw: calls.append(kw) or q)
    registered = {}
    monkeypatch.setattr(transformers.AttentionInterface, "register", classmethod(
        lambda cls, name, fn: registered.setdefault(name, fn)))
    fn = registered[st.register_transformers("sandbox-test")]
    q = torch.zeros(1, 2, 6, 8)
    module = type("M", (), {"is_causal": True})()
    fn(module, q, q, q, None, softcap=50.0, sliding_window=4)
    kw = calls[-1]
    assert kw["score_mod"].name == "softcap" and kw["score_mod"].params == {"cap": 50.0}
    assert kw["causal"] and kw["window"] == (3, 0)
    fn(module, q, q, q, None, softcap=50.0, sliding_window=8)        # the window does not bind: none
    assert calls[-1]["window"] is None and calls[-1]["score_mod"] is kw["score_mod"]
    fn(module, q, q, q, None)
    assert "score_mod" not in calls[-1]
    with pytest.raises(ValueError, match="s_aux"):
        fn(module, q, q, q, None, s_aux=torch.zeros(2))
    pad = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    pad[..., :2] = False                                           # left padding: a dense mask modifier
    fn(module, q, q, q, pad)
    assert calls[-1]["mask_mod"].name == "dense" and not calls[-1]["causal"]


def test_a_plan_with_modifiers_goes_with_either_of_them():
    """fastpath plans with modifiers: dropped when either modifier dies, and not kept alive by the other one's
    finalizer (a cached soft-cap lives for the whole run while a new mask comes each step: its plan, with the
    mask's buffers, must go with the mask)."""
    import gc
    import types
    import weakref
    from sandbox import fastpath, modifiers
    from sandbox.problem import make_problem
    q = torch.zeros(1, 2, 8, 16, dtype=torch.float16)
    bound = types.SimpleNamespace(variant=types.SimpleNamespace(impl=object()))     # no forward_plan
    sm = modifiers.softcap(30.0)
    refs = []
    for step in range(3):
        mm = modifiers.document(np.arange(8) // (step + 2))
        key = ("test-plan", step, id(sm), id(mm))
        plan = fastpath.make_plan(key, bound, make_problem(q, q, q, score_mod=sm, mask_mod=mm), q, q, q)
        assert plan.problem.mask_mod is None and fastpath.full_problem(plan).mask_mod is mm
        assert fastpath.lookup(key, sm, mm) is plan and fastpath.lookup(key, sm, None) is None
        refs.append((key, weakref.ref(plan)))
        del plan, mm
    gc.collect()
    assert all(key not in fastpath._PLANS and ref() is None for key, ref in refs)


def test_a_launch_plans_scratch_buffers_share_one_allocation():
    """LaunchPlan.scratch: the uninitialised buffers that are not results, at 256-byte aligned offsets that do not
    overlap (fastpath._run allocates scratch_bytes once per call and hands out base + offset); results, zeroed
    buffers and the stream's counters keep their own."""
    from sandbox.launch import COUNTERS, LaunchPlan
    buffers = {"D": ((2, 3, 5), "float32", False), "lse_pad": ((6, 128), "float32", False),
               "dq_acc": ((2, 3, 7, 64), "float32", False), "tmp16": ((3,), "float16", False),
               "dq": ((2, 3, 5, 64), "float16", False), "dk": ((2, 1, 5, 64), "float16", False),
               "zeros": ((4,), "float32", True), "sched": ((1,), "uint32", COUNTERS)}
    plan = LaunchPlan(buffers, run=lambda *a: None)
    assert list(plan.scratch) == ["D", "lse_pad", "dq_acc", "tmp16"]
    spans = []
    for name, at in plan.scratch.items():
        shape, dtype, _ = buffers[name]
        size = int(np.prod(shape)) * (4 if dtype == "float32" else 2)
        assert at % 256 == 0
        spans.append((at, at + size))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= plan.scratch_bytes
    assert LaunchPlan({"out": ((1,), "float16", False)}, run=None).scratch_bytes == 0
