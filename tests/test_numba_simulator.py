"""The Numba variants against the oracle under the CUDA simulator (CPU), small shapes.

On a machine with a GPU these run on the real device instead (sandbox.numba_support decides)."""
import numpy as np
import pytest
from hypothesis import given

from sandbox import fuzz, get_variant
from sandbox import numba_support as nb
from sandbox.numba_support import cuda        # the name `cuda` is what the simulator swaps in kernels
from sandbox.philox import philox4x32
from sandbox.registry import all_variants

NUMBA = sorted(n for n, v in all_variants().items() if v.backend == "numba")


@pytest.mark.simulator
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("name", NUMBA)
def test_numba_variant_matches_oracle(name, direction):
    variant = all_variants()[name]
    if direction == "backward" and not variant.caps.backward:
        pytest.skip(f"{name} has no backward")
    # tiled variants name small tiles for the simulator (each simulated thread is a Python thread)
    bound = get_variant(name, **getattr(variant.impl, "SIMULATOR_PARAMS", {}))

    @given(fuzz.cases(bound, "float32", fuzz.Limits.simulator()))
    def check(case):
        fuzz.assert_case(bound, case, direction)

    check()


@pytest.mark.simulator
def test_numba_philox_matches_numpy():
    for rounds in (7, 10):
        philox = nb.make_philox(rounds)

        @cuda.jit
        def fill(ctr, k0, k1, out):
            t = cuda.grid(1)
            if t < ctr.shape[0]:
                w = philox(ctr[t, 0], ctr[t, 1], ctr[t, 2], ctr[t, 3], k0, k1)
                for c in range(4):
                    out[t, c] = w[c]

        ctr = np.random.default_rng(rounds).integers(0, 2**32, (40, 4), dtype=np.uint64).astype(np.uint32)
        out = np.zeros((40, 4), np.uint32)
        fill[1, 64](ctr, np.uint32(0xDEADBEEF), np.uint32(12345), out)
        want = philox4x32(ctr.T, (0xDEADBEEF, 12345), rounds)
        assert np.array_equal(out, want)
