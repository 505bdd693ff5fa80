"""Tensor maps for the TMA rungs (kernels_cu/fa3_ws.cu): a (B, H, N, d) 16-bit array described to the
copy engine as a 4-D tensor (d, N, H, B) with the caller's strides, read in boxes of 64 columns x
`rows` rows with the 128-byte swizzle that the wgmma operands need (kernels_cu/hopper.cuh).

A map is 128 opaque bytes (CUtensorMap) that encodes the base address, so it is built per array
on the host with cuTensorMapEncodeTiled (cuda.bindings.driver) and passed to the kernel by value,
as a `const __grid_constant__` parameter. CuPy's launch packs only scalars and arrays, so these
kernels launch through loader.PackedLaunch, whose parameter array holds the 128 bytes themselves
(an `Opaque` argument, or a Slot of ctype "map" refilled per call from the map's address): the
driver copies each parameter's bytes from the pointer it is given, whatever the type.

Maps are cached by (address, shape, strides, dtype, box): a training loop that reuses the caching
allocator's blocks re-encodes nothing (encoding costs a few microseconds of host time).
"""
from __future__ import annotations

import functools

from .precision import dtype_name

ITEMSIZE = 2
BOX_COLS = 64           # 64 16-bit columns = 128 bytes: one swizzle row, one panel


class Opaque:
    """A by-value kernel argument of raw bytes (a CUtensorMap), for loader.PackedLaunch."""

    __slots__ = ("address", "nbytes", "keep")

    def __init__(self, address: int, nbytes: int, keep=None):
        self.address, self.nbytes, self.keep = address, nbytes, keep


def usable_strides(shape, strides) -> tuple | None:
    """Byte strides of dims N, H, B as TMA takes them, or None where it cannot: each a multiple of
    16 bytes and nonzero. Extent-1 dims get a harmless stride (any value describes them)."""
    B, H, N, d = shape
    out = []
    inner = d * ITEMSIZE
    for extent, st in ((N, strides[2]), (H, strides[1]), (B, strides[0])):
        byte = st * ITEMSIZE
        if extent == 1:
            byte = max(inner, 16)
            byte += -byte % 16
        if byte <= 0 or byte % 16 or byte >= 1 << 40:
            return None
        out.append(byte)
        inner = byte * extent
    return tuple(out)


@functools.lru_cache(maxsize=512)
def _encode(ptr: int, dtype: str, shape: tuple, byte_strides: tuple, rows: int):
    from cuda.bindings import driver as drv
    B, H, N, d = shape
    kind = {"float16": drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            "bfloat16": drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16}[dtype]
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t
    err, tmap = drv.cuTensorMapEncodeTiled(
        kind, 4, ptr, [u64(x) for x in (d, N, H, B)], [u64(x) for x in byte_strides],
        [u32(BOX_COLS), u32(rows), u32(1), u32(1)], [u32(1)] * 4,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)       # out of bounds: zeros
    if err != drv.CUresult.CUDA_SUCCESS:
        raise ValueError(f"cuTensorMapEncodeTiled refused shape {shape}, byte strides {byte_strides}, "
                         f"address {ptr:#x}: {err}")
    return tmap


def tensor_map(ptr: int, dtype: str, shape: tuple, strides: tuple, rows: int) -> Opaque:
    """The map of a (B, H, N, d) array at `ptr` with element `strides`, boxes of 64 x `rows`.
    ValueError where TMA cannot describe it (the caller copies to a contiguous array first)."""
    byte_strides = usable_strides(shape, strides)
    if byte_strides is None or ptr % 16:
        raise ValueError(f"TMA needs 16-byte aligned rows and base (strides {tuple(strides)} elements, "
                         f"address {ptr:#x})")
    tmap = _encode(int(ptr), dtype, tuple(int(s) for s in shape), byte_strides, int(rows))
    return Opaque(int(tmap.getPtr()), 128, tmap)


def map_of(x, rows: int) -> Opaque:
    """tensor_map of a CuPy array."""
    from .arrays import element_strides
    return tensor_map(x.data.ptr, dtype_name(x), tuple(x.shape), element_strides(x), rows)
