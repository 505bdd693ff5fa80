"""Score and mask modifiers (issue 18): validation, the oracle's semantics, tile classification,
the Numba variants under the CUDA simulator against the oracle, and a user's modifier with a
deliberately wrong NumPy twin that the fuzzer must catch. Tiny shapes and few examples: fast on CI."""
import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import Phase, given, settings

import sandbox
from sandbox import fuzz, modifiers, oracle
from sandbox.masks import (TILE_BAND, TILE_CAUSAL, TILE_EMPTY, TILE_FULL, TILE_PARTIAL, Band, BlockSparse, classify_tiles,
                          classify_tiles_mod)
from sandbox.modifiers import MaskMod, ScoreMod
from sandbox.registry import all_variants

NUMBA = sorted(n for n, v in all_variants().items() if v.backend == "numba")
# examples per variant and direction: numba-rowwise simulates cheaply, the tiled kernels do not
EXAMPLES = {"numba-rowwise": 12}


def qkv(B=1, Hq=2, Hkv=2, Nq=5, Nk=6, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, Nq, d)), rng.standard_normal((B, Hkv, Nk, d)),
            rng.standard_normal((B, Hkv, Nk, d)))


# ---- a user's modifier: a quadratic distance penalty, and a wrong NumPy twin of it

def _quad_scalar(s, b, h, i, j, alpha):
    return s - alpha[0] * (j - i) * (j - i)


def _quad_np(s, b, h, i, j, alpha):
    return s - alpha[0] * (j - i) ** 2


def _quad_wrong_np(s, b, h, i, j, alpha):
    return s - alpha[0] * np.abs(j - i)            # the bug: |j - i| where the kernel squares it


def _one_np(s, b, h, i, j, alpha):
    return np.ones_like(s)


def _one_scalar(s, b, h, i, j, alpha):
    return 1.0


def quadratic(alpha=0.3, numpy_form=_quad_np) -> ScoreMod:
    return ScoreMod("quadratic_distance", numpy_form, _quad_scalar, "s - alpha[0] * (float)((j - i) * (j - i))",
                    grad=_one_np, scalar_grad=_one_scalar, cuda_grad="1.0f", buffers={"alpha": [alpha]})


# ---- validation

@pytest.mark.parametrize("make,error,match", [
    (lambda: modifiers.softcap(0.0), ValueError, "softcap: cap"),
    (lambda: modifiers.softcap("1"), TypeError, "softcap: cap"),
    (lambda: modifiers.alibi([[1.0]]), ValueError, "alibi: slopes"),
    (lambda: modifiers.relative_bias(np.zeros((2, 4)), 2), ValueError, "relative_bias: table"),
    (lambda: modifiers.relative_bias(np.zeros((2, 5)), 2.0), TypeError, "max_distance"),
    (lambda: modifiers.sinks([]), ValueError, "sink logits"),
    (lambda: modifiers.sinks([np.inf]), ValueError, "sink logits"),
    (lambda: modifiers.document([0.5, 1.0]), TypeError, "document: seq_ids"),
    (lambda: modifiers.prefix_lm(-1), ValueError, "prefix_lm: prefix_len"),
    (lambda: modifiers.prefix_lm(2.5), TypeError, "prefix_lm: prefix_len"),
    (lambda: modifiers.dense(np.ones((2, 3, 4))), TypeError, "dense: the mask must be boolean"),
    (lambda: modifiers.dense(np.ones((2, 3, 4), bool)), ValueError, "dense: the mask must be 4-D"),
    (lambda: ScoreMod("x", None, _quad_scalar, "s"), TypeError, "numpy"),
    (lambda: ScoreMod("x", _quad_np, _quad_scalar, ""), TypeError, "cuda"),
    (lambda: ScoreMod("x", _quad_np, _quad_scalar, "s", grad=_one_np), ValueError, "all three forms"),
    (lambda: ScoreMod("x", _quad_np, _quad_scalar, "s", buffers={"j": [1.0]}), ValueError, "buffer name 'j'"),
    (lambda: ScoreMod("x", _quad_np, _quad_scalar, "s", buffers={"a": ["x"]}), TypeError, "buffer 'a'"),
    (lambda: MaskMod("", _quad_np, _quad_scalar, "true"), TypeError, "MaskMod name"),
    # Numba's CUDA inliner takes no *args (the simulator did): refused on every machine
    (lambda: ScoreMod("x", _quad_np, lambda s, b, h, i, j, *bufs: s, "s"), TypeError, r"scalar: .*\*bufs"),
    (lambda: ScoreMod("x", _quad_np, _quad_scalar, "s", grad=_one_np, scalar_grad=lambda *a: 1.0, cuda_grad="1.0f"),
     TypeError, r"scalar_grad: .*\*a"),
    (lambda: MaskMod("x", _quad_np, lambda b, h, i, j, **kw: True, "true"), TypeError, r"scalar: .*\*\*kw"),
])
def test_modifier_arguments_are_validated(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_a_checked_scalar_form_is_remembered_and_a_refused_one_is_not():
    """_scalar_form remembers the forms it has read (a modifier made per call skips inspect.signature) and never the
    ones it refused: the same *args function is refused every time."""
    from sandbox.modifiers import _SCALAR_FORMS_OK

    def bad(s, b, h, i, j, *bufs):
        return s
    for _ in range(2):
        with pytest.raises(TypeError, match=r"scalar: .*\*bufs"):
            ScoreMod("x", _quad_np, bad, "s")
    assert bad not in _SCALAR_FORMS_OK
    ScoreMod("x", _quad_np, _quad_scalar, "s")
    assert _quad_scalar in _SCALAR_FORMS_OK


@pytest.mark.parametrize("kw,error,match", [
    ({"score_mod": "softcap"}, TypeError, "score_mod must be"),
    ({"mask_mod": modifiers.softcap(1.0)}, TypeError, "mask_mod must be"),
    ({"score_mod": modifiers.alibi([0.1, 0.2, 0.3])}, ValueError, "alibi: slopes has 3 heads"),
    ({"mask_mod": modifiers.document([0, 0, 1])}, ValueError, "document: seq_ids"),
    ({"score_mod": modifiers.sinks([1.0, 2.0, 3.0])}, ValueError, "sink logits"),
])
def test_api_validates_modifiers_before_launch(kw, error, match):
    q, k, v = (x.astype(np.float32) for x in qkv())
    with pytest.raises(error, match=match):
        sandbox.forward(q, k, v, variant="numba-rowwise", **kw)


def test_variants_without_the_capability_refuse_modifiers():
    q, k, v = (x.astype(np.float32) for x in qkv())
    for kw, cap in (({"score_mod": modifiers.softcap(5.0)}, "score_mod"),
                    ({"mask_mod": modifiers.prefix_lm(2)}, "mask_mod")):
        with pytest.raises(ValueError, match=rf"variant 'standard'.*\({cap}\)"):
            sandbox.forward(q, k, v, variant="standard", **kw)       # no GPU here: refused before any launch
    rows = {r["name"]: r["capabilities"] for r in sandbox.variants()}
    assert rows["numba-rowwise"]["score_mod"] and rows["numba-rowwise"]["mask_mod"]
    assert not rows["standard"]["score_mod"] and not rows["fa2-tc-naive"]["mask_mod"]
    assert rows["fa2-tc"]["score_mod"] and rows["fa2-tc"]["mask_mod"]         # compiled in (tests/test_modifiers_tc.py)


def test_forward_only_modifier_refuses_the_backward():
    mod = ScoreMod("forward_only", _quad_np, _quad_scalar, "s", buffers={"alpha": [0.1]})
    q, k, v = (x.astype(np.float32) for x in qkv(Nq=2, Nk=2, d=2))
    res = sandbox.forward(q, k, v, variant="numba-rowwise", score_mod=mod)
    with pytest.raises(ValueError, match="no derivative"):
        sandbox.backward(np.ones_like(q), res)
    with pytest.raises(ValueError, match="no derivative"):
        oracle.backward(np.ones_like(q), q, k, v, score_mod=mod)


def test_backward_reuses_the_forwards_modifiers():
    q, k, v = (x.astype(np.float32) for x in qkv(Nq=3, Nk=3, d=2))
    mod = modifiers.softcap(2.0)
    res = sandbox.forward(q, k, v, variant="numba-rowwise", score_mod=mod)
    with pytest.raises(ValueError, match="score_mod=.*differs"):
        sandbox.backward(np.ones_like(q), res, score_mod=modifiers.softcap(2.0))
    sandbox.backward(np.ones_like(q), res, score_mod=mod)          # the forward's own object is fine


# ---- the oracle's semantics

def test_softcap_with_a_huge_cap_is_plain_attention():
    q, k, v = qkv()
    out, lse = oracle.forward(q, k, v, causal=True, score_mod=modifiers.softcap(1e6))
    ref_out, ref_lse = oracle.forward(q, k, v, causal=True)
    np.testing.assert_allclose(out, ref_out, atol=1e-9)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-9)
    capped, _ = oracle.forward(q * 10, k, v, score_mod=modifiers.softcap(1.0))
    assert not np.allclose(capped, oracle.forward(q * 10, k, v)[0], atol=1e-3)   # a small cap changes it


