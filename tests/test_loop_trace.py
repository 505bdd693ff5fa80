"""fa3's loop trace (trace=True, kernels_cu/fa3_ws.cu FA_TRACE; bench/loop_trace.py): the phase arithmetic on a
made-up trace, the traced build (CPU, NVRTC), and on the GPU that tracing changes no result and records every
iteration of block 0's walk in order."""
import numpy as np
import pytest

import sandbox
from bench import loop_trace
from variants import fa3_ws


def _trace(starts, phases, tail, iterations):
    """[3, 512, 8] clocks: warpgroup c's iteration i starts at 1000 + starts[c] + i * period (a clock of 0 means
    "not recorded"), its phases (PHASES order) last `phases`, then `tail` clocks to the next top."""
    t = np.zeros(fa3_ws.TRACE_SHAPE, np.int64)
    period = sum(phases) + tail
    for c, s0 in enumerate(starts):
        for i in range(iterations):
            t[c, i] = 1000 + s0 + i * period + np.concatenate([[0], np.cumsum(phases)])
    return t


def test_phase_medians_and_period_of_a_made_up_trace():
    phases = (100, 0, 400, 300, 50, 1000, 20)
    t = _trace([0, 1870 // 2], phases, tail=0, iterations=6)
    rows = loop_trace.summarize(t)
    assert [r["warpgroup"] for r in rows] == [0, 1]
    for r in rows:
        assert r["iterations"] == 6
        assert [r[p] for p in loop_trace.PHASES] == list(phases)
        assert r["period"] == sum(phases) and r["tail"] == 0


def test_softmax_overlap_is_the_shared_fraction():
    # softmax = event 5 -> 6: 1000 clocks from 850 clocks into each 1870-clock period
    phases = (100, 0, 400, 300, 50, 1000, 20)
    same = _trace([0, 0], phases, tail=0, iterations=4)
    assert loop_trace.softmax_overlap(same, 0, 1) == pytest.approx(1.0)
    half = _trace([0, 500], phases, tail=0, iterations=4)      # wg 1 500 clocks later: 500 of 1000 shared
    # each of wg 0's softmax intervals shares 500 clocks with wg 1's same iteration and none with another
    assert loop_trace.softmax_overlap(half, 0, 1) == pytest.approx(0.5)
    # half a period apart (+100): wg 0's softmax i shares 1015 - 850 = 165 clocks with wg 1's softmax i - 1 (a
    # softmax longer than half the period always meets the other's), iteration 0 none
    apart = _trace([0, 1870 // 2 + 100], phases, tail=0, iterations=4)
    assert loop_trace.softmax_overlap(apart, 0, 1) == pytest.approx(3 * 165 / 4000)


def test_softmax_concurrency_counts_the_warpgroups_in_their_softmax():
    # 1870-clock periods, softmax from 850 to 1850 of each: five iterations span 9,350 clocks, 5,000 of them softmax
    phases = (100, 0, 400, 300, 50, 1000, 20)
    k = loop_trace.softmax_concurrency(_trace([0], phases, tail=0, iterations=5))
    assert k["one"] == pytest.approx(5000 / 9350) and k["two or more"] == 0.0
    assert k["none"] == pytest.approx(4350 / 9350)
    same = loop_trace.softmax_concurrency(_trace([0, 0], phases, tail=0, iterations=5))
    assert same["two or more"] == pytest.approx(5000 / 9350) and same["one"] == 0.0
    # wg 1 500 clocks later: the window runs from wg 1's first top (+500) to wg 0's last end (9,350), 8,850 clocks;
    # each softmax pair shares 500 clocks (5 x 500 both); alone: wg 0's first 500 of each (5 x 500) and wg 1's last
    # 500 of each but the fifth, which the window cuts to 20 (4 x 500 + 20)
    half = loop_trace.softmax_concurrency(_trace([0, 500], phases, tail=0, iterations=5))
    assert half["two or more"] == pytest.approx(2500 / 8850)
    assert half["one"] == pytest.approx(4520 / 8850)
    assert sum(half.values()) == pytest.approx(1.0)
    # traces that never overlap in time leave no window
    apart = _trace([0, 20000], phases, tail=0, iterations=2)
    assert np.isnan(loop_trace.softmax_concurrency(apart)["none"])
    assert np.isnan(loop_trace.softmax_concurrency(np.zeros_like(apart))["one"])     # nothing recorded


def test_incomplete_rows_are_left_out():
    t = _trace([0, 0], (1, 1, 1, 1, 1, 1, 1), tail=3, iterations=5)
    t[1, 4, 6:] = 0                                           # wg 1's last iteration stopped before its end
    assert [r["iterations"] for r in loop_trace.summarize(t)] == [5, 4]
    assert "| 64 | 4096 | causal | default | 0 | 5 |" in loop_trace.markdown(
        [{"d": 64, "N": 4096, "case": "causal", "config": "", "warpgroups": loop_trace.summarize(t)}])


def test_configs_and_options_are_checked_before_anything_runs():
    assert loop_trace.configs("fa3", ",pingpong=true+stages=3") == [("", {}), ("pingpong=true+stages=3",
                                                                              {"pingpong": True, "stages": 3})]
    for bad in ("pingpong=maybe", "stages=5", "no_such_param=1"):
        with pytest.raises(SystemExit, match="--configs"):
            loop_trace.configs("fa3", bad)
    for argv in (["--cases", "softcap,nope"], ["--headdim", "64,x"], ["--seqlen", "0"]):
        with pytest.raises(SystemExit):                            # argparse's error, exit status 2
            loop_trace.main([*argv, "--out", "/tmp/unused-loop-trace"])


def test_trace_is_an_fa3_parameter_that_adds_the_switch_only_when_on():
    on, off = sandbox.get_variant("fa3", trace=True).config, sandbox.get_variant("fa3").config
    assert "-DFA_TRACE" in on.unit("float16", 128).options and "trace" in on.unit("float16", 128).label
    assert "-DFA_TRACE" not in off.unit("float16", 128).options
    with pytest.raises((ValueError, TypeError)):
        sandbox.get_variant("fa3-ws", trace=True)                 # fa3-ws has no overlapped loop to trace


def test_the_bench_finds_the_traced_variant_through_the_registry():
    assert loop_trace.traced_variants() == ["fa3"]
    impl = sandbox.get_variant("fa3").variant.impl
    assert impl.clear_traces is fa3_ws.clear_traces and impl.read_trace is fa3_ws.read_trace
    with pytest.raises(SystemExit, match="trace parameter"):
        loop_trace.main(["--variant", "fa2-tc", "--out", "/tmp/unused-loop-trace"])


def test_traced_build_compiles_without_spills():
    pytest.importorskip("cuda.bindings.nvrtc")
    from sandbox import loader
    u = sandbox.get_variant("fa3", trace=True).config.unit("float16", 128)
    name = u.names[0]
    job = loader.CompileUnit(u.source, (name,), tuple(u.options), {name: u.dynamic_smem[name]}, u.label, tuple(u.archs))
    (r,) = loader.reports(job, loader.build(job, "sm_90"))
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack == 0, r


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal", "softcap"])
def test_gpu_trace_records_block_zeros_walk_and_changes_no_result(case):
    """N = 1024 causal, Br = Bc = 128, non-persistent: block 0 runs the last Q tile (rows 896..1023), 8 K tiles,
    so the overlapped loop (after the prologue's tile) runs 7 iterations per warpgroup, each event in order."""
    cp = pytest.importorskip("cupy")
    from bench.modifiers_bench import modifier_options
    g = cp.random.default_rng(3)
    q, k, v = (g.standard_normal((2, 4, 1024, 64), dtype=cp.float32).astype(cp.float16) for _ in range(3))
    opts = modifier_options(case, 4, 1024)
    cfg = dict(consumers=2, persistent=False)
    plain = sandbox.forward(q, k, v, variant="fa3", **cfg, **opts)
    sandbox.forward(q, k, v, variant="fa3", trace=True, **cfg, **opts)       # loads the traced module
    fa3_ws.clear_traces()
    traced = sandbox.forward(q, k, v, variant="fa3", trace=True, **cfg, **opts)
    t = fa3_ws.read_trace()
    assert cp.array_equal(plain.out, traced.out) and cp.array_equal(plain.lse, traced.lse)
    for c in (0, 1):
        rows = loop_trace.complete_rows(t, c)
        assert len(rows) == 7 and not t[c, 7:].any()
        assert (np.diff(rows, axis=1) >= 0).all() and (np.diff(rows[:, 0]) > 0).all()
    assert not t[2].any()
