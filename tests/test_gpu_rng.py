"""The CUDA Philox (kernels_cu/philox.cuh) against the NumPy one, bit for bit, on the GPU."""
import numpy as np
import pytest

from sandbox.loader import CompileUnit, launch
from sandbox.philox import philox4x32
from sandbox.launch import cuda_options, u32, i32
from test_philox import KAT_10

pytestmark = pytest.mark.gpu


def cuda_philox(ctr, key, rounds):
    import cupy as cp
    unit = CompileUnit("philox_check.cu", ("philox_fill<10>", "philox_fill<7>"), cuda_options())
    c = cp.asarray(np.ascontiguousarray(ctr, dtype=np.uint32))
    out = cp.zeros_like(c)
    n = c.shape[0]
    launch(unit, f"philox_fill<{rounds}>", (-(-n // 128),), (128,), (c, u32(key[0]), u32(key[1]), out, i32(n)))
    return out.get()


def test_known_answer_vectors_on_the_gpu():
    for counter, key, expected in KAT_10:
        assert tuple(int(x) for x in cuda_philox(np.array([counter]), key, 10)[0]) == expected


@pytest.mark.parametrize("rounds", [10, 7])
def test_cuda_matches_numpy(rounds):
    rng = np.random.default_rng(rounds)
    ctr = rng.integers(0, 2**32, (100_000, 4), dtype=np.uint64).astype(np.uint32)
    key = (0x12345678, 0x9ABCDEF0)
    assert np.array_equal(cuda_philox(ctr, key, rounds), philox4x32(ctr.T, key, rounds))
