"""The single-launch packed-sequence forward of fa2-tc (sandbox/varlen.py `tables` / `_forward_single`,
variants/fa2_tc.py forward_varlen, kernels_cu/fa2_tc.cu with FA_VARLEN).

Without a GPU: the block-to-sequence table (empty sequences, Nq != Nk, lengths that are not tile
multiples, the per-sequence band, longest-first order), the kernel argument list against the
kernel's parameters, which calls take the single launch, and the NVRTC build of the new
instantiation held to the spill gate (sm_90). With a GPU (`pytest -m gpu`): the single launch
against the oracle per sequence (fp16 / bf16, causal or not, window, GQA, empty and length-1
sequences, Nq != Nk), bit-equal to the per-sequence path, gradients through sandbox.torch, and
torch tensors on a busy stream.
"""
import re

import numpy as np
import pytest

from sandbox import get_variant, loader, oracle, tolerance, varlen
from sandbox.device import has_gpu
from sandbox.masks import Band
from variants.fa2_tc import TCConfig, varlen_args

CU_Q = [0, 5, 5, 6, 140, 300, 301]          # lengths 5, 0 (empty), 1, 134, 160, 1
CU_K = [0, 9, 12, 12, 100, 400, 401]        # lengths 9, 3, 0 (no keys: dead rows), 88, 300, 1


# ---- no GPU: tables

