"""bfloat16 on the host: ml_dtypes arrays in, the bit-level helpers the CuPy path uses (CuPy has no
bf16 arithmetic), and the tensor-core variants accepting bf16 problems. GPU runs are in
test_gpu_variants.py (every dtype in a variant's capabilities)."""
import numpy as np
import pytest

import sandbox
from sandbox import arrays, fuzz
from sandbox.precision import numpy_dtype, round_to

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


def values():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(1000) * 10.0 ** rng.integers(-8, 8, 1000),
                        [0.0, -0.0, 1.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3e38, -3e38, np.inf, -np.inf, np.nan]])
    return x.astype(np.float32)


def test_numpy_dtype_names():
    assert numpy_dtype("bfloat16") == BF16 and numpy_dtype("float16") == np.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        numpy_dtype("int8")


def test_from_float32_rounds_to_nearest_even_like_the_oracle():
    x = values()
    got = arrays.from_float32(x, BF16, np).astype(np.float64)
    ref = round_to(x, "bfloat16")
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    assert np.array_equal(got[~np.isnan(ref)], ref[~np.isnan(ref)])
    assert np.array_equal(got[~np.isnan(ref)], x.astype(BF16).astype(np.float64)[~np.isnan(ref)])   # ml_dtypes agrees


@pytest.mark.gpu
def test_from_float32_on_the_gpu_is_the_host_forms_bits():
    """The CuPy path's one-kernel rounding (arrays._bf16_round) gives the NumPy form's bits, ties, subnormals,
    infinities and NaN included."""
    cp = pytest.importorskip("cupy")
    x = np.concatenate([values(), np.array([2.0**-130, -2.0**-140, 1.0 + 2.0**-8 + 2.0**-20], np.float32)])
    got = arrays.from_float32(cp.asarray(x), BF16, cp)
    assert got.dtype == BF16
    assert np.array_equal(cp.asnumpy(got.view(cp.uint16)), arrays.from_float32(x, BF16, np).view(np.uint16))


def test_to_float32_and_negate_are_exact():
    b = values().astype(BF16)
    assert np.array_equal(arrays.to_float32(b, np), b.astype(np.float32), equal_nan=True)
    neg = arrays.negate(b, np)
    assert neg.dtype == BF16 and np.array_equal(neg.astype(np.float32), -b.astype(np.float32), equal_nan=True)
    h = np.clip(values(), -6e4, 6e4).astype(np.float16)
    assert np.array_equal(arrays.negate(h, np), -h, equal_nan=True)


def test_fuzz_cases_and_problems_carry_bfloat16():
    case = fuzz.Case(1, 2, 1, 5, 7, 64, "bfloat16", {}, 3)
    q, k, v, dout = case.inputs()
    assert q.dtype == BF16 and dout.dtype == BF16
    p = sandbox.problem.make_problem(q, k, v)
    assert p.dtype == "bfloat16"
    for name in ("fa2-tc", "fa2-tc-naive", "fa1-tc"):
        bound = sandbox.get_variant(name)
        assert "bfloat16" in bound.variant.caps.dtypes
        bound.check(p)                                      # inside the envelope: no ValueError
    assert sandbox.get_variant("fa2-tc").variant.caps.backward