def test_alibi_with_zero_slopes_is_plain_attention():
    q, k, v = qkv(Hq=4, Hkv=2)
    mod = modifiers.alibi(np.zeros(4))
    for got, want in zip(oracle.forward(q, k, v, score_mod=mod), oracle.forward(q, k, v)):
        np.testing.assert_array_equal(got, want)
    dout = np.ones_like(q)
    for got, want in zip(oracle.backward(dout, q, k, v, score_mod=mod), oracle.backward(dout, q, k, v)):
        np.testing.assert_array_equal(got, want)


def test_alibi_and_relative_bias_add_their_bias():
    """ALiBi is a relative bias with one entry per distance: slope_h * (j - i) for |j - i| <= D."""
    q, k, v = qkv(Nq=4, Nk=4)
    slopes = np.array([-0.5, 0.25])
    dist = 3
    table = slopes[:, None] * np.arange(-dist, dist + 1)[None, :]
    a = oracle.forward(q, k, v, score_mod=modifiers.alibi(slopes))
    r = oracle.forward(q, k, v, score_mod=modifiers.relative_bias(table, dist))
    for x, y in zip(a, r):
        np.testing.assert_allclose(x, y, atol=1e-12)


def test_sinks_are_an_extra_key_with_no_value():
    """A sink logit per head equals one more key, visible to every row, whose score is sink_h and
    whose value row is zero (built with an extra dimension of q and k)."""
    q, k, v = qkv(Nq=4, Nk=5, d=3)
    sink = np.array([0.7, -1.2])
    scale = 1 / math.sqrt(3)
    B, H, Nk, d = k.shape
    q2 = np.concatenate([q, np.ones(q.shape[:3] + (1,))], axis=-1)
    k_sink = np.zeros((B, H, 1, d + 1))
    k_sink[..., 0, d] = sink / scale
    k2 = np.concatenate([k_sink, np.concatenate([k, np.zeros(k.shape[:3] + (1,))], axis=-1)], axis=2)
    v2 = np.concatenate([np.zeros((B, H, 1, d)), v], axis=2)
    want_out, want_lse = oracle.forward(q2, k2, np.pad(v2, ((0, 0),) * 3 + ((0, 1),)), scale=scale)
    out, lse = oracle.forward(q, k, v, score_mod=modifiers.sinks(sink))
    np.testing.assert_allclose(out, want_out[..., :d], atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)
    # a row that sees no key: out 0, lse = the sink
    out, lse = oracle.forward(q, k, v, window=(0, -10), score_mod=modifiers.sinks(sink))
    assert (out == 0).all() and np.allclose(lse, sink[None, :, None])


