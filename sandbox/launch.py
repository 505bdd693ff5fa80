"""Kernel-argument builders shared by the CUDA variants: masks, dropout and strides, every scalar
typed explicitly (CuPy would pass a bare Python int as long long)."""
from __future__ import annotations

import numpy as np

from . import arrays, loader
from .problem import Problem

i32, f32, u32, u64, i64 = np.int32, np.float32, np.uint32, np.uint64, np.int64


def cuda_options() -> tuple:
    """NVRTC options for run-time builds: the CUDA headers' include path where one is found."""
    return tuple(f"-I{d}" for d in loader.cuda_include_dirs())


def mask_args(problem: Problem, xp) -> tuple:
    """MASK_PARAMS of common.cuh: band lo/hi, element layout (or a dummy), its heads and geometry."""
    band = problem.band
    bm = problem.block_mask
    if bm is None:
        return (i32(band.lo), i32(band.hi), xp.zeros(1, dtype=xp.uint8), i32(0), i32(1), i32(1), i32(1), i32(1))
    layout = xp.asarray(bm.layout.astype(np.uint8))
    Hm, nbq, nbk = bm.layout.shape
    return (i32(band.lo), i32(band.hi), layout, i32(Hm), i32(bm.block[0]), i32(bm.block[1]), i32(nbq), i32(nbk))


def dropout_args(problem: Problem) -> tuple:
    """DROPOUT_PARAMS of common.cuh: threshold, 1/(1-p), seed, offset."""
    p = problem.dropout_p
    return (u32(problem.dropout_threshold), f32(1.0 / (1.0 - p)), u64(problem.seed), u32(problem.offset))


def strides4(x) -> tuple:
    """Element strides of a 4-D array as four int64 scalars."""
    return tuple(i64(s) for s in arrays.element_strides(x))
