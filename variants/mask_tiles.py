"""A mask modifier's tile classes on the GPU (kernels_cu/mask_tiles.cu), cached per modifier.

The tiled kernels skip EMPTY tiles and run the element predicate in PARTIAL ones only; with a mask modifier
the classes are those of band AND block mask AND the modifier. sandbox/masks.py classify_tiles_mod computes
them on the host from the NumPy form (the CPU variants and the argument-packing tests use it): one NumPy pass
over the score matrix, seconds at N = 32k. Here the modifier's CUDA form does the same pass on the GPU, on the
caller's stream, with no host copy of anything the GPU computed; the table's extent (Bm, Hm) comes from the
NumPy form evaluated at one element per (batch entry, head), whose broadcast shape says which axes the
predicate depends on. The two tables are equal element for element (tests/test_mask_tiles.py).
"""
from __future__ import annotations

import weakref

import numpy as np

from sandbox import modifiers, stream_counters
from sandbox.launch import cuda_options, i32, mask_args
from sandbox.loader import CompileUnit, launch

THREADS = 256
KERNEL = f"mask_tiles<{THREADS}>"

_TABLES = weakref.WeakKeyDictionary()    # mask modifier -> {(device, stream, shape, tiles, band, block mask): table}
_MAX_PER_MOD = 16


def extent(mask_mod, B: int, Hq: int, block_mask=None) -> tuple[int, int]:
    """(Bm, Hm): the table's batch and head extents, 1 on an axis neither the predicate (its NumPy form's
    broadcast shape at element (0, 0)) nor the block mask's layout depends on, else B and Hq; as
    masks.classify_tiles_mod's table. Device buffers stand in as zeros of their shape (no host copy, no wait):
    the broadcast shape of a NumPy expression depends on its operands' shapes, not their values."""
    Bm, Hm = mask_mod.visible(B, Hq, [0], 1, stand_ins=True).shape[:2]
    Hl = 1 if block_mask is None else block_mask.layout.shape[0]
    return int(Bm), int(max(Hm, Hl))


def unit(mask_mod) -> CompileUnit:
    """The classifier's module for this modifier's CUDA form (the disk cache keys it by the -D options)."""
    return CompileUnit("mask_tiles.cu", (KERNEL,), cuda_options() + modifiers.cuda_defines(None, mask_mod),
                       label=f"mask_tiles[{mask_mod.name}:{mask_mod.cuda_key}]")


def device_classes(p, block_r: int, block_c: int, xp, buffer_args) -> np.ndarray:
    """int8 device array [Bm, Hm, ceil(Nq/Br), ceil(Nk/Bc)]: the classes of problem p's band AND block mask AND
    mask modifier, as classify_tiles_mod gives them on the host. buffer_args(): the mask modifier's buffers as the
    kernels take them (device arrays, each followed by its int32 shape), called on a cache miss only.

    Launched on the current stream and cached per (modifier, stream, problem shape, tile, band, block mask) while
    the modifier lives: a loop over one mask classifies once per stream, and a hit reads a table its own stream
    wrote before (stream order; another stream's table could still be in flight). Not cached while the stream is
    captured into a CUDA graph: the launch is recorded there, not run, and runs on each replay."""
    mm = p.mask_mod
    nr, nc = -(-p.Nq // block_r), -(-p.Nk // block_c)
    stream = xp.cuda.get_current_stream()
    capturing = stream_counters.capturing(stream)
    key = (xp.cuda.Device().id, stream.ptr, p.B, p.Hq, p.Nq, p.Nk, block_r, block_c, p.band, p.block_mask)
    per_mod = _TABLES.setdefault(mm, {})
    hit = None if capturing else per_mod.get(key)
    if hit is None:
        if mm.tile_classes is not None:                  # a mask that knows its tiles (MaskMod.tile_classes)
            hit = mm.tile_classes(mm, p, block_r, block_c, xp)
            if hit is not None and (hit.shape[2:] != (nr, nc) or hit.dtype != xp.int8):
                raise ValueError(f"mask_mod {mm.name!r}: tile_classes gave {hit.dtype} {hit.shape}; need int8 "
                                 f"(Bm, Hm, {nr}, {nc})")
        if hit is None:
            Bm, Hm = extent(mm, p.B, p.Hq, p.block_mask)
            hit = xp.empty((Bm, Hm, nr, nc), dtype=xp.int8)
            launch(unit(mm), KERNEL, (nc * Bm * Hm, nr), (THREADS,),
                   (hit, i32(Hm), i32(p.Nq), i32(p.Nk), i32(block_r), i32(block_c), i32(nr), i32(nc),
                    *mask_args(p, xp), *buffer_args()))
        if not capturing:
            if len(per_mod) >= _MAX_PER_MOD:
                per_mod.pop(next(iter(per_mod)))
            per_mod[key] = hit
    return hit
