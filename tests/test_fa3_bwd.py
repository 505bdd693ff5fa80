"""bwd_kernel="wgmma2" (kernels_cu/fa3_bwd2.cu, variants/fa3_backward.py): the second wgmma backward of the
Hopper rungs. Without a GPU: the registry and dispatch (a choice of every Hopper rung, refused past d = 128
and with modifiers, built by the compile gate and held to no spills), its shared memory, the NVRTC build
of each kernel for sm_90a (no spills, no wgmma serialized by ptxas), and the accumulator order of the dQ
buffer against the index arithmetic of fa3_bwd2_dq. With a GPU (`pytest -m gpu`): forward + backward
against the float64 oracle (fp16 and bf16, d = 40, 64, 96, 128, masks, dropout, GQA, dead rows, ragged
and long sequences), the pointer-level plan from torch against SDPA, and the -DFA3_BWD2_SERIAL build.
"""
import dataclasses
import re

import numpy as np
import pytest

import sandbox
from sandbox import loader
from variants import fa3_backward

HOPPER = ("fa3-wgmma", "fa3-ws", "fa3")


def _problem(d, **kw):
    q = np.zeros((1, 4, 16, d), np.float16)
    k = np.zeros((1, 2, 16, d), np.float16)
    return sandbox.problem.make_problem(q, k, k, **kw)


# ---- registry, dispatch, envelope

@pytest.mark.parametrize("name", HOPPER)
def test_wgmma2_is_a_backward_of_every_hopper_rung(name):
    bound = sandbox.get_variant(name, bwd_kernel="wgmma2")
    assert bound.config.bwd_kernel == "wgmma2"
    for d in (8, 40, 64, 96, 128):
        bound.check(_problem(d), "backward")
    for d in (136, 256):
        bound.check(_problem(d), "forward")
        with pytest.raises(ValueError, match=rf"backward at head dim {d}.*d = 128"):
            bound.check(_problem(d), "backward")
    with pytest.raises(ValueError, match="backward at head dim 200"):
        bound.variant.impl.backward_plan(_problem(200), bound.config, {})