@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (17, 3)), (True, (40, None))])
@pytest.mark.parametrize("br,bc", [(128, 64), (64, 32)])
def test_tables_cover_every_tile_once_with_each_sequences_band(causal, window, br, bc):
    seqs, blocks = varlen.tables(CU_Q, CU_K, br, bc, causal, window)
    assert seqs.dtype == np.int32 and blocks.dtype == np.int32 and seqs.shape == (6, varlen.SEQ_INTS)
    nq, nk = np.diff(CU_Q), np.diff(CU_K)
    for s in range(6):
        band = Band.from_options(int(nq[s]), int(nk[s]), causal, window)
        assert seqs[s].tolist() == [CU_Q[s], nq[s], CU_K[s], nk[s], band.lo, band.hi], s
    want = sorted((s, t) for s in range(6) for t in range(-(-int(nq[s]) // br)))   # the empty sequence: none
    assert sorted(map(tuple, blocks.tolist())) == want
    assert 1 not in blocks[:, 0] and 2 in blocks[:, 0]             # no queries: no block; no keys: its blocks


def _work(seqs, blocks, br, bc):
    out = []
    for s, t in blocks.tolist():
        q0, nq, k0, nk, lo, hi = seqs[s].tolist()
        r0, r1 = t * br, min(t * br + br, nq) - 1
        jlo, jhi = max(0, r0 + lo), min(nk - 1, r1 + hi)
        out.append(jhi // bc - jlo // bc + 1 if jlo <= jhi else 0)
    return out


def test_blocks_run_longest_band_first():
    seqs, blocks = varlen.tables(CU_Q, CU_K, 64, 32, True, None)
    work = _work(seqs, blocks, 64, 32)
    assert work == sorted(work, reverse=True) and work[-1] == 0     # the dead sequence's block last
    seqs, blocks = varlen.tables([0, 512], [0, 512], 128, 64, True, None)
    assert blocks[:, 1].tolist() == [3, 2, 1, 0]                      # causal: the bottom tile first


def test_tables_of_empty_batches_and_int32_offsets():
    seqs, blocks = varlen.tables([0, 0, 0], [0, 4, 9], 128, 64, False, None)
    assert seqs.shape == (2, 6) and blocks.shape == (0, 2)
    with pytest.raises(ValueError, match="int32"):
        varlen.tables([0, 2**31], [0, 8], 128, 64, False, None)


# ---- no GPU: the kernel's arguments, the routing, the build

def _declared(options):
    """The C types of the forward kernel's parameters once MASK_PARAMS, DROPOUT_PARAMS, MOD_PARAMS
    (empty without modifiers) and VARLEN_PARAMS (-DFA_VARLEN) are substituted."""
    src = loader.source_text("fa2_tc.cu")
    common = loader.source_text("common.cuh")
    sig = re.search(r"fa2_tc_forward\((.*?)\) \{", src, re.S).group(1)
    sig = re.sub(r"//[^\n]*", "", sig)
    macros = {"MASK_PARAMS": re.search(r"#define MASK_PARAMS (.*?)\n(?!\s)", common, re.S).group(1),
              "DROPOUT_PARAMS": re.search(r"#define DROPOUT_PARAMS (.*?)\n(?!\s)", common, re.S).group(1),
              "MOD_PARAMS": "", "VARLEN_PARAMS": re.search(r"#define VARLEN_PARAMS (.*)", src).group(1)
              if "-DFA_VARLEN" in options else ""}
    for name, body in macros.items():
        sig = sig.replace(name, body.replace("\\", " "))
    decls = [x.strip() for x in sig.split(",") if x.strip()]
    return [re.sub(r"\s*(__restrict__\s*)?\w+$", "", x).replace("const ", "").strip() for x in decls]


C_OF = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long", np.dtype(np.float32): "float",
        np.dtype(np.uint32): "unsigned", np.dtype(np.uint64): "unsigned long long"}
PTR_OF = {np.dtype(np.float16): "T*", np.dtype(np.float32): "float*", np.dtype(np.int32): "int*",
          np.dtype(np.uint8): "unsigned char*", np.dtype(np.int8): "signed char*"}


def test_varlen_arguments_match_the_kernel_parameters():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 300, 64)).astype(np.float16)
    k = rng.standard_normal((1, 2, 400, 64)).astype(np.float16)
    out, lse = np.empty((300, 4, 64), np.float16), np.empty((4, 300), np.float32)
    seqs, blocks = varlen.tables(CU_Q, CU_K, 128, 64, True, None)
    args = varlen_args(q, k, k, out, lse, seqs.ravel(), blocks.ravel(), -0.25, np.zeros(1, np.uint8))
    types = _declared(TCConfig().varlen_unit("float16", 64).options)
    got = [C_OF[np.dtype(type(a))] if isinstance(a, np.generic) else PTR_OF[a.dtype] for a in args]
    # the tile table slot (signed char*, never read: the band classifies the tiles) takes the byte dummy
    assert len(got) == len(types)
    assert all(g == t or (t, g) == ("signed char*", "unsigned char*") for g, t in zip(got, types)), (got, types)
    assert len(_declared(TCConfig().unit("float16", 64).options)) == len(types) - 2
    ints = [int(a) for a in args if isinstance(a, np.int32)]
    assert ints[:6] == [1, 4, 2, 300, 400, 64]          # tile heads, Hq, group, total_q, total_k, d


def test_uploaded_tables_keep_their_shapes():
    """The kernel's grid.x is blocks.shape[0]: the one uploaded array must come back as [S, 6] and
    [blocks, 2] views, not flat (a flat block table launched 2x the blocks; the extra half read its
    entries past the table's end and faulted on the H100 with CUDA_ERROR_INVALID_ADDRESS_SPACE)."""
    seqs, blocks = varlen.tables(CU_Q, CU_K, 128, 64, True, None)
    table = np.concatenate([seqs.ravel(), blocks.ravel()])
    s2, b2 = varlen.split_tables(table, seqs.shape, blocks.shape)
    assert np.array_equal(s2, seqs) and np.array_equal(b2, blocks) and b2.shape[0] == 7
    assert np.shares_memory(b2, table)
    e_seqs, e_blocks = varlen.tables([0, 0, 0], [0, 4, 9], 128, 64, False, None)
    _, e2 = varlen.split_tables(np.concatenate([e_seqs.ravel(), e_blocks.ravel()]), e_seqs.shape, e_blocks.shape)
    assert e2.shape == (0, 2)
    impl, q = get_variant("fa2-tc").variant.impl, np.zeros((8, 2, 64), np.float16)
    with pytest.raises(ValueError, match="blocks, 2"):
        impl.forward_varlen(q, q, q, seqs, blocks.ravel(), 0.125, TCConfig())


def test_the_single_launch_is_fa2_tcs_own_kernel():
    assert get_variant("fa2-tc").variant.impl.varlen_forward
    assert get_variant("fa2-tc-deterministic").variant.impl.varlen_forward
    for name in ("fa2-tc-naive", "fa1-tc"):
        assert not get_variant(name).variant.impl.varlen_forward, name
    units = get_variant("fa2-tc").variant.impl.compile_units(TCConfig())
    assert {u.label for u in units} >= {f"fa2-tc-varlen[{dt}, D={D}]" for dt in ("float16", "bfloat16")
                                        for D in (64, 128)}
    assert all("-DFA_VARLEN" not in u.options for u in units if "varlen" not in u.label)
    with pytest.raises(ValueError, match="fa2-tc"):
        get_variant("fa2-tc").variant.impl.varlen_tiles(TCConfig(split="k", block_r=128), 128)


def test_host_arrays_keep_the_per_sequence_path():
    q = np.zeros((8, 2, 64), np.float16)
    assert varlen._single_launch_variant(q, q, q, "fa2-tc", {}) is None


# Registers (NVRTC 13, sm_90): 240 at D = 64, 255 at D = 128, no spills (the kernels without the switch:
# 214 / 247, unchanged; their CUBINs are byte-identical to those before the switch was added).
VARLEN_BUILDS = [("float16", 64), ("bfloat16", 128)]


@pytest.fixture(scope="module")
def built():
    pytest.importorskip("cuda.bindings.nvrtc", reason="pip install .[compile] for NVRTC builds")
    if has_gpu():
        pytest.skip("compile-only check (NVRTC logs are empty under pytest on the GPU image: tests/test_compile.py)")
    units = [TCConfig().varlen_unit(*b) for b in VARLEN_BUILDS]
    loader.prebuild(units, "sm_90")
    return {u: loader.compile_only(u, "sm_90") for u in units}


@pytest.mark.parametrize("build", VARLEN_BUILDS, ids=lambda x: f"{x[0]}-{x[1]}")
def test_varlen_builds_without_spills(built, build):
    rows = built[TCConfig().varlen_unit(*build)]
    assert len(rows) == 3                      # the forward and the device sequence table's two offset types
    for r in rows:
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.registers <= 255, r


# ---- GPU: against the oracle, the per-sequence path, torch


def _torch_packed(cu_q, cu_k, hq, hkv, d, dtype, seed=0):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = getattr(torch, dtype)
    return [torch.randn(n, h, d, device="cuda", generator=g, dtype=torch.float32).to(t)
            for n, h in ((cu_q[-1], hq), (cu_k[-1], hkv), (cu_k[-1], hkv))]


def _np(x):
    import torch
    return x.float().cpu().numpy() if isinstance(x, torch.Tensor) else x.get().astype(np.float32)


def _seq(x, a, b):
    return x[a:b].transpose(1, 0, 2)[None]


GPU_CASES = [({}, 64, 4, 4), ({"causal": True}, 64, 4, 2), ({"window": (33, 5)}, 96, 4, 1),
             ({"causal": True, "window": (70, None)}, 128, 6, 2), ({"scale": -0.3}, 40, 2, 2)]


def _prebuild():
    from sandbox.device import arch
    loader.prebuild([TCConfig().varlen_unit(dt, D) for dt in ("float16", "bfloat16") for D in (64, 128)]
                    + [TCConfig().unit(dt, D) for dt in ("float16", "bfloat16") for D in (64, 128)], arch())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_single_launch_matches_oracle_and_the_per_sequence_path(dtype):
    pytest.importorskip("torch")
    _prebuild()
    for n, (opts, d, hq, hkv) in enumerate(GPU_CASES):
        q, k, v = _torch_packed(CU_Q, CU_K, hq, hkv, d, dtype, seed=n)
        out, lse = varlen.forward(q, k, v, CU_Q, CU_K, **opts)
        ref_out, ref_lse = varlen.forward(q, k, v, CU_Q, CU_K, single_launch=False, **opts)
        o, l_, qn, kn, vn = (_np(x) for x in (out, lse, q, k, v))
        assert np.array_equal(o, _np(ref_out)) and np.array_equal(l_, _np(ref_lse)), (opts, d)   # same bits
        for s in range(len(CU_Q) - 1):
            a, b, c, e = CU_Q[s], CU_Q[s + 1], CU_K[s], CU_K[s + 1]
            if a == b:
                continue
            if c == e:
                assert not o[a:b].any() and np.all(np.isneginf(l_[:, a:b])), s
                continue
            args = (_seq(qn, a, b), _seq(kn, c, e), _seq(vn, c, e))
            refs = oracle.forward(*args, **opts)
            naive = oracle.forward(*args, precision=dtype, **opts)
            for name, got, ref, nv in zip(("out", "lse"), (_seq(o, a, b), l_[:, a:b][None]), refs, naive):
                assert tolerance.compare(name, got, ref, dtype, nv).ok, (opts, d, s, name)


@pytest.mark.gpu
def test_gradients_through_the_single_launch_forward():
    """sandbox.torch.varlen_attention: the per-sequence backward consumes the single launch's out and
    lse; the same out (bits) and gradients (dQ by fp32 atomics: its order of additions may differ) as the
    per-sequence forward's."""
    torch = pytest.importorskip("torch")
    import sandbox.torch as st
    grads = []
    for single in (True, False):
        q, k, v = (x.requires_grad_() for x in _torch_packed(CU_Q, CU_K, 4, 2, 64, "float16", seed=3))
        out = st.varlen_attention(q, k, v, CU_Q, CU_K, causal=True, single_launch=single)
        out.backward(torch.ones_like(out) * 0.1)
        grads.append([x.grad.float().cpu().numpy() for x in (q, k, v)] + [out.detach().float().cpu().numpy()])
    assert np.array_equal(grads[0][3], grads[1][3])
    for a, b in zip(grads[0][:3], grads[1][:3]):
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=2e-3)


