"""Attention masks: causal and sliding window (element predicates), block-sparse layouts, and the
host-side tile classification that kernels use to skip work.

Alignment (docs/ARCHITECTURE.md "Masks"): with shift = Nk - Nq, query i sees key j iff
    causal:           j <= i + shift
    window (l, r):    i + shift - l <= j <= i + shift + r        (None = unbounded side)
    block-sparse:     layout[h or 0, i // bq, j // bk]
and the three compose by AND. Causal and window together are one band `lo <= j - i <= hi`, which
is what kernels receive (`Band`); block-sparse layouts travel as a per-tile table.

Tile classes (for a kernel's own Br x Bc tiles, any size against any mask block size):
    EMPTY   no element visible: the tile is skipped (never loaded)
    FULL    every element visible: no per-element masking
    PARTIAL some visible: the element predicate is applied
The classification is exact (tests check it against the element mask).

A mask modifier (sandbox/modifiers.py MaskMod) is ANDed with the three; `classify_tiles_mod` derives
the tile classes of the combination by evaluating the predicate on the host, one row of tiles at a
time, cached per (mask, shape, tile size, band, block mask).
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import numpy as np

TILE_EMPTY, TILE_FULL, TILE_PARTIAL, TILE_BAND, TILE_CAUSAL = 0, 1, 2, 3, 4     # kernels_cu/tiles.cuh
UNBOUNDED = 1 << 30  # band offset meaning "no bound"; |j - i| < 2**30 for every supported N


@dataclass(frozen=True)
class Band:
    """Visible iff lo <= j - i <= hi (causal and window folded together)."""

    lo: int = -UNBOUNDED
    hi: int = UNBOUNDED

    @classmethod
    def from_options(cls, Nq: int, Nk: int, causal: bool, window) -> "Band":
        """The band of causal and window (docs/ARCHITECTURE.md alignment), lo and hi clamped to
        [-UNBOUNDED, UNBOUNDED]. |j - i| < 2**29 for every supported N, so a bound beyond
        UNBOUNDED changes nothing (window=(2**40, 0) is window=(None, 0)), and clamping keeps the
        band within the kernels' int32 arguments."""
        shift = Nk - Nq
        lo, hi = -UNBOUNDED, UNBOUNDED
        if window is not None:
            left, right = window
            if left is not None:
                lo = shift - left
            if right is not None:
                hi = shift + right
        if causal:
            hi = min(hi, shift)
        clamp = lambda x: max(-UNBOUNDED, min(UNBOUNDED, int(x)))  # noqa: E731
        return cls(clamp(lo), clamp(hi))

    @property
    def unbounded(self) -> bool:
        return self.lo <= -UNBOUNDED and self.hi >= UNBOUNDED

    def element_mask(self, Nq: int, Nk: int) -> np.ndarray:
        d = np.arange(Nk)[None, :] - np.arange(Nq)[:, None]
        return (d >= self.lo) & (d <= self.hi)


@functools.lru_cache(maxsize=256)
def mean_visible_keys(Nq: int, Nk: int, lo: int, hi: int) -> float:
    """The mean number of keys a query row sees under the band lo <= j - i <= hi (rows 0 .. Nq - 1, keys
    0 .. Nk - 1; dead rows count 0), exactly, once per shape."""
    i = np.arange(Nq, dtype=np.int64)
    seen = np.minimum(Nk - 1, i + hi) - np.maximum(0, i + lo) + 1
    return float(np.clip(seen, 0, None).mean()) if Nq else 0.0