def test_sink_gradient_by_finite_differences():
    q, k, v = qkv(Nq=3, Nk=4, d=2)
    dout = np.random.default_rng(1).standard_normal(q.shape)
    sink = np.array([0.3, -0.4])
    out, lse = oracle.forward(q, k, v, causal=True, score_mod=modifiers.sinks(sink))
    got = modifiers.sink_grad(dout, out, lse, modifiers.sinks(sink))
    loss = lambda s: np.sum(oracle.forward(q, k, v, causal=True, score_mod=modifiers.sinks(s))[0] * dout)  # noqa: E731
    fd = [(loss(sink + e) - loss(sink - e)) / 2e-6 for e in np.eye(2) * 1e-6]
    np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-8)
    # from a kernel's out and lse (numba-rowwise, float32): what a training step would call
    f32 = [x.astype(np.float32) for x in (q, k, v)]
    res = sandbox.forward(*f32, variant="numba-rowwise", causal=True, score_mod=modifiers.sinks(sink))
    np.testing.assert_allclose(modifiers.sink_grad(dout, res.out, res.lse, modifiers.sinks(sink)), fd, atol=1e-5)
    one = modifiers.sinks([0.3])                                   # one logit shared by the heads: summed
    out1, lse1 = oracle.forward(q, k, v, causal=True, score_mod=one)
    loss1 = lambda s: np.sum(oracle.forward(q, k, v, causal=True, score_mod=modifiers.sinks([s]))[0] * dout)  # noqa: E731
    np.testing.assert_allclose(modifiers.sink_grad(dout, out1, lse1, one), [(loss1(0.3 + 1e-6) - loss1(0.3 - 1e-6)) / 2e-6],
                               rtol=1e-6)


def test_document_mask_is_block_diagonal_attention():
    q, k, v = qkv(B=2, Nq=7, Nk=7)
    ids = np.array([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 3]])
    out, lse = oracle.forward(q, k, v, causal=True, mask_mod=modifiers.document(ids))
    for b in range(2):
        for doc in np.unique(ids[b]):
            sel = ids[b] == doc
            o, l = oracle.forward(q[b:b + 1, :, sel], k[b:b + 1, :, sel], v[b:b + 1, :, sel], causal=True)
            np.testing.assert_allclose(out[b:b + 1, :, sel], o, atol=1e-12)
            np.testing.assert_allclose(lse[b:b + 1, :, sel], l, atol=1e-12)


def test_prefix_lm_is_its_element_mask():
    q, k, v = qkv(Nq=6, Nk=6)
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    layout = (j <= i) | (j < 3)
    want = oracle.forward(q, k, v, block_mask=BlockSparse(layout, (1, 1)))
    got = oracle.forward(q, k, v, mask_mod=modifiers.prefix_lm(3))
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)


def test_dense_mask_is_its_element_mask_per_batch_and_head():
    """modifiers.dense(allowed) is the mask it is given: per batch entry and query head, broadcast over an axis
    of extent 1; the oracle with it equals the oracle per (b, h) with that element mask as a 1 x 1 block
    layout; a problem of another shape is refused."""
    q, k, v = qkv(B=2, Hq=2, Hkv=1, Nq=5, Nk=7)
    rng = np.random.default_rng(5)
    allowed = rng.random((2, 2, 5, 7)) < 0.6
    allowed[1, 0, 2] = False                                  # a dead row
    for mask in (allowed, allowed[:, :1], allowed[:1]):
        mod = modifiers.dense(mask)
        out, lse = oracle.forward(q, k, v, mask_mod=mod)
        for b, h in np.ndindex(2, 2):
            m = mask[min(b, mask.shape[0] - 1), min(h, mask.shape[1] - 1)]
            o, l = oracle.forward(q[b:b + 1, h:h + 1], k[b:b + 1], v[b:b + 1], block_mask=BlockSparse(m, (1, 1)))
            np.testing.assert_array_equal(out[b:b + 1, h:h + 1], o)
            np.testing.assert_array_equal(lse[b:b + 1, h:h + 1], l)
        assert modifiers.twin_errors(mod, B=2, H=2, Nq=5, Nk=7) == []
    assert np.isneginf(oracle.forward(q, k, v, mask_mod=modifiers.dense(allowed))[1][1, 0, 2])
    with pytest.raises(ValueError, match="dense: the mask has shape"):
        modifiers.dense(allowed).validate(2, 2, 5, 8)


@pytest.mark.parametrize("score_mod", [modifiers.softcap(1.5), quadratic(0.2),
                                       modifiers.relative_bias(np.arange(6.0).reshape(2, 3) / 4, 1),
                                       modifiers.softcap(2.0).with_sinks([0.5, -0.5])],
                         ids=["softcap", "quadratic", "relative_bias", "softcap+sinks"])
def test_gradients_by_finite_differences(score_mod):
    """The oracle's backward through the modifier's derivative, against central differences of the
    float64 forward (loss = sum(out * dout)), with a document mask and GQA."""
    q, k, v = qkv(Hq=2, Hkv=1, Nq=3, Nk=4, d=2, seed=3)
    dout = np.random.default_rng(4).standard_normal(q.shape)
    kw = dict(causal=True, score_mod=score_mod, mask_mod=modifiers.document([0, 0, 1], [0, 0, 0, 1]))
    grads = oracle.backward(dout, q, k, v, **kw)
    for which, (x, g) in enumerate(zip((q, k, v), grads)):
        fd = np.zeros_like(x)
        for idx in np.ndindex(*x.shape):
            args = [q, k, v]
            hi, lo = x.copy(), x.copy()
            hi[idx] += 1e-6
            lo[idx] -= 1e-6
            args[which] = hi
            up = np.sum(oracle.forward(*args, **kw)[0] * dout)
            args[which] = lo
            fd[idx] = (up - np.sum(oracle.forward(*args, **kw)[0] * dout)) / 2e-6
        np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-7)


