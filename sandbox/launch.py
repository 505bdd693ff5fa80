"""Kernel-argument builders shared by the CUDA variants: masks, dropout and strides, every scalar
typed explicitly (CuPy would pass a bare Python int as long long)."""
from __future__ import annotations

import functools
import hashlib
import math
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import arrays, loader
from .masks import classify_tiles
from .problem import Problem

i32, f32, u32, u64, i64 = np.int32, np.float32, np.uint32, np.uint64, np.int64


def cuda_options() -> tuple:
    """NVRTC options for run-time builds: the CUDA headers' include path where one is found. Found once per
    process and environment: the search stats a few dozen paths (about 0.5 ms of host time), and the
    packed-sequence forward names its compile unit on every call."""
    return _cuda_options(os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), tuple(sys.path))


@functools.lru_cache(maxsize=8)
def _cuda_options(cuda_path, cuda_home, path) -> tuple:
    return tuple(f"-I{d}" for d in loader.cuda_include_dirs())


# Device copies of host-built mask data, keyed by content: a loop over one mask (a benchmark, a
# training step) classifies tiles and uploads once. Measured: classify_tiles of a 4096 x 4096
# block-sparse problem takes 0.25-0.4 ms of host time per call.
_DEVICE_CACHE: OrderedDict = OrderedDict()
_DEVICE_CACHE_SIZE = 64


def _cached(key, build, xp):
    key = (xp.cuda.Device().id,) + key
    if key in _DEVICE_CACHE:
        _DEVICE_CACHE.move_to_end(key)
        return _DEVICE_CACHE[key]
    value = _DEVICE_CACHE[key] = build()
    if len(_DEVICE_CACHE) > _DEVICE_CACHE_SIZE:
        _DEVICE_CACHE.popitem(last=False)
    return value


def _layout_key(bm) -> tuple | None:
    if bm is None:
        return None
    return bm.block, bm.layout.shape, hashlib.blake2b(np.packbits(bm.layout).tobytes(), digest_size=16).digest()


def tile_table(problem: Problem, block_r: int, block_c: int, xp, row_shift: int = 0) -> tuple:
    """(device int8 [Hm, ceil(Nq/Br), ceil(Nk/Bc)] tile classes, i32(Hm)) for a kernel's tiles (Q tiles
    bottom-aligned by `row_shift` rows: masks.classify_tiles)."""
    p = problem
    key = ("tiles", p.Nq, p.Nk, block_r, block_c, p.band.lo, p.band.hi, _layout_key(p.block_mask), row_shift)
    t = _cached(key, lambda: xp.asarray(classify_tiles(p.Nq, p.Nk, block_r, block_c, p.band, p.block_mask,
                                                       row_shift)), xp)
    return t, i32(t.shape[0])


def mask_args(problem: Problem, xp) -> tuple:
    """MASK_PARAMS of common.cuh: band lo/hi, element layout (or a dummy), its heads and geometry."""
    band = problem.band
    bm = problem.block_mask
    if bm is None:
        dummy = _cached(("no-layout",), lambda: xp.zeros(1, dtype=xp.uint8), xp)   # never read: 0 heads
        return (i32(band.lo), i32(band.hi), dummy, i32(0), i32(1), i32(1), i32(1), i32(1))
    layout = _cached(("layout", _layout_key(bm)), lambda: xp.asarray(bm.layout.astype(np.uint8)), xp)
    Hm, nbq, nbk = bm.layout.shape
    return (i32(band.lo), i32(band.hi), layout, i32(Hm), i32(bm.block[0]), i32(bm.block[1]), i32(nbq), i32(nbk))


def dropout_args(problem: Problem) -> tuple:
    """DROPOUT_PARAMS of common.cuh: threshold, 1/(1-p), seed, offset."""
    p = problem.dropout_p
    return (u32(problem.dropout_threshold), f32(1.0 / (1.0 - p)), u64(problem.seed), u32(problem.offset))


def strides4(x) -> tuple:
    """Element strides of a 4-D array as four int64 scalars."""
    return tuple(i64(s) for s in arrays.element_strides(x))


COUNTERS = "stream-counters"     # a LaunchPlan buffer kept per stream and left at zero by its launches
RESULTS = ("out", "lse", "dq", "dk", "dv")   # LaunchPlan buffers handed to the caller: each its own allocation
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "uint32": 4}
SCRATCH_ALIGN = 256


@dataclass(frozen=True)
class LaunchPlan:
    """A variant's launches for one problem and stride layout, resolved once (sandbox/fastpath.py).

    buffers: name -> (shape, dtype name, zeroed): the arrays the caller allocates per call, on its
             own allocator and stream, beside the inputs (forward: out, lse; backward: D, dq, dk, dv, and
             a variant's scratch such as wgmma2's lse_pad and dq_acc).
             zeroed: False (uninitialised), True (zeros), or COUNTERS: zeros that the launch leaves
             at zero, the stream's kept buffer of sandbox/stream_counters.py (no allocation, no
             memset; fresh zeros while the stream is being captured into a graph).
    run(pointers, seed, offset, stream): launch on `stream` (a CuPy stream object) with `pointers`
             mapping every input and buffer name to a device address.
    keep:    device arrays the launches read (tile tables), held for the plan's lifetime.
    The uninitialised buffers that are not results (RESULTS: scratch such as D, lse_pad, dq_acc) share one
    allocation per call (`scratch`: name -> byte offset, 256-byte aligned; `scratch_bytes` in all): one
    trip through the caching allocator instead of one per buffer.
    """

    buffers: dict
    run: Callable
    keep: tuple = ()
    scratch: dict = field(init=False, default=None)
    scratch_bytes: int = field(init=False, default=0)

    def __post_init__(self):
        offsets, end = {}, 0
        for name, (shape, dtype, zeroed) in self.buffers.items():
            if zeroed is False and name not in RESULTS:
                offsets[name] = end
                end += -(-math.prod(shape) * ITEMSIZE[dtype] // SCRATCH_ALIGN) * SCRATCH_ALIGN
        object.__setattr__(self, "scratch", offsets)
        object.__setattr__(self, "scratch_bytes", end)