class BlockSparse:
    """Block-sparse layout: element (i, j) of head h is visible iff layout[h or 0, i//bq, j//bk]."""

    def __init__(self, layout, block):
        layout = np.asarray(layout)
        if layout.dtype != np.bool_:
            if not np.issubdtype(layout.dtype, np.integer) or not np.isin(layout, (0, 1)).all():
                raise ValueError("BlockSparse layout must be boolean (or 0/1 integers)")
            layout = layout.astype(bool)
        if layout.ndim == 2:
            layout = layout[None]
        if layout.ndim != 3:
            raise ValueError(f"BlockSparse layout must have shape (Hm, Nq/bq, Nk/bk), got {layout.shape}")
        bq, bk = (int(x) for x in block)
        if bq < 1 or bk < 1:
            raise ValueError(f"BlockSparse block sizes must be >= 1, got {block}")
        self.layout = np.ascontiguousarray(layout)
        self.block = (bq, bk)

    def __repr__(self):
        return f"BlockSparse(layout{self.layout.shape}, block={self.block}, density={self.layout.mean():.3f})"

    def validate(self, Hq: int, Nq: int, Nk: int) -> None:
        bq, bk = self.block
        want = (-(-Nq // bq), -(-Nk // bk))
        if self.layout.shape[0] not in (1, Hq) or self.layout.shape[1:] != want:
            raise ValueError(
                f"block_mask layout has shape {self.layout.shape}; for Hq={Hq}, Nq={Nq}, Nk={Nk} and "
                f"block={self.block} it must be (1 or {Hq}, {want[0]}, {want[1]})")

    def element_mask(self, Nq: int, Nk: int) -> np.ndarray:
        """[Hm, Nq, Nk] boolean."""
        bq, bk = self.block
        return self.layout[:, np.arange(Nq) // bq][:, :, np.arange(Nk) // bk]


def element_mask(Hq: int, Nq: int, Nk: int, causal=False, window=None, block_mask=None) -> np.ndarray:
    """[Hm, Nq, Nk] boolean visibility (Hm = 1 unless the block mask is per head)."""
    vis = Band.from_options(Nq, Nk, causal, window).element_mask(Nq, Nk)[None]
    if block_mask is not None:
        vis = vis & block_mask.element_mask(Nq, Nk)
    return vis


def _band_classes(band: Band, r0, r1, c0, c1):
    """Per rectangle rows [r0, r1) x cols [c0, c1): (empty, full) under the band (arrays)."""
    dmin = c0 - (r1 - 1)
    dmax = (c1 - 1) - r0
    empty = (dmax < band.lo) | (dmin > band.hi) | (band.lo > band.hi)
    full = (dmin >= band.lo) & (dmax <= band.hi)
    return empty, full


def classify_tiles(Nq: int, Nk: int, block_r: int, block_c: int, band: Band,
                   block_mask: BlockSparse | None = None, row_shift: int = 0) -> np.ndarray:
    """int8 [Hm, ceil(Nq/Br), ceil(Nk/Bc)] of TILE_EMPTY / TILE_FULL / TILE_PARTIAL (exact). `row_shift`
    (0 <= row_shift < Br, band alone): Q tile t covers rows [t Br - row_shift, (t + 1) Br - row_shift) within
    [0, Nq), so that a partial tile is the first (bottom-aligned tiles, fa3_ws.cu's row_shift)."""
    if row_shift and (block_mask is not None or not 0 <= row_shift < block_r):
        raise ValueError(f"row_shift {row_shift}: 0 <= row_shift < block_r ({block_r}), and a band alone")
    nr, nc = -(-Nq // block_r), -(-Nk // block_c)
    r0 = np.maximum(0, np.arange(nr) * block_r - row_shift)[:, None]
    r1 = np.minimum(np.arange(nr) * block_r - row_shift + block_r, Nq)[:, None]
    c0 = (np.arange(nc) * block_c)[None, :]
    c1 = np.minimum(c0 + block_c, Nk)
    band_empty, band_full = _band_classes(band, r0, r1, c0, c1)
    if block_mask is None:
        cls = np.where(band_empty, TILE_EMPTY, np.where(band_full, TILE_FULL, TILE_PARTIAL))
        return cls.astype(np.int8)[None]
    bq, bk = block_mask.block
    layout = block_mask.layout
    Hm = layout.shape[0]
    any_visible = np.zeros((Hm, nr, nc), bool)
    all_blocks_on = np.ones((Hm, nr, nc), bool)
    # Walk the mask blocks that overlap each tile: at most ceil(Br/bq)+1 by ceil(Bc/bk)+1 of them.
    for dr in range(-(-block_r // bq) + 1):
        br = r0 // bq + dr                                   # mask-block row index per tile row
        sr0, sr1 = np.maximum(r0, br * bq), np.minimum(r1, (br + 1) * bq)
        for dc in range(-(-block_c // bk) + 1):
            bc = c0 // bk + dc
            sc0, sc1 = np.maximum(c0, bc * bk), np.minimum(c1, (bc + 1) * bk)
            overlaps = (sr0 < sr1) & (sc0 < sc1)             # [nr, nc]
            on = layout[:, np.minimum(br, layout.shape[1] - 1)[:, 0]][:, :, np.minimum(bc, layout.shape[2] - 1)[0]]
            sub_empty, _ = _band_classes(band, sr0, sr1, sc0, sc1)
            any_visible |= overlaps & on & ~sub_empty
            all_blocks_on &= ~overlaps | on
    cls = np.where(~any_visible, TILE_EMPTY,
                   np.where(all_blocks_on & band_full, TILE_FULL, TILE_PARTIAL))
    return cls.astype(np.int8)


def classify_tiles_mod(mask_mod, B: int, Hq: int, Nq: int, Nk: int, block_r: int, block_c: int,
                       band: Band = Band(), block_mask: BlockSparse | None = None) -> np.ndarray:
    """int8 [Bm, Hm, ceil(Nq/Br), ceil(Nk/Bc)] tile classes of band AND block_mask AND mask_mod (exact); a partial
    tile where mask_mod is true wherever the band and block mask show (partial by them alone) is TILE_BAND, and one
    where it shows exactly the bottom-right causal part (j - i <= Nk - Nq) of what they show is TILE_CAUSAL (a causal
    mask given as a dense mask): the forwards with modifiers check those without the predicate (fa3_bwd2
    TILE_BAND only), and every other reader takes them as TILE_PARTIAL.

    Bm is 1 unless the mask depends on the batch entry, Hm 1 unless it (or the block mask) depends on
    the head. Cached per (mask_mod, shape, tile size, band, block mask) by identity: a loop over one
    mask classifies once. The predicate is evaluated for every element, Br rows at a time (host
    memory O(B H Br Nk)), so the cost is that of one pass over the score matrix. The cache holds the mask
    modifier weakly: a dense mask (and its device copy) goes with the last reference to its modifier."""
    per_mod = _MOD_TILES.setdefault(mask_mod, {})
    key = (B, Hq, Nq, Nk, block_r, block_c, band, block_mask)
    hit = per_mod.get(key)
    if hit is None:
        if len(per_mod) >= 16:
            per_mod.pop(next(iter(per_mod)))
        hit = per_mod[key] = _classify_tiles_mod(mask_mod, B, Hq, Nq, Nk, block_r, block_c, band, block_mask)
    return hit


_MOD_TILES = weakref.WeakKeyDictionary()      # mask modifier -> {(shape, tiles, band, block mask): classes}


def _classify_tiles_mod(mask_mod, B, Hq, Nq, Nk, block_r, block_c, band, block_mask):
    nr, nc = -(-Nq // block_r), -(-Nk // block_c)
    rows = []
    for tr in range(nr):
        r = np.arange(tr * block_r, min((tr + 1) * block_r, Nq))
        mod = mask_mod.visible(B, Hq, r, Nk)                      # [Bm, Hm, rows, Nk]
        dij = np.arange(Nk)[None, :] - r[:, None]
        shown = ((dij >= band.lo) & (dij <= band.hi))[None, None]
        if block_mask is not None:
            bq, bk = block_mask.block
            shown = shown & block_mask.layout[:, r // bq][:, :, np.arange(Nk) // bk][None]
        vis = mod & shown
        cls = _tile_row_classes(vis, nc, block_c)
        mod_all = _tile_row_classes(mod | ~shown, nc, block_c) == TILE_FULL    # partial by the band alone
        causal = _tile_row_classes((mod == (dij <= Nk - Nq)[None, None]) | ~shown, nc, block_c) == TILE_FULL
        rows.append(np.where(cls != TILE_PARTIAL, cls, np.where(mod_all, TILE_BAND,
                                                                np.where(causal, TILE_CAUSAL, TILE_PARTIAL))))
    Bm = max(x.shape[0] for x in rows)
    Hm = max(x.shape[1] for x in rows)
    out = np.stack([np.broadcast_to(x, (Bm, Hm, nc)) for x in rows], axis=2).astype(np.int8)
    out.setflags(write=False)
    return out


def _tile_row_classes(vis: np.ndarray, nc: int, block_c: int) -> np.ndarray:
    """[Bm, Hm, nc] classes of one row of tiles from its element visibility [Bm, Hm, rows, Nk]."""
    pad = nc * block_c - vis.shape[-1]
    any_on = np.pad(vis, [(0, 0)] * 3 + [(0, pad)], constant_values=False)
    all_on = np.pad(vis, [(0, 0)] * 3 + [(0, pad)], constant_values=True)
    shape = vis.shape[:2] + (vis.shape[2], nc, block_c)
    some = any_on.reshape(shape).any(axis=(2, 4))
    every = all_on.reshape(shape).all(axis=(2, 4))
    return np.where(~some, TILE_EMPTY, np.where(every, TILE_FULL, TILE_PARTIAL))