@pytest.mark.gpu
def test_torch_tensors_on_a_busy_stream():
    """Inputs written on a side stream still busy with earlier work: the table upload and the launch
    follow the caller's stream (no device synchronisation), so the result is the quiet one's."""
    torch = pytest.importorskip("torch")
    from sandbox.flash_attn import flash_attn_varlen_func
    cu = [0, 300, 301, 1000, 1700]
    q0, k0, v0 = _torch_packed(cu, cu, 8, 2, 128, "bfloat16", seed=7)
    want = flash_attn_varlen_func(q0, k0, v0, torch.tensor(cu, dtype=torch.int32), cu, 700, 700, causal=True)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)                               # ~tens of ms of busy stream
        q, k, v = (x * 1 for x in (q0, k0, v0))                      # written after the sleep
        got = flash_attn_varlen_func(q, k, v, torch.tensor(cu, dtype=torch.int32), cu, 700, 700, causal=True)
    side.synchronize()
    assert torch.equal(got, want)


# ---- GPU: offsets on the device (flash-attn's callers'), read in place

def _lens_max(cu):
    return int(np.diff(cu).max())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_device_offsets_give_the_host_tables_results(dtype, monkeypatch):
    """cu_seqlens as CUDA int32 / int64 tensors and CuPy arrays, with max_seqlen_q: the sequence table made on the
    device (fa2_varlen_seqs) and the block table of max_seqlen_q's tiles give the host tables' out and lse bit for
    bit (each row is computed by one block with the same code; only the blocks' order differs), dead rows included."""
    torch = pytest.importorskip("torch")
    import cupy as cp
    _prebuild()
    for n, (opts, d, hq, hkv) in enumerate(GPU_CASES):
        q, k, v = _torch_packed(CU_Q, CU_K, hq, hkv, d, dtype, seed=n)
        want = varlen.forward(q, k, v, CU_Q, CU_K, **opts)
        with monkeypatch.context() as m:      # the offsets must not reach the host (that path reads them there)
            m.setattr(varlen, "_lengths", lambda *a: pytest.fail("GPU offsets were copied to the host"))
            for iq, ik in ((torch.int32, torch.int32), (torch.int64, torch.int64), (torch.int32, torch.int64)):
                cq, ck = torch.tensor(CU_Q, dtype=iq, device="cuda"), torch.tensor(CU_K, dtype=ik, device="cuda")
                got = varlen.forward(q, k, v, cq, ck, _lens_max(CU_Q), _lens_max(CU_K), **opts)
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (opts, iq, ik)
            got = varlen.forward(q, k, v, cq, ck, 10 ** 9, 10 ** 9, **opts)     # a bucket size: as many blocks
            assert all(torch.equal(a, b) for a, b in zip(got, want)), opts       # as the packed rows need
            if dtype != "float16":
                continue              # CuPy holds no bfloat16 arithmetic type: the torch rows cover it
            qc, kc, vc = (cp.asarray(x) for x in (q, k, v))
            got = varlen.forward(qc, kc, vc, cp.asarray(CU_Q, dtype=cp.int32), cp.asarray(CU_K, dtype=cp.int32),
                                 _lens_max(CU_Q), _lens_max(CU_K), **opts)
            assert all(cp.array_equal(cp.asarray(a), cp.asarray(b)) for a, b in zip(got, want)), opts


