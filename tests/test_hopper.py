"""The Hopper rungs without a GPU: the generated wgmma wrappers, architecture-specific compile units
(sm_90a builds, none for sm_80), and the clear refusal on a GPU that is not sm_90."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import sandbox
from sandbox import loader

ROOT = Path(__file__).resolve().parents[1]


def test_wgmma_header_is_the_generators_output():
    spec = importlib.util.spec_from_file_location("gen_wgmma", ROOT / "kernels_cu" / "gen_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "kernels_cu" / "wgmma_ops.cuh").read_text() == gen.header(), \
        "kernels_cu/wgmma_ops.cuh is stale: run python kernels_cu/gen_wgmma.py"


def test_unit_targets():
    plain = loader.CompileUnit("fa2_tc.cu", ("k",))
    hopper = loader.CompileUnit("fa3_wgmma.cu", ("k",), archs=("sm_90a",))
    assert plain.target("sm_80") == "sm_80" and plain.target("sm_90") == "sm_90"
    assert hopper.target("sm_90") == "sm_90a" and hopper.target("sm_90a") == "sm_90a"
    assert hopper.target("sm_80") is None and hopper.target("sm_100") is None
    with pytest.raises(ValueError, match="sm_90a"):
        loader.build(hopper, "sm_80")


def test_hopper_units_build_for_sm_90a_only():
    from sandbox import compile_report
    bound = sandbox.get_variant("fa3-wgmma")
    entries = [("fa3-wgmma", bound, u) for u in bound.variant.impl.compile_units(bound.config)]
    jobs = compile_report.kernel_jobs(entries, ("sm_80", "sm_90"))
    fwd = [k for k in jobs if k[0] == "fa3_wgmma.cu"]
    bwd = [k for k in jobs if k[0] == "fa2_tc_bwd.cu"]
    assert fwd and {k[3] for k in fwd} == {"sm_90"} and all(jobs[k].target(k[3]) == "sm_90a" for k in fwd)
    assert {k[3] for k in bwd} == {"sm_80", "sm_90"}     # the backward is fa2-tc's: any architecture


def test_refused_on_a_gpu_that_is_not_sm_90(monkeypatch):
    mod = __import__("variants.fa3_wgmma", fromlist=["x"])
    monkeypatch.setattr(mod, "has_gpu", lambda: True)
    monkeypatch.setattr(mod, "arch", lambda: "sm_80")
    q = np.zeros((1, 1, 16, 64), np.float16)
    bound = sandbox.get_variant("fa3-wgmma")
    with pytest.raises(ValueError, match=r"sm_90 GPU.*sm_90a.*sm_80"):
        bound.check(sandbox.problem.make_problem(q, q, q), "forward")


def test_spec_booleans_and_pingpong_envelope():
    from sandbox.registry import parse_spec
    assert parse_spec("fa3:pingpong=true+stages=3") == ("fa3", {"pingpong": True, "stages": 3})
    assert sandbox.get_variant("fa3", pingpong=True).config.pingpong is True
    q = np.zeros((1, 2, 16, 64), np.float16)
    with pytest.raises(ValueError, match="pingpong"):
        sandbox.get_variant("fa3", pingpong=True, consumers=3, block_c=64).check(
            sandbox.problem.make_problem(q, q, q), "forward")


def test_tma_strides():
    """What TMA can describe: 16-byte multiples; extent-1 dims get a usable stride; zero strides of
    broadcast dims and odd rows are refused (the generic path copies those to contiguous arrays)."""
    from sandbox.tma import usable_strides
    assert usable_strides((2, 4, 128, 64), (4 * 128 * 64, 128 * 64, 64, 1)) == (128, 128 * 128, 4 * 128 * 128)
    assert usable_strides((1, 1, 100, 40), (999, 7, 40, 1)) == (80, 8000, 8000)       # extent-1 dims
    assert usable_strides((2, 4, 128, 64), (0, 128 * 64, 64, 1)) is None               # expanded batch
    assert usable_strides((2, 4, 128, 60), (4 * 128 * 60, 128 * 60, 60, 1)) is None    # 120-byte rows
    # (B, N, H, d) memory viewed as (B, H, N, d): strides need not grow with the dim
    assert usable_strides((2, 4, 128, 64), (128 * 4 * 64, 64, 4 * 64, 1)) == (512, 128, 65536)


def test_packed_launch_carries_structs_by_value():
    """A tma.Opaque argument lands in the parameter array as its bytes; a "map" Slot is 128 bytes."""
    import ctypes
    from sandbox.loader import PackedLaunch, Slot
    from sandbox.tma import Opaque
    raw = (ctypes.c_uint8 * 128)(*range(128))
    kernel = type("K", (), {"ptr": 0})()
    launch = PackedLaunch(kernel, (1,), (32,), 0, (Opaque(ctypes.addressof(raw), 128, raw), Slot("map_q", "map"),
                                                     np.int32(7)))
    assert bytes(launch.holders[0]) == bytes(range(128)) and ctypes.sizeof(launch.holders[1]) == 128
    assert launch.holders[2].value == 7 and not launch.cupy_path
