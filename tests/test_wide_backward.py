"""The backward at head dims 136..256 (issue 18 item 5): fa2-tc's wide kernel (kernels_cu/fa2_tc_bwd.cu
fa2_tc_bwd_wide, D = 192 and 256), the backward of the Hopper rungs' wide forwards.

Without a GPU: the padding, the config's geometry, names and shared memory, the refusals (a tile other than
the wide one, the deterministic form, d > 256, the wgmma backwards past d = 128, sm_80's shared memory at
D = 256), the gate's units, the NVRTC build of the new kernels (no spills, shared memory within sm_90's limit;
sm_80 too with SANDBOX_COMPILE_FULL=1), and an index model of the kernel's shared-memory layout and ldmatrix
addresses. On an H100 / H200 (`pytest -m gpu`): dq, dk, dv against the float64 oracle at d = 160, 192, 200,
256, fp16 and bf16, with every feature, a Hypothesis fuzz at the wide head dims, and sandbox.torch autograd
against SDPA.
"""
import os

import numpy as np
import pytest

import sandbox
from sandbox import loader
from sandbox.problem import Problem
from variants.fa2_tc import BWD_HEAD_DIMS, TCConfig, bwd_d_pad

WIDE_RUNGS = ("fa3-wgmma", "fa3-ws", "fa3")
WIDE_NAMES = [f"fa2_tc_bwd_wide<{ct}, {D}, 64, 64, 8, 10, {drop}>" for ct in ("__half", "__nv_bfloat16")
              for D in (192, 256) for drop in ("false", "true")]


def _problem(d, dtype="float16", **kw):
    return Problem(1, 2, 2, 128, 128, d, dtype, **kw)


# ---- padding, geometry, names, shared memory

def test_backward_head_dims_pad_to_the_next_kernel():
    assert BWD_HEAD_DIMS == (64, 128, 192, 256)
    assert [bwd_d_pad(d) for d in (8, 64, 72, 96, 128, 136, 160, 192, 200, 256)] == \
        [64, 64, 128, 128, 128, 192, 192, 192, 256, 256]
    from variants.fa3_wgmma import d_pad as fa3_pad        # the forward that writes out / lse pads the same way
    assert all(bwd_d_pad(d) == fa3_pad(d) for d in range(8, 257, 8))
    assert bwd_d_pad(264) > 256 and TCConfig().backward_errors(bwd_d_pad(264))


def test_wide_geometry_names_and_shared_memory():
    c = TCConfig()
    for D in (192, 256):
        assert c.bwd_geometry(D) == (64, 64, 8, 1) and c.bwd_blocks_per_sm(D) == 1 and c.backward_errors(D) == []
        assert c.backward_smem(D) == 2 * (2 * 64 * D + 4 * 64 * D + 2 * 64 * 64) + 4 * 4 * 64
    assert c.backward_smem(192) == 164864 <= 163 * 1024 < c.backward_smem(256) == 214016 <= 227 * 1024
    assert c.backward_name("float16", 256, False) == "fa2_tc_bwd_wide<__half, 256, 64, 64, 8, 10, false>"
    assert TCConfig(philox_rounds=7).backward_name("bfloat16", 192, True) == \
        "fa2_tc_bwd_wide<__nv_bfloat16, 192, 64, 64, 8, 7, true>"
    unit = c.backward_unit("bfloat16", 256)
    assert unit.names == ("fa2_tc_bwd_wide<__nv_bfloat16, 256, 64, 64, 8, 10, false>",
                          "fa2_tc_bwd_wide<__nv_bfloat16, 256, 64, 64, 8, 10, true>", "fa2_tc_bwd_rowdot<__nv_bfloat16>")
    assert unit.dynamic_smem[unit.names[0]] == 214016 and unit.dynamic_smem[unit.names[2]] == 0
    # the D <= 128 kernels are unchanged
    assert c.bwd_geometry(128) == (64, 128, 8, 1) and c.backward_name("float16", 128, False).startswith("fa2_tc_bwd<")


