"""The Hopper rungs without a GPU: the generated wgmma wrappers, architecture-specific compile units
(sm_90a builds, none for sm_80), and the clear refusal on a GPU that is not sm_90."""
import dataclasses
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


def test_softmax_turns_envelope_and_module():
    """softmax_turns: two consumer warpgroups (auto resolves to 2 at d = 64, where plain attention takes 3), no
    ping-pong; its module is its own (-DFA_SOFTMAX_TURNS, named in the label) and the kernel names are unchanged."""
    cfg = sandbox.get_variant("fa3", softmax_turns=True).config
    assert cfg.for_head_dim(64).consumers == 2 and cfg.for_head_dim(128).persistent is True
    for D in (64, 128, 192, 256):
        c = cfg.for_head_dim(D)
        u, plain = c.unit("float16", D), dataclasses.replace(c, softmax_turns=False).unit("float16", D)
        assert "-DFA_SOFTMAX_TURNS" in u.options and "-DFA_SOFTMAX_TURNS" not in plain.options
        assert u.names == plain.names and "softmax_turns" in u.label and c.envelope_errors(D) == []
    for bad in ({"pingpong": True}, {"consumers": 3, "block_c": 64}, {"consumers": 1}):
        with pytest.raises(ValueError, match="softmax_turns"):
            sandbox.get_variant("fa3", softmax_turns=True, **bad).check(_problem(64), "forward")
    with pytest.raises(ValueError, match="softmax_turns"):
        sandbox.get_variant("fa3-ws", softmax_turns=True)          # fa3's parameter (the overlapped loop)
    from variants.fa3_ws import WsConfig
    errs = WsConfig(overlap=False, consumers=2, persistent=False, softmax_turns=True).envelope_errors(128)
    assert len(errs) == 1 and "softmax_turns" in errs[0] and "no overlap" in errs[0]       # fa3-ws's loop


def test_softmax_turns_auto_rule():
    """softmax_turns="auto" (the default): on at D = 128 with two consumers (measured 1-13% faster there), and at
    D = 64 with modifiers (two consumers) unless a score modifier is compiled as text (ALiBi, a document mask, sinks
    1-8% faster; the soft-cap 5% slower); off at D = 64 without modifiers (three consumers), at 192 and 256 (not
    measured), with ping-pong, and on fa3-ws (no overlapped loop); its module carries the switch exactly then."""
    fa3, ws_cfg = sandbox.get_variant("fa3").config, sandbox.get_variant("fa3-ws").config
    assert fa3.softmax_turns == "auto"
    assert [fa3.for_head_dim(D).softmax_turns for D in (64, 128, 192, 256)] == [False, True, False, False]
    assert [fa3.for_head_dim(D, mods=True).softmax_turns for D in (64, 128)] == [True, True]
    assert [fa3.for_head_dim(D, mods=True, score_text=True).softmax_turns for D in (64, 128)] == [False, True]
    assert fa3.for_head_dim(64, short=True).softmax_turns is False
    assert not any(ws_cfg.for_head_dim(D, mods=True).softmax_turns for D in (64, 128, 192, 256))
    assert sandbox.get_variant("fa3", pingpong=True).config.for_head_dim(128).softmax_turns is False
    assert sandbox.get_variant("fa3", softmax_turns=False).config.for_head_dim(128).softmax_turns is False
    for cfg, D, on in ((fa3, 128, True), (fa3, 64, False), (ws_cfg, 128, False)):
        assert ("-DFA_SOFTMAX_TURNS" in cfg.unit("float16", D).options) is on, (cfg, D)


