"""Score and mask modifiers compiled into the fa2-tc kernels (issue 18; variants/fa2_tc.py ModKernel,
kernels_cu/tc_mods.cuh).

Without a GPU: NVRTC builds of fa2-tc's forward and backward with each built-in modifier (sm_90,
the H100 / H200 target) held to register / spill gates; the kernel argument list the host packs
against the parameters the -D options declare; the modifiers' tile tables; the refusals before any
launch. With a GPU (`pytest -m gpu`): fa2-tc and fa2-tc-deterministic against the oracle with every
built-in modifier, forward and backward, fp16 and bf16 (explicit cases and Hypothesis), and
sandbox.torch.attention with score_mod= / mask_mod= through autograd.
"""

import numpy as np
import pytest

from sandbox import fuzz, get_variant, loader, modifiers as M
from sandbox.masks import TILE_EMPTY, BlockSparse, classify_tiles_mod
from sandbox.problem import make_problem
from sandbox.registry import all_variants
from variants.fa2_tc import (ModKernel, TCConfig, backward_mods, d_pad, factored_args, modifier_args, modifier_tiles,
                             module_mods)

from mod_cases import (B, C_OF, HKV, HQ, NK, NQ, PTR_OF, compile_reports, declared_params as _declared_params,  # noqa: F401,E501
                       mask_mods as _mask_mods, problem as _problem, score_mods as _score_mods)


# ---- no GPU: capabilities, units, argument packing, tile tables, refusals

def test_fa2_tc_claims_modifiers_and_the_fuzzer_draws_them():
    from hypothesis import HealthCheck, find, settings
    for name in ("fa2-tc", "fa2-tc-deterministic"):
        caps = all_variants()[name].caps
        assert caps.score_mod and caps.mask_mod and caps.backward
    bound = get_variant("fa2-tc")
    fast = settings(max_examples=500, database=None, suppress_health_check=list(HealthCheck))
    case = find(fuzz.cases(bound, "float16"), lambda c: "score_mod" in c.options and "mask_mod" in c.options,
                settings=fast)
    bound.check(make_problem(*case.inputs()[:3], **case.options), "backward")     # accepted, not refused


def test_units_without_modifiers_are_unchanged():
    cfg = TCConfig()
    p = _problem()
    assert ModKernel.of(p) is None and ModKernel.of(p, backward=True) is None
    for D in (64, 128):
        plain, none = cfg.unit("float16", D), cfg.unit("float16", D, None)
        assert plain == none and plain.options == none.options and not any("-DFA_" in o for o in plain.options)
        assert len(plain.names) == 2                       # both dropout switches, as before
        assert not any("-DFA_" in o for o in cfg.backward_unit("bfloat16", D).options)


def test_modifier_units_carry_their_text_and_one_dropout_switch():
    cfg = TCConfig()
    sm, mm = _score_mods(), _mask_mods()
    a = cfg.unit("float16", 64, ModKernel.of(_problem(sm["softcap"])))
    b = cfg.unit("float16", 64, ModKernel.of(_problem(M.softcap(7.0))))        # another cap: the same module
    c = cfg.unit("float16", 64, ModKernel.of(_problem(sm["alibi"])))
    d = cfg.unit("float16", 64, ModKernel.of(_problem(sm["softcap"], dropout_p=0.1)))
    assert a == b and a != c and a.names != d.names and len(a.names) == 1
    assert "fa_tanh" in " ".join(a.options) and "-DFA_SCORE_MOD_GRAD=1" not in a.options
    # sinks alone (an identity score modifier): no FA_SCORE_MOD, so the kernel keeps its fast path
    for backward in (False, True):
        opts = ModKernel.of(_problem(sm["sinks"]), backward).options
        assert "-DFA_SINKS=1" in opts and not any(o.startswith("-DFA_SCORE_MOD") for o in opts)
    assert "-DFA_SCORE_MOD=1" in ModKernel.of(_problem(sm["softcap+sinks"])).options
    bw = cfg.backward_unit("float16", 64, _backward_mods(_problem(sm["softcap"], mm["document"])))
    assert "-DFA_SCORE_MOD_GRAD=1" in bw.options and "-DFA_MASK_MOD=1" in bw.options
    assert M.softcap(1.0).cuda_key in bw.label and mm["document"].cuda_key in bw.label
    # the soft-cap's backward compiles its factored core (tanh, sech^2: FA_TANH_CORE) and ALiBi alone seeds S^T
    assert {"-DFA_SCORE_FACTORED=1", "-DFA_TANH_CORE=1"} <= set(bw.options)
    al = _backward_mods(_problem(sm["alibi"]))
    assert "-DFA_DIST_BIAS=1" in al.options and not any(o.startswith("-DFA_SCORE_MOD") for o in al.options)
    assert _backward_mods(_problem(sm["alibi"], scale=0.0)).options != al.options    # no seed at scale 0: the text
    assert _backward_mods(_problem(sm["sinks"])) is None                             # P from lse: the plain module