@pytest.mark.parametrize("params,match", [
    ({"bwd_block_r": 128}, "runs Br = 64, Bc = 64 only"),
    ({"bwd_block_r": 32}, "runs Br = 64, Bc = 64 only"),
    ({"bwd_block_c": 128}, "runs Br = 64, Bc = 64 only"),
    ({"bwd_min_blocks": 2}, "one block per SM"),
    ({"deterministic": True}, "deterministic backward stops at d = 128"),
    ({"bwd_pre": "numpy"}, "bwd_pre"),
])
def test_wide_config_refusals_name_the_parameter(params, match):
    for D in (192, 256):
        errs = TCConfig(**params).backward_errors(D)
        assert errs and match in errs[0], errs
    assert TCConfig(bwd_block_r=64, bwd_block_c=64, bwd_min_blocks=1).backward_errors(256) == []


def test_sm_80_refuses_d_256_by_name_before_any_launch(monkeypatch):
    """sm_80's 166,912 B opt-in holds the D = 192 kernel, not D = 256's 214,016 B: refused by name, in check()
    and in a direct backward / backward_plan call, before CuPy is touched."""
    import sandbox.device as device
    monkeypatch.setattr(device, "smem_per_block_optin", lambda arch_name=None: 163 * 1024)
    monkeypatch.setattr(device, "arch", lambda device=None: "sm_80")
    c = TCConfig()
    assert c.backward_device_errors(192) == [] and c.backward_device_errors(128) == []
    (err,) = c.backward_device_errors(256)
    assert "214016 B" in err and "sm_80" in err and "166912 B" in err
    impl = sandbox.get_variant("fa3").variant.impl
    p = _problem(256)
    with pytest.raises(ValueError, match="214016 B of shared memory.*sm_80"):
        impl.backward(p, None, None, None, None, None, None, sandbox.get_variant("fa3").config)
    with pytest.raises(ValueError, match="214016 B of shared memory.*sm_80"):
        impl.backward_plan(p, sandbox.get_variant("fa3").config, {})
    q = np.zeros((1, 2, 16, 128), np.float16)
    sandbox.get_variant("fa2-tc").check(sandbox.problem.make_problem(q, q, q), "backward")   # d = 128 fits sm_80
    monkeypatch.setattr(device, "smem_per_block_optin", lambda arch_name=None: 99 * 1024)   # sm_86 / sm_89
    with pytest.raises(ValueError, match="148480 B of shared memory"):     # fa2-tc's own check() applies it too
        sandbox.get_variant("fa2-tc").check(sandbox.problem.make_problem(q, q, q), "backward")


# ---- the Hopper rungs: which backward runs where

@pytest.mark.parametrize("name", WIDE_RUNGS)
def test_hopper_rungs_take_the_wide_backward(name):
    from variants.fa3_wgmma import resolve_bwd_kernel
    for bwd_kernel in ("auto", "mma"):
        bound = sandbox.get_variant(name, bwd_kernel=bwd_kernel)
        for d in (136, 160, 192, 200, 256):
            for direction in ("backward", "both"):
                bound.check(_problem(d), direction)
            assert resolve_bwd_kernel(bwd_kernel, _problem(d)) == "mma"
    for bwd_kernel in ("wgmma", "wgmma2"):        # dK / dV of the whole head dim in registers: d <= 128
        bound = sandbox.get_variant(name, bwd_kernel=bwd_kernel)
        bound.check(_problem(128), "backward")
        for d in (136, 256):
            bound.check(_problem(d), "forward")
            with pytest.raises(ValueError, match=rf"backward at head dim {d}: bwd_kernel='{bwd_kernel}'.*d = 128"):
                bound.check(_problem(d), "backward")
            with pytest.raises(ValueError, match=rf"backward at head dim {d}"):    # a direct call, before launch
                bound.variant.impl.backward(_problem(d), None, None, None, None, None, None, bound.config)
            with pytest.raises(ValueError, match=rf"backward at head dim {d}"):
                bound.variant.impl.backward_plan(_problem(d), bound.config, {})
    with pytest.raises(ValueError, match="head dim 264"):
        sandbox.get_variant(name).check(_problem(264), "backward")


def test_wide_backward_takes_modifiers_and_refuses_no_derivative():
    from sandbox import modifiers as M
    sm = M.softcap(20.0)
    bound = sandbox.get_variant("fa3")
    bound.check(_problem(256, score_mod=sm), "backward")
    bound.check(_problem(200, mask_mod=M.prefix_lm(5)), "backward")
    forward_only = M.ScoreMod("fwd", lambda s, b, h, i, j: s, lambda s, b, h, i, j: s, "s")
    with pytest.raises(ValueError, match="no derivative"):
        bound.check(_problem(256, score_mod=forward_only), "backward")


