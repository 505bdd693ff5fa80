"""Option validation edges (issue 15, item 6): every option is checked for type and range before
anything is launched, and each rejection names the parameter.

Wrong types raise TypeError, out-of-range values ValueError. These run on NumPy inputs through
sandbox.problem.make_problem, the single place every entry point validates its options.
"""
import numpy as np
import pytest

from sandbox import dropout_mask, oracle
from sandbox.masks import UNBOUNDED, Band, element_mask
from sandbox.problem import make_problem


def qkv(Nq=4, Nk=5, d=8):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((1, 2, Nq, d)).astype(np.float32),
            rng.standard_normal((1, 2, Nk, d)).astype(np.float32),
            rng.standard_normal((1, 2, Nk, d)).astype(np.float32))


@pytest.mark.parametrize("kw,name", [
    ({"causal": "False"}, "causal"), ({"causal": 1}, "causal"), ({"causal": None}, "causal"),
    ({"seed": 1.5}, "seed"), ({"seed": 2.0}, "seed"), ({"seed": True}, "seed"), ({"seed": "7"}, "seed"),
    ({"offset": 1.5}, "offset"), ({"offset": False}, "offset"),
    ({"scale": "a"}, "scale"), ({"scale": True}, "scale"), ({"scale": 1j}, "scale"),
    ({"dropout_p": "0.1"}, "dropout_p"), ({"dropout_p": True}, "dropout_p"),
    ({"window": "ab"}, "window"), ({"window": 3}, "window"), ({"window": (1.5, None)}, "window"),
    ({"window": (2.0, 0)}, "window"), ({"window": (True, None)}, "window"), ({"window": (None, "1")}, "window"),
])
def test_wrong_types_are_type_errors_naming_the_option(kw, name):
    with pytest.raises(TypeError, match=name):
        make_problem(*qkv(), **kw)


@pytest.mark.parametrize("kw,name", [
    ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"offset": -1}, "offset"), ({"offset": 2**32}, "offset"),
    ({"scale": float("nan")}, "scale"), ({"scale": float("-inf")}, "scale"),
    ({"dropout_p": 1.0}, "dropout_p"), ({"dropout_p": float("nan")}, "dropout_p"),
    ({"window": (1, 2, 3)}, "window"), ({"window": (1,)}, "window"), ({"window": ()}, "window"),
    ({"window": (2**62, 0)}, "window"), ({"window": (0, -2**62)}, "window"),
])
def test_out_of_range_values_are_value_errors_naming_the_option(kw, name):
    with pytest.raises(ValueError, match=name):
        make_problem(*qkv(), **kw)


def test_type_errors_still_satisfy_callers_that_catch_value_error():
    """docs/ARCHITECTURE.md: every rejected option is a ValueError; the type errors are that too."""
    with pytest.raises(ValueError, match="causal"):
        make_problem(*qkv(), causal="False")


def test_type_error_message_shows_the_value_and_its_type():
    with pytest.raises(TypeError, match=r"causal must be a bool, got 'False' \(str\)"):
        make_problem(*qkv(), causal="False")
    with pytest.raises(TypeError, match=r"seed must be an int, got 1\.5 \(float\)"):
        make_problem(*qkv(), seed=1.5)


def test_numpy_scalars_are_accepted():
    p = make_problem(*qkv(), causal=np.bool_(True), seed=np.uint64(2**64 - 1), offset=np.int32(3),
                     scale=np.float32(0.5), dropout_p=np.float64(0.25), window=(np.int64(2), None))
    assert (p.causal, p.seed, p.offset, p.scale, p.dropout_p, p.window) == (True, 2**64 - 1, 3, 0.5, 0.25, (2, None))
    assert all(type(x) in (bool, int, float) for x in (p.causal, p.seed, p.offset, p.scale, p.dropout_p, p.window[0]))


def test_plain_python_options_are_unchanged():
    p = make_problem(*qkv(), causal=True, scale=2, seed=5, offset=6, window=[3, -1])
    assert (p.causal, p.scale, p.seed, p.offset, p.window) == (True, 2.0, 5, 6, (3, -1))
    assert make_problem(*qkv(d=16)).scale == 0.25


@pytest.mark.parametrize("huge,bounded", [((2**40, 0), (None, 0)), ((0, 2**40), (0, None)),
                                          ((2**61, 2**61), (None, None)), ((-2**40, 3), (-UNBOUNDED, 3))])
def test_huge_window_sides_clamp_to_the_int32_band(huge, bounded):
    """A side longer than any sequence means unbounded; the band stays within int32 for the kernels."""
    for Nq, Nk, causal in ((4, 5, False), (5, 4, True), (7, 7, True)):
        band = Band.from_options(Nq, Nk, causal, huge)
        assert -UNBOUNDED <= band.lo <= UNBOUNDED and -UNBOUNDED <= band.hi <= UNBOUNDED
        assert -2**31 <= band.lo < 2**31 and -2**31 <= band.hi < 2**31
        if huge[0] >= 0:
            assert band == Band.from_options(Nq, Nk, causal, bounded)
        assert np.array_equal(element_mask(2, Nq, Nk, causal, huge), element_mask(2, Nq, Nk, causal, bounded))


def test_huge_window_gives_the_same_oracle_result_as_unbounded():
    q, k, v = qkv()
    for causal in (False, True):
        want = oracle.forward(q, k, v, causal=causal, window=(None, 0))
        got = oracle.forward(q, k, v, causal=causal, window=(2**40, 0))
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert make_problem(q, k, v, window=(2**40, 0)).band == make_problem(q, k, v, window=(None, 0)).band


@pytest.mark.parametrize("shape", [(4, 4), (1, 2, 3), (1, 1, 2, 3, 4), (1, 1, -2, 4), (1, 1, 2.5, 4),
                                   (1, True, 2, 4), "abcd", 7, None])
def test_dropout_mask_shape_must_be_four_non_negative_ints(shape):
    with pytest.raises(ValueError, match="shape"):
        dropout_mask(shape, 0.5, seed=1)


@pytest.mark.parametrize("kw,exc,name", [
    ({"seed": 1.5}, TypeError, "seed"), ({"seed": True}, TypeError, "seed"), ({"seed": -1}, ValueError, "seed"),
    ({"seed": 1, "offset": 0.5}, TypeError, "offset"), ({"seed": 1, "offset": 2**32}, ValueError, "offset"),
])
def test_dropout_mask_checks_seed_and_offset(kw, exc, name):
    with pytest.raises(exc, match=name):
        dropout_mask((1, 1, 2, 4), 0.5, **kw)


def test_dropout_mask_accepts_numpy_shapes_and_empty_dimensions():
    m = dropout_mask(np.array([1, 2, 3, 5]), 0.5, seed=np.uint32(3), offset=np.int64(1))
    assert m.shape == (1, 2, 3, 5) and m.dtype == np.bool_
    assert np.array_equal(m, dropout_mask((1, 2, 3, 5), 0.5, seed=3, offset=1))
    assert dropout_mask((1, 2, 0, 5), 0.5, seed=3).shape == (1, 2, 0, 5)
    assert dropout_mask((1, 2, 3, 0), 0.5, seed=3).shape == (1, 2, 3, 0)