def test_wgmma_backwards_refuse_the_modifiers_they_do_not_take():
    """A config naming wgmma2 takes score and mask modifiers; one naming wgmma neither (fa3_backward.takes_mods,
    the same rule "auto" routes by)."""
    from sandbox import modifiers
    doc = _problem(64, mask_mod=modifiers.document(np.arange(16) // 8))
    soft = _problem(64, score_mod=modifiers.softcap(30.0))
    for p in (doc, soft):
        bound = sandbox.get_variant("fa3", bwd_kernel="wgmma")
        bound.check(p, "forward")
        with pytest.raises(ValueError, match="wgmma.*fa3_bwd.cu.*takes no modifiers"):
            bound.check(p, "backward")
        sandbox.get_variant("fa3", bwd_kernel="wgmma2").check(p, "backward")


@pytest.mark.parametrize("name", ["fa3-wgmma", "fa3-ws", "fa3"])
def test_a_wgmma_backward_config_lists_what_it_takes_and_the_fuzzer_draws_nothing_else(name):
    """registry.BoundVariant.caps narrows the variant's caps per config (impl.config_caps): the fuzzer
    draws within them, so `sandbox fuzz --variants fa3:bwd_kernel=wgmma2` never draws a modifier the
    config refuses (seen on the H100: it did before, and every such example was a ValueError)."""
    from hypothesis import HealthCheck, given, settings
    from sandbox import fuzz
    from sandbox.registry import all_variants
    v = all_variants()[name]
    assert v.bind().caps.score_mod and v.bind().caps.mask_mod
    for kernel in fa3_backward.KERNELS:
        bound = v.bind(bwd_kernel=kernel)
        assert bound.caps.score_mod == bound.caps.mask_mod == (kernel == "wgmma2")

        @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(fuzz.cases(bound, "float16"))
        def no_modifier(case):
            assert kernel == "wgmma2" or ("mask_mod" not in case.options and "score_mod" not in case.options)
        no_modifier()


def test_default_backward_is_wgmma2_where_it_can_run():
    """bwd_kernel="auto" (the default): wgmma2 for d <= 128 with or without modifiers (a distance bias seeded,
    other score modifiers and mask modifiers compiled in); fa2-tc's mma.sync past 128."""
    from sandbox import modifiers
    from sandbox.problem import Problem
    from variants.fa3_wgmma import resolve_bwd_kernel
    for name in HOPPER:
        assert sandbox.get_variant(name).config.bwd_kernel == "auto"
    assert fa3_backward.KERNELS == ("wgmma", "wgmma2")
    plain = Problem(B=1, Hq=2, Hkv=2, Nq=70, Nk=70, d=128, dtype="float16")
    assert resolve_bwd_kernel("auto", plain) == "wgmma2"
    assert resolve_bwd_kernel("auto", dataclasses.replace(plain, d=136)) == "mma"
    alibi = modifiers.alibi([0.5, 0.25])
    for sm in (modifiers.sinks([0.1, 0.2]), alibi, alibi.with_sinks([0.3]), modifiers.softcap(5.0)):
        assert resolve_bwd_kernel("auto", dataclasses.replace(plain, score_mod=sm)) == "wgmma2", sm
    kinds = [fa3_backward.backward_mods(dataclasses.replace(plain, score_mod=sm)) for sm in
             (None, modifiers.sinks([0.1]), alibi, modifiers.softcap(5.0).with_sinks([0.2]))]
    assert kinds == ["none", "none", "seed", "text"]
    doc = modifiers.document(np.arange(70) // 35)
    with_doc = [dataclasses.replace(plain, score_mod=sm, mask_mod=doc) for sm in (None, alibi, modifiers.softcap(5.0))]
    assert [resolve_bwd_kernel("auto", p) for p in with_doc] == ["wgmma2"] * 3
    assert [fa3_backward.backward_mods(p) for p in with_doc] == ["mask"] * 3
    # a mask modifier's module compiles a score modifier's text where one comes with it (ALiBi's too: with a mask
    # modifier the backward takes every score modifier's text)
    assert ["-DFA_SCORE_MOD=1" in fa3_backward.module_mods(p, "mask").options for p in with_doc] == [False, True, True]
    assert resolve_bwd_kernel("auto", dataclasses.replace(plain, d=136, mask_mod=doc)) == "mma"
    # wgmma (fa3_bwd.cu) seeds nothing: sinks alone, not ALiBi
    assert fa3_backward.takes_mods("wgmma", dataclasses.replace(plain, score_mod=modifiers.sinks([0.1])))
    assert not fa3_backward.takes_mods("wgmma", dataclasses.replace(plain, score_mod=alibi))
    assert resolve_bwd_kernel("mma", plain) == "mma" and resolve_bwd_kernel("wgmma", plain) == "wgmma"


def test_units_names_and_shared_memory():
    from variants.fa3_wgmma import SMEM_LIMIT
    # K, V; two buffers of Q and dO; the dS^T panel; 2 x 2 staging blocks of 64 x 64 fp32; lse, D; the two buffers'
    # mbarriers; alignment
    assert fa3_backward.smem2(128) == 2 * (2 * 128 * 128 + 4 * 64 * 128 + 128 * 64) + 4 * 16384 + 1024 + 16 + 1024 \
        == 215056
    assert fa3_backward.smem2(64) == 149520
    # D = 64 without dropout: 128 query rows per step (Q, dO buffers and the dS^T panels twice as large)
    assert fa3_backward.smem2(64, 128) == 2 * (2 * 128 * 64 + 4 * 128 * 64 + 128 * 128) + 4 * 16384 + 2048 + 16 + 1024
    assert max(fa3_backward.smem2(D, fa3_backward.rows2(D, drop)) for D in (64, 128) for drop in (0, 1)) <= SMEM_LIMIT
    assert [fa3_backward.rows2(D, drop) for D in (64, 128) for drop in (False, True)] == [128, 64, 64, 64]
    u = fa3_backward.unit2("bfloat16", 128, 10, serial=False)
    assert u.source == "fa3_bwd2.cu" and u.archs == ("sm_90a",)
    assert u.names == ("fa3_bwd2<__nv_bfloat16, 128, 64, 10, false>", "fa3_bwd2<__nv_bfloat16, 128, 64, 10, true>",
                       "fa3_bwd2_dq<__nv_bfloat16>", "fa3_bwd2_pre<__nv_bfloat16>")
    assert u.dynamic_smem[u.names[0]] == 215056 and u.dynamic_smem["fa3_bwd2_dq<__nv_bfloat16>"] == 0
    u64 = fa3_backward.unit2("float16", 64, 10, serial=False)
    assert u64.names[:2] == ("fa3_bwd2<__half, 64, 128, 10, false>", "fa3_bwd2<__half, 64, 64, 10, true>")
    assert [u64.dynamic_smem[n] for n in u64.names] == [199696, 149520, 0, 0]
    assert not any("FA3_BWD2_SERIAL" in o for o in u.options)
    serial = fa3_backward.unit2("bfloat16", 128, 10, serial=True)
    assert "-DFA3_BWD2_SERIAL" in serial.options and serial.label != u.label and serial.names == u.names
    assert fa3_backward.acc_shape(_problem(64), 64) == (4, 1, 64 * 64)
    assert [fa3_backward.padded_rows(n) for n in (1, 64, 128, 129, 300)] == [128, 128, 128, 256, 384]


def test_the_compile_gate_builds_wgmma2_and_holds_it_to_no_spills():
    from sandbox import compile_report
    v = sandbox.registry.all_variants()["fa3-wgmma"]
    bound = next(b for b in compile_report.configs(v, gate=True) if b.params["bwd_kernel"] == "wgmma2")
    units = [u for u in v.impl.compile_units(bound.config) if u.source == "fa3_bwd2.cu"]
    assert {(u.label) for u in units} == {f"fa3-bwd2[{dt}, D={D}]" for dt in ("float16", "bfloat16") for D in (64, 128)}
    assert all(v.impl.tuned(bound.config, u) for u in units)
    # the default config (bwd_kernel="auto") builds them too: it launches them
    assert {u.label for u in v.impl.compile_units(v.bind().config) if u.source == "fa3_bwd2.cu"} == \
        {u.label for u in units}


# ---- the sm_90a build: ptxas's report

def test_kernels_compile_without_spills_or_serialized_wgmma():
    """fp16 (the gate builds bf16 too), one kernel per program as the compile report builds it (the same
    cache key): no spills, shared memory within the limit, and no ptxas note that wgmma instructions were
    serialized (C7515 / C7519: a wgmma under a branch, an accumulator copied), which would undo the overlap."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from sandbox import compile_report
    bound = sandbox.get_variant("fa3-wgmma", bwd_kernel="wgmma2")
    units = [fa3_backward.unit2("float16", D, 10, serial=False) for D in (64, 128)]
    jobs = compile_report.kernel_jobs([("fa3-wgmma", bound, u) for u in units], ("sm_90",))
    loader.build_many([(j, "sm_90") for j in jobs.values()])
    for key, job in jobs.items():
        b = loader.build(job, "sm_90")
        (r,) = loader.reports(job, b)
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack == 0, (key, r)
        assert r.static_smem + job.dynamic_smem[key[2]] <= compile_report.SMEM_LIMIT["sm_90"], (key, r)
        assert "serialized" not in b.log and "C7515" not in b.log and "C7519" not in b.log, b.log



def _nvdisasm():
    """nvdisasm from PATH, SANDBOX_NVDISASM or the nvidia-cuda-nvdisasm wheel; None where there is none."""
    import os
    import shutil
    found = os.environ.get("SANDBOX_NVDISASM") or shutil.which("nvdisasm")
    if found is None:
        try:
            import nvidia.cu13
            cand = os.path.join(list(nvidia.cu13.__path__)[0], "bin", "nvdisasm")
            found = cand if os.path.exists(cand) else None
        except ImportError:
            pass
    return found


def test_wgmma2_keeps_each_gemm_group_whole_in_the_sass():
    """In fa3_bwd2's SASS, the only wait for every wgmma in flight (WARPGROUP.DEPBAR.LE gsb0, 0x0) is the one after
    the loop (the last dK): no ptxas split of S^T with a wait inside the loop. Where the next tile is looked up
    decides it (kernels_cu/fa3_bwd2.cu: a lookup under the GEMMs split S^T at D = 128, NVRTC 13; measured 3-5%
    slower on the H100). Plain units, fp16 and bf16, both dropout switches. (ALiBi's D = 64 unit with dropout has
    such a split since before session 10.) Needs nvdisasm (the CUDA toolkit or the nvidia-cuda-nvdisasm wheel)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    import subprocess
    import tempfile
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("no nvdisasm (CUDA toolkit, or pip install nvidia-cuda-nvdisasm)")
    for dt in ("float16", "bfloat16"):
        for D in (64, 128):
            u = fa3_backward.unit2(dt, D, 10, serial=False)
            for name in u.names[:2]:
                one = dataclasses.replace(u, names=(name,), dynamic_smem={name: u.dynamic_smem[name]})
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(loader.build(one, "sm_90a").cubin)
                    f.flush()
                    sass = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
                assert sass.count("HGMMA") >= 5 and sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == 1, name

def _alibi_problem(D, dropout_p=0.0, sinks=False):
    from sandbox import modifiers
    from sandbox.problem import Problem
    sm = modifiers.alibi([-0.5, -0.125])
    return Problem(B=1, Hq=2, Hkv=1, Nq=70, Nk=300, d=D, dtype="float16", causal=True, dropout_p=dropout_p,
                   score_mod=sm.with_sinks([0.2, -0.4]) if sinks else sm)


WGMMA2_TEXT_SPILLS = 128


def test_wgmma2_with_score_modifiers_compiles_within_the_spill_gate():
    """ALiBi's bias seeds fa3_bwd2's S^T (-DFA_DIST_BIAS, the forward's options); the soft-cap and the relative
    bias compile their text and derivative in (-DFA_SCORE_MOD, the backward's): a module per modifier text and
    dropout switch, built for sm_90a with no serialized wgmma, no spills at D = 64 (128 query rows without dropout,
    rows2, a text too) and for ALiBi, at most WGMMA2_TEXT_SPILLS bytes for a text at D = 128; a mask modifier
    compiles its predicate in (-DFA_MASK_MOD), at D = 64 without dropout on 128 query rows."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from sandbox import compile_report
    from variants.fa2_tc import ModKernel
    bound = sandbox.get_variant("fa3", bwd_kernel="wgmma2")
    from mod_cases import score_mods
    units = [fa3_backward.unit2("float16", D, 10, serial=False, mods=ModKernel.of(_alibi_problem(D, drop)))
             for D in (64, 128) for drop in (0.0, 0.2)]
    for u in units:
        assert "-DFA_DIST_BIAS=1" in u.options and len(u.names) == 3 and "alibi:" in u.label
    text_specs = (("float16", 64, 0.2, "softcap"), ("bfloat16", 128, 0.2, "softcap+sinks"),
                  ("float16", 128, 0.0, "relative_bias"), ("float16", 128, 0.0, "softcap"),
                  ("float16", 64, 0.0, "relative_bias"), ("bfloat16", 64, 0.0, "softcap+sinks"))
    text = [fa3_backward.unit2(dt, D, 10, serial=False, mods=ModKernel.of(
                dataclasses.replace(_alibi_problem(D, drop), score_mod=score_mods()[sm]), backward=True))
            for dt, D, drop, sm in text_specs]
    for u, (_, D, drop, _) in zip(text, text_specs):
        assert "-DFA_SCORE_MOD_GRAD=1" in u.options and "-DFA_DIST_BIAS=1" not in u.options
        assert (", 64, 128, 10," in u.names[0]) == (D == 64 and not drop), u.names    # rows2: 128 with a text too
    # the soft-cap's module as a backward runs it: the factored core and derivative, FA_TANH_CORE
    for dt, D, drop in (("float16", 128, 0.0), ("bfloat16", 128, 0.2), ("float16", 64, 0.0)):
        p = dataclasses.replace(_alibi_problem(D, drop), score_mod=score_mods()["softcap"])
        need = fa3_backward.backward_mods(p)
        u = fa3_backward.unit2(dt, D, 10, serial=False, mods=fa3_backward.module_mods(p, need))
        assert "-DFA_TANH_CORE=1" in u.options and "-DFA_SCORE_FACTORED=1" in u.options
        text.append(u)
    from sandbox import modifiers
    doc = modifiers.document(np.arange(300) // 150)
    masked = []
    for dt, D, drop, sm in (("float16", 64, 0.0, None), ("bfloat16", 64, 0.2, None), ("float16", 128, 0.0, None),
                            ("float16", 64, 0.0, "softcap"), ("float16", 128, 0.2, "alibi")):
        p = dataclasses.replace(_alibi_problem(D, drop), score_mod=score_mods()[sm] if sm else None, mask_mod=doc)
        need = fa3_backward.backward_mods(p)
        u = fa3_backward.unit2(dt, D, 10, serial=False, mods=fa3_backward.module_mods(p, need))
        assert need == "mask" and "-DFA_MASK_MOD=1" in u.options and len(u.names) == 3
        assert (", 64, 128, 10," in u.names[0]) == (D == 64 and not drop)
        masked.append(u)
    units += text + masked
    jobs = compile_report.kernel_jobs([("fa3", bound, u) for u in units], ("sm_90",))
    loader.build_many([(j, "sm_90") for j in jobs.values()])
    for key, job in jobs.items():
        b = loader.build(job, "sm_90")
        (r,) = loader.reports(job, b)
        # the text at D = 128 (250 registers without it) spills a little: NVRTC 13, the soft-cap 4 bytes of
        # stores, with dropout 100 (fa2-tc's modifier builds: up to 200); ALiBi's seed and D = 64 none
        d128 = re.match(r"fa3_bwd2<[^,]+, 128,", key[2])          # D = 128 (BR = 128 names hold "128," too)
        limit = WGMMA2_TEXT_SPILLS if "FA_SCORE_MOD" in " ".join(key[1]) and d128 else 0
        assert r.spill_stores <= limit and r.spill_loads <= limit and r.registers <= 255, (key, r)
        assert "serialized" not in b.log and "C7515" not in b.log and "C7519" not in b.log, b.log


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma2_with_score_modifiers_matches_the_oracle(dtype, d):
    """fa3's default backward ("auto") runs wgmma2 for ALiBi (seeded S^T; the text at scale 0, where the seed
    cannot run), sinks, the soft-cap (large logits: saturated scores) and a relative bias (text compiled in):
    against the oracle with GQA, ragged lengths, causal, a window, dropout, a negative scale. A slope 10% off
    in the seeded form alone fails the check (forward and backward: both use the seed), and a soft-cap
    derivative 10% off (the factored core's, or the text's) fails dq / dk with the forward still right."""
    from sandbox import fuzz, modifiers
    from variants.fa3_wgmma import resolve_bwd_kernel
    alibi = modifiers.alibi(-np.array([0.5, 0.25, 0.125, 0.0625]))
    cases = [fuzz.Case(1, 4, 2, 70, 300, d, dtype, {"score_mod": alibi, "causal": True}, 1, logit_scale=3.0),
             fuzz.Case(2, 4, 1, 257, 200, d, dtype, {"score_mod": alibi.with_sinks([0.5, -1.0, 0.0, 2.0]),
                                                     "window": (60, 5)}, 2),
             fuzz.Case(1, 4, 4, 130, 130, d, dtype, {"score_mod": alibi, "causal": True, "dropout_p": 0.3, "seed": 9}, 3),
             fuzz.Case(1, 4, 2, 100, 190, d, dtype, {"score_mod": alibi, "scale": -0.3}, 4),
             fuzz.Case(1, 4, 2, 100, 190, d, dtype, {"score_mod": alibi, "scale": 0.0, "causal": True}, 9),
             fuzz.Case(1, 4, 2, 100, 190, d, dtype, {"score_mod": modifiers.sinks([0.3, 1.0, -2.0, 0.0])}, 5),
             fuzz.Case(1, 4, 2, 120, 260, d, dtype, {"score_mod": modifiers.softcap(5.0), "causal": True}, 6,
                       logit_scale=8.0),
             fuzz.Case(2, 4, 4, 77, 140, d, dtype, {"score_mod": modifiers.softcap(2.0).with_sinks([1.0]),
                                                    "dropout_p": 0.2, "seed": 5, "scale": -0.2}, 7),
             fuzz.Case(1, 4, 1, 90, 90, d, dtype, {"score_mod": modifiers.relative_bias(
                 np.random.default_rng(0).standard_normal((4, 9)), 4), "window": (30, 30)}, 8),
             # a text on full tiles (Nq = Nk = 256: 128-row tiles at d = 64 since session 20), non-causal
             fuzz.Case(1, 2, 2, 256, 256, d, dtype, {"score_mod": modifiers.relative_bias(
                 np.random.default_rng(1).standard_normal((2, 9)), 4)}, 10)]
    bound = sandbox.get_variant("fa3")
    for case in cases:
        p = sandbox.problem.make_problem(*case.inputs()[:3], **case.options)
        assert resolve_bwd_kernel(bound.config.bwd_kernel, p) == "wgmma2"
        fuzz.assert_case(bound, case, "backward")
    bad = dataclasses.replace(alibi, name="alibi_bad", cuda_distance_slope="1.1f * slopes[min(h, slopes_shape0 - 1)]")
    verdicts = fuzz.check_case(bound, dataclasses.replace(cases[0], options={"score_mod": bad, "causal": True}),
                               "backward")
    assert not all(v.ok for v in verdicts)
    cap = modifiers.softcap(5.0)
    # the derivative wgmma2 compiles: the factored core's (FA_SCORE_FACTORED), or the text's for a modifier without
    # one; 10% off fails dq / dk either way
    for bad_grad in (dataclasses.replace(cap, name="softcap_bad_core_grad", cuda_factored_grad="1.1f * fa_sech2(s)"),
                     dataclasses.replace(cap, name="softcap_bad_grad", cuda_grad="1.1f * fa_sech2(s * cap[1])",
                                         cuda_factored_grad=None)):
        verdicts = {v.name: v for v in fuzz.check_case(bound, dataclasses.replace(cases[6], options={
            "score_mod": bad_grad, "causal": True}), "backward")}
        assert verdicts["out"].ok and not (verdicts["dq"].ok and verdicts["dk"].ok), bad_grad.name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_softcap_sech2_from_tanh_matches_the_oracle_and_fa_sech2(dtype):
    """The soft-cap's backward takes sech^2 from the core's tanh in tiles whose scores allow it (fa3_bwd2.cu
    FA_TANH_CORE): against the oracle with small logits (that path), large ones (fa_sech2 kept) and dropout, with a
    factored modifier whose post pre is 2 (moved out of the per-score loop: fa3_bwd2.cu ds_scale), and
    side by side with the same modifier spelled so that the switch does not recognise it (fa_sech2 everywhere):
    dv equal, dq and dk within a few 16-bit roundings of their largest element, and not equal (the path ran)."""
    from sandbox import fuzz, modifiers
    from sandbox.arrays import to_host
    bound = sandbox.get_variant("fa3")
    for case in [fuzz.Case(1, 4, 4, 512, 512, 128, dtype, {"causal": True, "score_mod": modifiers.softcap(30.0)}, 11),
                 fuzz.Case(2, 4, 2, 300, 300, 64, dtype, {"causal": True, "score_mod": modifiers.softcap(5.0)}, 12),
                 fuzz.Case(1, 2, 2, 640, 640, 128, dtype, {"score_mod": modifiers.softcap(20.0)}, 13, logit_scale=2.0),
                 fuzz.Case(1, 2, 1, 300, 400, 64, dtype, {"score_mod": modifiers.softcap(2.0)}, 14, logit_scale=4.0),
                 fuzz.Case(1, 2, 2, 512, 512, 128, dtype, {"score_mod": modifiers.softcap(50.0), "dropout_p": 0.1,
                                                            "seed": 3}, 15)]:
        fuzz.assert_case(bound, case, "backward")
    # a factored modifier with post pre = 2 (the soft-cap's is 1): dS leaves that factor to dK's epilogue and dQ's
    # scale, which a dropped or doubled factor fails; small logits (sech^2 from tanh) and large ones (fa_sech2)
    from mod_cases import twice_softcap
    for case in [fuzz.Case(1, 4, 2, 512, 512, 128, dtype, {"causal": True, "score_mod": twice_softcap(20.0)}, 16),
                 fuzz.Case(1, 2, 2, 300, 400, 64, dtype, {"score_mod": twice_softcap(2.0)}, 17, logit_scale=4.0)]:
        fuzz.assert_case(bound, case, "backward")
    cap = modifiers.softcap(30.0)
    _, pre, post = cap.cuda_factored
    spelled = dataclasses.replace(cap, cuda_factored=("fa_tanh((s))", pre, post))
    assert "FA_TANH_CORE" not in " ".join(modifiers.cuda_defines(spelled, None, backward=True, factored=True))
    for d in (64, 128):
        q, k, v, do = fuzz.Case(1, 4, 4, 1024, 1024, d, dtype, {}, 21).inputs()
        grads = [sandbox.backward(do, sandbox.forward(q, k, v, variant="fa3", causal=True, score_mod=sm))
                 for sm in (cap, spelled)]
        (dq, dk, dv), (dq0, dk0, dv0) = [[np.asarray(to_host(x), np.float32) for x in g] for g in grads]
        np.testing.assert_array_equal(dv, dv0)
        for a, b in ((dq, dq0), (dk, dk0)):
            diff = np.abs(a - b).max() / np.abs(b).max()
            assert 0 < diff <= (2.0 ** -9 if dtype == "float16" else 2.0 ** -6), (d, diff)     # 2^-11.6 on the H100


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma2_with_mask_modifiers_matches_the_oracle(dtype, d):
    """fa3's default backward runs wgmma2 with a mask modifier too (its predicate and tile classes compiled in):
    document masks per batch entry (query / key ids, GQA, causal, ragged; empty tiles skipped), a prefix-LM mask,
    with dropout (64 query rows), with a score modifier's text (soft-cap) and with ALiBi, a window, a negative
    scale; at d = 64 without dropout the 128-row tile takes the predicate as visibility bits. A predicate that
    is wrong in the CUDA form alone fails the check."""
    from sandbox import fuzz, modifiers
    from variants.fa3_wgmma import resolve_bwd_kernel
    rng = np.random.default_rng(7)
    ids = np.sort(rng.integers(0, 4, (2, 300)), axis=1)
    doc = modifiers.document(ids[:, :257], ids[:, :300])
    prefix = modifiers.prefix_lm([40, 130])
    cases = [fuzz.Case(2, 4, 2, 257, 300, d, dtype, {"mask_mod": doc}, 1),
             fuzz.Case(2, 4, 1, 257, 300, d, dtype, {"mask_mod": doc, "causal": True}, 2),
             fuzz.Case(2, 2, 2, 200, 200, d, dtype, {"mask_mod": prefix}, 3),
             fuzz.Case(2, 4, 2, 257, 300, d, dtype, {"mask_mod": doc, "dropout_p": 0.3, "seed": 4}, 4),
             fuzz.Case(2, 4, 4, 257, 300, d, dtype, {"mask_mod": doc, "score_mod": modifiers.softcap(5.0)}, 5,
                       logit_scale=6.0),
             fuzz.Case(2, 4, 2, 257, 300, d, dtype, {"mask_mod": doc, "score_mod": modifiers.alibi([0.5, 0.25, 0.1, 0.05]),
                                                     "window": (90, 20), "scale": -0.2}, 6)]
    bound = sandbox.get_variant("fa3")
    for case in cases:
        p = sandbox.problem.make_problem(*case.inputs()[:3], **case.options)
        assert resolve_bwd_kernel(bound.config.bwd_kernel, p) == "wgmma2"
        fuzz.assert_case(bound, case, "backward")
    bad = dataclasses.replace(prefix, name="prefix_bad", cuda="j <= i || j < prefix[min(b, prefix_shape0 - 1)] + 3")
    verdicts = fuzz.check_case(bound, dataclasses.replace(cases[2], options={"mask_mod": bad}), "backward")
    assert not all(v.ok for v in verdicts)


# ---- the dQ accumulator's order (kernel side: fa3_bwd2's staging; reader: fa3_bwd2_dq)

def _staged_position(D):
    """(row, column) -> float offset in one 64-row tile of dQacc, as fa3_bwd2 stages it: warpgroup w's
    thread t (warp t / 32 of the warpgroup, lane (g, tq)) holds the m64n64 accumulator d[n][e] of columns
    64 w + 8 n + 2 tq + (e & 1), rows 16 (t / 32) + g + 8 (e >= 2), written as float4 n at (n * 128 + t) * 4
    floats of the warpgroup's 4096-float block."""
    pos = np.full((64, D), -1, np.int64)
    for w in range(D // 64):
        for t in range(128):
            g, tq = (t % 32) // 4, t % 4
            for n in range(8):
                for e in range(4):
                    row, col = 16 * (t // 32) + g + 8 * (e >= 2), 64 * w + 8 * n + 2 * tq + (e & 1)
                    pos[row, col] = w * 4096 + (n * 128 + t) * 4 + e
    return pos


def _reader_position(D):
    """The same map as fa3_bwd2_dq reads it: thread item it -> row r, columns c0..c0+7 from
    (cg * 128 + (pr / 8) * 32 + (pr % 8) * 4) * 4 + 2 h + 4 q + {0, 1}."""
    pos = np.full((64, D), -1, np.int64)
    cgs = D // 8
    for it in range(64 * cgs):
        h, cg, pr = it & 1, (it >> 1) % cgs, (it >> 1) // cgs
        r, c0 = (pr // 8) * 16 + pr % 8 + 8 * h, cg * 8
        base = (cg * 128 + (pr // 8) * 32 + (pr % 8) * 4) * 4 + 2 * h
        for q in range(4):
            pos[r, c0 + 2 * q] = base + 4 * q
            pos[r, c0 + 2 * q + 1] = base + 4 * q + 1
    return pos


@pytest.mark.parametrize("D", [64, 128])
def test_accumulator_order_is_what_the_dq_kernel_reads(D):
    staged, read = _staged_position(D), _reader_position(D)
    assert (staged >= 0).all() and sorted(staged.ravel()) == list(range(64 * D))     # a bijection onto the tile
    assert (staged == read).all()


# ---- GPU: against the oracle, from torch, the serial build

def _gappy_layout():
    """A per-head block-sparse layout, blocks of (64, 128) on Nq = Nk = 384, whose key blocks each see query blocks
    with EMPTY ones between them (rows i // 2 == j, and row 5 for key block 0), rolled by the head: the work list
    skips EMPTY tiles inside [t0, t1] at Br = 64 and 128 and walks on across a GQA group's heads."""
    from sandbox.masks import BlockSparse
    base = np.array([[i // 2 == j or (i == 5 and j == 0) for j in range(3)] for i in range(6)])
    return BlockSparse(np.stack([np.roll(base, h, axis=0) for h in range(4)]), (64, 128))


def test_the_gappy_layout_has_empty_tiles_inside_the_walks():
    from sandbox.masks import TILE_EMPTY, Band, classify_tiles
    def gaps(layout, br, nq, nk, bc=128):
        cls = classify_tiles(nq, nk, br, bc, Band(), layout)
        n = 0
        for col in cls.transpose(0, 2, 1).reshape(-1, cls.shape[1]):     # one key block of one head
            live = np.flatnonzero(col != TILE_EMPTY)
            n += int((col[live[0]:live[-1] + 1] == TILE_EMPTY).sum()) if live.size else 0
        return n
    assert gaps(_gappy_layout(), 64, 384, 384) >= 8 and gaps(_gappy_layout(), 128, 384, 384) >= 2
    from sandbox.masks import BlockSparse
    assert gaps(BlockSparse(np.eye(4, 5, dtype=bool)[None], (25, 49)), 64, 97, 241) == 0   # the older case has none


def _cases(dtype, d):
    """Non-causal (Nq < 64, Nk < 128, one tile each), large logits, causal GQA with dead rows (Nq > Nk),
    dropout (causal, and with a window), block-sparse (one with EMPTY tiles between a key block's visible ones,
    per head, with GQA: the guessed next tile falls back to the skipping walk; also with dropout, Br = 64 at
    d = 64), a negative scale, and long ragged sequences (many Q tiles per block: the double buffers, the
    deferred reductions, the work list across the group's heads; at d = 64 and 128)."""
    from sandbox import fuzz
    from sandbox.masks import BlockSparse
    return [
        fuzz.Case(1, 2, 2, 1, 1, d, dtype, {}, 0),
        fuzz.Case(2, 2, 2, 37, 90, d, dtype, {}, 1, logit_scale=4.0),
        fuzz.Case(1, 4, 2, 200, 161, d, dtype, {"causal": True}, 2),
        fuzz.Case(1, 4, 1, 257, 300, d, dtype, {"causal": True, "dropout_p": 0.3, "seed": 2**40 + 5, "offset": 7}, 3),
        fuzz.Case(1, 2, 2, 150, 240, d, dtype, {"window": (40, 7), "dropout_p": 0.5, "seed": 11}, 4, mean=0.5),
        fuzz.Case(1, 2, 1, 97, 241, d, dtype, {"block_mask": BlockSparse(np.eye(4, 5, dtype=bool)[None], (25, 49))}, 5),
        fuzz.Case(1, 4, 2, 384, 384, d, dtype, {"block_mask": _gappy_layout()}, 9),
        fuzz.Case(1, 4, 2, 384, 384, d, dtype, {"block_mask": _gappy_layout(), "dropout_p": 0.2, "seed": 4}, 10),
        fuzz.Case(1, 2, 2, 64, 90, d, dtype, {"scale": -0.3, "causal": True}, 6),
    ] + ([fuzz.Case(1, 4, 2, 700, 1030, d, dtype, {}, 7),
          fuzz.Case(2, 2, 2, 1000, 1000, d, dtype, {"causal": True}, 8)] if d in (64, 128) else [])


@pytest.fixture(scope="module")
def built():
    from sandbox.device import arch
    units = [fa3_backward.unit2(dt, D, 10, serial=sr) for dt in ("float16", "bfloat16") for D in (64, 128)
             for sr in (False, True)]
    fa3 = sandbox.get_variant("fa3").config
    units += [fa3.bwd.backward_unit(dt, D) for dt in ("float16", "bfloat16") for D in (64, 128)]   # wgmma, mma
    units += [fa3.unit(dt, D) for dt in ("float16", "bfloat16") for D in (64, 128)]                # forwards
    units.append(sandbox.get_variant("fa3-wgmma").config.unit("float16", 128))
    loader.prebuild(units, arch())


@pytest.mark.gpu
@pytest.mark.parametrize("d", [40, 64, 96, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma2_matches_the_oracle(built, dtype, d):
    from sandbox import fuzz
    bound = sandbox.get_variant("fa3", bwd_kernel="wgmma2")
    for case in _cases(dtype, d):
        fuzz.assert_case(bound, case, "backward")


@pytest.mark.gpu
def test_wgmma2_on_fa3_wgmma_and_the_serial_build(built, monkeypatch):
    """The same kernels behind fa3-wgmma's forward; then the -DFA3_BWD2_SERIAL build (the ablation the
    timing compares) on the same cases."""
    from sandbox import fuzz
    cases = [c for c in _cases("float16", 128) if c.Nq > 1][:4] + _cases("float16", 128)[-1:]
    for case in cases:
        fuzz.assert_case(sandbox.get_variant("fa3-wgmma", bwd_kernel="wgmma2"), case, "backward")
    monkeypatch.setattr(fa3_backward, "SERIAL", True)
    for case in cases:
        fuzz.assert_case(sandbox.get_variant("fa3", bwd_kernel="wgmma2"), case, "backward")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_wgmma2_from_torch_against_sdpa(built, causal):
    """sandbox.torch's autograd (the pointer-level plan: dq_acc zeroed by fa3_bwd2_pre, dq in q's dtype) against
    SDPA in float64, with the tolerance rule of tests/test_gpu_torch.py; and a second run agrees (the
    reduction order may differ: within fp32 rounding of the accumulation, so equal after the fp16 cast to
    within one ulp)."""
    torch = pytest.importorskip("torch")
    import sandbox.torch as st
    g = torch.Generator(device="cuda").manual_seed(3)
    # SDPA's is_causal is top-left aligned, the sandbox's bottom-right (flash-attn's): equal lengths when causal
    nq = 600 if causal else 520
    q, dout = (torch.randn(2, 4, nq, 128, device="cuda", generator=g, dtype=torch.float16) for _ in range(2))
    k, v = (torch.randn(2, 2, 600, 128, device="cuda", generator=g, dtype=torch.float16) for _ in range(2))

    def grads(fn, *xs):
        xs = [x.detach().clone().requires_grad_(True) for x in xs]
        out = fn(*xs)
        out.backward(dout.to(out.dtype))
        return [out.detach()] + [x.grad for x in xs]

    def ours(a, b, c):
        return st.attention(a, b, c, variant="fa3", bwd_kernel="wgmma2", causal=causal, enable_gqa=True)

    def sdpa(a, b, c):
        return torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True)

    got, again = grads(ours, q, k, v), grads(ours, q, k, v)
    ref = grads(sdpa, q.double(), k.double(), v.double())
    base = grads(sdpa, q, k, v)
    eps = 2**-10
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        r = ref[i]
        err = (got[i].double() - r).abs().max().item()
        factor, ulps = (2.0, 1.0) if what == "out" else (3.0, 2.0)
        tol = factor * (base[i].double() - r).abs().max().item() + ulps * eps * r.abs().max().item()
        assert err <= tol, f"{what}: err {err:.3g} > tol {tol:.3g}"
        assert (got[i].double() - again[i].double()).abs().max().item() <= 2 * eps * r.abs().max().item(), what


# ---- device-call helpers (not tests): python3 tests/test_fa3_bwd.py MODE
#   prebuild   every module the GPU tests, the fuzz and the timing use, built in parallel (NVRTC)
#   small      one small forward + backward at D = 128 (causal, GQA) and D = 64 (dropout, window): for
#              compute-sanitizer memcheck / racecheck
#   time       from torch, B = 4, H = 2048 / d, N = 4096, fp16: backward alone and forward + backward of fa3
#              with each backward (mma, wgmma, wgmma2) beside SDPA flash and cuDNN, TFLOP/s (backward 2.5x,
#              both 3.5x the forward's 4 B H N^2 d, halved causal); argv[2:] restricts the rows (e.g. wgmma2)
#   profile    d = 128, N = 4096: one backward with wgmma, one with wgmma2 (for ncu, kernels fa3_bwd / fa3_bwd2)

def _main(argv):
    mode = argv[1]
    if mode == "prebuild":
        from sandbox.device import arch
        fa3 = sandbox.get_variant("fa3").config
        units = []
        for dt in ("float16", "bfloat16"):
            for D in (64, 128):
                units += [fa3_backward.unit2(dt, D, 10, serial=False), fa3_backward.unit2(dt, D, 10, serial=True),
                          fa3_backward.unit(dt, D, 10), fa3.unit(dt, D), fa3.bwd.backward_unit(dt, D)]
        units.append(sandbox.get_variant("fa3-wgmma").config.unit("float16", 128))
        loader.prebuild(units, arch())
        print(f"built {len(units)} modules")
    elif mode == "small":
        rng = np.random.default_rng(0)
        for (hq, hkv, nq, nk, d), kw in (((4, 2, 70, 150, 128), {"causal": True}),
                                         ((2, 1, 130, 90, 40), {"dropout_p": 0.3, "seed": 5, "window": (30, 4)})):
            q, dout = (rng.standard_normal((1, hq, nq, d)).astype(np.float16) for _ in range(2))
            k, v = (rng.standard_normal((1, hkv, nk, d)).astype(np.float16) for _ in range(2))
            res = sandbox.forward(q, k, v, variant="fa3", bwd_kernel="wgmma2", **kw)
            dq, dk, dv = sandbox.backward(dout, res)
            print(d, kw, [float(np.abs(np.asarray(sandbox.arrays.to_host(x), np.float32)).max()) for x in (dq, dk, dv)])
    elif mode == "time":
        _time(argv[2:])
    elif mode == "profile":
        import torch
        q, k, v, dout = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.float16) for _ in range(4))
        for kernel in ("wgmma", "wgmma2"):
            res = sandbox.forward(q, k, v, variant="fa3", bwd_kernel=kernel)
            sandbox.backward(dout, res)
        torch.cuda.synchronize()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


def _time(only):
    import torch
    import sandbox.torch as st
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = [("fa3 mma", "mma"), ("fa3 wgmma", "wgmma"), ("fa3 wgmma2", "wgmma2"),
            ("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)]
    rows = [r for r in rows if not only or any(o in r[0] for o in only)]
    serial = " (SANDBOX_BWD2_SERIAL=1)" if fa3_backward.SERIAL else ""
    print(f"| d | causal | backward | bwd ms | bwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |{serial}")
    print("|---|---|---|---|---|---|---|")
    for d in (128, 64):
        B, H, N = 4, 2048 // d, 4096
        for causal in (False, True):
            q, k, v, dout = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16) for _ in range(4))
            fwd = 4 * B * H * N * N * d / (2 if causal else 1)
            for label, which in rows:
                if isinstance(which, str):
                    def f(a, b, c, which=which):
                        return st.attention(a, b, c, variant="fa3", bwd_kernel=which, causal=causal)
                    ctx = torch.enable_grad
                else:
                    def f(a, b, c):
                        return torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal)
                    ctx = (lambda w=which: sdpa_kernel(w))
                with ctx():
                    xs = [x.detach().requires_grad_(True) for x in (q, k, v)]
                    out = f(*xs)
                    bwd_ms = _events(lambda: out.backward(dout, retain_graph=True))

                    def both():
                        f(*xs).backward(dout)
                    both_ms = _events(both)
                print(f"| {d} | {causal} | {label} | {bwd_ms:.3f} | {2.5 * fwd / bwd_ms / 1e9:.0f} | {both_ms:.3f} | "
                      f"{3.5 * fwd / both_ms / 1e9:.0f} |", flush=True)


def _events(fn, warmup=3, reps=10):
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


if __name__ == "__main__":
    import sys
    _main(sys.argv)
