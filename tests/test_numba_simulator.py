"""The Numba variants against the oracle under the CUDA simulator (CPU), small shapes.

On a machine with a GPU these run on the real device instead (sandbox.numba_support decides)."""
import numpy as np
import pytest
from hypothesis import given, settings

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
    # Under the simulator the tiled variants (FA1 / FA2 tile loops, a Python thread per simulated CUDA
    # thread) cost about a second per example: they draw half the profile's examples there, which keeps
    # the README's test command inside five minutes on two cores; tests/test_modifiers.py runs the same
    # kernels again with modifiers, and on a GPU every variant draws the whole profile.
    examples = settings().max_examples
    if nb.SIMULATOR and hasattr(variant.impl, "SIMULATOR_PARAMS"):       # the tiled ones
        examples = max(1, examples // 2)

    @settings(max_examples=examples)
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


@pytest.mark.simulator
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # -inf - -inf = NaN, on purpose
@pytest.mark.parametrize("name", ["numba-rowwise", "numba-fa2", "numba-fa1"])
def test_numba_nan_query_row_propagates(name):
    """Issue 15: a NaN in q makes that row's out and lse NaN (it is not a dead row); every other row
    matches the oracle; the backward has no NaN where the oracle has none."""
    import sandbox
    from sandbox import oracle
    variant = all_variants()[name]
    bound = get_variant(name, **getattr(variant.impl, "SIMULATOR_PARAMS", {}))
    rng = np.random.default_rng(15)
    q, k, v, dout = (rng.standard_normal((1, 1, 8, 8)).astype(np.float32) for _ in range(4))
    q[0, 0, 5, 2] = np.nan
    res = sandbox.forward(q, k, v, variant=bound, causal=True)
    ref_out, ref_lse = oracle.forward(q, k, v, causal=True)
    out, lse = np.asarray(res.out, np.float64), np.asarray(res.lse, np.float64)
    assert np.isnan(out[0, 0, 5]).all() and np.isnan(lse[0, 0, 5])
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    fin = ~np.isnan(ref_out)
    np.testing.assert_allclose(out[fin], ref_out[fin], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse[~np.isnan(ref_lse)], ref_lse[~np.isnan(ref_lse)], rtol=1e-5, atol=1e-5)
    if not variant.caps.backward:
        return
    for got, ref in zip(sandbox.backward(dout, res), oracle.backward(dout, q, k, v, causal=True)):
        got, fin = np.asarray(got, np.float64), ~np.isnan(ref)
        assert not np.isnan(got[fin]).any()
        np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-4, atol=1e-5)
    assert np.isnan(np.asarray(sandbox.backward(dout, res)[0])[0, 0, 5]).all()    # dQ of the NaN row