def test_registry_lists_the_backward_at_every_forward_head_dim():
    for name in WIDE_RUNGS:
        caps = sandbox.registry.all_variants()[name].caps
        assert caps.backward and caps.head_dims[-1] == 256     # one head-dim list for both directions


# ---- the gate's kernels and their NVRTC builds

def _gate_wide_entries():
    from sandbox import compile_report
    return [e for e in compile_report.units(gate=True) if e[2].source == "fa2_tc_bwd.cu"
            and any("_wide<" in n for n in e[2].names)]


def test_gate_builds_the_wide_kernels_and_holds_them_to_no_spills():
    from sandbox import compile_report
    entries = _gate_wide_entries()
    assert entries and {e[0] for e in entries} == set(WIDE_RUNGS)
    assert all(compile_report._tuned(bound, unit) for _, bound, unit in entries)   # tuned: spills fail the gate
    names = {n for _, _, u in entries for n in u.names if "_wide<" in n}
    assert names == set(WIDE_NAMES)            # 8 new kernels: 2 dtypes x 2 head dims x dropout on / off
    # fa2-tc's own units are unchanged (its forward stops at d = 128)
    bound = sandbox.get_variant("fa2-tc")
    assert not [n for u in bound.variant.impl.compile_units(bound.config) for n in u.names if "_wide<" in n]


ARCHS = ("sm_90", "sm_80") if os.environ.get("SANDBOX_COMPILE_FULL") == "1" else ("sm_90",)


@pytest.mark.parametrize("arch", ARCHS)
def test_wide_kernels_compile_without_spills(arch):
    """The gate's builds (one kernel per program, the compile report's cache keys: CI builds each once for
    test_compile.py and this test together). sm_90: within 227 KB; sm_80: D = 192 within 163 KB, D = 256 not
    (the host refuses it there, test above)."""
    from sandbox import compile_report
    pytest.importorskip("cuda.bindings.nvrtc")
    from sandbox.device import has_gpu
    if has_gpu():
        pytest.skip("compile-only check runs in CI (empty NVRTC logs under pytest on the GPU image)")
    jobs = compile_report.kernel_jobs(_gate_wide_entries(), (arch,))
    keys = sorted(k for k in jobs if "_wide<" in k[2])
    assert len(keys) == len(WIDE_NAMES)
    builds = loader.build_many([(jobs[k], arch) for k in keys])
    for k, b in zip(keys, builds):
        (r,) = loader.reports(jobs[k], b)
        smem = r.static_smem + jobs[k].dynamic_smem[k[2]]
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack == 0, (k[2], arch, r)
        D = int(k[2].split(",")[1])
        assert smem == TCConfig().backward_smem(D)
        assert (smem <= compile_report.SMEM_LIMIT[arch]) == (arch == "sm_90" or D == 192), (k[2], arch, smem)


# ---- an index model of the kernel's layout (the formulas of fa2_tc_bwd_wide, in Python)

def test_layout_model_feeds_every_fragment_its_operand():
    """Shared memory filled as load_panels_async and the P^T / dS^T stores fill it; ldmatrix (x4, .trans) read
    from the lane addresses the kernel forms; every lane's A and B fragment elements (mma.m16n8k16 layouts,
    kernels_cu/mma.cuh) checked against the operand each GEMM means: S^T = K Q^T, dP^T = V dO^T, dV += P^T dO,
    dK += dS^T Q over the warp's interleaved columns, dQ += dS K over the dQ tiles add_dq_tiles writes."""
    for D in (192, 256):
        _layout_model(D)