# ---- tile classification from a mask modifier

@pytest.mark.parametrize("mask_mod", [modifiers.document([[0, 0, 0, 1, 1, 1, 2, 2, 2, 2]] * 2),
                                      modifiers.prefix_lm([3, 7]),
                                      modifiers.dense(np.random.default_rng(3).random((2, 1, 10, 10)) < 0.8)],
                         ids=["document", "prefix_lm", "dense"])
def test_tile_classes_of_a_mask_modifier_are_exact(mask_mod):
    B, H, N = 2, 2, 10
    layout = np.ones((H, 4, 4), bool)
    layout[1, 2, 1] = False                                   # one block off, in head 1
    bm = BlockSparse(layout, (3, 3))
    for band, (br, bc) in ((Band.from_options(N, N, False, (None, 6)), (2, 2)),
                           (Band.from_options(N, N, True, None), (4, 3))):
        tiles = classify_tiles_mod(mask_mod, B, H, N, N, br, bc, band, bm)
        mod = np.broadcast_to(mask_mod.visible(B, H, np.arange(N), N), (B, H, N, N))
        shown = np.broadcast_to(band.element_mask(N, N) & bm.element_mask(N, N)[None], (B, H, N, N))
        vis = mod & shown
        causal_part = np.arange(N)[None, :] - np.arange(N)[:, None] <= 0
        for b, h, tr, tc in np.ndindex(B, H, *tiles.shape[2:]):
            rows, cols = slice(tr * br, (tr + 1) * br), slice(tc * bc, (tc + 1) * bc)
            t = vis[b, h, rows, cols]
            # partial: TILE_BAND where the modifier hides nothing the band and block mask show (they cut the tile),
            # else TILE_CAUSAL where it shows exactly their bottom-right causal part
            band_alone = (mod | ~shown)[b, h, rows, cols].all()
            causal_alone = ((mod == causal_part) | ~shown)[b, h, rows, cols].all()
            want = TILE_EMPTY if not t.any() else (TILE_FULL if t.all() else TILE_BAND if band_alone else
                                                    TILE_CAUSAL if causal_alone else TILE_PARTIAL)
            assert tiles[min(b, tiles.shape[0] - 1), min(h, tiles.shape[1] - 1), tr, tc] == want
        assert classify_tiles_mod(mask_mod, B, H, N, N, br, bc, band, bm) is tiles          # cached
    tiles = classify_tiles_mod(mask_mod, B, H, N, N, 2, 2, Band(), bm)
    assert {TILE_EMPTY, TILE_FULL, TILE_PARTIAL} <= set(np.unique(tiles).tolist())
    causal = classify_tiles_mod(mask_mod, B, H, N, N, 2, 2, Band.from_options(N, N, True, None))
    assert TILE_BAND in causal           # diagonal tiles inside one document / the prefix / a dense run of Trues


def test_a_causal_mask_given_densely_marks_its_diagonal_tiles_causal():
    """A model's causal mask as a dense boolean mask, without causal=True: the diagonal tiles are TILE_CAUSAL (the
    kernels test j - i <= Nk - Nq there instead of loading a mask byte per score), bottom-right aligned for Nq < Nk;
    a padded row turns its tiles back to TILE_PARTIAL."""
    Nq, Nk = 12, 20
    tril = np.arange(Nk)[None, :] - np.arange(Nq)[:, None] <= Nk - Nq
    dense = np.broadcast_to(tril, (2, 1, Nq, Nk)).copy()
    dense[1, 0, :, :3] = False                                 # batch entry 1: three keys of padding
    tiles = classify_tiles_mod(modifiers.dense(dense), 2, 1, Nq, Nk, 4, 4, Band())
    plain = classify_tiles(Nq, Nk, 4, 4, Band.from_options(Nq, Nk, True, None))
    np.testing.assert_array_equal(tiles[0, 0], np.where(plain == TILE_PARTIAL, TILE_CAUSAL, plain)[0])
    assert tiles[1, 0, 0, 0] == TILE_PARTIAL and tiles[1, 0, 0, 2] == TILE_CAUSAL


def test_an_all_visible_mask_modifier_keeps_the_band_classes():
    everything = MaskMod("all", lambda b, h, i, j: (j >= 0) & (i >= 0), lambda b, h, i, j: True, "true")
    band = Band.from_options(9, 11, True, (4, None))
    tiles = classify_tiles_mod(everything, 1, 1, 9, 11, 4, 4, band)
    plain = classify_tiles(9, 11, 4, 4, band)[None]
    assert (plain == TILE_PARTIAL).any()
    np.testing.assert_array_equal(tiles, np.where(plain == TILE_PARTIAL, TILE_BAND, plain))   # the band alone cuts


# ---- the Numba variants against the oracle (CUDA simulator on the CPU)

@pytest.mark.simulator
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("name", NUMBA)
def test_numba_variants_with_modifiers_match_the_oracle(name, direction):
    variant = all_variants()[name]
    assert variant.caps.score_mod and variant.caps.mask_mod
    bound = sandbox.get_variant(name, **getattr(variant.impl, "SIMULATOR_PARAMS", {}))
    limits = fuzz.Limits(max_n=5, max_batch_heads=2, dims=(1, 2))

    @settings(max_examples=EXAMPLES.get(name, 4), deadline=None, database=None, derandomize=True)
    @given(fuzz.cases(bound, "float32", limits, score_mods=fuzz.SCORE_MODS, mask_mods=fuzz.MASK_MODS))
    def check(case):
        fuzz.assert_case(bound, case, direction)

    check()


