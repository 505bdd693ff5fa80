"""A mask modifier's tile classes on the GPU (variants/mask_tiles.py, kernels_cu/mask_tiles.cu) against the host's
(sandbox/masks.py classify_tiles_mod, from the NumPy form), element for element.

Without a GPU: the table's extents (which axes a predicate depends on, from the NumPy form's broadcast shape),
the built-ins' NumPy forms no longer claiming axes they ignore, and NVRTC builds of the classifier for each
built-in mask modifier and a user-written one. On the GPU: the tables of the built-ins and of user predicates
under bands, windows, per-head block masks and ragged shapes, a Hypothesis search over document ids and windows,
the launch on the caller's stream with nothing synchronised, and the cache (one launch per mask and shape)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sandbox import modifiers as M
from sandbox.masks import BlockSparse, classify_tiles_mod

from mod_cases import compile_reports
from variants import mask_tiles

gpu = pytest.mark.gpu


def _quadratic_window(w: int) -> M.MaskMod:
    """A user predicate with no buffers: (i - j)^2 <= w^2 (a symmetric window written another way)."""
    return M.MaskMod("square_window", lambda b, h, i, j: (i - j) ** 2 <= w * w,
                     lambda b, h, i, j: (i - j) ** 2 <= w * w, f"(long long)(i - j) * (i - j) <= {w * w}LL")


def _striped_heads(H: int) -> M.MaskMod:
    """A user predicate of the head: head h sees keys j with j % (h + 2) != 1."""
    return M.MaskMod("striped", lambda b, h, i, j: j % (h + 2) != 1, lambda b, h, i, j: j % (h + 2) != 1,
                     "j % (h + 2) != 1")


# ---- no GPU

def test_extent_follows_what_the_predicate_reads():
    B, H = 4, 6
    assert mask_tiles.extent(M.dense(np.ones((B, 1, 8, 8), bool)), B, H) == (B, 1)
    assert mask_tiles.extent(M.dense(np.ones((1, H, 8, 8), bool)), B, H) == (1, H)
    assert mask_tiles.extent(M.dense(np.ones((1, 1, 8, 8), bool)), B, H) == (1, 1)
    assert mask_tiles.extent(M.prefix_lm(3), B, H) == (1, 1)
    assert mask_tiles.extent(M.prefix_lm(np.arange(B)), B, H) == (B, 1)
    assert mask_tiles.extent(M.document(np.arange(8)), B, H) == (1, 1)
    assert mask_tiles.extent(M.document(np.zeros((B, 8), int)), B, H) == (B, 1)
    assert mask_tiles.extent(_striped_heads(H), B, H) == (1, H)
    assert mask_tiles.extent(_quadratic_window(3), B, H) == (1, 1)
    layout = BlockSparse(np.ones((H, 2, 2), bool), (4, 4))          # a per-head block mask widens the head axis
    assert mask_tiles.extent(M.prefix_lm(3), B, H, layout) == (1, H)


def test_host_tables_of_masks_shared_across_heads_have_one_head():
    """A (B, 1, Nq, Nk) dense mask (a model's padding mask) classifies once per batch entry, not once per head:
    its NumPy form used to index the head axis with min(h, 0), whose broadcast shape claimed every head (16 times
    the host work and table)."""
    allowed = np.ones((2, 1, 40, 50), bool)
    allowed[1, :, :, 30:] = False
    cls = classify_tiles_mod(M.dense(allowed), 2, 16, 40, 50, 16, 16)
    assert cls.shape == (2, 1, 3, 4)
    assert (cls[1, 0, :, 1] == 2).all() and (cls[1, 0, :, 2:] == 0).all() and (cls[0] == 1).all()


def test_classifier_builds_for_each_mask_modifier():
    units = [mask_tiles.unit(m) for m in (M.document(np.arange(8)), M.prefix_lm([1, 2]),
                                          M.dense(np.ones((1, 1, 8, 8), bool)), _quadratic_window(3), _striped_heads(4))]
    reports = compile_reports(units, "sm_90")
    for u in units:
        (r,) = reports[u]
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.registers <= 64, r


def _sorted_vs_exact(ids_q, ids_k, B, Hq, br, bc, xp, **opts):
    """(the sorted-ids tables of document(sorted_ids=True) (MaskMod.tile_classes) with xp, the exact host table)."""
    from sandbox.problem import make_problem
    Nq, Nk = ids_q.shape[-1], ids_k.shape[-1]
    mm = M.document(ids_q, ids_k, sorted_ids=True)
    p = make_problem(np.zeros((B, Hq, Nq, 8), np.float16), np.zeros((B, Hq, Nk, 8), np.float16),
                     np.zeros((B, Hq, Nk, 8), np.float16), mask_mod=mm, **opts)
    got = mm.tile_classes(mm, p, br, bc, xp)
    exact = classify_tiles_mod(M.document(ids_q, ids_k), B, Hq, Nq, Nk, br, bc, p.band)
    return (got if xp is np else xp.asnumpy(got)), exact


def _check_sorted_tables(got, exact):
    """Where the sorted-ids table is not PARTIAL it is the exact class, and every exact FULL tile is FULL in it."""
    from sandbox.masks import TILE_FULL, TILE_PARTIAL
    assert got.shape == exact.shape and got.dtype == np.int8
    assert ((got == exact) | (got == TILE_PARTIAL)).all()
    assert (got[exact == TILE_FULL] == TILE_FULL).all()


def test_sorted_document_ids_give_tables_the_exact_test_agrees_with():
    """document(sorted_ids=True): tile classes from each tile's first and last ids (O(tiles)); over random packed
    layouts (empty sequences, ids outside every sequence at both ends as sandbox/varlen.py makes them, ragged
    lengths, causal and windows), never a class the element-wise test contradicts, and never PARTIAL where that
    test says FULL."""
    from sandbox.masks import TILE_PARTIAL
    rng = np.random.default_rng(5)
    partial = total = 0
    for case in range(60):
        S = int(rng.integers(1, 8))
        n = int(rng.integers(1, 500))
        cu = np.concatenate([[0], np.sort(rng.integers(0, n + 1, S - 1)), [n]]) + int(rng.integers(0, 20))
        t = np.arange(int(cu[-1]) + int(rng.integers(0, 30)))
        seq = np.searchsorted(cu[1:], t, side="right")
        q = np.where(t < cu[0], -1, np.where(t >= cu[-1], S, seq))
        k = np.where(t < cu[0], -2, np.where(t >= cu[-1], S + 1, seq))
        opts = [{}, {"causal": True}, {"window": (int(rng.integers(0, 200)), int(rng.integers(0, 50)))}][case % 3]
        br, bc = [(64, 64), (128, 128), (192, 112), (16, 16)][case % 4]
        got, exact = _sorted_vs_exact(q, k, 1, 2, br, bc, np, **opts)
        _check_sorted_tables(got, exact)
        partial += int((got == TILE_PARTIAL).sum() - (exact == TILE_PARTIAL).sum())
        total += got.size
    assert total > 1000 and partial < 0.2 * total        # conservative on few tiles (gaps, band-hidden pairs)


def test_sorted_document_ids_per_batch_entry():
    ids = np.sort(np.random.default_rng(6).integers(0, 4, (3, 200)), axis=1)
    got, exact = _sorted_vs_exact(ids, ids, 3, 2, 64, 32, np, causal=True)
    assert got.shape == (3, 1, 4, 7)
    _check_sorted_tables(got, exact)
    with pytest.raises(TypeError, match="sorted_ids"):
        M.document(ids, sorted_ids=1)
    with pytest.raises(TypeError, match="tile_classes must be callable"):
        M.MaskMod("m", lambda b, h, i, j: i >= j, lambda b, h, i, j: i >= j, "i >= j", tile_classes=3)


# ---- GPU

@gpu
def test_sorted_document_ids_on_the_gpu_through_the_device_classifier():
    """device_classes takes MaskMod.tile_classes where a mask has one: the same tables from device ids."""
    import cupy as cp
    from sandbox.problem import make_problem
    from variants.fa2_tc import _buffer_args
    ids = np.repeat(np.arange(5), [0, 70, 1, 130, 99])[None]
    dq = cp.asarray(np.concatenate([[-1] * 3, ids[0], [5] * 9])[None].astype(np.int32))
    dk = cp.asarray(np.concatenate([[-2] * 3, ids[0], [6] * 9])[None].astype(np.int32))
    for opts in ({}, {"causal": True}, {"window": (40, 3)}):
        mm = M.document(dq, dk, sorted_ids=True)
        N = dq.shape[1]
        p = make_problem(np.zeros((1, 2, N, 8), np.float16), np.zeros((1, 2, N, 8), np.float16),
                         np.zeros((1, 2, N, 8), np.float16), mask_mod=mm, **opts)
        dev = cp.asnumpy(mask_tiles.device_classes(p, 64, 64, cp, lambda: _buffer_args(mm, cp)))
        exact = classify_tiles_mod(M.document(cp.asnumpy(dq), cp.asnumpy(dk)), 1, 2, N, N, 64, 64, p.band)
        _check_sorted_tables(dev, exact)


def _both(mm, B, Hq, Nq, Nk, br, bc, causal=False, window=None, block_mask=None):
    """(device table, host table) of one problem."""
    import cupy as cp
    from sandbox.problem import make_problem
    from variants.fa2_tc import _buffer_args
    q = np.zeros((B, Hq, Nq, 8), np.float16)
    k = np.zeros((B, Hq, Nk, 8), np.float16)
    p = make_problem(q, k, k, causal=causal, window=window, block_mask=block_mask, mask_mod=mm)
    dev = mask_tiles.device_classes(p, br, bc, cp, lambda: _buffer_args(mm, cp))
    host = classify_tiles_mod(mm, B, Hq, Nq, Nk, br, bc, p.band, block_mask)
    return cp.asnumpy(dev), host


CASES = [
    ("document", lambda: M.document(np.sort(np.random.default_rng(0).integers(0, 5, (3, 300)), axis=1)), 3, 4, 300, 300),
    ("document-kv", lambda: M.document(np.repeat(np.arange(4), 50), np.repeat(np.arange(4), 77)[:290]), 1, 2, 200, 290),
    ("prefix", lambda: M.prefix_lm([0, 17, 250]), 3, 2, 257, 260),
    ("dense", lambda: M.dense(np.random.default_rng(1).random((2, 1, 130, 97)) < 0.97), 2, 8, 130, 97),
    ("dense-heads", lambda: M.dense(np.broadcast_to(np.arange(97) < np.array([10, 60, 97])[:, None, None],
                                                    (1, 3, 64, 97)).copy()), 1, 3, 64, 97),
    ("dense-batch-heads", lambda: M.dense(np.random.default_rng(4).random((3, 2, 90, 77)) < 0.9), 3, 2, 90, 77),
    ("square", lambda: _quadratic_window(40), 1, 1, 500, 333),
    ("striped", lambda: _striped_heads(3), 2, 3, 70, 90),
]


@gpu
@pytest.mark.parametrize("name, make, B, Hq, Nq, Nk", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("br, bc", [(64, 64), (128, 128), (192, 112), (16, 16)])
def test_device_table_equals_the_host_table(name, make, B, Hq, Nq, Nk, br, bc):
    mm = make()
    dev, host = _both(mm, B, Hq, Nq, Nk, br, bc)
    assert dev.shape == host.shape and np.array_equal(dev, host)
    for opts in ({"causal": True}, {"window": (37, 5)}):
        dev, host = _both(mm, B, Hq, Nq, Nk, br, bc, **opts)
        assert np.array_equal(dev, host), opts


@gpu
def test_device_table_with_a_per_head_block_mask():
    layout = np.random.default_rng(3).random((4, 5, 9)) < 0.6
    bm = BlockSparse(layout, (31, 17))
    mm = M.document(np.repeat(np.arange(3), 50)[:150])
    dev, host = _both(mm, 2, 4, 150, 150, 64, 32, block_mask=bm)
    assert dev.shape == host.shape == (1, 4, 3, 5) and np.array_equal(dev, host)
    per_batch = M.prefix_lm([10, 120])                     # batch from the predicate, heads from the layout
    dev, host = _both(per_batch, 2, 4, 150, 150, 64, 32, causal=True, block_mask=bm)
    assert dev.shape == host.shape == (2, 4, 3, 5) and np.array_equal(dev, host)


@gpu
@settings(max_examples=40, deadline=None)
@given(n_docs=st.integers(1, 9), Nq=st.integers(1, 400), extra_k=st.integers(-50, 50), seed=st.integers(0, 2**16),
       causal=st.booleans(), left=st.one_of(st.none(), st.integers(0, 300)), tile=st.sampled_from([(64, 64), (128, 80)]))
def test_device_table_search(n_docs, Nq, extra_k, seed, causal, left, tile):
    Nk = max(1, Nq + extra_k)
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.integers(0, n_docs, (2, max(Nq, Nk))), axis=1)
    mm = M.document(ids[:, :Nq], ids[:, :Nk])
    dev, host = _both(mm, 2, 2, Nq, Nk, *tile, causal=causal, window=None if left is None else (left, None))
    assert np.array_equal(dev, host)


@gpu
def test_device_tables_are_cached_per_mask_and_stream():
    import cupy as cp
    from sandbox.problem import make_problem
    from variants.fa2_tc import _buffer_args
    mm = M.prefix_lm(30)
    q = np.zeros((1, 2, 100, 8), np.float16)
    p = make_problem(q, q, q, mask_mod=mm)          # the classifier launches where the caller's stream is current
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        first = mask_tiles.device_classes(p, 64, 64, cp, lambda: _buffer_args(mm, cp))
        assert mask_tiles.device_classes(p, 64, 64, cp, lambda: _buffer_args(mm, cp)) is first
        done = stream.record()
    done.synchronize()
    assert np.array_equal(cp.asnumpy(first), classify_tiles_mod(mm, 1, 2, 100, 100, 64, 64))
    other = cp.cuda.Stream(non_blocking=True)
    with other:                      # another stream: its own launch, ordered on it (a hit there could race)
        second = mask_tiles.device_classes(p, 64, 64, cp, lambda: _buffer_args(mm, cp))
        assert second is not first
        other.synchronize()
    assert np.array_equal(cp.asnumpy(second), cp.asnumpy(first))
