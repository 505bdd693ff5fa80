"""bench.mufu_rate (kernels_cu/mufu_rate.cu): the body builds for sm_90 small enough for four warps per
sub-partition, its table from made-up rows, bad options refused before the GPU, and on the GPU rates below the
MUFU's peak."""
import pytest

from bench import mufu_rate


def test_every_body_builds_without_spills_and_fits_four_warps_a_sub_partition():
    pytest.importorskip("cuda.bindings.nvrtc")
    from sandbox import loader
    reports = loader.reports(mufu_rate.UNIT, loader.build(mufu_rate.UNIT, "sm_90"))
    assert len(reports) == len(mufu_rate.MODES)
    for r in reports:
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack == 0, r
        assert r.registers * 128 * 4 <= 65536, r          # the 4-warp launch: 512 threads on one SM's registers


def test_markdown_of_made_up_rows():
    rows = [{"mode": "exp2 only", "warps": 1, "per_ns_per_sm": 15.9, "per_clock": 8.02},
            {"mode": "tanh, exp2", "warps": 1, "per_ns_per_sm": 21.5, "per_clock": 10.83},
            {"mode": "tanh, exp2", "warps": 2, "per_ns_per_sm": 30.0, "per_clock": 15.17}]
    table = mufu_rate.markdown(rows, 1.98e9)
    assert "1.98 GHz" in table
    assert "| 1 | 15.9 (8.02) | 21.5 (10.83) |" in table
    assert "| 2 | - | 30.0 (15.17) |" in table


@pytest.mark.parametrize("argv", [["--warps", "5"], ["--warps", "0"], ["--iters", "0"], ["--warps", "two"]])
def test_bad_options_are_refused_before_the_gpu(argv):
    with pytest.raises(SystemExit) as e:
        mufu_rate.main(argv)
    assert e.value.code == 2           # argparse's usage error, not the missing-GPU exit (a message) of a CPU machine


@pytest.mark.gpu
def test_rates_stay_below_the_peak(tmp_path):
    cp = pytest.importorskip("cupy")
    attrs = cp.cuda.Device().attributes
    sms, clock = attrs["MultiProcessorCount"], attrs["ClockRate"] * 1e3
    one = mufu_rate.rate(1, 1, 20, sms, clock)
    two = mufu_rate.rate(1, 2, 20, sms, clock)
    for r in (one, two):
        assert 0 < r["per_clock"] <= 16 * 1.02, r          # 16 MUFU results per SM clock on sm_90
    assert two["per_ns_per_sm"] > one["per_ns_per_sm"]      # a second warp adds to one warp's rate
