"""On the GPU: what the benchmark tables rest on. The device tile-table cache (a mask's tiles are
classified once, and a changed layout is classified again), the timer hiding host work behind its
spin kernel, and the peak-memory hook of the memory family."""
import time

import numpy as np
import pytest

from sandbox.launch import tile_table
from sandbox.masks import BlockSparse, classify_tiles
from sandbox.problem import make_problem

pytestmark = pytest.mark.gpu


def test_tile_table_is_cached_by_content():
    q = np.zeros((1, 2, 256, 16), np.float32)
    layout = np.random.default_rng(0).random((1, 4, 4)) < 0.5
    bm = BlockSparse(layout.copy(), (64, 64))
    p = make_problem(q, q, q, block_mask=bm)
    a, ha = tile_table(p, 64, 32, __import__("cupy"))
    b, _ = tile_table(make_problem(q, q, q, block_mask=BlockSparse(layout.copy(), (64, 64))), 64, 32, __import__("cupy"))
    assert a is b and int(ha) == 1
    np.testing.assert_array_equal(a.get(), classify_tiles(256, 256, 64, 32, p.band, bm))
    bm.layout[0, 0, 0] = not bm.layout[0, 0, 0]                # same object, new content: a new table
    c, _ = tile_table(make_problem(q, q, q, block_mask=bm), 64, 32, __import__("cupy"))
    assert c is not a
    np.testing.assert_array_equal(c.get(), classify_tiles(256, 256, 64, 32, p.band, bm))


def test_time_fn_keeps_host_work_out_of_the_events():
    import cupy as cp
    from sandbox.timing import time_fn
    x = cp.zeros(1 << 20, cp.float32)

    def slow_host():
        time.sleep(0.003)               # 3 ms of Python before a ~10 us kernel
        x.fill(1.0)

    t = time_fn(slow_host, reps=5)
    assert t.median_ms < 0.5, t


def test_memory_hook_counts_a_calls_peak():
    import cupy as cp
    from bench.memory import PeakHook
    hook = PeakHook()
    with hook:
        a = cp.empty(1 << 20, cp.uint8)
        b = cp.empty(1 << 21, cp.uint8)
        del a, b
        c = cp.empty(1 << 20, cp.uint8)
        del c
    assert hook.peak == 3 << 20 and hook.current == 0


@pytest.mark.parametrize("causal", [False, True])
def test_cupy_standard_baseline_matches_the_oracle(causal):
    import cupy as cp
    from sandbox import baselines, oracle
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, n, 32)).astype(np.float16) for n in (70, 90, 90))
    out = baselines.cupy_standard_attention(*(cp.asarray(x) for x in (q, k, v)), causal=causal)
    ref, _ = oracle.forward(q, k, v, causal=causal)
    np.testing.assert_allclose(out.get().astype(np.float64), ref, atol=2e-2)


def test_sdpa_backward_baseline_times_the_backward_alone():
    """The grid's backward rows divide 2.5x the forward FLOPs by the time: SDPA's backward callable must
    not run a forward (it did until 2026-11-22). Forward + backward takes longer than backward alone by
    about the forward's time, a quarter of the total or more at this size."""
    from sandbox import baselines
    from sandbox.timing import time_fn
    args = (4, 16, 2048, 2048, 64)
    fns = {dr: baselines.sdpa("flash", *args, direction=dr) for dr in ("forward", "backward", "both")}
    if any(f is None for f in fns.values()):
        pytest.skip("no SDPA flash backend here")
    t = {dr: time_fn(f, reps=10).median_ms for dr, f in fns.items()}
    assert t["backward"] < t["both"] - 0.5 * t["forward"], t
