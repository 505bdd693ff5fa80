"""Packed variable-length batches (sandbox/varlen.py) against the oracle per sequence, on the CPU
with a Numba variant under the simulator; sandbox.torch.varlen_attention's gradients; the checks."""
import numpy as np
import pytest

from sandbox import oracle, tolerance, varlen

VARIANT = "numba-rowwise"        # a simulator variant: causal, window, GQA, backward


def _seq(x, a, b):
    return x[a:b].transpose(1, 0, 2)[None]


def _packed(cu_q, cu_k, hq=4, hkv=2, d=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((cu_q[-1], hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((cu_k[-1], hkv, d)).astype(np.float32) for _ in range(2))
    return q, k, v, rng.standard_normal(q.shape).astype(np.float32)


@pytest.mark.parametrize("opts", [{}, {"causal": True}, {"window": (3, 0)}], ids=["full", "causal", "window"])
def test_each_sequence_is_its_own_problem(opts):
    """Sequences of different lengths, Nq != Nk within one, an empty query span, a sequence without
    keys (dead rows: out 0, lse -inf): forward and backward equal the oracle on each sequence."""
    cu_q, cu_k = [0, 5, 5, 12, 20], [0, 7, 9, 9, 20]
    q, k, v, dout = _packed(cu_q, cu_k)
    out, lse = varlen.forward(q, k, v, cu_q, cu_k, variant=VARIANT, **opts)
    dq, dk, dv = varlen.backward(dout, q, k, v, out, lse, cu_q, cu_k, variant=VARIANT, **opts)
    assert out.shape == q.shape and lse.shape == (4, 20) and lse.dtype == np.float32
    for s in range(4):
        a, b, c, e = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        if c == e:
            assert not out[a:b].any() and np.all(np.isneginf(lse[:, a:b]))
            continue
        if a == b:
            assert not dk[c:e].any() and not dv[c:e].any()       # keys nobody attends to
            continue
        ro, rl = oracle.forward(_seq(q, a, b), _seq(k, c, e), _seq(v, c, e), **opts)
        assert tolerance.compare("out", _seq(out, a, b), ro, "float32").ok
        assert tolerance.compare("lse", lse[:, a:b][None], rl, "float32").ok
        grads = oracle.backward(_seq(dout, a, b), _seq(q, a, b), _seq(k, c, e), _seq(v, c, e), **opts)
        for name, got, ref in zip(("dq", "dk", "dv"), (_seq(dq, a, b), _seq(dk, c, e), _seq(dv, c, e)), grads):
            assert tolerance.compare(name, got, ref, "float32").ok, (s, name)


def test_torch_entry_point_gradients():
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("sandbox.torch")
    cu = [0, 6, 16]
    q, k, v, dout = (torch.from_numpy(x) for x in _packed(cu, cu, hq=2, hkv=2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = st.varlen_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), cu, causal=True, variant=VARIANT)
    out.backward(dout)
    ref_out, _ = oracle.forward(_seq(q.detach().numpy(), 6, 16), _seq(k.detach().numpy(), 6, 16),
                                _seq(v.detach().numpy(), 6, 16), causal=True)
    assert tolerance.compare("out", _seq(out.detach().numpy(), 6, 16), ref_out, "float32").ok
    ref = oracle.backward(_seq(dout.numpy(), 0, 6), *(_seq(x.detach().numpy(), 0, 6) for x in (q, k, v)), causal=True)
    assert tolerance.compare("dq", _seq(q.grad.numpy(), 0, 6), ref[0], "float32").ok


def test_offsets_changed_in_place_before_the_backward_are_refused():
    """Offsets given as tensors are saved for the backward with their version: a loader that reuses the buffer
    before the backward gets autograd's error, not the gradients of other sequences."""
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("sandbox.torch")
    cu = [0, 6, 16]
    q, k, v, dout = (torch.from_numpy(x) for x in _packed(cu, cu, hq=2, hkv=2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    offsets = torch.tensor(cu, dtype=torch.int32)
    out = st.varlen_attention(q, k, v, offsets, offsets, causal=True, variant=VARIANT)
    offsets[1] = 8
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(dout)


@pytest.mark.parametrize("cu_q,cu_k,kwargs,err,match", [
    ([0, 5, 4], [0, 3, 8], {}, ValueError, "cu_seqlens_q"),                     # decreasing
    ([0, 4, 8], [0, 8], {}, ValueError, "as many sequences"),
    ([0, 4, 9], [0, 3, 8], {}, ValueError, "packed length 8"),
    ([0.0, 8.0], [0, 8], {}, TypeError, "integer"),
    ([0, 4, 8], [0, 3, 8], {"dropout_p": 0.1}, ValueError, "dropout_p"),
    ([0, 4, 8], [0, 3, 8], {"max_seqlen_q": 3}, ValueError, "max_seqlen_q"),
])
def test_checks_before_any_launch(cu_q, cu_k, kwargs, err, match):
    q, k, v, _ = _packed([0, 8], [0, 8])
    with pytest.raises(err, match=match):
        varlen.forward(q, k, v, cu_q, cu_k, variant=VARIANT, **kwargs)


@pytest.mark.parametrize("which", ["k", "v", "out", "dout"])
def test_dtypes_are_checked_before_any_launch(which):
    """k, v, out and dout in q's dtype, refused by name before any launch: the packed backward's row kernel sizes every
    row by q's dtype (kernels_cu/varlen_rows.cu), and would read and write past the narrower arrays' rows."""
    q, k, v, dout = _packed([0, 8], [0, 8])
    out = np.zeros_like(q)
    lse = np.zeros((q.shape[1], q.shape[0]), np.float32)
    arrs = {"q": q, "k": k, "v": v, "out": out, "dout": dout}
    arrs[which] = arrs[which].astype(np.float32 if arrs[which].dtype != np.float32 else np.float16)
    with pytest.raises(TypeError, match=f"{which} must have q's dtype"):
        if which in ("k", "v"):
            varlen.forward(arrs["q"], arrs["k"], arrs["v"], [0, 8], [0, 8], variant=VARIANT)
        else:
            varlen.backward(arrs["dout"], q, k, v, arrs["out"], lse, [0, 8], [0, 8], variant=VARIANT)


@pytest.mark.parametrize("bad,err,match", [
    ("cu_float", TypeError, "int32 or int64"), ("k_dtype", TypeError, "k must have q's dtype"),
    ("out_dtype", TypeError, "out must have q's dtype"), ("k_rows", ValueError, "share one shape|as many packed rows"),
    ("lse_shape", ValueError, "lse must be float32"),
])
def test_document_inputs_refuses_before_its_launch(bad, err, match):
    """sandbox.varlen.document_inputs (the packed backward's one-launch preparation) runs the entry points' checks
    first: its kernel sizes every row by q's dtype and k's heads. CPU tensors stand in (the checks read shapes,
    dtypes and strides alone), so this runs without a GPU."""
    torch = pytest.importorskip("torch")
    q = torch.zeros(8, 4, 16, dtype=torch.float16)
    k = v = torch.zeros(8, 2, 16, dtype=torch.float16)
    out, dout, lse = q.clone(), q.clone(), torch.zeros(4, 8)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    args = {"cu": cu, "q": q, "out": out, "dout": dout, "k": k, "v": v, "lse": lse}
    if bad == "cu_float":
        args["cu"] = cu.float()
    elif bad == "k_dtype":
        args["k"] = args["v"] = k.float()
    elif bad == "out_dtype":
        args["out"] = out.float()
    elif bad == "k_rows":
        args["k"] = args["v"] = torch.zeros(9, 2, 16, dtype=torch.float16)
    else:
        args["lse"] = torch.zeros(4, 7)
    with pytest.raises(err, match=match):
        varlen.document_inputs(**args)


def test_packed_shapes_are_checked():
    q, k, v, _ = _packed([0, 8], [0, 8])
    with pytest.raises(ValueError, match="packed"):
        varlen.forward(q[None], k, v, [0, 8], [0, 8], variant=VARIANT)


@pytest.mark.parametrize("cu_q,cu_k,max_q,err,match", [
    ("f32", "i32", 8, TypeError, "cu_seqlens_q must be a 1-D int32 or int64"),
    ("i32", "2d", 8, TypeError, "cu_seqlens_k must be a 1-D int32 or int64"),
    ("one", "one", 8, TypeError, "S \\+ 1 >= 2"),
    ("strided", "i32", 8, ValueError, "contiguous"),
    ("i32", "short", 8, ValueError, "as many sequences"),
    ("i32", "i32", -1, ValueError, "max_seqlen_q=-1"),
    ("i32", "i32", True, ValueError, "max_seqlen_q=True"),
    ("i32", "i32", 8.0, ValueError, "max_seqlen_q=8.0"),
])
def test_offsets_on_the_gpu_are_checked_for_what_the_host_can_see(cu_q, cu_k, max_q, err, match):
    """GPU offsets are read only by the kernel (their values would need a wait): the host refuses what it sees
    without reading them, before any launch: dtype, rank, length, stride, S agreement, max_seqlen types. The checks
    read shapes, dtypes and strides alone, so CPU tensors stand in for CUDA ones here."""
    torch = pytest.importorskip("torch")
    arrs = {"i32": torch.tensor([0, 4, 8], dtype=torch.int32), "f32": torch.tensor([0.0, 4.0, 8.0]),
            "2d": torch.zeros(3, 1, dtype=torch.int32), "one": torch.zeros(1, dtype=torch.int32),
            "strided": torch.tensor([0, 0, 4, 0, 8, 0], dtype=torch.int32)[::2],
            "short": torch.tensor([0, 8], dtype=torch.int32)}
    with pytest.raises(err, match=match):
        varlen._check_device_offsets(arrs[cu_q], arrs[cu_k], max_q, None)
    varlen._check_device_offsets(arrs["i32"], arrs["i32"].long(), 8, 8)     # mixed types are taken (converted)