def test_softmax_turns_at_d64_follow_the_modules_score_text():
    """At D = 64 the rule reads whether the module compiles a score modifier's text: variants/fa2_tc.score_text(p)
    says so exactly when ModKernel's options carry FA_SCORE_MOD, for every built-in modifier (ALiBi seeded, and as
    text at scale 0), and the forward module of each carries the switch accordingly."""
    from sandbox import modifiers as M
    from sandbox.problem import make_problem
    from variants.fa2_tc import ModKernel, score_text
    z = np.zeros((1, 2, 64, 64), np.float16)
    fa3 = sandbox.get_variant("fa3").config
    cases = [dict(score_mod=M.softcap(20.0)), dict(score_mod=M.alibi([0.5, 0.25])),
             dict(score_mod=M.alibi([0.5, 0.25]), scale=0.0), dict(score_mod=M.sinks([0.1, 0.2])),
             dict(score_mod=M.relative_bias(np.zeros((2, 9)), 4)), dict(mask_mod=M.document(np.arange(64) // 20))]
    for kw in cases:
        p = make_problem(z, z, z, causal=True, **kw)
        mk = ModKernel.of(p)
        text = "-DFA_SCORE_MOD=1" in mk.options
        assert score_text(p) is text, kw
        assert ("-DFA_SOFTMAX_TURNS" in fa3.unit("float16", 64, mk).options) is (not text), kw


def test_softmax_turns_at_d64_stop_for_a_long_distance_bias():
    """At D = 64 a distance bias seeded into S (ALiBi) with dropout (two consumers: three spill) takes turns below
    AUTO_TURNS_BIAS_NK keys and not from there (measured slower at 8k-16k); without dropout it runs three consumers
    and no turns; a document mask keeps them at every length, and D = 128 is unchanged."""
    from sandbox import modifiers as M
    from sandbox.problem import make_problem
    from variants.fa2_tc import ModKernel
    from variants.fa3_ws import AUTO_TURNS_BIAS_NK
    bound = sandbox.get_variant("fa3")
    drop = dict(dropout_p=0.1, seed=1)
    for d, nk, kw, turns in ((64, AUTO_TURNS_BIAS_NK // 2, dict(score_mod=M.alibi([0.5]), **drop), True),
                             (64, AUTO_TURNS_BIAS_NK, dict(score_mod=M.alibi([0.5]), **drop), False),
                             (64, AUTO_TURNS_BIAS_NK // 2, dict(score_mod=M.alibi([0.5])), False),
                             (64, AUTO_TURNS_BIAS_NK, dict(mask_mod=M.document(np.arange(64) // 9, np.arange(AUTO_TURNS_BIAS_NK) // 999)),
                              True),
                             (128, AUTO_TURNS_BIAS_NK, dict(score_mod=M.alibi([0.5])), True)):
        z = np.zeros((1, 1, nk, d), np.float16)
        p = make_problem(z[:, :, :64], z, z, **kw)
        c = bound.variant.impl._resolved(p, bound.config)
        assert c.softmax_turns is turns, (d, nk, kw)
        assert ("-DFA_SOFTMAX_TURNS" in c.unit("float16", d, ModKernel.of(p)).options) is turns, (d, nk, kw)


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


# ---- head dims past 128 (forward only): padding, tiles, envelopes, the backward's refusal

WIDE_RUNGS = ("fa3-wgmma", "fa3-ws", "fa3")


def _problem(d):
    q = np.zeros((1, 4, 16, d), np.float16)
    k = np.zeros((1, 2, 16, d), np.float16)
    return sandbox.problem.make_problem(q, k, k)


def test_head_dims_pad_to_the_kernels_and_pick_fa3s_key_tiles():
    from variants.fa3_wgmma import AUTO_BC, d_pad
    assert [d_pad(d) for d in (8, 64, 72, 96, 128, 136, 192, 200, 256)] == [64, 64, 128, 128, 128, 192, 192, 256, 256]
    assert AUTO_BC == {64: 128, 128: 128, 192: 112, 256: 80}
    for name in WIDE_RUNGS:
        cfg = sandbox.get_variant(name).config
        at128 = cfg.for_head_dim(128) if hasattr(cfg, "for_head_dim") else cfg
        assert cfg.block_c == "auto" and at128.block_r == 128
        # the former default block_c=128 is what auto builds at D <= 128: the same kernels
        assert [cfg.bc(D) for D in (64, 128, 192, 256)] == [128, 128, 112, 80]
        assert cfg.forward_name("float16", 128, False) == sandbox.get_variant(name, block_c=128).config.forward_name(
            "float16", 128, False)
        assert ", 256, 80, 2," in cfg.forward_name("bfloat16", 256, True)
        assert list(sandbox.get_variant(name).variant.caps.head_dims) == list(range(8, 257, 8))


def test_auto_consumers_take_three_warpgroups_at_d64_without_modifiers():
    """fa3 / fa3-ws consumers="auto": Br = 192 at D = 64 (three consumer warpgroups, spill-free since the
    band mask goes row by row there), two elsewhere, with modifiers (a soft-cap's text spills at 160
    registers in the overlapped loop) and with ping-pong; an explicit count stays; an unresolved config refuses Br."""
    from sandbox import modifiers
    for name in ("fa3", "fa3-ws"):
        cfg = sandbox.get_variant(name).config
        assert cfg.consumers == "auto"
        assert [cfg.for_head_dim(D).consumers for D in (64, 128, 192, 256)] == [3, 2, 2, 2]
        assert cfg.for_head_dim(64, mods=True).consumers == 2
        assert cfg.for_head_dim(64).block_r == 192 and cfg.for_head_dim(64).threads == 512
        assert ", 64, 128, 3, 2," in cfg.forward_name("float16", 64, False)
        assert ", 64, 128, 2, 2," in cfg.forward_name("float16", 64, False, mods=True)
        assert cfg.forward_smem(64) == 2 * 64 * (192 + 2 * 2 * 128) + 8 * 12 + 8 + 1024
        assert sandbox.get_variant(name, consumers=2).config.for_head_dim(64).consumers == 2
        with pytest.raises(ValueError, match="for_head_dim"):
            cfg.block_r
        assert cfg.for_head_dim(64).envelope_errors(64) == [] and cfg.envelope_errors(64) == []
        sm = dataclasses.replace(_problem(64), score_mod=modifiers.softcap(5.0))
        assert sandbox.get_variant(name).variant.impl._resolved(sm, cfg).consumers == 2   # small: no serial_three
    assert sandbox.get_variant("fa3", pingpong=True).config.for_head_dim(64).consumers == 2


def test_auto_persistent_is_on_at_d128_where_it_fits():
    """persistent="auto": the persistent grid at D = 128 (measured 0-8% faster there), at D = 64 only on short
    walks (3% slower at N >= 8k), with modifiers the same (3-13% faster at N = 4k causal) but with two consumers
    only; not with ping-pong, or where two Q buffers do not fit beside the ring (stages=3)."""
    for name in ("fa3", "fa3-ws"):
        cfg = sandbox.get_variant(name).config
        assert cfg.persistent == "auto"
        assert [cfg.for_head_dim(D).persistent for D in (64, 128, 192, 256)] == [False, True, False, False]
        assert [cfg.for_head_dim(D, short=True).persistent for D in (64, 128, 192, 256)] == [True, True, False, False]
        with_mods = [cfg.for_head_dim(64, mods=True, short=True), cfg.for_head_dim(128, mods=True)]
        assert [(c.persistent, c.consumers) for c in with_mods] == [(True, 2), (True, 2)]
        assert cfg.for_head_dim(64, mods=True).persistent is False                       # long walks
        three = sandbox.get_variant(name, consumers=3).config                             # spills persistent
        assert three.for_head_dim(64, short=True).persistent and not three.for_head_dim(64, True, True).persistent
        assert ", true, 10, false>" in cfg.forward_name("float16", 128, False, mods=True)
        assert sandbox.get_variant(name, stages=3).config.for_head_dim(128).persistent is False
        assert sandbox.get_variant(name, persistent=False).config.for_head_dim(128).persistent is False
        assert sandbox.get_variant(name, persistent=True).config.for_head_dim(64).persistent is True
        assert ", 128, 128, 2, 2," in cfg.forward_name("float16", 128, False) and \
            ", true, 10, false>" in cfg.forward_name("float16", 128, False)
    assert sandbox.get_variant("fa3", pingpong=True).config.for_head_dim(128).persistent is False


@pytest.mark.parametrize("Nq, Nk, causal, window", [(1, 1, False, None), (7, 300, True, None), (300, 7, True, None),
                                                     (500, 500, False, (31, 5)), (64, 1000, False, (None, -900)),
                                                     (1000, 64, True, (10, None)), (0, 5, False, None)])
def test_mean_visible_keys_counts_every_row(Nq, Nk, causal, window):
    """masks.mean_visible_keys (persistent="auto"'s short walks) equals the element mask's mean row count."""
    from sandbox.masks import Band, mean_visible_keys
    band = Band.from_options(Nq, Nk, causal, window)
    want = band.element_mask(Nq, Nk).sum(axis=1).mean() if Nq else 0.0
    assert mean_visible_keys(Nq, Nk, band.lo, band.hi) == pytest.approx(want, abs=1e-9)


def test_auto_persistent_at_d64_follows_the_walk_length(monkeypatch):
    """At d = 64 persistent="auto" is on where a row sees at most 3k keys on average (N = 2k, causal N = 4k on the
    FA2 paper grid) and the Q tiles outnumber the SMs, off beyond, with modifiers the same (two consumers), and
    never against an explicit choice."""
    import variants.fa3_ws as ws
    from sandbox import modifiers
    from sandbox.problem import Problem
    from variants.fa3_ws import short_walk
    monkeypatch.setattr(ws, "sm_count", lambda: 132)
    assert [short_walk(N, N, c, None) for N, c in ((2048, False), (4096, True), (4096, False), (8192, True))] == \
        [True, True, False, False]
    assert short_walk(16384, 16384, False, (1024, 0))          # a sliding window: short at any N
    for name in ("fa3", "fa3-ws"):
        bound = sandbox.get_variant(name)
        impl = bound.variant.impl
        resolved = lambda N, causal, B=4, **kw: impl._resolved(      # noqa: E731
            Problem(B, 8, 8, N, N, 64, "float16", causal=causal, **kw), bound.config)
        assert resolved(2048, True).persistent and resolved(4096, True).persistent
        assert not resolved(4096, False).persistent and not resolved(8192, True).persistent
        assert resolved(2048, True).consumers == 3
        softcap = modifiers.softcap(20.0)
        # 704 and 1,408 Q tiles for 132 SMs: below serial_three's 16 per SM, the overlapped two as before
        assert [(c.persistent, c.consumers) for c in (resolved(4096, True, score_mod=softcap),
                                                       resolved(8192, True, score_mod=softcap))] == [(True, 2), (False, 2)]
        assert not impl._resolved(Problem(4, 8, 8, 2048, 2048, 64, "float16", causal=True),
                                  sandbox.get_variant(name, persistent=False).config).persistent
        assert resolved(16384, True, window=(512, 0)).persistent
        # 11 Q tiles x 8 heads = 88 items for 132 SMs: nothing to balance, the counter's zeroing saved
        assert not resolved(2048, True, B=1).persistent and not resolved(128, False, B=1).persistent


@pytest.mark.parametrize("Nq, Nk, br, bc, causal, window", [(500, 500, 192, 128, True, None), (70, 300, 192, 64, True, None),
                                                           (333, 90, 128, 128, False, (50, 10)), (1, 1, 192, 128, True, None),
                                                           (1000, 1000, 192, 112, False, (None, -30))])
def test_bottom_aligned_tile_classes_are_exact(Nq, Nk, br, bc, causal, window):
    """masks.classify_tiles with row_shift (fa3_ws.cu's bottom-aligned Q tiles): each tile's class from the element
    mask of its rows [t Br - shift, (t + 1) Br - shift) within [0, Nq)."""
    from sandbox.masks import TILE_EMPTY, TILE_FULL, TILE_PARTIAL, Band, classify_tiles
    band = Band.from_options(Nq, Nk, causal, window)
    shift = -Nq % br
    got = classify_tiles(Nq, Nk, br, bc, band, None, shift)[0]
    vis = band.element_mask(Nq, Nk)
    assert got.shape == (-(-Nq // br), -(-Nk // bc))
    for t in range(got.shape[0]):
        rows = vis[max(0, t * br - shift):t * br - shift + br]
        assert len(rows) == (min(Nq, br - shift) if t == 0 else br)
        for c in range(got.shape[1]):
            block = rows[:, c * bc:(c + 1) * bc]
            want = TILE_EMPTY if not block.any() else TILE_FULL if block.all() else TILE_PARTIAL
            assert got[t, c] == want, (t, c)
    with pytest.raises(ValueError, match="row_shift"):
        classify_tiles(Nq, Nk, br, bc, band, None, br)


def test_row_shift_only_where_a_band_bounds_the_keys_from_above():
    """variants/fa3_ws.row_shift: -Nq mod Br for causal or a right-bounded window, also with score modifiers and sinks;
    0 non-causal, with a left bound alone, a block-sparse layout or a mask modifier (top-aligned tile tables)."""
    from sandbox import modifiers
    from sandbox.masks import BlockSparse
    from sandbox.problem import Problem
    from variants.fa3_ws import row_shift
    P = lambda **kw: Problem(1, 2, 2, 500, 500, 64, "float16", **kw)      # noqa: E731
    assert row_shift(P(causal=True), 192) == 76 and row_shift(P(causal=True), 128) == 12
    assert row_shift(P(window=(None, 5)), 192) == 76 and row_shift(P(causal=True), 100) == 0
    assert row_shift(P(), 192) == 0 and row_shift(P(window=(5, None)), 192) == 0
    assert row_shift(P(causal=True, block_mask=BlockSparse(np.ones((1, 2, 2), bool), (250, 250))), 192) == 0
    assert row_shift(P(causal=True, score_mod=modifiers.softcap(5.0)), 192) == 76
    assert row_shift(P(causal=True, score_mod=modifiers.alibi([-0.5, -0.25])), 128) == 12
    assert row_shift(P(score_mod=modifiers.sinks([0.0, 1.0])), 192) == 0
    assert row_shift(P(causal=True, mask_mod=modifiers.document(np.arange(500) // 100)), 192) == 0
    assert row_shift(P(causal=True, score_mod=modifiers.softcap(5.0),
                       mask_mod=modifiers.document(np.arange(500) // 100)), 192) == 0


def test_shifted_tile_table_with_score_modifiers_on_the_host():
    """fa3_wgmma.forward_tiles with row_shift and a score modifier: the band's bottom-aligned table (what the kernel
    walks) and the modifier's arguments with a tile table of batch extent 1; with a mask modifier it refuses."""
    from sandbox import modifiers
    from sandbox.masks import Band, classify_tiles
    from sandbox.problem import Problem
    from variants.fa3_wgmma import forward_tiles
    cfg = sandbox.get_variant("fa3", consumers=3).config
    p = Problem(1, 2, 2, 500, 700, 64, "float16", causal=True, score_mod=modifiers.alibi([-0.5, -0.25]))
    tiles, heads, rest = forward_tiles(p, cfg, 64, object(), None, 76)
    want = classify_tiles(500, 700, 192, 128, Band.from_options(500, 700, True, None), None, 76)
    assert np.array_equal(tiles, want) and int(heads) == want.shape[0]
    assert int(rest[0]) == 1                          # the tile table's batch extent
    pm = Problem(1, 2, 2, 500, 700, 64, "float16", causal=True, mask_mod=modifiers.document(np.arange(500) // 100))
    with pytest.raises(ValueError, match="row_shift"):
        forward_tiles(pm, cfg, 64, object(), None, 76)


def test_three_consumers_where_modifiers_stay_spill_free():
    """fa3's consumers="auto" at d = 64 with modifiers: three (and the persistent grid for a distance bias) where
    fa3_ws.three_consumers says the build stays spill-free (sinks, ALiBi without dropout), else two."""
    from sandbox import modifiers
    from sandbox.problem import Problem
    from variants import fa3_ws as ws
    bound = sandbox.get_variant("fa3")
    P = lambda N, **kw: Problem(4, 32, 32, N, N, 64, "float16", causal=True, **kw)      # noqa: E731
    alibi, sinks = modifiers.alibi(modifiers.alibi_slopes(32)), modifiers.sinks(np.zeros(32))
    doc = modifiers.document(np.arange(4096) // 1024)
    cases = [(P(4096, score_mod=alibi), True, 3, True), (P(16384, score_mod=alibi), True, 3, True),
             (P(4096, score_mod=alibi, dropout_p=0.1, seed=1), False, 2, None),
             (P(4096, score_mod=sinks), True, 3, True), (P(16384, score_mod=sinks), True, 3, False),
             (P(4096, score_mod=sinks, dropout_p=0.1, seed=1), True, 3, True),
             (P(4096, score_mod=modifiers.softcap(50.0), dropout_p=0.1, seed=1), False, 2, None),
             (P(4096, mask_mod=doc), False, 2, None),
             (P(4096, score_mod=sinks, mask_mod=doc), False, 2, None)]
    for p, three, consumers, persistent in cases:
        assert ws.three_consumers(p) is three, p
        cfg = bound.variant.impl._resolved(p, bound.config)
        assert cfg.consumers == consumers, p
        if persistent is not None:
            assert cfg.persistent is persistent, p
    explicit = sandbox.get_variant("fa3", consumers=2)          # a bias on two consumers keeps the walk rule
    assert explicit.variant.impl._resolved(P(16384, score_mod=alibi), explicit.config).persistent is False
    assert bound.config.for_head_dim(64, mods=True, three=True).consumers == 3
    assert bound.config.for_head_dim(128, mods=True, three=True).consumers == 2
    assert sandbox.get_variant("fa3", pingpong=True).config.for_head_dim(64, mods=True, three=True).consumers == 2


def test_score_text_runs_three_consumers_without_the_overlap(monkeypatch):
    """fa3 at d = 64 with a score modifier's text (soft-cap, relative bias, sinks beside them), no mask modifier, no
    dropout, and at least SERIAL_WAVES Q tiles per SM (B 4, 32 heads, N = 4k: 2,816 tiles for 132 SMs): three consumers
    without the overlap (fa3-ws's loop: OVERLAP false in the kernel's name), no turns, the persistent grid; everything
    else keeps the overlapped loop: smaller problems (where it measured slower), dropout, a mask modifier, d = 128,
    ALiBi's seeded form, an explicit consumer count, persistent=False, ping-pong, softmax turns, p_smem, the trace."""
    from sandbox import modifiers
    from sandbox.problem import Problem
    from variants import fa3_ws as ws
    monkeypatch.setattr(ws, "sm_count", lambda: 132)
    P = lambda d=64, B=4, **kw: Problem(B, 32, 32, 4096, 4096, d, "float16", causal=True, **kw)      # noqa: E731
    cap, rel = modifiers.softcap(50.0), modifiers.relative_bias(np.zeros((32, 9)), 4)
    doc = modifiers.document(np.arange(4096) // 1024)

    def resolved(p, **params):
        bound = sandbox.get_variant("fa3", **params)
        return bound.variant.impl._resolved(p, bound.config)

    for p in (P(score_mod=cap), P(score_mod=rel), P(score_mod=cap.with_sinks(np.zeros(32)))):
        assert ws.serial_three(p), p
        c = resolved(p)
        assert (c.consumers, c.overlap, c.persistent, c.softmax_turns) == (3, False, True, False), p
        assert c.forward_name("float16", 64, False) == "fa3_ws_forward<__half, 64, 128, 3, 2, false, false, true, 10, false>"
        assert c.envelope_errors(64) == []
        assert resolved(p, persistent=True).overlap is False
    assert (resolved(P(score_mod=cap), mufu_pipe=True).overlap, resolved(P(score_mod=cap), q_prescale=True).overlap) == (
        False, False)                                   # switches of the softmax both loops share
    # B = 2: 1,408 tiles, 10.7 per SM (measured a tie); B = 4 with 4,000 SMs: under one per SM
    assert not ws.serial_three(P(B=2, score_mod=cap))
    monkeypatch.setattr(ws, "sm_count", lambda: 4000)
    assert not ws.serial_three(P(score_mod=cap)) and resolved(P(score_mod=cap)).overlap is True
    monkeypatch.setattr(ws, "sm_count", lambda: 132)
    kept = [(P(B=2, score_mod=cap), {}), (P(score_mod=cap, dropout_p=0.1, seed=1), {}),
            (P(score_mod=cap, mask_mod=doc), {}), (P(128, score_mod=cap), {}),
            (P(score_mod=modifiers.alibi(modifiers.alibi_slopes(32))), {}), (P(score_mod=cap), {"consumers": 2}),
            (P(score_mod=cap), {"consumers": 3}), (P(score_mod=cap), {"persistent": False}),
            (P(score_mod=cap), {"pingpong": True}), (P(score_mod=cap), {"softmax_turns": True}),
            (P(score_mod=cap), {"p_smem": True}),
            (P(score_mod=cap), {"trace": True})]                         # the trace records the overlapped loop
    for p, params in kept:
        assert resolved(p, **params).overlap is True, (p, params)
    ws_cfg = sandbox.get_variant("fa3-ws")
    assert ws_cfg.variant.impl._resolved(P(score_mod=cap), ws_cfg.config).consumers == 2      # fa3's rule only


def test_persistent_grid_and_shared_memory():
    """persistent=True: at most one block per SM walking every (Q tile, batch, head) item, two Q buffers (D <= 128),
    refused with ping-pong or past D = 128 before any launch; the template switch is in the kernel's name."""
    from variants.fa3_ws import FA3WarpSpecialized
    p = dataclasses.replace(_problem(64), B=2, Hq=4, Nq=1000)
    for name in ("fa3", "fa3-ws"):
        cfg = sandbox.get_variant(name, persistent=True).config.for_head_dim(64)
        plain = sandbox.get_variant(name).config.for_head_dim(64)
        assert FA3WarpSpecialized.grid(p, plain) == (6, 8)               # ceil(1000 / 192), B Hq
        items = 6 * 8
        assert FA3WarpSpecialized.grid(p, cfg) in ((items, 1), (min(items, sandbox.device.sm_count() or items), 1))
        assert cfg.forward_smem(64) - plain.forward_smem(64) == 2 * 64 * 192
        overlap = "true" if name == "fa3" else "false"        # fa3 overlaps; then pingpong, persistent
        assert cfg.forward_name("float16", 64, False).endswith(f", {overlap}, false, true, 10, false>")
        assert cfg.envelope_errors(64) == [] and cfg.envelope_errors(128) == []
        assert any("persistent" in e for e in cfg.envelope_errors(256))
    with pytest.raises(ValueError, match="persistent"):
        sandbox.get_variant("fa3", persistent=True, pingpong=True).check(_problem(64), "forward")


def test_wide_default_tiles_fit_shared_memory():
    """D = 256: Q 64 KB beside two ring slots of K and V (4 x 40 KB) for the TMA rungs; fa3-wgmma's single
    K and V tiles. All under the 227 KB per block."""
    from variants.fa3_wgmma import SMEM_LIMIT
    ws = sandbox.get_variant("fa3").config
    assert ws.forward_smem(256) == 2 * 256 * (128 + 2 * 2 * 80) + 8 * 12 + 8 + 1024 <= SMEM_LIMIT
    assert ws.forward_smem(192) == 2 * 192 * (128 + 2 * 2 * 112) + 8 * 12 + 8 + 1024 <= SMEM_LIMIT
    assert sandbox.get_variant("fa3-wgmma").config.forward_smem(256) == 2 * 256 * (128 + 2 * 80) + 1024
    for name in WIDE_RUNGS:
        for d in (96, 136, 192, 200, 256):
            sandbox.get_variant(name).check(_problem(d), "forward")


@pytest.mark.parametrize("name,params,match", [
    ("fa3", {"stages": 3}, "shared memory"),                       # 3 ring slots of 40 KB K and V: 294 KB
    ("fa3-ws", {"block_c": 128}, "shared memory"),
    ("fa3", {"consumers": 3, "block_c": 64}, "registers"),         # O alone is 128 of a consumer's 160
    ("fa3-wgmma", {"warpgroups": 3}, "registers"),                  # 384 threads: 168 registers each
    ("fa3-wgmma", {"block_c": 192}, "registers"),
])
def test_wide_envelopes_refuse_what_cannot_fit(name, params, match):
    bound = sandbox.get_variant(name, **params)
    with pytest.raises(ValueError, match=match):
        bound.check(_problem(256), "forward")
    bound.check(_problem(128), "forward")      # the same config runs at d = 128


@pytest.mark.parametrize("name", WIDE_RUNGS)
@pytest.mark.parametrize("bwd_kernel", ["wgmma", "wgmma2"])
def test_backward_refused_past_128_naming_the_head_dim(name, bwd_kernel):
    bound = sandbox.get_variant(name, bwd_kernel=bwd_kernel)
    for d in (136, 192, 256):
        bound.check(_problem(d), "forward")
        for direction in ("backward", "both"):
            with pytest.raises(ValueError, match=rf"backward at head dim {d}.*d = 128"):
                bound.check(_problem(d), direction)
    bound.check(_problem(128), "backward")
    # a direct call is refused too, before any launch
    with pytest.raises(ValueError, match="backward at head dim 256"):
        bound.variant.impl.backward(_problem(256), None, None, None, None, None, None, bound.config)
    with pytest.raises(ValueError, match="backward at head dim 200"):
        bound.variant.impl.backward_plan(_problem(200), bound.config, {})


def test_wide_units_are_compiled_by_the_gate():
    """The defaults (tuned) build D = 192 and 256 beside 64 and 128, for both dtypes; fa3's ping-pong too."""
    from sandbox import compile_report
    got = {}
    for name in WIDE_RUNGS:
        v = sandbox.registry.all_variants()[name]
        for bound in compile_report.configs(v, gate=True):
            assert v.impl.tuned(bound.config)
            for unit in v.impl.compile_units(bound.config):
                got.setdefault(name, set()).update(unit.names)
    for name, source in (("fa3-wgmma", "fa3_wgmma_forward"), ("fa3-ws", "fa3_ws_forward"), ("fa3", "fa3_ws_forward")):
        for ct in ("__half", "__nv_bfloat16"):
            for D, bc in ((192, 112), (256, 80)):
                assert any(n.startswith(f"{source}<{ct}, {D}, {bc}, 2,") for n in got[name]), (name, ct, D)
    assert any(", true, true, false, 10," in n and ", 256, 80," in n for n in got["fa3"])     # ping-pong at D = 256


def test_bench_grid_times_the_hopper_rungs_at_d_256():
    from bench import grid, selection
    specs = [s for s, _ in grid.selection_for("float16", 256, ("forward",))]
    names = {s.partition(":")[0] for s in specs}
    assert {"fa3-wgmma", "fa3-ws", "fa3"} <= names
    assert all(sandbox.registry.all_variants()[n].caps.head_dims[-1] >= 256 for n in names)
    # the wide backward (fa2_tc_bwd_wide, bwd_kernel auto / mma) makes the rungs' default backward rows timeable
    wide = {s for s in selection.ladder("float16", 256, "backward") if s.partition(":")[0] in WIDE_RUNGS
            and _backward_ok(s, 256)}
    assert {"fa3", "fa3-wgmma", "fa3-ws"} <= wide


def _backward_ok(spec, d):
    from bench.common import parse_variant
    _, bound = parse_variant(spec)[:2]
    try:
        bound.check(_problem(d), "backward")
        return True
    except ValueError:
        return False


# The sm_90a kernels of the wide head dims: built here (NVRTC on the CPU, the disk cache), held to no spills
# and their shared memory; one dtype (the gate builds both).
WIDE_KERNELS = [(name, D) for name in WIDE_RUNGS for D in (192, 256)]


@pytest.mark.parametrize("name,D", WIDE_KERNELS)
def test_wide_kernels_compile_without_spills(name, D):
    from sandbox import compile_report
    pytest.importorskip("cuda.bindings.nvrtc")
    bound = sandbox.get_variant(name)
    unit = bound.config.unit("float16", D)
    # one kernel per program, as the compile report builds it (compile_report.kernel_jobs): the same
    # cache key, so CI compiles each of these once for the gate and this test together
    jobs = compile_report.kernel_jobs([(name, bound, unit)], ("sm_90",))
    for kname in unit.names:
        (r,) = loader.compile_only(jobs[compile_report.kernel_key(unit, kname, "sm_90")], "sm_90")
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack == 0, (kname, r)
        assert r.static_smem + unit.dynamic_smem[kname] <= compile_report.SMEM_LIMIT["sm_90"], (kname, r)


# ---- GPU: the wide head dims against the oracle (pytest -m gpu on an H100 / H200)

def _wide_cases(dtype, d):
    """Non-causal and causal (dead rows: Nq > Nk), GQA, dropout on the Philox contract, a window, block-sparse,
    a negative scale, ragged Nq / Nk (1, past the 80 and 112 key tiles, past the 128-row query tile)."""
    from sandbox import fuzz
    from sandbox.masks import BlockSparse
    return [
        fuzz.Case(1, 2, 2, 1, 1, d, dtype, {}, 0),
        fuzz.Case(2, 2, 2, 130, 177, d, dtype, {}, 1, logit_scale=4.0),
        fuzz.Case(1, 4, 2, 200, 161, d, dtype, {"causal": True}, 2),                       # GQA, dead rows
        fuzz.Case(1, 4, 1, 257, 300, d, dtype, {"causal": True, "dropout_p": 0.3, "seed": 2**40 + 5, "offset": 7}, 3),
        fuzz.Case(1, 2, 2, 150, 240, d, dtype, {"window": (40, 7), "dropout_p": 0.5, "seed": 11}, 4, mean=0.5),
        fuzz.Case(1, 2, 1, 97, 241, d, dtype, {"block_mask": BlockSparse(np.eye(4, 5, dtype=bool)[None], (25, 49))}, 5),
        fuzz.Case(1, 2, 2, 64, 90, d, dtype, {"scale": -0.3, "causal": True}, 6),
    ]


WIDE_GPU = [(name, params) for name in WIDE_RUNGS for params in ({},)] + [("fa3", {"pingpong": True}),
                                                                          ("fa3-wgmma", {"block_c": 64})]


@pytest.fixture(scope="module")
def wide_kernels_built():
    """Every module the wide GPU tests launch, built in parallel up front (one NVRTC job per core)."""
    from sandbox.device import arch
    units = [sandbox.get_variant(n, **p).config.unit(dt, D) for n, p in WIDE_GPU for dt in ("float16", "bfloat16")
             for D in (128, 192, 256)]
    loader.prebuild(units, arch())


@pytest.mark.gpu
@pytest.mark.parametrize("d", [96, 192, 256, 200])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name,params", WIDE_GPU, ids=[f"{n}{''.join(f'-{k}={v}' for k, v in p.items())}"
                                                        for n, p in WIDE_GPU])
def test_wide_head_dims_match_oracle(wide_kernels_built, name, params, dtype, d):
    from sandbox import fuzz
    bound = sandbox.get_variant(name, **params)
    for case in _wide_cases(dtype, d):
        fuzz.assert_case(bound, case, "forward")


@pytest.mark.gpu
def test_wgmma_backward_past_128_is_refused_on_the_gpu():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 64, 256)).astype(np.float16)
    res = sandbox.forward(q, q, q, variant="fa3", bwd_kernel="wgmma2")
    with pytest.raises(ValueError, match="backward at head dim 256"):
        sandbox.backward(q, res)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fa3", "fa3-ws"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_persistent_blocks_walk_every_item(monkeypatch, name, dtype):
    """persistent=True with the grid capped at three blocks, so that each walks many (Q tile, batch, head) items
    and reuses both Q buffers and the K / V ring across items: causal GQA with dead rows, dropout, a window,
    block-sparse, a negative scale, score and mask modifiers (the default with modifiers at d = 128 and on short
    walks at d = 64), d = 64 (three consumers, two with modifiers) and 128 (two)."""
    import variants.fa3_ws as ws
    from sandbox import fuzz, modifiers
    from sandbox.masks import BlockSparse
    monkeypatch.setattr(ws, "sm_count", lambda: 3)
    bound = sandbox.get_variant(name, persistent=True)
    cases = [fuzz.Case(2, 4, 2, 200, 161, 64, dtype, {"causal": True}, 1),
             fuzz.Case(1, 4, 1, 257, 300, 64, dtype, {"causal": True, "dropout_p": 0.3, "seed": 5}, 2),
             fuzz.Case(1, 2, 2, 150, 240, 128, dtype, {"window": (40, 7)}, 3),
             fuzz.Case(1, 2, 1, 97, 241, 64, dtype, {"block_mask": BlockSparse(np.eye(4, 5, dtype=bool)[None], (25, 49))}, 4),
             fuzz.Case(2, 2, 2, 64, 90, 128, dtype, {"scale": -0.3, "causal": True}, 5),
             fuzz.Case(1, 4, 2, 700, 300, 128, dtype, {"causal": True}, 6),
             fuzz.Case(1, 4, 2, 120, 260, 64, dtype, {"score_mod": modifiers.softcap(5.0), "causal": True}, 7),
             fuzz.Case(1, 2, 2, 300, 300, 64, dtype, {"mask_mod": modifiers.document(np.arange(300) // 100)}, 8),
             fuzz.Case(2, 4, 2, 200, 333, 128, dtype, {"score_mod": modifiers.alibi(modifiers.alibi_slopes(4)),
                                                       "causal": True}, 9),
             fuzz.Case(1, 4, 4, 190, 190, 96, dtype, {"score_mod": modifiers.sinks(np.linspace(-1, 2, 4)),
                                                      "mask_mod": modifiers.prefix_lm(np.array([50]))}, 10)]
    for case in cases:
        p = sandbox.problem.make_problem(*case.inputs()[:3], **case.options)
        cfg = bound.variant.impl._resolved(p, bound.config)
        assert ws.FA3WarpSpecialized.grid(p, cfg)[0] <= 3
        fuzz.assert_case(bound, case, "forward")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fa3", "fa3-ws"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bottom_aligned_q_tiles_match_oracle(name, dtype):
    """Causal and right-bounded windows start the Q tiles row_shift rows above row 0 (the partial tile first):
    ragged Nq at Br = 192 (d = 64) and 128 (d = 128), Nk above and below Nq, GQA, dropout, the persistent grid
    (forced: these problems are too small for "auto" to take it) and the default one, forward and (through the
    forward's lse) backward, against the oracle."""
    import variants.fa3_ws as ws
    from sandbox import fuzz
    cases = [(fuzz.Case(2, 4, 2, 500, 500, 64, dtype, {"causal": True}, 1), {}),
             (fuzz.Case(1, 4, 1, 333, 700, 64, dtype, {"causal": True, "dropout_p": 0.2, "seed": 3}, 2),
              {"persistent": True}),
             (fuzz.Case(1, 2, 2, 700, 260, 64, dtype, {"causal": True}, 3), {"persistent": False}),
             (fuzz.Case(1, 2, 1, 450, 450, 128, dtype, {"window": (None, 20)}, 4), {}),
             (fuzz.Case(2, 2, 2, 70, 90, 128, dtype, {"causal": True}, 5), {"persistent": False}),
             (fuzz.Case(1, 4, 2, 257, 257, 64, dtype, {"window": (64, 0)}, 6), {"persistent": True})]
    for case, params in cases:
        bound = sandbox.get_variant(name, **params)
        p = sandbox.problem.make_problem(*case.inputs()[:3], **case.options)
        cfg = bound.variant.impl._resolved(p, bound.config)
        assert ws.row_shift(p, cfg.block_r) > 0, case
        fuzz.assert_case(bound, case, "forward")
    fuzz.assert_case(sandbox.get_variant(name), cases[0][0], "backward")


def _row_bias(n: int):
    """A user modifier reading a buffer indexed by the query row (s + qb[i]): rows < 0 of a shifted first Q tile
    must never reach it. Their results are never written, so a read there would pass the oracle: the CUDA form traps
    on i < 0 (the launch then fails) instead."""
    from sandbox import modifiers
    buf = np.linspace(-1.0, 1.0, n)
    return modifiers.ScoreMod("row_bias", lambda s, b, h, i, j, qb: s + qb[i], lambda s, b, h, i, j, qb: s + qb[i],
                              "(i < 0 ? (__trap(), s) : s + qb[i])", buffers={"qb": buf})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bottom_aligned_q_tiles_with_score_modifiers_match_oracle(dtype):
    """Score modifiers and sinks on bottom-aligned Q tiles (row_shift > 0): ALiBi, the soft-cap with Nk > Nq (rows
    above row 0 see keys), a relative bias, a row-indexed user buffer, sinks with dropout; three consumers on both
    grids and the default config, forward against the oracle."""
    import variants.fa3_ws as ws
    from sandbox import fuzz, modifiers as M
    cases = [fuzz.Case(1, 4, 2, 700, 700, 64, dtype, {"causal": True, "score_mod": M.alibi(M.alibi_slopes(4))}, 1),
             fuzz.Case(2, 2, 2, 333, 517, 64, dtype, {"causal": True, "score_mod": M.softcap(5.0)}, 2, logit_scale=4.0),
             fuzz.Case(1, 2, 2, 1000, 1000, 64, dtype,
                       {"causal": True, "score_mod": M.relative_bias(np.linspace(-1, 1, 130).reshape(2, 65), 32)}, 3),
             fuzz.Case(1, 2, 2, 450, 600, 64, dtype, {"causal": True, "score_mod": _row_bias(450)}, 4),
             fuzz.Case(1, 4, 4, 400, 1000, 48, dtype,
                       {"window": (100, 37), "dropout_p": 0.2, "seed": 3, "score_mod": M.sinks(np.linspace(-1, 1, 4))}, 5)]
    for params in ({"consumers": 3, "persistent": True}, {"consumers": 3, "persistent": False}, {}):
        bound = sandbox.get_variant("fa3", **params)
        for case in cases:
            p = sandbox.problem.make_problem(*case.inputs()[:3], **case.options)
            assert ws.row_shift(p, bound.variant.impl._resolved(p, bound.config).block_r) > 0, case
            fuzz.assert_case(bound, case, "forward")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_from_torch_matches_the_default(monkeypatch, causal):
    """sandbox.torch.attention with persistent=True (the plan path: the item counter is the stream's kept buffer,
    which the kernel's last claim resets) equals the default grid's output bit for bit on the same inputs, called
    twice (the second call finds the counter at zero), with the grid capped at five blocks."""
    torch = pytest.importorskip("torch")
    import sandbox.torch as st
    import variants.fa3_ws as ws
    monkeypatch.setattr(ws, "sm_count", lambda: 5)
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 4, 333, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    ref = st.attention(q, k, v, variant="fa3", causal=causal, persistent=False)
    for _ in range(2):
        out = st.attention(q, k, v, variant="fa3", causal=causal, persistent=True)
        assert torch.equal(out, ref)



@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_softmax_turns_match_oracle_and_the_loop_without_them(monkeypatch, dtype):
    """softmax_turns=True orders the two consumer warpgroups' softmaxes with named barriers and changes no
    arithmetic: each case against the oracle and bit for bit against the same config without turns. Cases: d = 64
    and 128, GQA, dropout, a window, a block-sparse layout, causal with Nq > Nk (Q tiles whose walk is empty: neither
    warpgroup takes a turn there), a soft-cap with a document mask, ALiBi, sinks and a document mask at d = 64, and
    the persistent grid capped at three blocks (the turns run on across a block's items: a miscount deadlocks or
    races)."""
    import variants.fa3_ws as ws
    from sandbox import fuzz, modifiers
    from sandbox.masks import BlockSparse
    monkeypatch.setattr(ws, "sm_count", lambda: 3)
    docs = modifiers.document(np.repeat(np.arange(3), [100, 150, 50])[None])
    cases = [(fuzz.Case(2, 4, 2, 300, 300, 64, dtype, {"causal": True}, 1), {"persistent": True}),
             (fuzz.Case(1, 4, 1, 333, 200, 128, dtype, {"causal": True, "dropout_p": 0.2, "seed": 3}, 2), {}),
             (fuzz.Case(1, 2, 2, 600, 150, 128, dtype, {"causal": True}, 3), {"persistent": True}),
             (fuzz.Case(1, 2, 2, 450, 450, 64, dtype, {"window": (70, 20)}, 4), {"persistent": False}),
             (fuzz.Case(1, 2, 1, 97, 241, 128, dtype,
                        {"block_mask": BlockSparse(np.eye(4, 5, dtype=bool)[None], (25, 49))}, 5), {}),
             (fuzz.Case(1, 2, 2, 300, 300, 128, dtype, {"causal": True, "score_mod": modifiers.softcap(5.0),
                                                        "mask_mod": docs}, 6), {"persistent": True}),
             # d = 64 with modifiers, where "auto" turns them on since session 18: ALiBi (seeded), sinks, a document
             # mask (its short walks: the persistent grid)
             (fuzz.Case(2, 4, 2, 300, 300, 64, dtype, {"causal": True, "score_mod": modifiers.alibi([0.5, 0.25, 0.1,
                                                                                                       0.05])}, 7), {}),
             (fuzz.Case(1, 2, 1, 257, 300, 64, dtype, {"score_mod": modifiers.sinks([0.3, -1.0])}, 8), {}),
             (fuzz.Case(1, 2, 2, 300, 300, 64, dtype, {"causal": True, "mask_mod": docs}, 9), {"persistent": True})]
    for case, params in cases:
        turns = sandbox.get_variant("fa3", softmax_turns=True, **params)
        fuzz.assert_case(turns, case, "forward")
        q, k, v = case.inputs()[:3]
        a = sandbox.forward(q, k, v, variant="fa3", softmax_turns=True, **params, **case.options)
        b = sandbox.forward(q, k, v, variant="fa3", consumers=2, softmax_turns=False, **params, **case.options)
        assert np.array_equal(np.asarray(a.out), np.asarray(b.out), equal_nan=True), case
        assert np.array_equal(np.asarray(a.lse), np.asarray(b.lse), equal_nan=True), case


@pytest.mark.gpu
def test_persistent_calls_queued_back_to_back_leave_the_counter_at_zero(monkeypatch):
    """Persistent forwards queued on one non-blocking stream with no synchronisation between them (grids of
    3 and 5 blocks, one item to many, d = 64 and 128, fp16 and bf16, dropout): each
    launch starts where the last left the stream's item counter, so a counter not reset by the last claim would
    skip the next launch's items. Every output equals the plain grid's bit for bit (as in the torch test below)
    and the counter is zero afterwards."""
    import cupy as cp
    import variants.fa3_ws as ws
    from sandbox import fuzz, stream_counters
    cases = [(3, fuzz.Case(2, 4, 2, 500, 500, 64, "float16", {"causal": True}, 11)),
             (5, fuzz.Case(1, 1, 1, 64, 300, 128, "bfloat16", {}, 12)),            # 1 item, a grid of 1
             (3, fuzz.Case(1, 4, 2, 700, 260, 128, "float16", {"causal": True}, 13)),
             (5, fuzz.Case(2, 2, 2, 130, 130, 64, "bfloat16", {"dropout_p": 0.2, "seed": 9}, 14))]
    bound = sandbox.get_variant("fa3", persistent=True)
    dev = [tuple(cp.asarray(x) for x in case.inputs()[:3]) for _, case in cases]
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    outs = []
    with s:
        for (sms, case), (q, k, v) in zip(cases, dev):
            monkeypatch.setattr(ws, "sm_count", lambda sms=sms: sms)
            outs.append(sandbox.forward(q, k, v, variant=bound, **case.options))
    s.synchronize()
    bufs = stream_counters.of_stream(s)
    assert len(bufs) == 1 and not bool(bufs[0].any()), "the stream's item counter must be zero between launches"
    plain = sandbox.get_variant("fa3", persistent=False)
    for (_, case), (q, k, v), res in zip(cases, dev, outs):
        ref = sandbox.forward(q, k, v, variant=plain, **case.options)
        assert bool(cp.array_equal(res.out, ref.out)) and bool(cp.array_equal(res.lse, ref.lse, equal_nan=True)), case


@pytest.mark.gpu
def test_persistent_forward_in_a_torch_cuda_graph(monkeypatch):
    """A persistent forward from torch captured into a CUDA graph (the capture takes fresh zeros for its counter,
    which its launch leaves at zero for the next replay) and replayed three times with new inputs: each replay
    equals a direct call with persistent=False on the same inputs."""
    torch = pytest.importorskip("torch")
    import sandbox.torch as st
    import variants.fa3_ws as ws
    monkeypatch.setattr(ws, "sm_count", lambda: 4)
    g = torch.Generator(device="cuda").manual_seed(5)
    static = [torch.randn(2, 4, 400, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(3)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            st.attention(*static, variant="fa3", causal=True, persistent=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = st.attention(*static, variant="fa3", causal=True, persistent=True)
    for _ in range(3):
        for x in static:
            x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=g))
        graph.replay()
        ref = st.attention(*static, variant="fa3", causal=True, persistent=False)
        assert torch.equal(out, ref)

def _c_params(text: str, kernel: str) -> list[str]:
    """The C parameter types of `kernel`'s definition in `text`, MASK_PARAMS and DROPOUT_PARAMS expanded from
    common.cuh, MOD_PARAMS empty (the module without modifiers), const, __grid_constant__ and __restrict__ dropped."""
    import re
    common = loader.source_text("common.cuh").replace("\\\n", " ")
    sig = re.search(kernel + r"\((.*?)\)\s*\{", re.sub(r"//[^\n]*", "", text), re.S).group(1)
    for macro in ("MASK_PARAMS", "DROPOUT_PARAMS"):
        sig = sig.replace(macro, re.search(rf"#define {macro} ([^\n]*)", common).group(1))
    sig = sig.replace("MOD_PARAMS", "")
    out = []
    for decl in (x.strip() for x in sig.split(",")):
        if decl:
            decl = re.sub(r"\b(const|__grid_constant__|__restrict__)\b", "", decl)
            out.append(" ".join(re.sub(r"\w+$", "", decl.strip()).split()).replace(" *", "*"))
    return out


def test_forward_arguments_follow_the_kernel_signature():
    """fa3_ws_forward's arguments as the host packs them (launch and the torch plan path share _arguments, then
    the dropout arguments) against its parameter list in kernels_cu/fa3_ws.cu, type by type: a parameter added,
    dropped or moved past one of another type on one side only fails here, without a GPU."""
    from types import SimpleNamespace
    from sandbox.launch import dropout_args
    from sandbox.problem import Problem
    xp = SimpleNamespace(asarray=np.asarray, zeros=np.zeros, uint8=np.uint8,
                         cuda=SimpleNamespace(Device=lambda: SimpleNamespace(id=-1)))
    want = _c_params(loader.source_text("fa3_ws.cu"), "fa3_ws_forward")
    c_of = {np.int32: "int", np.float32: "float", np.uint32: "unsigned", np.uint64: "unsigned long long"}
    ptr_of = {"float16": "T*", "float32": "float*", "int32": "int*", "uint32": "unsigned*", "int8": "signed char*",
              "uint8": "unsigned char*"}
    for causal in (False, True):
        p = Problem(2, 4, 2, 500, 300, 64, "float16", causal=causal, dropout_p=0.1)
        bound = sandbox.get_variant("fa3")
        cfg = bound.variant.impl._resolved(p, bound.config)
        maps = tuple(SimpleNamespace(kind="TmaDesc") for _ in range(3))
        out, lse = np.empty((2, 4, 500, 64), np.float16), np.empty((2, 4, 500), np.float32)
        _, args, _, _, rest = bound.variant.impl._arguments(p, cfg, maps, out, lse, np.zeros(1, np.uint32), xp)
        got = [a.kind if isinstance(a, SimpleNamespace) else ptr_of[str(a.dtype)] if isinstance(a, np.ndarray)
               else c_of[type(a)] for a in (*args, *dropout_args(p), *rest)]
        assert got == want


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_serial_three_matches_oracle_and_fa3_ws(monkeypatch, dtype):
    """fa3's three consumers without the overlap (serial_three), taken here on small problems by counting one SM (16 Q
    tiles per SM then means 16 tiles): forward and backward against the oracle, and the forward bit for bit equal to
    fa3-ws's three consumers on the persistent grid (the same kernel). The soft-cap causal with ragged N, a relative
    bias with a window, the soft-cap with sinks, GQA and Nq != Nk, the soft-cap non-causal with a negative scale."""
    import variants.fa3_ws as ws
    from sandbox import fuzz, modifiers
    from sandbox.problem import make_problem
    monkeypatch.setattr(ws, "sm_count", lambda: 1)
    rel = modifiers.relative_bias(np.random.default_rng(3).standard_normal((4, 9)), 4)
    cases = [fuzz.Case(2, 4, 2, 700, 700, 64, dtype, {"causal": True, "score_mod": modifiers.softcap(20.0)}, 1),
             fuzz.Case(1, 4, 4, 900, 900, 64, dtype, {"window": (150, 20), "score_mod": rel}, 2),
             fuzz.Case(2, 4, 2, 500, 800, 48, dtype, {"causal": True, "score_mod": modifiers.softcap(5.0).with_sinks(
                 [0.3, -1.0, 0.0, 2.0])}, 3),
             fuzz.Case(2, 4, 4, 600, 600, 64, dtype, {"score_mod": modifiers.softcap(8.0), "scale": -0.2}, 4,
                       logit_scale=3.0)]
    fa3 = sandbox.get_variant("fa3")
    for case in cases:
        p = make_problem(*case.inputs()[:3], **case.options)
        c = fa3.variant.impl._resolved(p, fa3.config)
        assert (c.consumers, c.overlap, c.persistent) == (3, False, True), case
        fuzz.assert_case(fa3, case, "backward")
        q, k, v = case.inputs()[:3]
        a = sandbox.forward(q, k, v, variant="fa3", **case.options)
        b = sandbox.forward(q, k, v, variant="fa3-ws", consumers=3, persistent=True, **case.options)
        assert np.array_equal(np.asarray(a.out), np.asarray(b.out), equal_nan=True), case
        assert np.array_equal(np.asarray(a.lse), np.asarray(b.lse), equal_nan=True), case
