"""The lecture's three softmax algorithms: NumPy references agree with each other, the naive one
overflows where the other two do not, and the Numba (simulator or GPU) and CUDA kernels match."""
import numpy as np
import pytest

from sandbox import softmax
from sandbox.device import has_gpu


def test_references_agree_on_moderate_inputs():
    x = np.random.default_rng(0).standard_normal((5, 37)) * 4
    ref = softmax.reference(x, "safe")
    for alg in ("naive", "online"):
        np.testing.assert_allclose(softmax.reference(x, alg), ref, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(ref.sum(axis=1), 1.0, rtol=1e-12)


def test_naive_overflows_where_safe_and_online_do_not():
    x = np.array([[1000.0, 0.0, -5.0]])
    assert not np.isfinite(softmax.reference(x, "naive")).all()
    for alg in ("safe", "online"):
        np.testing.assert_allclose(softmax.reference(x, alg), [[1.0, np.exp(-1000.0), 0.0]], atol=1e-300)


@pytest.mark.parametrize("bad,match", [
    (np.zeros((2, 3), np.float64), "float32"),
    (np.zeros((2, 3, 4), np.float32), r"\[rows, n\]"),
    (np.zeros((0, 3), np.float32), "non-empty"),
])
def test_bad_input_is_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        softmax.softmax(bad, "online", "numba")


def test_unknown_algorithm_and_backend():
    x = np.zeros((1, 4), np.float32)
    with pytest.raises(ValueError, match="algorithm"):
        softmax.softmax(x, "fast")
    with pytest.raises(ValueError, match="backend"):
        softmax.softmax(x, "safe", "triton")


def _inputs(rows, n, spread, seed=0):
    return (np.random.default_rng(seed).standard_normal((rows, n)) * spread).astype(np.float32)


@pytest.mark.parametrize("algorithm", softmax.ALGORITHMS)
def test_numba_kernels(algorithm):
    """Under the CUDA simulator in CI (small rows), on the GPU otherwise."""
    for rows, n in ((2, 1), (3, 129), (1, 300)):
        x = _inputs(rows, n, 3.0)
        np.testing.assert_allclose(np.asarray(softmax.softmax(x, algorithm, "numba")), softmax.reference(x, algorithm),
                                   rtol=2e-6, atol=1e-7)
    big = np.array([[100.0, 0.0, 99.0]], np.float32)            # exp(100) overflows float32
    y = np.asarray(softmax.softmax(big, algorithm, "numba"))
    assert np.isfinite(y).all() != (algorithm == "naive")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="CUDA kernels need a GPU")
@pytest.mark.parametrize("algorithm", softmax.ALGORITHMS)
def test_cuda_kernels(algorithm):
    import cupy as cp
    for rows, n in ((4, 1), (7, 257), (3, 4096), (2, 70001)):
        x = _inputs(rows, n, 3.0, seed=n)
        y = softmax.softmax(cp.asarray(x), algorithm, "cuda")
        assert isinstance(y, cp.ndarray)
        np.testing.assert_allclose(y.get(), softmax.reference(x, algorithm), rtol=2e-6, atol=1e-9)
    big = np.array([[100.0, 0.0, 99.0]], np.float32)
    assert np.isfinite(softmax.softmax(big, algorithm, "cuda")).all() != (algorithm == "naive")
