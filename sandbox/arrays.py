"""Array interop: NumPy, CuPy and any DLPack / __cuda_array_interface__ array in, the caller's type out.

`to_backend` takes the caller's arrays to the backend's array module without copies where it can
(CuPy and PyTorch CUDA tensors are wrapped zero-copy); `from_backend` hands results back as the
caller's type. bf16 arrays carry ml_dtypes' bfloat16 dtype on the host and in CuPy; CuPy has no
arithmetic for it, so `to_float32`, `from_float32` and `negate` work on the 16-bit patterns.
"""
from __future__ import annotations

import sys

import numpy as np

from .device import cupy_or_none


def kind_of(x) -> str:
    mod = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod == "cupy":
        return "cupy"
    if hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__"):
        return mod
    raise ValueError(f"unsupported array type {type(x).__name__}: pass NumPy, CuPy, or a DLPack / "
                     "__cuda_array_interface__ array")


def to_device(x, name="array"):
    """A CuPy view (zero-copy) or copy (NumPy) of x on the current GPU, with unit stride along d.

    CUDA kernels take strides but index d with unit stride; NumPy inputs are copied (contiguous),
    device arrays are taken as they are and rejected if their last axis is strided."""
    d = _to_device(x)
    check_unit_stride_d(d, name)
    return d


def _to_device(x):
    cp = cupy_or_none()
    if cp is None:
        raise RuntimeError("CUDA arrays need a GPU with CuPy installed")
    kind = kind_of(x)
    if kind == "cupy":
        return x
    if kind == "numpy":
        return cp.asarray(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cp.asarray(x)
    return cp.from_dlpack(x)


def to_host(x):
    """NumPy view or copy of x (for the simulator and for oracles)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get"):
        return x.get()
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().cpu().numpy()
    return np.asarray(x)


def like(result, caller_kind: str):
    """result (CuPy or NumPy) converted to the caller's array kind."""
    if caller_kind == "numpy":
        return to_host(result)
    if caller_kind == "cupy":
        return result
    module = sys.modules.get(caller_kind)
    if module is not None and hasattr(module, "from_dlpack"):
        return module.from_dlpack(result)
    return result


def check_unit_stride_d(x, what: str):
    """Kernels take strides but need unit stride along d (the last axis)."""
    strides = getattr(x, "strides", None)
    if strides is not None and x.shape[-1] > 1 and strides[-1] != x.itemsize:
        raise ValueError(f"{what} must have unit stride along d (last axis); got strides {strides}")


def element_strides(x) -> tuple[int, ...]:
    return tuple(s // x.itemsize for s in x.strides)


# ---- 16-bit helpers that also work where the array module has no bfloat16 arithmetic (CuPy)

def to_float32(x, xp):
    """x as float32; bfloat16 via its bit pattern (the high half of a float32)."""
    if str(x.dtype) != "bfloat16":
        return x.astype(xp.float32)
    return (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)


def from_float32(x, dtype, xp):
    """float32 x rounded to nearest even in `dtype`; bfloat16 through the bit pattern (NaN stays NaN)."""
    if str(dtype) != "bfloat16":
        return x.astype(dtype)
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    r = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
    r = xp.where(xp.isnan(x), xp.uint16(0x7FC0), r)
    return r.view(dtype)


def negate(x, xp):
    """-x for a 16-bit float array: the sign bit flipped (a contiguous copy)."""
    return (xp.ascontiguousarray(x).view(xp.uint16) ^ xp.uint16(0x8000)).view(x.dtype)