@pytest.mark.simulator
@pytest.mark.parametrize("name", NUMBA)
def test_every_builtin_runs_in_the_numba_variants(name):
    """Each built-in score modifier once, forward and backward, with a document mask (the Hypothesis
    tests above draw a few of them at random)."""
    bound = sandbox.get_variant(name, **getattr(all_variants()[name].impl, "SIMULATOR_PARAMS", {}))
    rng = np.random.default_rng(5)
    for factory in fuzz.SCORE_MODS:
        case = fuzz.Case(1, 2, 1, 4, 5, 2, "float32", {"score_mod": factory(rng, 1, 2, 4, 5),
                                                        "mask_mod": fuzz.MASK_MODS[0](rng, 1, 2, 4, 5)}, 7)
        fuzz.assert_case(bound, case, "backward")


@pytest.mark.simulator
def test_user_modifier_matches_the_oracle():
    bound = sandbox.get_variant("numba-rowwise")
    case = fuzz.Case(1, 2, 2, 5, 6, 2, "float32", {"score_mod": quadratic(0.3), "causal": True}, 11)
    fuzz.assert_case(bound, case, "backward")


@pytest.mark.simulator
def test_the_fuzzer_catches_a_wrong_numpy_twin():
    bound = sandbox.get_variant("numba-rowwise")
    wrong = lambda rng, B, Hq, Nq, Nk: quadratic(0.3, numpy_form=_quad_wrong_np)  # noqa: E731
    # one case directly: the kernel (scalar form) disagrees with the oracle (NumPy form), and the
    # twin check says why
    case = fuzz.Case(1, 2, 2, 5, 6, 2, "float32", {"score_mod": wrong(None, 1, 2, 5, 6)}, 11)
    verdicts = {v.name: v for v in fuzz.check_case(bound, case)}
    assert not verdicts["out"].ok and not verdicts["lse"].ok
    assert not verdicts["score_mod"].ok and "scalar form" in verdicts["score_mod"].why
    # and the fuzzer, drawing problems: it reports the failure (no shrinking, to stay fast)
    limits = fuzz.Limits(max_n=5, max_batch_heads=2, dims=(1, 2))

    @settings(max_examples=5, deadline=None, database=None, derandomize=True, phases=[Phase.generate])
    @given(fuzz.cases(bound, "float32", limits, score_mods=(wrong,)))
    def run(case):
        fuzz.assert_case(bound, case)

    with pytest.raises(AssertionError, match="quadratic_distance"):
        run()


def test_twin_checks_pass_for_every_builtin():
    rng = np.random.default_rng(2)
    for factory in fuzz.SCORE_MODS + fuzz.MASK_MODS:
        mod = factory(rng, 2, 2, 5, 6)
        assert modifiers.twin_errors(mod, 2, 2, 5, 6) == [], mod
    assert modifiers.twin_errors(quadratic()) == []
    bad_grad = ScoreMod("bad_grad", modifiers._softcap_np, modifiers._softcap_scalar, "s",
                        grad=lambda s, b, h, i, j, cap: np.ones_like(s),        # the bug: tanh's slope is not 1
                        scalar_grad=lambda s, b, h, i, j, cap: 1.0, cuda_grad="1.0f", buffers={"cap": [1.0]})
    assert any("finite difference" in e for e in modifiers.twin_errors(bad_grad))


def test_cuda_text_renders_a_device_function():
    text = modifiers.relative_bias(np.zeros((2, 5)), 2).cuda_function()
    assert "__device__ __forceinline__ float score_mod(float s, int b, int h, int i, int j, float fi, float fj, " \
           "const float* __restrict__ table, int table_shape0, int table_shape1)" in text
    assert "score_mod_grad" in text
    assert modifiers.softcap(1.0).cuda_key == modifiers.softcap(2.0).cuda_key    # buffers are data, not text
    assert modifiers.softcap(1.0).cuda_key != modifiers.alibi([0.1]).cuda_key
    assert "bool mask_mod(int b, int h, int i, int j, const int* __restrict__ prefix" in \
        modifiers.prefix_lm(3).cuda_function()


def test_scalar_forms_compile_in_nopython_mode():
    """Every built-in's scalar forms compile with Numba's nopython mode on the CPU, with the buffer
    dtypes the kernels pass (float32, int32): a proxy for cuda.jit(device=True), which the simulator
    never compiles."""
    import numba
    from variants.numba_rowwise import _device_buffer
    rng = np.random.default_rng(3)
    for factory in fuzz.SCORE_MODS + fuzz.MASK_MODS:
        mod = factory(rng, 2, 2, 5, 6)
        bufs = [_device_buffer(a) for a in mod.buffers.values()]
        if isinstance(mod, ScoreMod):
            for fn in (mod.scalar, mod.scalar_grad):
                got = numba.njit(fn)(np.float32(0.7), 1, 1, 3, 2, *bufs)
                assert math.isfinite(got), mod
        else:
            assert numba.njit(mod.scalar)(1, 1, 3, 2, *bufs) in (True, False), mod