@pytest.mark.parametrize("sm_name,mm_name", [(a, b) for a in (None, *_score_mods()) for b in (None, *_mask_mods())
                                              if (a, b) != (None, None)])
def test_modifier_arguments_match_the_kernel_parameters(sm_name, mm_name):
    sm = _score_mods().get(sm_name)
    mm = _mask_mods().get(mm_name)
    p = _problem(sm, mm, scale=-0.3)
    need = backward_mods(p)
    for mods, args in ((ModKernel.of(p), modifier_args(p, 1)),
                       (module_mods(p, need), modifier_args(p, 1) + factored_args(p, need))):
        if mods is None:                      # sinks alone: the backward runs the module without modifiers
            assert need == "none" and sm is not None and sm.is_identity and mm is None
            continue
        got = [C_OF[np.dtype(type(a))] if isinstance(a, np.generic) else PTR_OF[a.dtype] for a in args]
        assert got == _declared_params(mods.options)
    args = modifier_args(p, 2)
    assert args[0] == 2 and args[1] == np.float32(0.3)                 # tile batch extent, |scale|
    sink = args[2]
    if sm is not None and sm.sink is not None:
        assert sink.shape == (HQ,) and np.allclose(sink, np.broadcast_to(sm.sink, (HQ,)))
    rest = args[3:]
    for mod in (sm, mm):                                               # each buffer, then its shape
        for arr in (mod.buffers.values() if mod is not None else ()):
            kind = {"b": np.uint8, "i": np.int32, "u": np.int32, "f": np.float32}[arr.dtype.kind]
            assert rest[0].dtype == kind and np.array_equal(rest[0], arr.astype(kind))
            assert tuple(int(n) for n in rest[1:1 + arr.ndim]) == arr.shape
            assert rest[0].flags.c_contiguous
            rest = rest[1 + arr.ndim:]
    assert rest == ()


