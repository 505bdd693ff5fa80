"""NumPy tile-loop models of the FA1 and FA2 kernels against the oracle (CPU, Hypothesis): tile skipping,
split-Q/split-K reductions and the column-parallel backward compute exactly attention."""
import numpy as np
from hypothesis import given, strategies as st

from sandbox import oracle, tile_models
from sandbox.masks import BlockSparse


@st.composite
def problems(draw):
    Nq, Nk, d = draw(st.integers(1, 20)), draw(st.integers(1, 20)), draw(st.sampled_from([1, 3, 4]))
    Hkv = draw(st.sampled_from([1, 2])); Hq = Hkv * draw(st.sampled_from([1, 2]))
    kw = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(0, 8))
        kw["window"] = (draw(side), draw(side))
    if draw(st.booleans()):
        bq, bk = draw(st.integers(1, 7)), draw(st.integers(1, 7))
        layout = np.random.default_rng(draw(st.integers(0, 99))).random((Hq, -(-Nq // bq), -(-Nk // bk))) < 0.6
        kw["block_mask"] = BlockSparse(layout, (bq, bk))
    if draw(st.booleans()):
        kw.update(dropout_p=0.3, seed=draw(st.integers(0, 2**40)))
    tiles = dict(block_r=draw(st.sampled_from([1, 4, 8])), block_c=draw(st.sampled_from([4, 8])))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    q, k, v = rng.standard_normal((1, Hq, Nq, d)), rng.standard_normal((1, Hkv, Nk, d)), rng.standard_normal((1, Hkv, Nk, d))
    return q, k, v, rng.standard_normal((1, Hq, Nq, d)), kw, tiles


@given(problems(), st.sampled_from([("q", 1), ("k", 2), ("k", 4)]))
def test_fa2_forward_model(problem, split):
    q, k, v, _, kw, tiles = problem
    out, lse = tile_models.fa2_forward(q, k, v, split=split[0], warps=split[1], **tiles, **kw)
    ref_out, ref_lse = oracle.forward(q, k, v, **kw)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12)


@given(problems(), st.sampled_from([("q", 1), ("k", 2), ("k", 4)]))
def test_fa1_forward_model(problem, split):
    """K/V-outer loop with O, l, m written back every step: the same numbers as the oracle."""
    q, k, v, _, kw, tiles = problem
    out, lse = tile_models.fa1_forward(q, k, v, split=split[0], warps=split[1], **tiles, **kw)
    ref_out, ref_lse = oracle.forward(q, k, v, **kw)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12)


@given(problems())
def test_fa2_backward_model(problem):
    q, k, v, dout, kw, tiles = problem
    got = tile_models.fa2_backward(dout, q, k, v, **tiles, **kw)
    for g, r in zip(got, oracle.backward(dout, q, k, v, **kw)):
        np.testing.assert_allclose(g, r, atol=1e-11)


@given(st.integers(0, 2**31), st.sampled_from([0.0, 2.0, 8.0]), st.sampled_from([("q", 1), ("k", 4)]),
       st.floats(0.05, 1.5), st.sampled_from([5, 60]), st.booleans())
def test_conditional_rescaling_keeps_p_bounded_and_the_result_exact(seed, slack, split, ramp, Nq, causal):
    """Scores that rise along the keys (by `ramp` per key, plus noise) move each row's max in small and
    large steps: the rows that keep their max (rises within the slack) and the rows that move it give the
    oracle's output and lse, and no P exceeds 2^slack (the kernels convert P to fp16 / bf16); causal with
    Nq > Nk has dead rows (max -inf throughout) and rows whose first tiles are masked."""
    rng = np.random.default_rng(seed)
    Nk, d = 48, 4
    q = np.zeros((1, 1, Nq, d)); q[..., 0] = 1.0
    k = rng.standard_normal((1, 1, Nk, d)) * 0.3
    k[..., 0] += ramp * np.arange(Nk) * rng.uniform(0.5, 1.5, Nk)
    v = rng.standard_normal((1, 1, Nk, d))
    p_max = []
    out, lse = tile_models.fa2_forward(q, k, v, block_r=4, block_c=8, split=split[0], warps=split[1], scale=1.0,
                                       causal=causal, rescale_slack=slack, p_max=p_max)
    ref_out, ref_lse = oracle.forward(q, k, v, scale=1.0, causal=causal)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12)
    assert max(p_max) <= 2.0 ** slack * (1 + 1e-12)
    if slack == 8.0 and ramp <= 0.5 and not causal:       # a tile rises by about 8 ramp nats = 11.5 ramp bits: within the slack
        assert max(p_max) > 2.0, "the case keeps some rows' max through a rise (the skip runs)"