@pytest.mark.gpu
def test_device_offsets_written_on_a_busy_stream_are_read_without_a_wait():
    """Offsets written on a side stream behind ~0.1 s of work: the call returns while that stream is still busy
    (nothing read them on the host), and the result is the quiet call's; through the torch autograd route, GPU
    offsets give the host offsets' out and gradients (its backward copies them to the host)."""
    torch = pytest.importorskip("torch")
    import sandbox.torch as st
    from sandbox.flash_attn import flash_attn_varlen_func
    cu = [0, 300, 301, 1000, 1700]
    q0, k0, v0 = _torch_packed(cu, cu, 8, 2, 128, "bfloat16", seed=9)
    want = flash_attn_varlen_func(q0, k0, v0, cu, cu, 700, 700, causal=True)
    base = torch.tensor(cu, dtype=torch.int32, device="cuda")
    flash_attn_varlen_func(q0, k0, v0, base, base, 700, 700, causal=True)      # every module loaded
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        cu_dev = torch.zeros_like(base)     # allocated before the sleep: a new block of the side stream's pool waits
        flash_attn_varlen_func(q0, k0, v0, base, base, 700, 700, causal=True)   # the side stream's own pools warm
        torch.cuda._sleep(200_000_000)
        cu_dev.copy_(base)                                             # the offsets are written after the sleep
        got = flash_attn_varlen_func(q0, k0, v0, cu_dev, cu_dev, 700, 700, causal=True)
        busy = not side.query()
    side.synchronize()
    assert busy, "the call waited for the stream"
    assert torch.equal(got, want)
    grads = []
    for offsets in (cu, base):
        q, k, v = (x.detach().clone().requires_grad_() for x in (q0, k0, v0))
        out = st.varlen_attention(q, k, v, offsets, offsets, 700, 700, causal=True)
        out.backward(torch.ones_like(out))
        grads.append((out.detach(), q.grad, k.grad, v.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1:], grads[1][1:]):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_device_offsets_that_break_the_contract_show_as_nan_and_stay_in_bounds():
    """Offsets the host cannot check without a wait: a max_seqlen_q below the longest sequence leaves that
    sequence's rows past it NaN (out and lse) and every other row right; offsets ending short of the packed length
    leave the tail NaN; a sequence whose offsets leave the array, decrease or reach back into an earlier one is not
    taken (its rows NaN unless a taken sequence holds them); strided GPU offsets are refused. Run under
    compute-sanitizer too (no access outside the arrays)."""
    torch = pytest.importorskip("torch")
    q, k, v = _torch_packed(CU_Q, CU_K, 4, 2, 64, "float16", seed=4)
    want_o, want_l = varlen.forward(q, k, v, CU_Q, CU_K, causal=True)
    cq, ck = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (CU_Q, CU_K))
    o, l_ = varlen.forward(q, k, v, cq, ck, 100, 300, causal=True)     # sequence 3 has 134 rows, 4 has 160
    rows = torch.zeros(CU_Q[-1], dtype=torch.bool, device="cuda")
    br = get_variant("fa2-tc").variant.impl.varlen_tiles(TCConfig(), 64)[0]
    covered = -(-100 // br) * br
    for s in range(len(CU_Q) - 1):
        rows[CU_Q[s] + covered:CU_Q[s + 1]] = True
    assert rows.any()
    assert torch.isnan(o[rows]).all() and torch.isnan(l_[:, rows]).all()
    assert torch.equal(o[~rows], want_o[~rows]) and torch.equal(l_[:, ~rows], want_l[:, ~rows])
    short = torch.tensor(CU_Q[:-1] + [CU_Q[-2]], dtype=torch.int32, device="cuda")   # the last row left out
    o, l_ = varlen.forward(q, k, v, short, ck, 300, 300, causal=True)
    assert torch.isnan(o[-1]).all() and torch.isnan(l_[:, -1]).all() and not torch.isnan(o[:-1]).any()
    # offsets out of the array or decreasing: no sequence is taken, every row NaN
    o, l_ = varlen.forward(q, k, v, torch.tensor([0, 10**6, 5, 2**31 - 1, 7, -3, 301], dtype=torch.int32,
                                                 device="cuda"), ck, 400, 400)
    assert torch.isnan(o).all() and torch.isnan(l_).all()
    # a sequence reaching back into an earlier one is not taken (no two blocks write one row): the first sequence,
    # all 301 rows against its 9 keys, is the only one taken, the others' rows are its own
    o, l_ = varlen.forward(q, k, v, torch.tensor([0, 301, 0, 301, 0, 301, 0], dtype=torch.int32, device="cuda"),
                           ck, 400, 400)
    one_o, one_l = varlen.forward(q, k[:9], v[:9], [0, 301], [0, 9])
    assert torch.equal(o, one_o) and torch.equal(l_, one_l)
    with pytest.raises(ValueError, match="contiguous"):
        varlen.forward(q, k, v, torch.tensor(CU_Q * 2, dtype=torch.int32, device="cuda")[::2], ck, 400, 400)


# ---- GPU: the backward of packed self-attention with device offsets (one call under a document mask, no wait)

CU_SELF = [3, 8, 8, 9, 143, 303, 304]      # lengths 5, 0, 1, 134, 160, 1; rows 0..2 and 304..319 outside
SELF_TOTAL = 320
CU_SELF_HOST = [0, *CU_SELF, SELF_TOTAL]    # host offsets cover the array: the outside rows as two more sequences
# Two routes to one gradient: the document backward sums dK / dV over other tiles (a 320-row problem's, not each
# sequence's) and dQ by fp32 atomics in another order, each rounded to the 16-bit dtype once; bf16's unit roundoff
# is 2^-8 = 3.9e-3 and these gradients reach magnitudes of a few units, so a few roundings of either route differ
# by up to ~2e-2 (the per-sequence route's own repeats differ by less: the single-launch test's 1e-2 / 2e-3)
ROUTES_RTOL = ROUTES_ATOL = 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_self_attention_backward_with_device_offsets_matches_the_per_sequence_one(dtype, monkeypatch):
    """cu_seqlens_q and cu_seqlens_k one CUDA array: the backward is one call under a document mask whose ids are
    made on the device (the offsets never reach the host: _lengths fails the test), with the per-sequence
    backward's gradients (host offsets); rows outside cu[0] .. cu[S], NaN in q, k, v and dout and in the device
    forward's out and lse, get zero gradients and leave every other gradient finite. int32 and int64 offsets, torch
    and CuPy arrays."""
    torch = pytest.importorskip("torch")
    import cupy as cp
    g = torch.Generator(device="cuda").manual_seed(11)
    t = getattr(torch, dtype)
    longest = _lens_max(CU_SELF)
    inside = torch.zeros(SELF_TOTAL, dtype=torch.bool, device="cuda")
    inside[CU_SELF[0]:CU_SELF[-1]] = True
    for opts, d, hq, hkv in [({"causal": True}, 64, 4, 2), ({}, 128, 4, 4), ({"causal": True, "window": (17, 3)}, 64, 2, 1)]:
        q, k, v, dout = (torch.randn(SELF_TOTAL, h, d, device="cuda", generator=g).to(t) for h in (hq, hkv, hkv, hq))
        for x in (q, k, v, dout):
            x[~inside] = float("nan")          # padding as torch.empty may leave it: must not reach the others
        out, lse = varlen.forward(q, k, v, CU_SELF_HOST, CU_SELF_HOST, **opts)
        want = varlen.backward(dout, q, k, v, out, lse, CU_SELF_HOST, CU_SELF_HOST, **opts)
        for it in (torch.int32, torch.int64):
            cu = torch.tensor(CU_SELF, dtype=it, device="cuda")
            out_d, lse_d = varlen.forward(q, k, v, cu, cu, longest, longest, **opts)
            assert torch.isnan(out_d[~inside]).all()                    # the device forward's outside rows
            with monkeypatch.context() as m:
                m.setattr(varlen, "_lengths", lambda *a: pytest.fail("GPU offsets were copied to the host"))
                got = varlen.backward(dout, q, k, v, out_d, lse_d, cu, cu, longest, longest, **opts)
            for a, b in zip(got, want):
                assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
                assert torch.isfinite(a).all(), (opts, it)
                assert not a[~inside].any(), (opts, it)                  # outside rows: zero
                torch.testing.assert_close(a[inside].float(), b[inside].float(), rtol=ROUTES_RTOL, atol=ROUTES_ATOL)
        if dtype == "float16":                 # CuPy arrays take the same route
            cu = cp.asarray(CU_SELF, dtype=cp.int32)
            qc, kc, vc, dc = (cp.asarray(x) for x in (q, k, v, dout))
            oc, lc = varlen.forward(qc, kc, vc, cu, cu, longest, longest, **opts)
            with monkeypatch.context() as m:
                m.setattr(varlen, "_lengths", lambda *a: pytest.fail("GPU offsets were copied to the host"))
                got = varlen.backward(dc, qc, kc, vc, oc, lc, cu, cu, longest, longest, **opts)
            rows = inside.cpu().numpy()
            for a, b in zip(got, want):
                np.testing.assert_allclose(_np(a)[rows], _np(b)[rows], rtol=ROUTES_RTOL, atol=ROUTES_ATOL)
                assert not _np(a)[~rows].any()


@pytest.mark.gpu
def test_self_attention_backward_with_device_offsets_waits_for_nothing():
    """Offsets written on a side stream behind ~0.1 s of work, one array for queries and keys: forward and backward
    (through sandbox.torch's autograd) return while the stream is still busy, with the quiet call's gradients.
    Two equal arrays (not one) take the per-sequence backward, which waits."""
    torch = pytest.importorskip("torch")
    import sandbox.torch as st
    cu = [0, 300, 301, 1000, 1700]
    q0, k0, v0 = _torch_packed(cu, cu, 8, 2, 128, "bfloat16", seed=12)
    base = torch.tensor(cu, dtype=torch.int32, device="cuda")

    def step(offsets, offsets_k=None, gain=1.0):
        q, k, v = ((gain * x).detach().requires_grad_() for x in (q0, k0, v0))
        out = st.varlen_attention(q, k, v, offsets, offsets if offsets_k is None else offsets_k, 700, 700, causal=True)
        out.backward(torch.ones_like(out))
        return q.grad, k.grad, v.grad

    want = step(cu)
    step(base)                                                     # every module and table kernel loaded
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        cu_dev = torch.zeros_like(base)
        # the side stream's pools warm, with other gradients: a copy of the result that raced the backward on another
        # stream (or from another pool) would read these instead (review, session 16)
        step(base, gain=0.5)
        torch.cuda._sleep(200_000_000)
        slept = torch.cuda.Event()
        slept.record(side)                                         # done when the sleep is: whether the host waited
        cu_dev.copy_(base)
        got = step(cu_dev)
        waited = slept.query()
    side.synchronize()
    assert not waited, "the forward or the backward waited for the stream"
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        slept = torch.cuda.Event()
        slept.record(side)
        step(base, base.clone())                                   # two arrays: the per-sequence backward
        # (not side.query(): the kernels queued after its host copy may still run, on a GPU other processes share)
        waited = slept.query()
    side.synchronize()
    assert waited, "two offsets arrays were expected to take the per-sequence backward (a host copy)"


def test_copy_width_divides_every_row_and_pointer():
    assert varlen._copy_width((4096, 1024, 256, 512)) == 16
    assert varlen._copy_width((4096, 1032, 256)) == 8                # a row of 129 x 8 bytes
    assert varlen._copy_width((4096, 1024, 256 + 4)) == 4            # one pointer 4-byte aligned
    assert varlen._copy_width((6, 1024)) == 2                         # a row of three fp16 values
    assert varlen._rows_kernel(np.dtype("int64"), 16) == "document_rows<long long, uint4>"
    assert varlen._rows_kernel(np.dtype("int32"), 2) in varlen.rows_unit().names


@pytest.mark.gpu
def test_document_inputs_from_device_offsets():
    """The document backward's one-launch preparation (kernels_cu/varlen_rows.cu) against a NumPy model: ids from
    searchsorted inside cu[0] .. cu[S] (-1 / S for queries, -2 / S + 1 for keys outside), lse -inf and q, out, dout
    zeroed in rows outside or with a NaN lse, k and v zeroed outside, NaN padding gone, bits kept elsewhere; empty
    sequences, int32 and int64 offsets, S = 1, GQA head counts, rows of every copy width, float16 / float32 and
    strided inputs."""
    import cupy as cp
    rng = np.random.default_rng(8)
    for case in range(40):
        S = int(rng.integers(1, 9))
        m = int(rng.integers(0, 300))
        cu = np.concatenate([[0], np.sort(rng.integers(0, m + 1, S - 1)), [m]]) + int(rng.integers(0, 9))
        n = int(cu[-1]) + int(rng.integers(0, 9))
        hq, hkv = [(4, 2), (3, 3), (1, 1), (8, 1)][case % 4]
        d = [64, 3, 4, 40, 128][case % 5]
        dt = np.float32 if case % 3 == 0 else np.float16
        t = np.arange(n)
        qid = np.where(t < cu[0], -1, np.where(t >= cu[-1], S, np.searchsorted(cu[1:], t, side="right")))
        kid = np.where(t < cu[0], -2, np.where(t >= cu[-1], S + 1, qid))
        host = {nm: rng.standard_normal((n, h, d)).astype(dt) for nm, h in
                (("q", hq), ("out", hq), ("dout", hq), ("k", hkv), ("v", hkv))}
        for x in host.values():
            x[(qid < 0) | (qid >= S)] = np.nan                       # padding as torch.empty may leave it
        lse = rng.standard_normal((hq, n)).astype(np.float32)
        nan_rows = rng.random(n) < 0.1
        lse[int(rng.integers(0, hq)), nan_rows] = np.nan
        dev = {nm: cp.asarray(x) for nm, x in host.items()}
        if case % 4 == 1:                                             # a strided q: every other head of a wider one
            dev["q"] = cp.repeat(dev["q"], 2, axis=1)[:, ::2]
        c = cp.asarray(cu, dtype=cp.int64 if case % 2 else cp.int32)
        ys, q_ids, k_ids, lse_c = varlen.document_inputs(c, dev["q"], dev["out"], dev["dout"], dev["k"], dev["v"],
                                                         cp.asarray(lse))
        keep_q = (qid >= 0) & (qid < S) & ~nan_rows
        keep_k = (kid >= 0) & (kid < S)
        assert q_ids.dtype == k_ids.dtype == cp.int32
        assert np.array_equal(cp.asnumpy(q_ids), qid) and np.array_equal(cp.asnumpy(k_ids), kid), (cu, n)
        want_lse = np.where(keep_q[None], lse, -np.inf)
        assert np.array_equal(cp.asnumpy(lse_c), want_lse, equal_nan=False), (cu, n)
        for y, nm in zip(ys, ("q", "out", "dout", "k", "v")):
            keep = keep_k if nm in ("k", "v") else keep_q
            want = np.where(keep[:, None, None], host[nm], dt(0))
            got = cp.asnumpy(y)
            assert y.dtype == dt and y.flags.c_contiguous and got.shape == want.shape, nm
            assert np.array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}")), (nm, cu, n)


