"""sandbox.decode on the CPU (a Numba variant under the simulator) against the oracle: contiguous and
paged caches, keys appended in place, the key range split and merged by log-sum-exp, causal decoding."""
import numpy as np
import pytest

from sandbox import decode, oracle, tolerance

VARIANT = "numba-rowwise"
B, HQ, HKV, D, PAGE = 3, 4, 2, 8, 4


def _case(nq, lens, nnew, paged, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    full_k, full_v = f(B, HKV, 24, D), f(B, HKV, 24, D)       # each sequence's keys, for the reference
    q, k_new, v_new = f(B, HQ, nq, D), f(B, HKV, nnew, D), f(B, HKV, nnew, D)
    for b, n in enumerate(lens):
        full_k[b, :, n:n + nnew], full_v[b, :, n:n + nnew] = k_new[b], v_new[b]
    if not paged:
        k_cache, v_cache = full_k.copy(), full_v.copy()
        for b, n in enumerate(lens):
            k_cache[b, :, n:n + nnew] = v_cache[b, :, n:n + nnew] = 7.0     # overwritten by the append
            k_cache[b, :, n + nnew:] = v_cache[b, :, n + nnew:] = np.nan     # past the sequence: never read
        return q, k_new, v_new, k_cache, v_cache, None, full_k, full_v
    pages = rng.permutation(B * 6).reshape(B, 6)               # 6 pages of 4 keys per sequence, shuffled
    k_cache = np.full((B * 6, HKV, PAGE, D), np.nan, np.float32)
    v_cache = k_cache.copy()
    for b, n in enumerate(lens):
        for pos in range(n):
            k_cache[pages[b, pos // PAGE], :, pos % PAGE] = full_k[b, :, pos]
            v_cache[pages[b, pos // PAGE], :, pos % PAGE] = full_v[b, :, pos]
    return q, k_new, v_new, k_cache, v_cache, pages, full_k, full_v


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("causal,nq,splits", [(False, 1, 1), (False, 1, 3), (True, 3, 3)])
def test_decode_matches_the_oracle(paged, causal, nq, splits):
    lens, nnew = [0, 5, 13], 2
    q, k_new, v_new, kc, vc, pages, full_k, full_v = _case(nq, lens, nnew, paged)
    out, lse = decode.forward(q, kc, vc, lens, block_table=pages, k_new=k_new, v_new=v_new, causal=causal,
                              num_splits=splits, variant=VARIANT)
    assert out.shape == q.shape and lse.shape == (B, HQ, nq) and lse.dtype == np.float32
    for b, n in enumerate(lens):
        L = n + nnew
        ref_out, ref_lse = oracle.forward(q[b:b + 1], full_k[b:b + 1, :, :L], full_v[b:b + 1, :, :L], causal=causal)
        assert tolerance.compare("out", out[b:b + 1], ref_out, "float32").ok, b
        assert tolerance.compare("lse", lse[b:b + 1], ref_lse, "float32").ok, b


def test_append_writes_in_place():
    lens = [0, 5, 13]
    q, k_new, v_new, kc, vc, pages, full_k, _ = _case(1, lens, 2, paged=True)
    decode.forward(q, kc, vc, lens, block_table=pages, k_new=k_new, v_new=v_new, variant=VARIANT)
    for b, n in enumerate(lens):
        for t in range(2):
            pos = n + t
            np.testing.assert_array_equal(kc[pages[b, pos // PAGE], :, pos % PAGE], k_new[b, :, t])


def test_merge_of_key_splits_and_of_nothing():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 3, 8)) for _ in range(3))
    full = oracle.forward(q, k, v)
    parts = [oracle.forward(q, k[:, :, :1], v[:, :, :1]), oracle.forward(q, k[:, :, 1:], v[:, :, 1:])]
    out, lse = decode.merge([p[0] for p in parts], [p[1] for p in parts])
    np.testing.assert_allclose(out, full[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, full[1], rtol=1e-5, atol=1e-6)
    dead = np.full((1, 2, 3), -np.inf)
    out, lse = decode.merge([np.ones((1, 2, 3, 8)), np.ones((1, 2, 3, 8))], [dead, dead])
    assert not out.any() and np.all(np.isneginf(lse))


@pytest.mark.parametrize("kwargs,err,match", [
    ({"cache_seqlens": [0, 1]}, ValueError, "cache_seqlens"),
    ({"cache_seqlens": [0, 1, 23]}, ValueError, "room"),
    ({"num_splits": 0}, ValueError, "num_splits"),
    ({"k_new": np.zeros((B, HKV, 1, D), np.float32)}, ValueError, "k_new and v_new"),
])
def test_checks(kwargs, err, match):
    q, k_new, v_new, kc, vc, _, _, _ = _case(1, [0, 5, 13], 2, paged=False)
    args = {"cache_seqlens": [0, 5, 13], "k_new": k_new, "v_new": v_new, **kwargs}
    if "k_new" in kwargs:
        args["v_new"] = None
    with pytest.raises(err, match=match):
        decode.forward(q, kc, vc, variant=VARIANT, **args)


def test_refusals_leave_the_cache_untouched():
    """A request refused for any reason (a variant that lacks the dtype, dropout, a modifier, new keys of
    the wrong shape) raises before the new keys are written."""
    from sandbox import modifiers
    q, k_new, v_new, kc, vc, _, _, _ = _case(1, [0, 5, 13], 2, paged=False)
    before = kc.copy()
    bad = [({"variant": "fa2-tc"}, "float16"), ({"variant": VARIANT, "dropout_p": 0.1}, "dropout_p"),
           ({"variant": VARIANT, "score_mod": modifiers.softcap(5.0)}, "score_mod"),
           ({"variant": VARIANT, "k_new": k_new[:, :1], "v_new": v_new[:, :1]}, "k_new")]
    for kwargs, match in bad:
        args = {"k_new": k_new, "v_new": v_new, **kwargs}
        with pytest.raises((ValueError, TypeError), match=match):
            decode.forward(q, kc, vc, [0, 5, 13], **args)
        np.testing.assert_array_equal(kc, before)


def test_nan_propagates_and_padding_pages_are_ignored():
    q, k_new, v_new, kc, vc, pages, _, _ = _case(1, [0, 5, 13], 2, paged=True)
    pages = pages.copy()
    pages[0, 1:] = -1                                   # sequence 0 uses one page (2 keys); the rest is padding
    q[1, 0, 0, 0] = np.nan
    out, lse = decode.forward(q, kc, vc, [0, 5, 13], block_table=pages, k_new=k_new, v_new=v_new, num_splits=2,
                              variant=VARIANT)
    assert np.isnan(out[1, 0, 0]).all() and np.isnan(lse[1, 0, 0])
    assert np.isfinite(lse[0]).all() and np.isfinite(lse[2]).all()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("causal,window,nq", [(False, (2, 0), 1), (True, (3, None), 3), (False, (4, 1), 2),
                                              (False, (-1, 3), 2)])
def test_window_matches_the_oracle_across_splits(paged, causal, window, nq):
    """A window (bottom-right aligned per sequence) survives the split into chunks: each chunk gets
    the sequence's band moved by its distance from the end (decode._chunk_window)."""
    lens, nnew = [0, 5, 13], 2
    q, k_new, v_new, kc, vc, pages, full_k, full_v = _case(nq, lens, nnew, paged, seed=2)
    out, lse = decode.forward(q, kc, vc, lens, block_table=pages, k_new=k_new, v_new=v_new, causal=causal,
                              window=window, num_splits=3, variant=VARIANT)
    for b, n in enumerate(lens):
        L = n + nnew
        ref_out, ref_lse = oracle.forward(q[b:b + 1], full_k[b:b + 1, :, :L], full_v[b:b + 1, :, :L], causal=causal,
                                          window=window)
        assert tolerance.compare("out", out[b:b + 1], ref_out, "float32").ok, b
        assert tolerance.compare("lse", lse[b:b + 1], ref_lse, "float32").ok, b


# ---- the kernel's host side (no GPU): split planning, envelope, compile units

@pytest.mark.parametrize("B,Hkv,rows,d,max_len", [(1, 8, 4, 128, 262144), (1, 8, 4, 128, 4096), (64, 8, 4, 128, 4096),
                                                  (8, 8, 4, 128, 65536), (3, 2, 64, 64, 1000), (2, 1, 13, 256, 77),
                                                  (1, 1, 1, 64, 1), (5, 4, 8, 128, 0)])
def test_plan_splits_covers_every_key_once(B, Hkv, rows, d, max_len):
    S, chunk = decode.plan_splits(B, Hkv, rows, d, max_len, sm_count=132)
    per_iter = decode.keys_per_iter(d, decode.row_tile(rows))
    assert 1 <= S <= decode.MAX_SPLITS and chunk % per_iter == 0 and chunk >= 1
    if max_len:
        assert (S - 1) * chunk < max_len <= S * chunk          # no empty split for the longest sequence
        assert S == 1 or chunk >= min(decode.MIN_KEYS_PER_SPLIT, max_len) - per_iter
    blocks = B * Hkv * -(-rows // decode.row_tile(rows)) * S
    # the GPU is filled, unless the splits are already as short as allowed (or as many)
    slots = decode.wave_blocks_per_sm(None) * 132
    assert (blocks >= 0.9 * slots or chunk < 2 * decode.MIN_KEYS_PER_SPLIT + per_iter or S == decode.MAX_SPLITS)
    # every wave of resident blocks at least 3/4 full once there are enough keys to split
    if max_len >= 32768:
        assert blocks / (-(-blocks // slots) * slots) >= 0.75
    assert decode.plan_splits(B, Hkv, rows, d, max_len, 132, num_splits=2)[0] <= 2


def test_plan_splits_fills_whole_waves():
    # B = 1, Hkv = 8, N = 256k on 132 SMs: the first plan (66 splits, 528 blocks at 3 per SM) left a last
    # wave of 132 blocks on 396 slots; a wave is now 2 blocks per SM, whatever the occupancy above it
    S, _ = decode.plan_splits(1, 8, 4, 128, 1 << 18, sm_count=132, blocks_per_sm=4)
    assert 8 * S / (-(-8 * S // 264) * 264) >= 0.95
    assert decode.wave_blocks_per_sm(1) == 1 and decode.wave_blocks_per_sm(4) == 2
    assert decode.wave_blocks_per_sm(None) == 2          # BLOCKS_PER_SM_TARGET (3) capped
    # a kernel with one resident block per SM plans waves of one
    S1, _ = decode.plan_splits(1, 8, 4, 128, 1 << 18, sm_count=132, blocks_per_sm=1)
    assert 8 * S1 / (-(-8 * S1 // 132) * 132) >= 0.95 and S1 < S
    assert decode.keys_per_iter(128, 4, 0) == 32 and decode.keys_per_iter(128, 4, 1) == 16


@pytest.mark.parametrize("B,N,best", [(8, 1 << 15, 4), (8, 1 << 16, 4), (8, 1 << 18, 4), (1, 1 << 15, 33),
                                      (1, 1 << 18, 33), (64, 4096, 1), (64, 1 << 15, 1)])
def test_plan_splits_pins_the_swept_choices(B, N, best):
    """The plan at the points of the H100 sweep (session 11: Nq = 1, Hq 32 / Hkv 8, d = 128, the kernel's 4
    resident blocks per SM): one wave of long splits at 2 blocks per SM, each choice the fastest measured or
    within 1% of it (B = 1, 32k: 33 at 0.0677 ms, 32 at 0.0673; B = 64: one split, 1.10-1.17x SDPA flash)."""
    assert decode.plan_splits(B, 8, 4, 128, N, sm_count=132, blocks_per_sm=4)[0] == best


def test_resident_blocks():
    class K:
        num_regs, shared_size_bytes = 128, 32848
    assert decode.resident_blocks(K) == 4
    K.num_regs, K.shared_size_bytes = 168, 2128
    assert decode.resident_blocks(K) == 3
    assert decode.resident_blocks(object()) is None


def test_plan_splits_follows_the_sm_count():
    small = decode.plan_splits(1, 8, 4, 128, 1 << 18, sm_count=16)[0]
    large = decode.plan_splits(1, 8, 4, 128, 1 << 18, sm_count=132)[0]
    assert small < large


def test_row_tiles_and_refusals():
    assert [decode.row_tile(r) for r in (1, 4, 5, 8, 9, 16, 17, 64)] == [4, 4, 8, 8, 16, 16, 16, 16]
    assert decode.kernel_refusal("float16", 128, 16) is None
    assert "dtype" in decode.kernel_refusal("float32", 128, 1)
    assert "head dim" in decode.kernel_refusal("bfloat16", 96, 1)
    assert "Nq=17" in decode.kernel_refusal("float16", 64, 17)
    assert decode.relative_band(True, None) == (-(1 << 30), 0)
    assert decode.relative_band(False, (5, 2)) == (-5, 2)
    assert decode._chunk_window(-(1 << 30), 0, 7) == (None, 7)
    assert decode._chunk_window(-(1 << 30), 1 << 30, 7) is None


def test_compile_units_name_every_instantiation():
    names = {n for u in decode.compile_units() for n in u.names}
    for t in ("__half", "__nv_bfloat16"):
        for d in decode.KERNEL_HEAD_DIMS:
            assert f"decode_merge<{t}, {d}>" in names
            assert {f"decode_splitkv<{t}, {d}, {r}, 0>" for r in decode.ROW_TILES} <= names
            assert {f"decode_splitkv<{t}, {d}, {r}, 1>" for r in decode.ROW_TILES if r < 16} <= names
    from sandbox import compile_report
    gated = {(v, n) for v, _, u in compile_report.units(gate=True) for n in u.names}
    assert {("decode-splitkv", n) for n in names} <= gated


def test_kernel_path_refuses_page_sizes_before_touching_anything():
    """The kernel's page-size check runs before any device work, with the parameter named."""
    q = np.zeros((1, 4, 1, 64), np.float16)
    kc = np.zeros((4, 2, 24, 64), np.float16)
    with pytest.raises(ValueError, match="page_size=24"):
        decode._forward_kernel(q, kc, kc.copy(), np.array([30]), 0, np.array([[0, 1, 2, 3]]), None, None, False,
                               0.125, None, None, kc[:1, :, :1], kc[:1, :, :1])


def test_kernel_path_checks_v_caches_dtype_before_touching_anything():
    """A v_cache of another dtype than k_cache is refused by name, not read as k's dtype by the kernel."""
    q = np.zeros((1, 4, 1, 64), np.float16)
    kc = np.zeros((1, 2, 32, 64), np.float16)
    vc = np.zeros((1, 2, 32, 64), np.float32)
    with pytest.raises(ValueError, match="dtype"):
        decode._forward_kernel(q, kc, vc, np.array([30]), 0, None, None, None, False, 0.125, None, None,
                               kc[:1, :, :1], vc[:1, :, :1])
    with pytest.raises(ValueError, match="dtype"):
        decode.forward(q, kc, vc, [30], variant="numba-rowwise")


@pytest.mark.skipif(not __import__("sandbox.device", fromlist=["x"]).has_gpu(), reason="needs CuPy on a GPU")
def test_kernel_path_refuses_a_cache_on_the_host_by_name():
    import cupy as cp
    q = cp.zeros((1, 4, 1, 64), cp.float16)
    kc = cp.zeros((1, 2, 32, 64), cp.float16)
    with pytest.raises(ValueError, match="v_cache"):
        decode.forward(q, kc, np.zeros((1, 2, 32, 64), np.float16), [30])


def test_variant_refuses_more_than_16_rows_and_is_listed():
    import sandbox
    from sandbox.problem import make_problem
    bound = sandbox.get_variant("decode-splitkv")
    q, k = np.zeros((1, 4, 17, 64), np.float16), np.zeros((1, 2, 40, 64), np.float16)
    with pytest.raises(ValueError, match=r"Nq=17 query rows \(max_query_rows=16\)"):
        bound.check(make_problem(q, k, k), "forward")
    assert bound.variant.caps.max_query_rows == decode.KERNEL_MAX_NQ == 16
    with pytest.raises(ValueError, match="float32"):
        bound.check(make_problem(q[:, :, :3].astype(np.float32), k.astype(np.float32), k.astype(np.float32)))
    bound.check(make_problem(q[:, :, :16], k, k, causal=True, window=(8, 0)))
    row = next(r for r in sandbox.variants() if r["name"] == "decode-splitkv")
    assert row["tags"] == ["decode"] and row["capabilities"]["backward"] is False
    assert row["capabilities"]["max_query_rows"] == 16
    assert all(r["capabilities"]["max_query_rows"] is None for r in sandbox.variants() if r["name"] != "decode-splitkv")


def test_fuzz_draws_query_rows_within_max_query_rows():
    """The registry-wide fuzz (tests/test_gpu_variants.py) draws Nq <= max_query_rows for a variant
    that has one, keys of any length; every drawn case passes the variant's checks."""
    from hypothesis import given, settings
    import sandbox
    from sandbox import fuzz
    from sandbox.problem import make_problem
    bound = sandbox.get_variant("decode-splitkv")
    seen = set()

    @settings(max_examples=150, database=None, derandomize=True)
    @given(fuzz.cases(bound, "float16"))
    def draw(case):
        assert 1 <= case.Nq <= 16
        q = np.zeros((case.B, case.Hq, case.Nq, case.d), np.float16)
        k = np.zeros((case.B, case.Hkv, case.Nk, case.d), np.float16)
        bound.check(make_problem(q, k, k, **case.options), "forward")
        seen.add((case.Nq, case.Nk > 16))
    draw()
    assert {n for n, _ in seen} >= {1, 16} and any(long for _, long in seen)


def test_oracle_verdicts_use_the_same_precision_naive():
    """The GPU tests' comparison (decode.oracle_verdicts): 16-bit results under the tensor-core tier
    with the oracle in the kernel's precision as the naive reference (tolerance.compare refuses a
    16-bit comparison without one); the oracle's answer rounded to the dtype passes, and an answer
    off by a few ulps of its magnitude fails."""
    from sandbox.precision import EPS, numpy_dtype
    rng = np.random.default_rng(3)
    for dtype in ("float16", "bfloat16"):
        npdt = numpy_dtype(dtype)
        q = rng.standard_normal((1, 8, 3, 64)).astype(npdt)
        k, v = (rng.standard_normal((1, 2, 300, 64)).astype(npdt) for _ in range(2))
        ref_o, ref_l = oracle.forward(q, k, v, causal=True, window=(100, None))
        good = decode.oracle_verdicts(ref_o.astype(npdt), ref_l.astype(np.float32), q, k, v, dtype, True, (100, None))
        assert [v_.name for v_ in good] == ["out", "lse"] and all(v_.ok for v_ in good), good
        bad_o = ref_o + 8 * EPS[dtype] * np.abs(ref_o).max()
        bad = decode.oracle_verdicts(bad_o.astype(npdt), ref_l.astype(np.float32), q, k, v, dtype, True, (100, None))
        assert not bad[0].ok and bad[1].ok
    with pytest.raises(ValueError, match="naive"):
        tolerance.compare("out", ref_o, ref_o, "bfloat16")


# ---- the one-launch kernel's host side: uploads, arrival counters, the transposed reduction's algebra

def test_device_ints_make_at_most_one_upload():
    """Equal lengths go by value (no lengths array); ragged lengths are one upload; a paged call's
    lengths and block table share one upload (views of it), with padding clipped into int32."""
    calls = []

    def upload(a):
        calls.append(np.array(a))
        return np.asarray(a, np.int32).copy()
    assert decode._device_ints(np.array([7, 7, 7]), None, upload) == (None, None, 7) and not calls
    lens, table, uni = decode._device_ints(np.array([7, 0, 9]), None, upload)
    assert uni is None and table is None and lens.tolist() == [7, 0, 9] and len(calls) == 1
    calls.clear()
    t = np.array([[3, 1, 2**40], [0, 2, -5]])
    lens, table, uni = decode._device_ints(np.array([40, 90]), t, upload)
    assert len(calls) == 1 and uni is None and lens.tolist() == [40, 90]
    assert table.shape == (2, 3) and table.tolist() == [[3, 1, 2**31 - 1], [0, 2, -1]]
    calls.clear()
    lens, table, uni = decode._device_ints(np.array([64, 64]), t, upload)
    assert lens is None and uni == 64 and len(calls) == 1 and table.shape == (2, 3)


def _transpose_reduce(v, nv, m, lane):
    """NumPy model of decode_splitkv.cu's transpose_reduce over the lanes of one warp (v: list of
    per-lane arrays of 32)."""
    if m < 1:
        return v
    v = list(v)
    if nv > 1:
        up = (lane & m) != 0
        for i in range(nv // 2):
            send = np.where(up, v[i], v[i + nv // 2])
            keep = np.where(up, v[i + nv // 2], v[i])
            v[i] = keep + send[lane ^ m]
        return _transpose_reduce(v, nv // 2, m // 2, lane)
    v[0] = v[0] + v[0][lane ^ m]
    return _transpose_reduce(v, 1, m // 2, lane)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("rows", [4, 8, 16])
def test_transposed_reduction_gives_each_lane_its_rows(d, rows):
    """The kernel's per-key dot products: ROWS partial sums per lane reduced over the d / 8 lanes of
    a key with one shuffle per kept value per level; afterwards lane c of a key group holds the full
    dot products of rows own_row(c, i), and the lane the kernel broadcasts row r's p from
    (key group base + r * REPLICAS, or + r / NV, value r % NV) holds row r."""
    lpk = d // 8
    nv = rows // lpk if rows > lpk else 1
    rep = lpk // rows if rows < lpk else 1
    lane = np.arange(32)
    rng = np.random.default_rng(rows * d)
    part = rng.integers(-50, 50, size=(rows, 32)).astype(np.float64)       # exact sums
    got = _transpose_reduce([part[r] for r in range(rows)], rows, lpk // 2, lane)
    own = lambda c, i: c // rep if rows <= lpk else c * nv + i  # noqa: E731
    for ln in range(32):
        group = slice(ln - ln % lpk, ln - ln % lpk + lpk)
        for i in range(nv):
            assert got[i][ln] == part[own(ln % lpk, i), group].sum(), (ln, i)
    for r in range(rows):
        for kgb in range(0, 32, lpk):
            src = kgb + (r * rep if rows <= lpk else r // nv)
            assert own(src % lpk, 0 if rows <= lpk else r % nv) == r
