"""The split-KV decoding kernel (kernels_cu/decode_splitkv.cu) on the GPU against the float64 oracle
under the tolerance rule, with the oracle in the kernel's precision as the naive reference as for
every 16-bit variant (decode.oracle_verdicts, per sequence over its own keys):
sandbox.decode's kernel path (contiguous and paged caches, GQA, Nq 1-16, page sizes 16-256, ragged
cache lengths with empty sequences, appended keys, causal and windows, long caches), the registered
variant through sandbox.forward, flash_attn_with_kvcache on torch tensors, results on a busy caller
stream, and the refusals that only device arrays reach; the one-launch form's arrival counters
(back-to-back calls on one stream, two streams at once, a torch CUDA graph), and its agreement with
the two-launch form and the load-path / L2 switches. Marked `gpu` (skipped without a GPU)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sandbox import decode, stream_counters
from sandbox.precision import numpy_dtype

pytestmark = pytest.mark.gpu


def _make(B, Hq, Hkv, Nq, d, dtype, lens, nnew, paged, page_size, seed):
    """(q, k_new, v_new, k_cache, v_cache, table, full_k, full_v) as NumPy: each sequence's keys in
    full_k / full_v (the reference), the cache holding lens[b] of them, NaN past them (never read)."""
    rng = np.random.default_rng(seed)
    npdt = numpy_dtype(dtype)
    room = max(lens) + nnew
    f = lambda *s: rng.standard_normal(s).astype(np.float32).astype(npdt)  # noqa: E731
    full_k, full_v = f(B, Hkv, max(room, 1), d), f(B, Hkv, max(room, 1), d)
    q = f(B, Hq, Nq, d)
    k_new = np.stack([full_k[b, :, n:n + nnew] for b, n in enumerate(lens)]) if nnew else None
    v_new = np.stack([full_v[b, :, n:n + nnew] for b, n in enumerate(lens)]) if nnew else None
    if not paged:
        kc = np.full((B, Hkv, max(room, 1), d), np.nan, npdt)
        vc = kc.copy()
        for b, n in enumerate(lens):
            kc[b, :, :n], vc[b, :, :n] = full_k[b, :, :n], full_v[b, :, :n]
        return q, k_new, v_new, kc, vc, None, full_k, full_v
    per_seq = -(-max(room, 1) // page_size)
    table = rng.permutation(B * per_seq + 3).astype(np.int32)[:B * per_seq].reshape(B, per_seq)
    kc = np.full((B * per_seq + 3, Hkv, page_size, d), np.nan, npdt)
    vc = kc.copy()
    for b, n in enumerate(lens):
        for pos in range(n):
            kc[table[b, pos // page_size], :, pos % page_size] = full_k[b, :, pos]
            vc[table[b, pos // page_size], :, pos % page_size] = full_v[b, :, pos]
    return q, k_new, v_new, kc, vc, table, full_k, full_v


def _check(out, lse, q, full_k, full_v, lens, nnew, dtype, causal, window):
    out, lse = np.asarray(out).astype(np.float32), np.asarray(lse)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    for b, n in enumerate(lens):
        L = n + nnew
        if L == 0:                                   # no keys at all: dead rows
            assert not out[b].any() and np.isneginf(lse[b]).all()
            continue
        for v in decode.oracle_verdicts(out[b:b + 1], lse[b:b + 1], q[b:b + 1], full_k[b:b + 1, :, :L],
                                        full_v[b:b + 1, :, :L], dtype, causal, window):
            assert v.ok, f"sequence {b} (L={L}): {v}"


def _run_cupy(case, num_splits=None):
    import cupy as cp
    (B, Hq, Hkv, Nq, d, dtype, lens, nnew, paged, page_size, causal, window, seed) = case
    q, k_new, v_new, kc, vc, table, full_k, full_v = _make(B, Hq, Hkv, Nq, d, dtype, lens, nnew, paged, page_size,
                                                           seed)
    dev = lambda x: None if x is None else cp.asarray(x)  # noqa: E731
    kcd, vcd = dev(kc), dev(vc)
    out, lse = decode.forward(dev(q), kcd, vcd, lens, block_table=table, k_new=dev(k_new), v_new=dev(v_new),
                              causal=causal, window=window, num_splits=num_splits)
    assert isinstance(out, cp.ndarray) and out.dtype == q.dtype and lse.dtype == np.float32
    _check(out.get(), lse.get(), q, full_k, full_v, lens, nnew, dtype, causal, window)


@st.composite
def cases(draw):
    B = draw(st.integers(1, 4))
    Hkv = draw(st.sampled_from([1, 2, 4]))
    Hq = Hkv * draw(st.sampled_from([1, 2, 4, 8]))
    Nq = draw(st.integers(1, 16))
    d = draw(st.sampled_from([64, 128, 128, 256]))
    dtype = draw(st.sampled_from(["float16", "bfloat16"]))
    lens = draw(st.lists(st.integers(0, 2000), min_size=B, max_size=B))
    nnew = draw(st.integers(0, 2))
    paged = draw(st.booleans())
    page_size = draw(st.sampled_from([16, 32, 64, 128, 256]))
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 600)),
                                                 st.one_of(st.none(), st.integers(0, 4)))))
    return (B, Hq, Hkv, Nq, d, dtype, lens, nnew, paged, page_size, causal, window, draw(st.integers(0, 2**16)))


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
@example((3, 8, 2, 1, 128, "float16", [0, 1, 1500], 1, True, 16, True, None, 1))        # empty cache + 1 new key
@example((2, 32, 8, 16, 128, "bfloat16", [700, 3], 0, False, 64, True, None, 2))        # 64 rows: 4 tiles of 16
@example((1, 4, 1, 3, 64, "float16", [5], 0, True, 256, True, None, 3))                  # Nq > L: dead rows
def test_kernel_matches_the_oracle(case):
    _run_cupy(case)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("nq,dtype", [(1, "float16"), (4, "bfloat16")])
def test_long_caches(paged, nq, dtype):
    """65536 keys (and a ragged partner): many splits, merged; causal with 4 rows."""
    _run_cupy((2, 8, 2, nq, 128, dtype, [65536, 40000], 0, paged, 256, nq > 1, None, 7))


def test_num_splits_caps_the_plan_and_one_split_is_exact():
    for s in (1, 3):
        _run_cupy((2, 8, 2, 2, 64, "float16", [3000, 17], 1, True, 32, True, (100, None), 8), num_splits=s)


def test_nan_in_q_reaches_only_its_row():
    import cupy as cp
    q, _, _, kc, vc, table, _, _ = _make(2, 4, 2, 1, 64, "float16", [300, 40], 0, True, 16, 9)
    q[1, 3, 0, 5] = np.nan
    out, lse = decode.forward(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), [300, 40], block_table=table)
    out, lse = out.get().astype(np.float32), lse.get()
    assert np.isnan(out[1, 3]).all() and np.isnan(lse[1, 3])
    assert np.isfinite(out[0]).all() and np.isfinite(lse[:, :3]).all()


@pytest.mark.parametrize("window", [None, (30, 0), (None, 2)])
def test_registered_variant_through_the_public_api(window):
    """decode-splitkv through sandbox.forward: contiguous K/V, Nk keys per sequence, GQA 4."""
    import cupy as cp
    import sandbox
    rng = np.random.default_rng(10)
    q = rng.standard_normal((2, 8, 5, 128)).astype(np.float16)
    k, v = (rng.standard_normal((2, 2, 999, 128)).astype(np.float16) for _ in range(2))
    res = sandbox.forward(cp.asarray(q), cp.asarray(k), cp.asarray(v), variant="decode-splitkv", causal=True,
                          window=window)
    for v_ in decode.oracle_verdicts(res.out.get(), res.lse.get(), q, k, v, "float16", True, window):
        assert v_.ok, v_


def test_flash_attn_with_kvcache_on_torch_tensors():
    """flash-attn's layout (B, N, H, d), paged, bf16, two appended keys; the result is a torch tensor
    on the caller's device."""
    torch = pytest.importorskip("torch")
    from sandbox.flash_attn import flash_attn_with_kvcache
    lens, page = [100, 1000], 64
    q, k_new, v_new, kc, vc, table, full_k, full_v = _make(2, 16, 4, 2, 128, "bfloat16", lens, 2, True, page, 11)
    t = lambda x: torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()  # noqa: E731
    tr = lambda x: t(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))  # noqa: E731  (B, H, N, d) -> (B, N, H, d)
    kcache, vcache = tr(kc), tr(vc)
    out, lse = flash_attn_with_kvcache(tr(q), kcache, vcache, tr(k_new), tr(v_new), cache_seqlens=lens,
                                       block_table=torch.from_numpy(table), causal=True, return_softmax_lse=True)
    assert out.is_cuda and out.dtype == torch.bfloat16 and out.shape == (2, 2, 16, 128)
    got = out.transpose(1, 2).float().cpu().numpy()
    _check(got, lse.cpu().numpy(), q, full_k, full_v, lens, 2, "bfloat16", True, None)
    pos = lens[1]                                              # the append wrote in place, in the caller's cache
    written = kcache[table[1, pos // page], pos % page].float().cpu().numpy()
    np.testing.assert_array_equal(written, k_new[1, :, 0].astype(np.float32))


def test_busy_caller_stream_cupy():
    """Inputs written on the caller's stream behind queued work: the kernel runs after them (same
    stream), and nothing in the call waits for the device."""
    import cupy as cp
    q, _, _, kc, vc, table, full_k, full_v = _make(2, 8, 2, 1, 128, "float16", [5000, 300], 0, True, 64, 12)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        qd, kd, vd = cp.zeros(q.shape, q.dtype), cp.asarray(kc), cp.asarray(vc)
        big = cp.random.standard_normal((4096, 4096), dtype=cp.float32)
        for _ in range(20):
            big = big @ big / 64.0                             # tens of ms of queued work
        qd[...] = cp.asarray(q)                                # written after the queued work
        out, lse = decode.forward(qd, kd, vd, [5000, 300], block_table=table)
    s.synchronize()
    _check(out.get(), lse.get(), q, full_k, full_v, [5000, 300], 0, "float16", False, None)


def test_busy_caller_stream_torch():
    torch = pytest.importorskip("torch")
    q, _, _, kc, vc, _, full_k, full_v = _make(2, 8, 2, 3, 64, "float16", [4000, 4000], 0, False, 64, 13)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        kd, vd = torch.from_numpy(kc).cuda(), torch.from_numpy(vc).cuda()
        qd = torch.zeros(q.shape, dtype=torch.float16, device="cuda")
        torch.cuda._sleep(50_000_000)                          # queued work on the caller's stream
        qd.copy_(torch.from_numpy(q).cuda())
        out, lse = decode.forward(qd, kd, vd, [4000, 4000], causal=True)
    s.synchronize()
    assert isinstance(out, torch.Tensor) and out.device.type == "cuda"
    _check(out.cpu().numpy(), lse.cpu().numpy(), q, full_k, full_v, [4000, 4000], 0, "float16", True, None)


def test_device_refusals_leave_the_cache_untouched():
    import cupy as cp
    q, k_new, v_new, kc, vc, _, _, _ = _make(1, 4, 2, 1, 64, "float16", [10], 1, False, 16, 14)
    wide = cp.zeros((1, 2, kc.shape[2], 72), dtype=cp.float16)
    wide[..., 4:68] = cp.asarray(kc)
    misaligned = wide[..., 4:68]                               # rows start 8 bytes off a 16-byte boundary
    before = wide.copy()
    with pytest.raises(ValueError, match="16-byte"):
        decode.forward(cp.asarray(q), misaligned, misaligned.copy(), [10], k_new=cp.asarray(k_new),
                       v_new=cp.asarray(v_new))
    assert bool(cp.array_equal(wide, before, equal_nan=True))
    with pytest.raises(ValueError, match="page_size=24"):
        pages = cp.zeros((4, 2, 24, 64), dtype=cp.float16)
        decode.forward(cp.asarray(q), pages, pages.copy(), [10], block_table=[[0, 1]], k_new=cp.asarray(k_new),
                       v_new=cp.asarray(v_new))


# ---- the fused merge (one launch): arrival counters reused across calls, streams and graphs

def test_back_to_back_calls_reuse_the_counters():
    """Calls queued back to back on one stream share its counter buffer: each launch's last blocks
    leave it zeroed for the next (other inputs, split counts and tiles, a batch whose tiles outgrow the
    buffer, a one-split call that writes out directly); every result matches the oracle and the
    buffer is all zeros afterwards."""
    import cupy as cp
    cases = [((2, 8, 2, 1, 128, "float16", [5000, 300], 0, False, 64, False, None, 20 + i), None) for i in range(3)]
    cases += [((4, 16, 4, 2, 64, "bfloat16", [900, 0, 4100, 2500], 1, True, 32, True, None, 23), None),
              ((40, 32, 32, 1, 64, "float16", [200] * 40, 0, False, 64, False, None, 24), 3),   # 1280 counters
              ((2, 8, 2, 1, 128, "float16", [5000, 300], 0, False, 64, False, None, 25), None),
              ((2, 8, 2, 1, 128, "float16", [5000, 300], 0, False, 64, False, None, 26), 1)]     # direct, no counters
    made = [_make(*c[:10], c[12]) for c, _ in cases]
    dev = lambda x: None if x is None else cp.asarray(x)  # noqa: E731
    inputs = [tuple(dev(x) for x in m[:5]) for m in made]
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    results = []
    with s:
        for (c, splits), (q, k_new, v_new, kc, vc), m in zip(cases, inputs, made):
            results.append(decode.forward(q, kc, vc, c[6], block_table=m[5], k_new=k_new, v_new=v_new, causal=c[10],
                                          window=c[11], num_splits=splits))
    s.synchronize()
    for (c, _), m, (out, lse) in zip(cases, made, results):
        _check(out.get(), lse.get(), m[0], m[6], m[7], c[6], c[7], c[5], c[10], c[11])
    bufs = stream_counters.of_stream(s)
    assert len(bufs) == 1 and bufs[0].size >= 40 * 32, "one buffer per stream, grown to the largest launch"
    assert not bool(bufs[0].any()), "the stream's counters must be zero between launches"


def test_calls_on_two_streams_use_two_counter_buffers():
    """Two non-blocking streams with decode calls in flight at once (queued behind busy work, issued
    alternately, inputs already on the device): each stream counts in its own buffer, every result is
    right and both buffers are zero afterwards."""
    import cupy as cp
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    calls = []
    for rep in range(3):
        for i in range(2):
            case = (3, 8, 2, 1, 128, "float16", [4000 + 700 * i, 3000, 17 * rep], 0, bool(i), 64, True, None,
                    40 + 10 * i + rep)
            m = _make(*case[:10], case[12])
            calls.append((i, case, m, tuple(cp.asarray(x) for x in (m[0], m[3], m[4]))))
    for i in range(2):                                  # warm-up: compiled and planned before the timing matters
        decode.forward(*calls[i][3], calls[i][1][6], block_table=calls[i][2][5], causal=True)
    cp.cuda.Device().synchronize()
    for s in streams:
        with s:
            big = cp.random.standard_normal((4096, 4096), dtype=cp.float32)
            for _ in range(20):
                big = big @ big / 64.0                  # tens of ms queued: the calls below overlap in time
    outs = []
    for i, case, m, (q, kc, vc) in calls:
        with streams[i]:
            outs.append(decode.forward(q, kc, vc, case[6], block_table=m[5], causal=True))
    busy = [not s.done for s in streams]
    for s in streams:
        s.synchronize()
    for (i, case, m, _), (out, lse) in zip(calls, outs):
        _check(out.get(), lse.get(), m[0], m[6], m[7], case[6], 0, "float16", True, None)
    bufs = [stream_counters.of_stream(s) for s in streams]
    assert all(len(b) == 1 for b in bufs) and bufs[0][0].data.ptr != bufs[1][0].data.ptr
    assert not any(bool(b[0].any()) for b in bufs)
    assert all(busy), "the calls waited for the GPU (a synchronisation inside the call)"


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_fused_and_two_launch_merges_agree(paged):
    """The one-launch path (last block merges) and the two-launch path (decode_merge) on the same
    problem: both match the oracle, and each other to a few float32 ulps of the output."""
    import cupy as cp
    from sandbox import arrays
    q, _, _, kc, vc, table, full_k, full_v = _make(2, 16, 4, 3, 128, "bfloat16", [20000, 777], 0, paged, 128, 30)
    lens = [20000, 777]
    qd, kd, vd = cp.asarray(q), cp.asarray(kc), cp.asarray(vc)
    res = []
    for fused in (1, 0):
        lens_dev, table_dev, uni = decode._device_ints(np.array(lens), table, lambda a: cp.asarray(a.astype(np.int32)))
        with arrays.caller_stream(qd):
            out, lse = decode.splitkv(qd, kd, vd, lens_dev, max(lens), 1 / np.sqrt(128), decode.relative_band(True, None),
                                      table_dev, uniform_len=uni, fused=fused)
        _check(out.get(), lse.get(), q, full_k, full_v, lens, 0, "bfloat16", True, None)
        res.append((out.get().astype(np.float32), lse.get()))
    np.testing.assert_allclose(res[0][1], res[1][1], rtol=0, atol=1e-4)
    np.testing.assert_allclose(res[0][0], res[1][0], rtol=0, atol=2 * 2.0**-8 * np.abs(res[1][0]).max())


@pytest.mark.parametrize("hq,nq", [(8, 1), (8, 2)], ids=["rows4", "rows8"])
def test_register_path_and_both_l2_priorities(hq, nq):
    """The switches the bench compares (SANDBOX_DECODE_PIPE=0: the register load path;
    SANDBOX_DECODE_L2=first: the evict-first hint, normal the default) on the one-launch form, paged and ragged."""
    import cupy as cp
    from sandbox import arrays
    lens = [6000, 1, 2500]
    q, _, _, kc, vc, table, full_k, full_v = _make(3, hq, 2, nq, 128, "float16", lens, 0, True, 64, 60 + hq)
    qd, kd, vd = cp.asarray(q), cp.asarray(kc), cp.asarray(vc)
    for pipe, l2 in ((0, "normal"), (0, "first"), (1, "normal"), (1, "first")):
        lens_dev, table_dev, uni = decode._device_ints(np.array(lens), table, lambda a: cp.asarray(a.astype(np.int32)))
        with arrays.caller_stream(qd):
            out, lse = decode.splitkv(qd, kd, vd, lens_dev, max(lens), 1 / np.sqrt(128), decode.relative_band(True, None),
                                      table_dev, pipe=pipe, uniform_len=uni, l2=l2)
        _check(out.get(), lse.get(), q, full_k, full_v, lens, 0, "float16", True, None)


def test_torch_cuda_graph_capture_with_many_splits():
    """A decoding step with enough keys for many splits (so the fused merge counts) captured into a
    torch CUDA graph and replayed twice with new inputs: the capture takes its own zeroed counters."""
    torch = pytest.importorskip("torch")
    import sandbox
    rng = np.random.default_rng(50)
    B, Hq, Hkv, N, d = 2, 8, 2, 9000, 128
    mk = lambda *s: rng.standard_normal(s).astype(np.float16)  # noqa: E731
    static = [torch.from_numpy(x).cuda() for x in (mk(B, Hq, 1, d), mk(B, Hkv, N, d), mk(B, Hkv, N, d))]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            sandbox.forward(*static, variant="decode-splitkv", causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = sandbox.forward(*static, variant="decode-splitkv", causal=True)
    for rep in range(2):
        new = (mk(B, Hq, 1, d), mk(B, Hkv, N, d), mk(B, Hkv, N, d))
        for s_, x in zip(static, new):
            s_.copy_(torch.from_numpy(x).cuda())
        graph.replay()
        torch.cuda.synchronize()
        got_o, got_l = res.out.float().cpu().numpy(), res.lse.cpu().numpy()
        for b in range(B):
            for v_ in decode.oracle_verdicts(got_o[b:b + 1], got_l[b:b + 1], new[0][b:b + 1], new[1][b:b + 1],
                                             new[2][b:b + 1], "float16", True):
                assert v_.ok, (rep, b, v_)


@pytest.mark.parametrize("order", ["splits", "heads"])
def test_both_grid_orders_with_several_row_tiles_and_splits(order):
    """The grid-order switch (SANDBOX_DECODE_ORDER): splits or row tiles on the grid's x axis. Hq / Hkv = 8
    and 4 query rows give 32 rows per K/V head, two row tiles of 16; ragged lengths of up to 20k keys give
    many splits, so the fused merge's counters (per sequence and row tile) count in both orders."""
    import cupy as cp
    from sandbox import arrays
    lens = [20000, 3, 9000]
    q, _, _, kc, vc, table, full_k, full_v = _make(3, 16, 2, 4, 128, "float16", lens, 0, True, 64, 77)
    qd, kd, vd = cp.asarray(q), cp.asarray(kc), cp.asarray(vc)
    lens_dev, table_dev, uni = decode._device_ints(np.array(lens), table, lambda a: cp.asarray(a.astype(np.int32)))
    assert decode.launch_plan(3, 16, 2, 4, 128, "float16", max(lens))[2] > 1
    for _ in range(2):                      # the second call finds the counters the first left at zero
        with arrays.caller_stream(qd):
            out, lse = decode.splitkv(qd, kd, vd, lens_dev, max(lens), 1 / np.sqrt(128),
                                      decode.relative_band(True, None), table_dev, uniform_len=uni, order=order)
        _check(out.get(), lse.get(), q, full_k, full_v, lens, 0, "float16", True, None)
    with pytest.raises(ValueError, match="order"):
        decode.splitkv(qd, kd, vd, lens_dev, max(lens), 1.0, (0, 0), table_dev, uniform_len=uni, order="rows")