@pytest.mark.gpu
def test_self_attention_backward_outside_its_envelope():
    """The document backward's edges: a too-small max_seqlen_q leaves NaN rows in the forward (a broken contract),
    which get zero gradients and do not reach the intact sequences' (equal to the per-sequence backward's); one
    offsets array with q and k of different packed lengths is not packed self-attention (the per-sequence backward
    refuses it on the host); strided and int16 GPU offsets take the per-sequence backward."""
    torch = pytest.importorskip("torch")
    cu = [0, 5, 5, 6, 140, 300, 301]           # sequences 3 and 4 (134 and 160 rows) pass max_seqlen_q = 100
    q, k, v = _torch_packed(cu, cu, 4, 2, 64, "float16", seed=13)
    dout = torch.randn_like(q)
    out, lse = varlen.forward(q, k, v, cu, cu, causal=True)
    want = varlen.backward(dout, q, k, v, out, lse, cu, cu, causal=True)
    dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    out_d, lse_d = varlen.forward(q, k, v, dev, dev, 100, 100, causal=True)
    assert torch.isnan(out_d[140:]).any()
    got = varlen.backward(dout, q, k, v, out_d, lse_d, dev, dev, 100, 100, causal=True)
    intact = torch.zeros(cu[-1], dtype=torch.bool, device="cuda")
    for a, b in ((0, 5), (5, 6), (300, 301)):
        intact[a:b] = True
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a[intact].float(), b[intact].float(), rtol=ROUTES_RTOL, atol=ROUTES_ATOL)
    q2 = torch.cat([q, q[:10]])                # 311 query rows against 301 key rows, one offsets array
    with pytest.raises(ValueError):
        varlen.backward(torch.cat([dout, dout[:10]]), q2, k, v, torch.cat([out, out[:10]]),
                        torch.cat([lse, lse[:, :10]], 1), dev, dev, 400, 400, causal=True)
    strided = torch.tensor([x for c_ in cu for x in (c_, -1)], dtype=torch.int32, device="cuda")[::2]
    for offsets in (strided, dev.to(torch.int16)):
        got = varlen.backward(dout, q, k, v, out, lse, offsets, offsets, 400, 400, causal=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=2e-3)   # dQ: fp32 atomics


