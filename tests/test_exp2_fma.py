"""The softmax's exp2 on the FMA pipe (kernels_cu/tc_softmax.cuh exp2_fma; the fa3 variants' `exp2_fma`
parameter): every k-th n8 column block's 2^x by a degree-4 polynomial instead of MUFU.EX2.

Without a GPU: a float32 model of exp2_fma built from the coefficients and clamp in the header itself (so an
edit of either shows here) holds 2^x to 3e-6 relative error over the softmax's range, gives exactly 0 for
-inf and keeps NaN; the parameter adds one -D option and nothing at 0; the fa3 module with it compiles
without spills.
With a GPU: fa3 and fa3-ws with exp2_fma on, fuzzed against the oracle, forward and backward (the
backward reads the forward's lse), with and without a soft-cap (the case the parameter is for).
"""
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given

from sandbox import fuzz, get_variant, loader, modifiers
from sandbox.registry import all_variants

HEADER = Path(__file__).resolve().parents[1] / "kernels_cu" / "tc_softmax.cuh"
SHIFTER = np.float32(12582912.0)


def _coefficients():
    """exp2_fma's Horner coefficients, highest degree first, read from its source."""
    body = HEADER.read_text().split("float exp2_fma(float x)", 1)[1].split("\n}", 1)[0]
    nums = [np.float32(v) for v in re.findall(r"fmaf\(\s*(?:p|0\.\d+f),\s*f,\s*([0-9.]+)f?\)", body)]
    first = re.search(r"fmaf\((0\.\d+)f, f,", body)
    assert first and len(nums) == 4, body
    return [np.float32(first.group(1)), *nums]


def exp2_fma_model(x):
    """exp2_fma step by step in float32 (NumPy rounds each float32 operation as the GPU does; fmaf's
    single rounding is emulated in float64, exact for these operand sizes). The clamp is PTX max.NaN:
    NaN stays NaN (np.maximum propagates NaN the same way)."""
    clamp = re.search(r"max\.NaN\.f32 %0, %0, 0f([0-9A-F]{8})", HEADER.read_text()).group(1)
    x = np.maximum(np.asarray(x, np.float32), np.uint32(int(clamp, 16)).view(np.float32))
    with np.errstate(invalid="ignore"):
        shifted = (x + SHIFTER).astype(np.float32)
        j = (shifted - SHIFTER).astype(np.float32)
        f = (x - j).astype(np.float32)
        c = _coefficients()
        p = np.full_like(f, c[0])
        for ck in c[1:]:
            p = (p.astype(np.float64) * f.astype(np.float64) + np.float64(ck)).astype(np.float32)
        e = ((shifted.view(np.uint32).astype(np.uint64) + np.uint64((127 - 0x4B400000) % 2**32)) << np.uint64(23)) \
            & np.uint64(0xFFFFFFFF)
        return (p * e.astype(np.uint32).view(np.float32)).astype(np.float32)


def test_exp2_fma_model_is_accurate_over_the_softmax_range():
    x = np.concatenate([np.linspace(-126.0, 0.0, 2_000_001, dtype=np.float32),
                        -np.float32(2.0) ** -np.arange(1, 40, dtype=np.float32), np.float32([0.0, -0.5, 0.5 - 1])])
    got = exp2_fma_model(x).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1.0)
    assert rel.max() < 3e-6, (rel.max(), x[rel.argmax()])
    assert np.all(np.diff(got[:2_000_001]) >= -3e-6 * got[1:2_000_001])        # no jumps at the rounding seams


def test_exp2_fma_model_flushes_like_ex2_ftz():
    """-inf (masked scores, dead rows: the epilogue tests l == 0) and everything below -126.5 give exactly 0,
    never NaN (a first version, with 2^0 = 1 - 7e-7 and j added to p's exponent field, borrowed into the sign
    bit at the clamp: NaN, caught here); -126 gives the smallest normal."""
    zero = exp2_fma_model(np.float32([-np.inf, -1e30, -200.0, -127.0, -126.9, -126.6]))
    assert np.all(zero == 0.0) and not np.any(np.signbit(zero))
    assert exp2_fma_model(np.float32([-126.0]))[0] == np.float32(2.0) ** -126


def test_exp2_fma_model_keeps_nan():
    """A NaN score must reach its row's output (the NaN contract, tests/test_gpu_nan.py); fmaxf as the clamp
    turned it into 2^-127 = 0 (found in review). max.NaN keeps it, and the product with 2^j passes it on."""
    assert np.all(np.isnan(exp2_fma_model(np.float32([np.nan, -np.nan]))))


def test_parameter_sets_one_option():
    cfg = lambda **kw: all_variants()["fa3"].impl.configure(**kw)       # noqa: E731
    plain, emu = cfg().unit("float16", 64), cfg(exp2_fma=2).unit("float16", 64)
    assert not any("FA_EXP2_EMU" in o for o in plain.options)
    assert [o for o in emu.options if o not in plain.options] == ["-DFA_EXP2_EMU=2"]
    assert emu.names == plain.names and "exp2_fma=2" in emu.label
    with pytest.raises(ValueError, match="exp2_fma"):
        get_variant("fa3", exp2_fma=5)


@pytest.mark.parametrize("D", [64, 128])
def test_exp2_fma_module_builds_without_spills(D):
    unit = get_variant("fa3", exp2_fma=2).config.unit("float16", D)
    build = loader.build(loader.CompileUnit(unit.source, unit.names[:1], unit.options, unit.dynamic_smem,
                                            archs=unit.archs), "sm_90a")
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", build.log), build.log


SOFTCAP = (lambda rng, B, Hq, Nq, Nk: modifiers.softcap(float(rng.choice([5.0, 30.0, 50.0]))),)
GPU_CASES = [(name, k, dtype, direction, softcap) for name, k in (("fa3", 2), ("fa3", 4), ("fa3-ws", 3))
             for dtype in ("float16", "bfloat16") for direction in ("forward", "backward")
             for softcap in (False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,k,dtype,direction,softcap", GPU_CASES)
def test_exp2_fma_matches_oracle(name, k, dtype, direction, softcap):
    bound = get_variant(name, exp2_fma=k)
    extra = {"score_mods": SOFTCAP} if softcap else {}

    @given(fuzz.cases(bound, dtype, fuzz.Limits(dims=(32, 64, 96, 128)), **extra))
    def check(case):
        fuzz.assert_case(bound, case, direction)

    check()