def _layout_model(D, BR=64, BC=64, WARPS=8):
    threads, mem = 32 * WARPS, {}
    sK = 0
    sV, sQ = sK + BC * D, sK + 2 * BC * D
    sdO, sP = sQ + 2 * BR * D, sQ + 4 * BR * D
    sdS = sP + BC * BR
    qbuf = BR * D * 2

    def panel_offset(rows, row, chunk):
        return (chunk >> 3) * (rows * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3)

    def load(tile, base, rows):
        step = threads // 32
        for tid in range(threads):
            c, r = tid % 32, tid // 32
            if c >= D // 8:
                continue
            s = 2 * (base + panel_offset(rows, r, c))
            for it in range(rows // step):
                for e in range(8):
                    key = s + it * step * 128 + 2 * e
                    assert key not in mem
                    mem[key] = (tile, r + it * step, c * 8 + e)

    load("K", sK, BC)
    load("V", sV, BC)
    for buf in (0, 1):
        load(("Q", buf), sQ + buf * BR * D, BR)
        load(("dO", buf), sdO + buf * BR * D, BR)
    for warp in range(WARPS):
        wkey, qh = (warp % 4) * 16, (warp // 4) * 32
        for lane in range(32):
            g, tq = lane // 4, lane % 4
            for n in range(BR // 16):
                for hr in range(2):
                    row, col = wkey + g + 8 * hr, qh + n * 8 + 2 * tq
                    at = row * BR + (((col // 8) ^ (row & 7)) << 3) + col % 8
                    for tile, base in (("P", sP), ("dS", sdS)):
                        for e in range(2):
                            assert 2 * (base + at + e) not in mem
                            mem[2 * (base + at + e)] = (tile, row, col + e)

    def ldsm(addrs, trans):
        regs = [[None] * 4 for _ in range(32)]
        for m in range(4):
            rows = [[mem[addrs[8 * m + r] + 2 * e] for e in range(8)] for r in range(8)]
            for t in range(32):
                if trans:
                    regs[t][m] = (rows[2 * (t % 4)][t // 4], rows[2 * (t % 4) + 1][t // 4])
                else:
                    regs[t][m] = (rows[t // 4][2 * (t % 4)], rows[t // 4][2 * (t % 4) + 1])
        return regs

    def check_a(regs, want):          # want(row, k)
        for t in range(32):
            g, c = t // 4, 2 * (t % 4)
            assert regs[t] == [(want(g, c), want(g, c + 1)), (want(g + 8, c), want(g + 8, c + 1)),
                               (want(g, c + 8), want(g, c + 9)), (want(g + 8, c + 8), want(g + 8, c + 9))]

    def check_b(regs, h, want):       # n8 tile h of an x4 load; want(k, n)
        for t in range(32):
            g, c = t // 4, 2 * (t % 4)
            assert regs[t][2 * h:2 * h + 2] == [(want(c, g), want(c + 1, g)), (want(c + 8, g), want(c + 9, g))]

    def panel_a(base, row, lane):
        return base + (row + lane % 16) * 128 + (((lane // 16) ^ (lane & 7)) << 4)

    def panel_b(base, row, lane):
        return base + (row + (lane // 16) * 8 + (lane & 7)) * 128 + ((((lane // 8) & 1) ^ (lane & 7)) << 4)

    def panel_bt(base, lane):
        return base + (((lane // 8) & 1) * 8 + (lane & 7)) * 128 + (((lane // 16) ^ (lane & 7)) << 4)

    lanes = range(32)
    for warp in range(WARPS):
        strip, hs = warp % 4, warp // 4
        wkey, qh, wq = strip * 16, hs * 32, strip * 16
        for cbuf in (0, 1):
            off = cbuf * qbuf
            for ta, a0, tb, b0 in (("K", sK, ("Q", cbuf), sQ), ("V", sV, ("dO", cbuf), sdO)):
                a_base = [panel_a(2 * a0, wkey, ln) for ln in lanes]
                b_base = [panel_b(2 * b0, qh, ln) + off for ln in lanes]
                for kk in range(D // 16):
                    a = ldsm([(x ^ ((kk & 3) << 5)) + (kk >> 2) * BC * 128 for x in a_base], False)
                    check_a(a, lambda r, k: (ta, wkey + r, 16 * kk + k))
                    for np_ in range(BR // 32):
                        b = ldsm([(x ^ ((kk & 3) << 5)) + (kk >> 2) * BR * 128 + np_ * 16 * 128 for x in b_base], False)
                        for h in range(2):
                            check_b(b, h, lambda k, n: (tb, qh + 16 * np_ + 8 * h + n, 16 * kk + k))
            p_a = [2 * sP + (wkey + ln % 16) * BR * 2 + (((ln // 16) ^ (ln & 7)) << 4) for ln in lanes]
            ds_a = [x - 2 * sP + 2 * sdS for x in p_a]
            for ta, a_base, tb, b0 in (("P", p_a, ("dO", cbuf), sdO), ("dS", ds_a, ("Q", cbuf), sQ)):
                bt = [(panel_bt(2 * b0, ln) ^ ((2 * hs) << 5)) + off for ln in lanes]
                for kk in range(BR // 16):
                    check_a(ldsm([x ^ (kk << 5) for x in a_base], False), lambda r, k: (ta, wkey + r, 16 * kk + k))
                    for m in range(D // 64):
                        for jp in range(2):
                            b = ldsm([(x ^ (jp << 5)) + m * BR * 128 + kk * 16 * 128 for x in bt], True)
                            for h in range(2):
                                n8 = 4 * m + 2 * jp + h
                                col = (n8 // 4) * 64 + 32 * hs + (n8 % 4) * 8      # the epilogue's column
                                check_b(b, h, lambda k, n: (tb, 16 * kk + k, col + n))
            ds_t = []
            for ln in lanes:
                dsr = (ln // 16) * 8 + (ln & 7)
                ds_t.append((2 * sdS + dsr * BR * 2 + ((((ln // 8) & 1) ^ (dsr & 7)) << 4)) ^ (strip << 5))
            k_t = [panel_bt(2 * sK, ln) ^ ((2 * hs) << 5) for ln in lanes]
            for kk in range(BC // 16):
                check_a(ldsm([x + kk * 16 * BR * 2 for x in ds_t], True), lambda r, k: ("dS", 16 * kk + k, wq + r))
                for m in range(D // 64):
                    for jp in range(2):
                        b = ldsm([(x ^ (jp << 5)) + m * BC * 128 + kk * 16 * 128 for x in k_t], True)
                        for h in range(2):
                            tile = 8 * m + 4 * hs + 2 * jp + h            # add_dq_tiles(dq, row, 8 m + 4 hs, ...)
                            check_b(b, h, lambda k, n: ("K", 16 * kk + k, 8 * tile + n))
    cols = sorted((n // 4) * 64 + 32 * hs + (n % 4) * 8 for hs in range(2) for n in range(D // 16))
    assert cols == list(range(0, D, 8))      # the two halves of a strip cover the head dim once
    assert len(mem) == (2 * BC * D + 4 * BR * D + 2 * BC * BR)


# ---- GPU: against the float64 oracle (pytest -m gpu on an H100 / H200)

GPU_DIMS = [160, 192, 200, 256]


@pytest.fixture(scope="module")
def wide_built():
    """The forward and backward modules the GPU tests launch, built in parallel up front."""
    from sandbox.device import arch
    units = []
    for name in WIDE_RUNGS:
        cfg = sandbox.get_variant(name).config
        units += [cfg.unit(dt, D) for dt in ("float16", "bfloat16") for D in (192, 256)]
    cfg = TCConfig()
    units += [cfg.backward_unit(dt, D) for dt in ("float16", "bfloat16") for D in (192, 256)]
    loader.prebuild(units, arch())


def _cases(dtype, d):
    """Plain, causal with dead rows (Nq > Nk) and GQA, dropout (causal, GQA / MQA; window), block-sparse,
    a negative scale, ragged lengths across the 64-key and 64-row tiles and the forward's 80 / 112-key tiles,
    length 1."""
    from sandbox import fuzz
    from sandbox.masks import BlockSparse
    return [
        fuzz.Case(1, 1, 1, 1, 1, d, dtype, {}, 0),
        fuzz.Case(2, 2, 2, 130, 177, d, dtype, {}, 1, logit_scale=4.0),
        fuzz.Case(1, 4, 2, 200, 161, d, dtype, {"causal": True}, 2),                       # GQA, dead rows
        fuzz.Case(1, 4, 1, 257, 300, d, dtype, {"causal": True, "dropout_p": 0.3, "seed": 2**40 + 5, "offset": 7}, 3),
        fuzz.Case(1, 2, 2, 150, 240, d, dtype, {"window": (40, 7), "dropout_p": 0.5, "seed": 11}, 4, mean=0.5),
        fuzz.Case(1, 2, 1, 97, 241, d, dtype, {"block_mask": BlockSparse(np.eye(4, 5, dtype=bool)[None], (25, 49))}, 5),
        fuzz.Case(1, 2, 2, 64, 90, d, dtype, {"scale": -0.3, "causal": True}, 6),
        fuzz.Case(1, 3, 3, 65, 64, d, dtype, {"causal": True}, 7),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("d", GPU_DIMS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wide_backward_matches_oracle(wide_built, dtype, d):
    from sandbox import fuzz
    bound = sandbox.get_variant("fa3")
    for case in _cases(dtype, d):
        fuzz.assert_case(bound, case, "backward")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [192, 256])
def test_wide_backward_of_the_other_rungs(wide_built, d):
    """fa3-wgmma's and fa3-ws's forwards with the same backward (causal GQA; dropout MQA)."""
    from sandbox import fuzz
    for name in ("fa3-wgmma", "fa3-ws"):
        for case in _cases("bfloat16", d)[2:4]:
            fuzz.assert_case(sandbox.get_variant(name), case, "backward")


@pytest.mark.gpu
def test_wide_backward_with_modifiers(wide_built):
    """Score and mask modifiers compiled into the wide kernel at d = 256 (each combination is a module of its
    own, forward and backward, built here: a few seconds each): softcap, causal; ALiBi and a document mask
    (empty tiles skipped) with dropout."""
    from sandbox import fuzz
    from sandbox import modifiers as M
    rng = np.random.default_rng(0)
    ids = np.sort(rng.integers(0, 3, (1, 150)), axis=1)
    for opts in ({"score_mod": M.softcap(2.0), "causal": True},
                 {"score_mod": M.alibi(rng.uniform(-1, 0.5, 2)), "mask_mod": M.document(ids), "dropout_p": 0.2,
                  "seed": 3}):
        fuzz.assert_case(sandbox.get_variant("fa3"), fuzz.Case(1, 2, 2, 150, 150, 256, "float16", opts, 8), "backward")


@pytest.mark.gpu
def test_wide_backward_fuzz(wide_built):
    """Hypothesis over the wide head dims (136..256), fp16 and bf16, every feature of the fa3 rungs but the
    modifiers (each drawn modifier would build two modules; test_wide_backward_with_modifiers covers them):
    HYPOTHESIS_PROFILE=gpu GPU_EXAMPLES=N sets the count."""
    import dataclasses
    import types
    from hypothesis import given
    from hypothesis import strategies as st
    from sandbox import fuzz
    bound = sandbox.get_variant("fa3")
    plain = types.SimpleNamespace(caps=dataclasses.replace(bound.caps, score_mod=False, mask_mod=False))
    limits = fuzz.Limits(dims=(136, 160, 192, 200, 256))

    @given(st.sampled_from(("float16", "bfloat16")), st.data())
    def check(dtype, data):
        fuzz.assert_case(bound, data.draw(fuzz.cases(plain, dtype, limits)), "backward")

    check()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_wide_autograd_against_sdpa(wide_built, causal):
    """sandbox.torch.attention (fa3 forward, the wide backward) at d = 256, bf16, GQA: out and gradients against
    SDPA math in float64, within the tolerance rule's factors of SDPA's own kernel's errors (2x out, 3x grads,
    plus the dtype's rounding at the output's magnitude), as tests/test_gpu_torch.py measures."""
    torch = pytest.importorskip("torch")
    import sandbox.torch as st
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gen = torch.Generator(device="cpu").manual_seed(3)
    q = torch.randn(2, 4, 300, 256, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(2, 2, 300, 256, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    dout = torch.randn(2, 4, 300, 256, generator=gen).to("cuda", torch.bfloat16)

    def grads(fn, *xs):
        xs = [x.detach().clone().requires_grad_(True) for x in xs]
        out = fn(*xs)
        out.backward(dout.to(out.dtype))
        return [out.detach()] + [x.grad for x in xs]

    def sdpa(a, b, c):
        return torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True)

    ours = grads(lambda a, b, c: st.attention(a, b, c, variant="fa3", causal=causal, enable_gqa=True), q, k, v)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = grads(sdpa, *(x.double() for x in (q, k, v)))
    base = grads(sdpa, q, k, v)
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        r = ref[i]
        err = (ours[i].double() - r).abs().max().item()
        factor, ulps = (2.0, 1.0) if what == "out" else (3.0, 2.0)
        tol = factor * (base[i].double() - r).abs().max().item() + ulps * 2**-7 * r.abs().max().item()
        assert err <= tol, f"{what}: err {err:.3g} > tol {tol:.3g}"