def test_mask_modifier_tile_tables_fold_in_its_classes():
    mm = _mask_mods()["document"]
    p = _problem(mask_mod=mm, causal=True)
    tiles, heads, batch = modifier_tiles(p, 32, 16)
    ref = classify_tiles_mod(mm, B, HQ, NQ, NK, 32, 16, p.band, None)
    assert (int(batch), int(heads)) == ref.shape[:2] == (B, 1)
    assert tiles.shape == (B * 1, -(-NQ // 32), -(-NK // 16)) and tiles.dtype == np.int8
    assert np.array_equal(tiles.reshape(ref.shape), ref) and (tiles == TILE_EMPTY).any()
    plain, heads, batch = modifier_tiles(_problem(_score_mods()["alibi"], causal=True), 32, 16)
    assert int(batch) == 1 and int(heads) == plain.shape[0] == 1


def test_modifier_refusals_come_before_any_launch():
    bound = get_variant("fa2-tc")
    commented = M.ScoreMod("commented", lambda s, b, h, i, j: s, lambda s, b, h, i, j: s, "s // plain")
    with pytest.raises(ValueError, match="score_mod 'commented'.*'//'"):
        bound.check(_problem(commented), "forward")
    wide = M.prefix_lm(np.array([2**40]))
    with pytest.raises(ValueError, match="prefix.*int32"):
        bound.check(_problem(mask_mod=wide), "forward")
    forward_only = M.ScoreMod("fwd", lambda s, b, h, i, j: s, lambda s, b, h, i, j: s, "s")
    bound.check(_problem(forward_only), "forward")
    with pytest.raises(ValueError, match="no derivative"):
        bound.check(_problem(forward_only), "backward")
    with pytest.raises(ValueError, match="no derivative"):
        M.cuda_defines(forward_only, None, backward=True)


def _backward_mods(p):
    """The modifier options of p's backward module, as FA2TensorCore.backward builds it."""
    return module_mods(p, backward_mods(p))


# ---- no GPU: NVRTC builds with each built-in modifier, register / spill gates (sm_90)

# Forward: spill-free like the default without modifiers (214 registers at D = 64, 247 at D = 128).
# Backward (Br = Bc = 64, 3 blocks per SM at D = 64): the default already spills 108 bytes of stores
# without modifiers (TCConfig.BWD_AUTO); the gate holds the modifier builds under 208 bytes (softcap + document with the
# hardware tanh, fa_tanh: 200 bytes of stores, 108 of loads; 68 / 68 with libdevice tanhf, whose forward ran
# 4.4x the plain one: the spills are the price of the faster build, to be measured on the GPU). Since session 26 the
# element-wise step is compiled in a full-tile and a masked form (kernels_cu/fa2_tc_bwd.cu elementwise_forms): ALiBi
# (S^T seeded) 232 bytes, the relative bias 224, sinks with a document mask in the deterministic kernel 248, for a
# plain causal backward 5-14% faster; ALiBi then costs 3-6% over plain causal.
BWD_SPILL_LIMIT = 256
FORWARD_BUILDS = [("float16", 64, "softcap", None), ("float16", 64, "alibi", None),
                  ("float16", 64, "relative_bias", None), ("float16", 64, "sinks", None),
                  ("float16", 64, None, "document"), ("float16", 64, None, "prefix_lm"),
                  ("bfloat16", 128, "softcap+sinks", "document")]
BACKWARD_BUILDS = [("float16", 64, "softcap", "document", False), ("bfloat16", 64, "relative_bias", "prefix_lm", False),
                   ("float16", 128, "alibi", None, False), ("float16", 64, "sinks", "document", True)]


def _forward_unit(dtype, D, sm, mm):
    p = _problem(_score_mods().get(sm), _mask_mods().get(mm), np.float16, D)
    return TCConfig().unit(dtype, D, ModKernel.of(p))


def _backward_unit(dtype, D, sm, mm, deterministic):
    p = _problem(_score_mods().get(sm), _mask_mods().get(mm), np.float16, D)
    return TCConfig(deterministic=deterministic).backward_unit(dtype, D, _backward_mods(p))


@pytest.fixture(scope="module")
def built():
    return compile_reports([_forward_unit(*x) for x in FORWARD_BUILDS] + [_backward_unit(*x) for x in BACKWARD_BUILDS], "sm_90")


@pytest.mark.parametrize("build", FORWARD_BUILDS, ids=lambda x: "-".join(str(v) for v in x))
def test_forward_builds_without_spills(built, build):
    reports = built[_forward_unit(*build)]
    assert len(reports) == 1
    r = reports[0]
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.registers <= 255, r


@pytest.mark.parametrize("build", BACKWARD_BUILDS, ids=lambda x: "-".join(str(v) for v in x))
def test_backward_builds_within_the_spill_gate(built, build):
    reports = built[_backward_unit(*build)]
    names = [r.name for r in reports]
    assert any(n.startswith("fa2_tc_bwd<") for n in names) and any("rowdot" in n for n in names)
    assert build[-1] == any(n.startswith("fa2_tc_bwd_dq<") for n in names)
    for r in reports:
        assert r.spill_stores <= BWD_SPILL_LIMIT and r.registers <= 255, r


# ---- GPU: against the oracle

def _combos():
    sm, mm = _score_mods(), _mask_mods()
    return [(sm["softcap"], None), (sm["alibi"], mm["document"]), (sm["relative_bias"], mm["prefix_lm"]),
            (sm["sinks"], None), (sm["softcap+sinks"], mm["document"]), (None, mm["prefix_lm"])]


def _gpu_cases(dtype):
    """(score_mod, mask_mod, Case): every combination on awkward shapes; GQA, causal, window, dropout,
    a negative scale and head dims padded to 64 and 128 spread over them."""
    out = []
    for n, (sm, mm) in enumerate(_combos()):
        layout = np.random.default_rng(n).random((HQ, 3, 3)) < 0.7
        extra = [{"causal": True}, {"window": (7, 3)}, {"scale": -0.4}, {"dropout_p": 0.3, "seed": 11, "offset": 2},
                 {"causal": True}, {"block_mask": BlockSparse(layout, (32, 32))}][n]
        d = 96 if n % 3 == 2 else 64
        out.append(fuzz.Case(B, HQ, HKV, NQ, NK, d, dtype, dict(extra, score_mod=sm, mask_mod=mm), 10 + n))
    return out


def _prebuild(name, dtype, problems):
    """The problems' modules (forward and backward), built in parallel before the first launch: one
    NVRTC build per modifier text, dropout switch, dtype and padded head dim, however many cases share it."""
    from sandbox.device import arch
    config = get_variant(name).config
    units = {}
    for p in problems:
        D = d_pad(p.d)
        for u in (config.unit(dtype, D, ModKernel.of(p)), config.backward_unit(dtype, D, _backward_mods(p))):
            units.setdefault(u, None)
    loader.prebuild(list(units), arch())


def _case_problems(dtype):
    out = []
    for case in _gpu_cases(dtype):
        q, k, v, _ = case.inputs()
        out.append(make_problem(q, k, v, **case.options))
    return out


def _fuzz_problems(score_mods, mask_mods, d=64):
    """One problem per (score modifier factory, mask modifier factory, dropout on / off): the modules
    the fuzzer can draw at head dims that pad to d (a factory's random parameters are buffers, not text)."""
    rng = np.random.default_rng(0)
    q = np.zeros((1, 2, 8, d), np.float16)
    return [make_problem(q, q, q, dropout_p=drop, score_mod=sf(rng, 1, 2, 8, 8), mask_mod=mf(rng, 1, 2, 8, 8))
            for sf in score_mods for mf in mask_mods for drop in (0.0, 0.5)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["fa2-tc", "fa2-tc-deterministic"])
def test_modifiers_match_oracle_forward_and_backward(name, dtype):
    _prebuild(name, dtype, _case_problems(dtype))
    bound = get_variant(name)
    for case in _gpu_cases(dtype):
        fuzz.assert_case(bound, case, "backward")


def _backward_form_cases(dtype):
    """(variant, Case) for the backward's compiled forms (kernels_cu/fa2_tc_bwd.cu): the soft-cap's factored core with
    sech^2 from its tanh where a warp's |x| <= 0.5 (FA_TANH_CORE) and from fa_sech2 elsewhere, a factor post pre = 2
    that dK and dQ must carry (twice_softcap), ALiBi seeding S^T (and the deterministic dQ kernel's S) with either
    sign of the scale and with dropout, and the wide kernel (d = 192, 256: fa3's backward there is fa2-tc's)."""
    from mod_cases import twice_softcap
    al = M.alibi(M.alibi_slopes(4))
    C = fuzz.Case
    return [("fa2-tc", C(1, 4, 2, 300, 300, 128, dtype, {"causal": True, "score_mod": M.softcap(30.0)}, 40)),
            ("fa2-tc", C(2, 4, 4, 257, 300, 64, dtype, {"score_mod": M.softcap(2.0)}, 41, logit_scale=4.0)),
            ("fa2-tc", C(1, 4, 2, 200, 333, 64, dtype, {"causal": True, "score_mod": twice_softcap(5.0)}, 42,
                         logit_scale=3.0)),
            ("fa2-tc-deterministic", C(1, 4, 2, 200, 333, 128, dtype, {"score_mod": twice_softcap(20.0)}, 43)),
            ("fa2-tc", C(1, 4, 2, 300, 300, 64, dtype, {"causal": True, "score_mod": al}, 44)),
            ("fa2-tc", C(1, 4, 4, 190, 260, 128, dtype, {"scale": -0.4, "score_mod": al}, 45)),
            ("fa2-tc", C(1, 4, 2, 300, 300, 64, dtype, {"causal": True, "score_mod": al, "dropout_p": 0.3, "seed": 5,
                                                        "offset": 1}, 46)),
            ("fa2-tc-deterministic", C(1, 4, 2, 300, 280, 64, dtype, {"causal": True, "score_mod": al}, 47)),
            ("fa3", C(1, 4, 2, 200, 200, 192, dtype, {"causal": True, "score_mod": M.softcap(20.0)}, 48)),
            ("fa3", C(1, 4, 2, 200, 230, 256, dtype, {"score_mod": al}, 49))]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_backward_forms_match_oracle(dtype):
    for name, case in _backward_form_cases(dtype):
        fuzz.assert_case(get_variant(name), case, "backward")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_modifiers_fuzzed_against_oracle(dtype):
    """Hypothesis with a modifier in every case (the built-ins with random parameters, a mask modifier
    in two thirds); head dims that pad to 64, so that the modules stay few."""
    from hypothesis import given, settings
    bound = get_variant("fa2-tc")
    limits = fuzz.Limits(max_n=200, dims=(16, 40, 64))
    mask_mods = (*fuzz.MASK_MODS, lambda rng, B, Hq, Nq, Nk: None)
    _prebuild("fa2-tc", dtype, _fuzz_problems(fuzz.SCORE_MODS, mask_mods))

    @settings(max_examples=40, deadline=None)
    @given(fuzz.cases(bound, dtype, limits, score_mods=fuzz.SCORE_MODS, mask_mods=mask_mods))
    def check(case):
        fuzz.assert_case(bound, case, "backward")

    check()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_attention_passes_modifiers_through_autograd(dtype):
    """sandbox.torch.attention(score_mod=, mask_mod=) runs the same kernels as sandbox.forward /
    sandbox.backward (checked against the oracle above): the same bits, forward and gradients."""
    torch = pytest.importorskip("torch")
    import sandbox
    import sandbox.torch as st
    sm, mm = _combos()[4]
    q, k, v, dout = _gpu_cases(dtype)[4].inputs()
    tdt = getattr(torch, dtype)
    tq, tk, tv, tdo = (torch.tensor(x.astype(np.float32)).to("cuda", tdt) for x in (q, k, v, dout))
    for x in (tq, tk, tv):
        x.requires_grad_()
    out = st.attention(tq, tk, tv, causal=True, score_mod=sm, mask_mod=mm, enable_gqa=True)
    out.backward(tdo)
    res = sandbox.forward(tq.detach(), tk.detach(), tv.detach(), causal=True, score_mod=sm, mask_mod=mm)
    grads = sandbox.backward(tdo, res)
    assert torch.equal(out.detach(), torch.as_tensor(res.out))
    for got, want in zip((tq.grad, tk.grad, tv.grad), grads):
        assert torch.equal(got, torch.as_tensor(want))
    with torch.no_grad():                                      # no autograd node: the direct route
        assert torch.equal(st.attention(tq, tk, tv, causal=True, score_mod=sm, mask_mod=mm, enable_gqa=True), out)


def test_a_large_read_only_buffer_is_uploaded_once_and_freed_with_its_owner():
    """A dense mask's bytes (B Nq Nk) are neither hashed per call nor kept by the shared device cache: one copy
    per live host buffer, dropped when the buffer (its modifier) goes."""
    import gc
    import types
    from variants import fa2_tc
    uploads = []
    xp = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0)),
                               asarray=lambda a: uploads.append(a) or object())
    mod = M.dense(np.ones((2, 1, 1024, 1024), bool))
    (buf,) = M.cuda_buffers(mod)
    assert buf.dtype == np.uint8 and buf.nbytes > fa2_tc.BIG_BUFFER_BYTES and not buf.flags.writeable
    first = fa2_tc._device_copy(buf, xp)
    assert fa2_tc._device_copy(M.cuda_buffers(mod)[0], xp) is first and len(uploads) == 1
    before = len(fa2_tc._BIG_COPIES)
    del mod, buf, first
    uploads.clear()
    gc.collect()
    assert len(fa2_tc._BIG_COPIES) == before - 1


