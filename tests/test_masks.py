"""Masks: bottom-right band semantics, BlockSparse validation, exact tile classification."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from sandbox.masks import (TILE_EMPTY, TILE_FULL, TILE_PARTIAL, Band, BlockSparse, classify_tiles,
                           element_mask)


def test_causal_is_bottom_right_aligned():
    vis = element_mask(1, 2, 4, causal=True)[0]        # shift = 2: row 0 sees keys 0..2
    assert vis.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    vis = element_mask(1, 3, 1, causal=True)[0]        # Nq > Nk: rows 0, 1 see nothing
    assert vis[:, 0].tolist() == [False, False, True]


def test_window_sides():
    vis = element_mask(1, 4, 4, window=(1, 0))[0]
    assert vis.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert element_mask(1, 3, 3, window=(None, None)).all()


def test_block_sparse_validation():
    with pytest.raises(ValueError, match="must be"):
        BlockSparse(np.ones((1, 2, 2)), (0, 2))
    bs = BlockSparse(np.ones((2, 2, 3), bool), (4, 4))
    bs.validate(2, 8, 9)
    with pytest.raises(ValueError, match="block_mask layout has shape"):
        bs.validate(3, 8, 9)
    with pytest.raises(ValueError, match="block_mask layout has shape"):
        bs.validate(2, 9, 9)
    with pytest.raises(ValueError, match="boolean"):
        BlockSparse(np.full((1, 1, 1), 0.5), (1, 1))


@st.composite
def tiling_problems(draw):
    Nq, Nk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    causal = draw(st.booleans())
    side = st.one_of(st.none(), st.integers(-3, 20))
    window = draw(st.one_of(st.none(), st.tuples(side, side)))
    bm = None
    if draw(st.booleans()):
        bq, bk = draw(st.integers(1, 12)), draw(st.integers(1, 12))
        shape = (draw(st.sampled_from([1, 2])), -(-Nq // bq), -(-Nk // bk))
        layout = np.random.default_rng(draw(st.integers(0, 999))).random(shape) < draw(st.sampled_from([0.2, 0.6, 1.0]))
        bm = BlockSparse(layout, (bq, bk))
    return Nq, Nk, causal, window, bm, draw(st.integers(1, 16)), draw(st.integers(1, 16))


@given(tiling_problems())
def test_tile_classes_are_exact(problem):
    Nq, Nk, causal, window, bm, Br, Bc = problem
    vis = element_mask(2, Nq, Nk, causal, window, bm)
    cls = classify_tiles(Nq, Nk, Br, Bc, Band.from_options(Nq, Nk, causal, window), bm)
    assert cls.shape[1:] == (-(-Nq // Br), -(-Nk // Bc))
    for h in range(vis.shape[0]):
        for r in range(cls.shape[1]):
            for c in range(cls.shape[2]):
                tile = vis[h, r * Br:(r + 1) * Br, c * Bc:(c + 1) * Bc]
                want = TILE_EMPTY if not tile.any() else TILE_FULL if tile.all() else TILE_PARTIAL
                assert cls[min(h, cls.shape[0] - 1), r, c] == want, (h, r, c)


@given(st.integers(1, 12), st.integers(1, 12), st.booleans(),
       st.tuples(*[st.one_of(st.none(), st.integers(-2**61, 2**61), st.integers(-20, 20))] * 2))
def test_band_stays_in_int32_and_matches_the_window_definition(Nq, Nk, causal, window):
    """Huge sides clamp to UNBOUNDED (kernels take the band as int32) without changing the mask."""
    band = Band.from_options(Nq, Nk, causal, window)
    assert -2**30 <= band.lo <= 2**30 and -2**30 <= band.hi <= 2**30
    left, right = window
    shift = Nk - Nq
    want = [[(left is None or j >= i + shift - left) and (right is None or j <= i + shift + right)
             and (not causal or j <= i + shift) for j in range(Nk)] for i in range(Nq)]
    assert band.element_mask(Nq, Nk).tolist() == want