@pytest.mark.simulator
def test_tiled_kernels_skip_empty_tiles_and_test_only_partial_ones():
    """numba-fa2 (8 x 8 tiles) evaluates a mask modifier's scalar form only inside PARTIAL tiles: a
    recording predicate (possible under the simulator only, where device functions are Python) is
    never called in the EMPTY and FULL tiles of a document mask."""
    from sandbox import numba_support as nb
    if not nb.SIMULATOR:
        pytest.skip("records calls from Python: simulator only")
    calls = []

    def recording(b, h, i, j, q_ids, kv_ids):
        calls.append((i, j))
        return modifiers._document_scalar(b, h, i, j, q_ids, kv_ids)

    ids = np.array([0] * 8 + [1] * 4 + [2] * 4)          # tile (0, 0) is FULL, (1, 1) PARTIAL, the rest EMPTY
    mask = MaskMod("recorded_document", modifiers._document_np, recording, "true",
                   buffers={"q_ids": ids[None], "kv_ids": ids[None]})
    q, k, v = (x.astype(np.float32) for x in qkv(Hq=1, Hkv=1, Nq=16, Nk=16, d=2))
    bound = sandbox.get_variant("numba-fa2", block_r=8, block_c=8, threads=32)
    res = sandbox.forward(q, k, v, variant=bound, mask_mod=mask)
    want = oracle.forward(q, k, v, mask_mod=modifiers.document(ids))
    np.testing.assert_allclose(res.out, want[0], atol=1e-5)
    assert calls and {(i // 8, j // 8) for i, j in calls} == {(1, 1)}


def test_cuda_text_of_every_builtin_compiles_with_nvrtc():
    """The CUDA C forms, rendered as device functions, compile with NVRTC (no GPU needed), each in
    its own namespace of one program; a broken expression does not."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="pip install .[compile] for NVRTC")
    from sandbox import loader
    rng = np.random.default_rng(0)
    mods = [f(rng, 2, 2, 5, 6) for f in fuzz.SCORE_MODS + fuzz.MASK_MODS] + [quadratic()]
    helpers = re.search(r"__device__ __forceinline__ float fa_tanh.*?float fa_tanh_e.*?\n}\n", loader.source_text("tc_mods.cuh"),
                        re.S).group(0)                           # what the kernels give a modifier's text
    text = helpers + "".join(f"namespace m{n} {{\n{m.cuda_function()}}}\n" for n, m in enumerate(mods))
    loader._nvrtc_build("modifiers.cu", text, ["-std=c++17"], (), "sm_90")
    broken = ScoreMod("broken", _quad_np, _quad_scalar, "s - alpha[0] * (j - i) *", buffers={"alpha": [0.1]})
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        loader._nvrtc_build("broken.cu", broken.cuda_function(), ["-std=c++17"], (), "sm_90")


def test_fuzz_counts_the_features_of_each_checked_case():
    """The per-feature example counts the GPU reports quote (fuzz.FEATURES): each feature of a case
    is named, a sink modifier under its own name as well as its base modifier's."""
    case = fuzz.Case(1, 4, 2, 9, 11, 256, "float16",
                     {"causal": True, "dropout_p": 0.5, "seed": 1, "offset": 0,
                      "score_mod": modifiers.softcap(2.0).with_sinks(np.zeros(4)),
                      "mask_mod": modifiers.prefix_lm(3)}, 0)
    assert fuzz.features(case) == ["causal", "dropout", "gqa", "head_dim>128", "score_mod:softcap",
                                   "score_mod:sinks", "mask_mod:prefix_lm"]
    assert fuzz.features(fuzz.Case(1, 1, 1, 5, 5, 16, "float32", {"dropout_p": 0.0}, 0)) == []


# ---- the factored form (cuda_factored): post * core(pre * s), folded into the forward's scales

def test_softcap_forward_compiles_its_factored_core_and_the_backward_its_text():
    cap = modifiers.softcap(7.0)
    assert cap.cuda_factored == ("fa_tanh(s)", 1.0 / 7.0, 7.0) and cap.forward_scales() == (1.0 / 7.0, 7.0)
    fwd = " ".join(modifiers.cuda_defines(cap, None, backward=False))
    bwd = " ".join(modifiers.cuda_defines(cap, None, backward=True))
    assert "return fa_tanh(s);" in fwd and "cap[0] * fa_tanh(s * cap[1])" not in fwd
    assert "cap[0] * fa_tanh(s * cap[1])" in bwd and "fa_sech2" in bwd
    assert modifiers.alibi([0.5]).forward_scales() == (1.0, 1.0)
    # one module for every cap: the factor travels as a kernel argument, not as text
    assert modifiers.cuda_defines(modifiers.softcap(2.0), None) == modifiers.cuda_defines(cap, None)
    # a cap whose factors would leave float32's comfortable range compiles the whole text
    huge = modifiers.softcap(1e30)
    assert huge.cuda_factored is None and "cap[0] * fa_tanh(s * cap[1])" in " ".join(modifiers.cuda_defines(huge, None))


def test_softcap_wgmma2_backward_compiles_the_factored_core_and_its_derivative():
    """A backward module of a kernel that takes FA_SCORE_FACTORED's arguments (fa3_bwd2) compiles fa_tanh(s) and
    fa_sech2(s), the caps travelling as (pre, post log2 e, post pre); other backward modules keep the text."""
    from variants import fa3_backward
    from variants.fa2_tc import LOG2E
    cap = modifiers.softcap(7.0)
    assert cap.backward_factored and cap.backward_factors() == pytest.approx((1 / 7.0, 7.0 * LOG2E, 1.0))
    fac = " ".join(modifiers.cuda_defines(cap, None, backward=True, factored=True))
    assert "-DFA_SCORE_FACTORED=1" in fac and "return fa_tanh(s);" in fac and "return fa_sech2(s);" in fac
    # the core tanh with derivative sech^2: fa3_bwd2 may take sech^2 from the tanh it has (FA_TANH_CORE), a
    # modifier whose factored texts differ (a wrong derivative, another core) keeps its own derivative
    assert "-DFA_TANH_CORE=1" in fac
    for other in (dataclasses.replace(cap, cuda_factored_grad="1.1f * fa_sech2(s)"),
                  dataclasses.replace(cap, cuda_factored=("fa_tanh(s) * 0.5f", 1 / 7.0, 7.0))):
        assert "FA_TANH_CORE" not in " ".join(modifiers.cuda_defines(other, None, backward=True, factored=True))
    assert "cap[0]" not in fac.split("FA_MOD_FUNCS")[1]
    text = " ".join(modifiers.cuda_defines(cap, None, backward=True))
    assert "FA_SCORE_FACTORED" not in text and "FA_TANH_CORE" not in text and "cap[0] * fa_tanh(s * cap[1])" in text
    assert "FA_SCORE_FACTORED" not in " ".join(modifiers.cuda_defines(cap, None, backward=False, factored=True))
    huge = modifiers.softcap(1e30)                       # no factored form: the text, whatever the kernel takes
    assert not huge.backward_factored
    assert "FA_SCORE_FACTORED" not in " ".join(modifiers.cuda_defines(huge, None, backward=True, factored=True))
    q = np.zeros((1, 2, 4, 8), np.float16)
    p = sandbox.problem.make_problem(q, q, q, scale=-0.5, score_mod=cap)
    need = fa3_backward.backward_mods(p)
    assert need == "text" and "-DFA_SCORE_FACTORED=1" in fa3_backward.module_mods(p, need).options
    args = fa3_backward.factored_args(p, need)
    assert [type(a) for a in args] == [np.float32] * 3 and np.allclose(args, (1 / 7.0, 7.0 * LOG2E, 1.0))
    # dS leaves post pre to the epilogues: dK's in the kernel (ds_scale), dQ's through fa3_bwd2_dq's argument
    assert fa3_backward.dq_scale(p, need) == np.float32(-0.5 * float(args[2]))
    assert type(fa3_backward.dq_scale(p, need)) is np.float32
    from mod_cases import twice_softcap
    two = twice_softcap(7.0)            # post pre = 2: dQ's scale must carry it (the soft-cap's is 1)
    assert "-DFA_TANH_CORE=1" in " ".join(modifiers.cuda_defines(two, None, backward=True, factored=True))
    p2 = sandbox.problem.make_problem(q, q, q, scale=-0.5, score_mod=two)
    assert fa3_backward.dq_scale(p2, fa3_backward.backward_mods(p2)) == np.float32(-1.0)
    for other in (modifiers.alibi([0.5]), modifiers.relative_bias(np.zeros((2, 3)), 1), huge):
        po = sandbox.problem.make_problem(q, q, q, scale=-0.5, score_mod=other)
        assert fa3_backward.factored_args(po, fa3_backward.backward_mods(po)) == ()
        assert fa3_backward.dq_scale(po, fa3_backward.backward_mods(po)) == np.float32(-0.5)
    with pytest.raises(ValueError, match="cuda_factored_grad"):
        ScoreMod("t", lambda s, b, h, i, j: s, lambda s, b, h, i, j: s, "s", cuda_factored_grad="1.0f")


def test_sech2_from_tanh_is_accurate_within_the_kernels_range():
    """The backward kernels' FA_TANH_CORE (fa3_bwd2.cu, fa2_tc_bwd.cu through tc_mods.cuh) takes sech^2 x = 1 - t^2
    from t = MUFU.TANH(x) (relative error up to 2^-11, PTX ISA) while every |x| of a warp's tile is at most
    FA_TANH_GRAD_X: at the worst rounding of t, 1 - t^2 stays within 2^-11.5 of sech^2 there (about fp16's own
    rounding), and it would not at |x| = 1 (the cancellation grows)."""
    kernels = Path(__file__).resolve().parents[1] / "kernels_cu"
    mods, bwd2, tc = ((kernels / f).read_text() for f in ("tc_mods.cuh", "fa3_bwd2.cu", "fa2_tc_bwd.cu"))
    x_max = float(re.search(r"#define FA_TANH_GRAD_X ([0-9.]+)f", mods).group(1))
    assert "fmaf(-core, core, 1.0f)" in mods and "<= FA_TANH_GRAD_X" in mods.split("bool bwd_core_small")[1]
    assert "fmaf(-core, core, 1.0f)" in bwd2 and "bwd_core_small" in bwd2.split("exp_scores_mod(false, true)")[0]
    assert "bwd_core_small" in tc.split("f(false, true)")[0]

    def worst(limit):
        x = np.linspace(-limit, limit, 100001)
        exact = 1.0 / np.cosh(x) ** 2
        return max(np.max(np.abs((1.0 - (np.tanh(x) * (1 + sgn * 2.0 ** -11)) ** 2) / exact - 1)) for sgn in (-1, 1))
    assert worst(x_max) <= 2.0 ** -11.5
    assert worst(1.0) > 2.0 ** -10


def test_factored_scales_reach_the_forward_arguments_only():
    from variants.fa2_tc import LOG2E, forward_scale_log2, modifier_args, scale_log2
    q = np.zeros((1, 2, 4, 8), np.float16)
    p = sandbox.problem.make_problem(q, q, q, scale=-0.5, score_mod=modifiers.softcap(4.0))
    assert np.float32(modifier_args(p, 1, forward=True)[1]) == np.float32(0.5 / 4.0)
    assert np.float32(modifier_args(p, 1)[1]) == np.float32(0.5)                      # the backward's |scale|
    assert forward_scale_log2(p) == pytest.approx(4.0 * LOG2E)
    alibi = sandbox.problem.make_problem(q, q, q, scale=-0.5, score_mod=modifiers.alibi([0.1]))
    # ALiBi's bias seeds S in raw units (cuda_distance_slope): the raw scores' factor, |scale| as mod_scale
    assert forward_scale_log2(alibi) == scale_log2(-0.5) and modifier_args(alibi, 1, forward=True)[1] == 0.5
    sinks = sandbox.problem.make_problem(q, q, q, scale=-0.5, score_mod=modifiers.sinks([0.3]))
    assert forward_scale_log2(sinks) == scale_log2(-0.5)          # raw scores: the identity compiles nothing


@pytest.mark.parametrize("factored,error,match", [
    ("fa_tanh(s)", TypeError, "cuda_factored must be a tuple"),
    (("fa_tanh(s)", 1.0), TypeError, "cuda_factored must be a tuple"),
    (("fa_tanh(s)", 0.0, 1.0), ValueError, "pre must lie in"),
    (("fa_tanh(s)", 1.0, -2.0), ValueError, "post must lie in"),
    (("fa_tanh(s)", 1.0, float("inf")), ValueError, "post must lie in"),
    (("fa_tanh(s)", 1e-30, 1.0), ValueError, "pre must lie in"),
    (("fa_tanh(s)", "1", 1.0), TypeError, "pre must be a real number"),
])
def test_factored_form_is_validated(factored, error, match):
    with pytest.raises(error, match=match):
        ScoreMod("t", lambda s, b, h, i, j: s, lambda s, b, h, i, j: s, "s", cuda_factored=factored)


# ---- the distance form (cuda_distance_slope): s + slope(b, h) * (j - i), the bias where S starts

def test_alibi_forward_seeds_a_distance_bias_and_the_backward_compiles_its_text():
    al = modifiers.alibi([0.5, 0.25])
    fwd = " ".join(modifiers.cuda_defines(al, None, backward=False))
    bwd = " ".join(modifiers.cuda_defines(al, None, backward=True))
    assert "-DFA_DIST_BIAS=1" in fwd and "-DFA_SCORE_MOD=1" not in fwd
    assert "float dist_slope(int b, int h, const float* __restrict__ slopes, int slopes_shape0)" in fwd
    assert "return slopes[min(h, slopes_shape0 - 1)];" in fwd
    assert "-DFA_DIST_BIAS" not in bwd and "-DFA_SCORE_MOD=1" in bwd and "(fj - fi)" in bwd
    # the seed needs |scale| log2 e above the kernels' floor (scale 0: the bias / |scale| would be inf): the text there
    from variants.fa2_tc import LOG2E, forward_scale_log2, seeds_bias
    q = np.zeros((1, 2, 4, 8), np.float16)
    for scale, seeded in ((0.5, True), (-1e-3, True), (0.0, False), (1e-40, False)):
        p = sandbox.problem.make_problem(q, q, q, scale=scale, score_mod=al)
        assert seeds_bias(p) == seeded, scale
        assert ("-DFA_DIST_BIAS=1" in modifiers.cuda_defines(al, None, seed=seeds_bias(p))) == seeded
        assert forward_scale_log2(p) == (max(abs(scale) * LOG2E, 2.0 ** -100) if seeded else LOG2E)
    assert not seeds_bias(sandbox.problem.make_problem(q, q, q, score_mod=modifiers.softcap(3.0)))
    # the slope text is part of the module key; a copy with a different slope is a different module
    other = dataclasses.replace(al, cuda_distance_slope="2.0f * slopes[min(h, slopes_shape0 - 1)]")
    assert other.cuda_key != al.cuda_key
    assert " ".join(modifiers.cuda_defines(al.with_sinks([0.1]), None)).count("-DFA_SINKS=1") == 1


@pytest.mark.parametrize("kw,exc,msg", [
    ({"cuda_distance_slope": ""}, TypeError, "cuda_distance_slope must be a non-empty string"),
    ({"cuda_distance_slope": 0.5}, TypeError, "cuda_distance_slope must be a non-empty string"),
    ({"cuda_distance_slope": "0.5f", "cuda_factored": ("s", 1.0, 1.0)}, ValueError, "not both"),
])
def test_distance_form_refusals(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        ScoreMod("t", lambda s, b, h, i, j: s, lambda s, b, h, i, j: s, "s", **kw)


def test_tanh_from_the_shared_exponential_is_accurate_in_absolute_terms():
    """fa_tanh_e (kernels_cu/tc_mods.cuh) modelled in float32 with the header's own constants, the MUFU
    exponential taken as exact: within 1.25e-5 of tanh in absolute terms over |x| <= 60 (the soft-cap's
    exponent sees cap * tanh, so absolute error is what matters; MUFU.TANH's is up to 4.9e-4), odd, NaN
    for NaN; and fa_sech2 from the same e, r within 3e-5 relative (its documented bound)."""
    from sandbox import loader
    text = loader.source_text("tc_mods.cuh")
    body = re.search(r"float fa_recip_1p\(float e\) \{(.*?)\n\}", text, re.S).group(1)
    a, c = (np.float32(float(x)) for x in re.search(r"fmaf\(-([0-9.]+)f, d, ([0-9.]+)f\)", body).groups())
    k = np.float32(float(re.search(r'"f"\((-[0-9.]+)f \* fabsf\(x\)\)', text).group(1)))
    x = np.concatenate([np.linspace(-60, 60, 200001), [0.0, 1e-30, -1e-7, 44.0, -44.5, np.nan]]).astype(np.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        e = np.exp2((k * np.abs(x)).astype(np.float64)).astype(np.float32)
        d = np.float32(1) + e
        r = (-a * d + c).astype(np.float32)
        for _ in range(2):
            r = (r * (np.float32(2) - d * r)).astype(np.float32)
        tanh_e = np.copysign((np.float32(1) - e) * r, x)
        sech2 = np.float32(4) * e * (r * r)
    assert np.isnan(tanh_e[-1]) and np.isnan(sech2[-1])
    x, tanh_e, sech2 = x[:-1], tanh_e[:-1], sech2[:-1]
    assert np.abs(tanh_e.astype(np.float64) - np.tanh(x.astype(np.float64))).max() < 1.25e-5
    ref = 1 / np.cosh(x.astype(np.float64)) ** 2
    ok = ref > 1e-30
    assert (np.abs(sech2[ok] - ref[ok]) / ref[ok]).max() < 3e-5
    assert np.array_equal(np.signbit(tanh_e), np.signbit(x))          # odd: the sign is x's (copysign)
    assert "copysignf((1.0f - e) * fa_recip_1p(e), x)" in text    # the form modelled here


def test_tile_classes_do_not_keep_a_mask_modifier_alive():
    """A new padded mask per training step must not pile up: the classes are cached weakly per modifier."""
    import gc
    import weakref
    mod = modifiers.dense(np.random.default_rng(0).random((2, 1, 40, 40)) < 0.8)
    tiles = classify_tiles_mod(mod, 2, 2, 40, 40, 16, 16)
    assert classify_tiles_mod(mod, 2, 2, 40, 40, 16, 16) is tiles
    gone = weakref.ref(mod.buffers["allowed"])
    del mod
    gc.collect()
    assert gone() is None
