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
    assert st._causal_from_mask(causal, nq, nk) is True
    assert st._causal_from_mask(torch.ones(1, 1, nq, nk, dtype=torch.bool), nq, nk) is False
    additive = torch.where(causal, 0.0, float("-inf"))
    assert st._causal_from_mask(additive, nq, nk) is True
    padded = causal.clone()
    padded[..., 0] = False
    with pytest.raises(ValueError, match="neither causal"):
        st._causal_from_mask(padded, nq, nk)