@pytest.mark.gpu
def test_the_one_call_backward_takes_the_api_default_variant(monkeypatch):
    """variant=None: the one-call backward of packed self-attention runs api.default_variant's backward (fa3 on an
    sm_90 GPU: its wgmma backward under the document mask, 34-60% less time than fa2-tc's on the H100), while a named
    variant is kept; the gradients of both agree with the per-sequence backward's."""
    torch = pytest.importorskip("torch")
    from sandbox import api
    cu = [0, 5, 5, 6, 140, 300, 301]
    q, k, v = _torch_packed(cu, cu, 4, 2, 64, "bfloat16", seed=21)
    dout = torch.randn_like(q)
    out, lse = varlen.forward(q, k, v, cu, cu, causal=True)
    want = varlen.backward(dout, q, k, v, out, lse, cu, cu, causal=True)
    dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    seen, real = [], api.backward
    monkeypatch.setattr(varlen.api, "backward", lambda *a, **kw: seen.append(kw["variant"]) or real(*a, **kw))
    for variant, expect in ((None, api.default_variant(q)), ("fa2-tc", "fa2-tc")):
        seen.clear()
        got = varlen.backward(dout, q, k, v, out, lse, dev, dev, 300, 300, variant=variant, causal=True)
        assert seen == [expect], (variant, seen)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), rtol=ROUTES_RTOL, atol=ROUTES_ATOL)