MANY_DOCUMENTS = [("fa2-tc", 64, {"causal": True}, 2, 1), ("fa2-tc", 64, {}, 2, 1), ("fa2-tc", 64, {"causal": True}, 1, 1),
                  ("fa2-tc-deterministic", 64, {"causal": True}, 2, 1), ("fa3", 256, {"causal": True}, 2, 1),
                  ("fa2-tc", 128, {"causal": True}, 2, 2), ("fa3", 128, {"causal": True}, 2, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name,d,opts,hkv,B", MANY_DOCUMENTS, ids=lambda x: str(x))
def test_document_mask_over_many_short_documents(dtype, name, d, opts, hkv, B):
    """A sorted document mask over ~90 packed documents (the packed backward's mask, sandbox/varlen.py): runs of EMPTY
    tiles far longer than the 32 tiles of one warp-wide step of tiles.cuh's first_live_tile (the forwards' leading
    run, the earlier documents: fa2_tc_forward, the deterministic dQ kernel) and last_live_tile (the backward's
    trailing run, the later ones: fa2_tc_bwd, fa3's wgmma backward fa3_bwd2 at d = 128, and fa2_tc_bwd_wide under fa3
    at d = 256, where fa2-tc stops at 128),
    with documents shorter than a tile and
    one longer than several; against the oracle, causal and not, with and without GQA (the backward narrows its
    walk for one query head per block only), and with other documents per batch entry (a [B]-row tile table)."""
    import cupy as cp
    rng = np.random.default_rng(5)
    ids = []
    for _ in range(B):
        lengths = np.concatenate([rng.integers(1, 70, 60), [700], rng.integers(1, 40, 30)])
        ids.append(np.repeat(np.arange(lengths.size), lengths)[:3600])
    ids = np.stack([x if x.size == 3600 else np.pad(x, (0, 3600 - x.size), mode="edge") for x in ids])
    N = ids.shape[1]                                                   # 3,600 rows: 57 tiles of 64
    mm = M.document(cp.asarray(ids.astype(np.int32)), sorted_ids=True)
    case = fuzz.Case(B, 2, hkv, N, N, d, dtype, dict(opts, mask_mod=mm), 30 + d + B)
    fuzz.assert_case(get_variant(name), case, "backward")
