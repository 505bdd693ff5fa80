"""Array interop: NumPy, CuPy and any DLPack / __cuda_array_interface__ array in, the caller's type out.

`to_backend` takes the caller's arrays to the backend's array module without copies where it can
(CuPy and PyTorch CUDA tensors are wrapped zero-copy); `like` hands results back as the caller's
type. bf16 arrays carry ml_dtypes' bfloat16 dtype on the host and in CuPy; CuPy has no arithmetic
for it, so `to_float32`, `from_float32` and `negate` work on the 16-bit patterns.

PyTorch tensors are wrapped from their data pointer, shape and strides rather than through
`__cuda_array_interface__`, which torch refuses for bfloat16 and for tensors that require grad (the
plain API treats those as data: `.detach()` shares the storage). Results go back through DLPack,
bfloat16 as its 16-bit pattern (CuPy cannot export a bfloat16 DLPack tensor) viewed as
torch.bfloat16: zero-copy both ways.

`caller_stream(x)` is the stream rule: every launch of a call goes to the caller's current stream
(torch's for torch tensors, CuPy's for CuPy and NumPy arrays), on the array's device.
"""
from __future__ import annotations

import contextlib
import functools
import sys

import numpy as np

from .device import cupy_or_none


def kind_of(x) -> str:
    mod = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod in ("cupy", "torch"):       # torch: before hasattr, which torch's interface raises through
        return mod
    if hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__"):
        return mod
    raise ValueError(f"unsupported array type {type(x).__name__}: pass NumPy, CuPy, or a DLPack / "
                     "__cuda_array_interface__ array")


def to_device(x, name="array"):
    """A CuPy view (zero-copy) or copy (NumPy) of x on the current GPU, with unit stride along d.

    CUDA kernels take strides but index d with unit stride; NumPy inputs are copied (contiguous),
    device arrays are taken as they are and rejected if their last axis is strided."""
    d = _to_device(x, name)
    check_unit_stride_d(d, name)
    return d


def _to_device(x, name="array"):
    cp = cupy_or_none()
    if cp is None:
        raise RuntimeError("CUDA arrays need a GPU with CuPy installed")
    kind = kind_of(x)
    if kind == "cupy":
        return x
    if kind == "numpy":
        return cp.asarray(x)
    if kind == "torch":
        return torch_to_cupy(x, name)
    if hasattr(x, "__cuda_array_interface__"):
        return cp.asarray(x)
    return cp.from_dlpack(x)


def _torch_numpy_dtype(t):
    name = str(t.dtype).removeprefix("torch.")
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        raise ValueError(f"unsupported torch dtype {t.dtype}") from None


def torch_to_cupy(t, name="array"):
    """A CuPy view of a CUDA torch tensor (any dtype CuPy holds, bf16 included; requires_grad is
    ignored: the plain API reads the data), sharing its storage and keeping it alive."""
    import cupy as cp
    if not t.is_cuda:
        raise ValueError(f"{name} is a torch tensor on {t.device}; move it to a CUDA device first")
    dtype = _torch_numpy_dtype(t)
    item = dtype.itemsize
    shape, strides = tuple(t.shape), tuple(t.stride())
    if t.numel() == 0:
        return cp.empty(shape, dtype)
    span = (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * item
    mem = cp.cuda.UnownedMemory(t.data_ptr(), span, t, t.device.index)
    return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0), tuple(s * item for s in strides))


def cupy_to_torch(x):
    """A torch view of a CuPy array (DLPack); bfloat16 travels as its 16-bit pattern."""
    import torch
    if str(x.dtype) == "bfloat16":
        import cupy as cp
        return torch.from_dlpack(x.view(cp.uint16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


_EXTERNAL_STREAMS: dict = {}


def _external_stream(ptr: int, device: int):
    """cupy.cuda.ExternalStream for a raw stream handle, made once per (handle, device)."""
    key = (ptr, device)
    s = _EXTERNAL_STREAMS.get(key)
    if s is None:
        import cupy as cp
        if len(_EXTERNAL_STREAMS) > 256:
            _EXTERNAL_STREAMS.clear()
        s = _EXTERNAL_STREAMS[key] = cp.cuda.ExternalStream(ptr, device)
    return s


def torch_stream_ptr(device_index: int) -> int:
    """The raw handle of torch's current stream on a device (no Stream object is built)."""
    import torch
    return torch._C._cuda_getCurrentRawStream(device_index)


class _TorchBlock:
    """Owner of a block from torch's caching allocator: given back when CuPy drops the memory."""

    __slots__ = ("ptr", "free")

    def __init__(self, ptr, free):
        self.ptr, self.free = ptr, free

    def __del__(self):
        try:
            self.free(self.ptr)
        except Exception:       # interpreter shutdown: torch may already be gone
            pass


def _torch_allocator(size: int):
    """CuPy allocator drawing from torch's caching allocator on torch's current stream: for torch
    callers, scratch and results share torch's pool (no second cache holding memory torch cannot
    reuse) and follow torch's rules under CUDA-graph capture (the graph's private pool)."""
    import cupy as cp
    import torch
    dev = cp.cuda.runtime.getDevice()
    ptr = torch.cuda.caching_allocator_alloc(max(size, 1), dev, torch_stream_ptr(dev))
    mem = cp.cuda.UnownedMemory(ptr, size, _TorchBlock(ptr, torch.cuda.caching_allocator_delete), dev)
    return cp.cuda.MemoryPointer(mem, 0)


@contextlib.contextmanager
def caller_stream(x):
    """Run the body with CuPy's device and current stream set to the caller's: for a torch tensor
    torch's current stream on its device (and torch's allocator), for a CuPy array CuPy's current
    stream on its device. Allocations and launches inside follow it; nothing here synchronises."""
    kind = kind_of(x)
    if kind == "torch" and x.is_cuda:
        dev = x.device.index
        import cupy as cp
        with cp.cuda.Device(dev), _external_stream(torch_stream_ptr(dev), dev), \
                cp.cuda.using_allocator(_torch_allocator):
            yield
    elif kind == "cupy":
        with x.device:
            yield
    else:
        yield


def to_host(x):
    """NumPy view or copy of x (for the simulator and for oracles)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get"):
        return x.get()
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if type(x).__module__.split(".")[0] == "torch":
        t = x.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            import ml_dtypes
            import torch
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(x)


def like(result, caller_kind: str):
    """result (CuPy or NumPy) converted to the caller's array kind."""
    if caller_kind == "numpy":
        return to_host(result)
    if caller_kind == "cupy":
        return result
    if caller_kind == "torch" and type(result).__module__.split(".")[0] == "cupy":
        return cupy_to_torch(result)
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
    """float32 x rounded to nearest even in `dtype`; bfloat16 through the bit pattern (NaN stays NaN). On the GPU
    one elementwise kernel (the NumPy form's seven array operations were seven launches and passes: 0.8 ms for a
    16k-token dQ on the H100)."""
    if str(dtype) != "bfloat16":
        return x.astype(dtype)
    if xp.__name__ == "cupy":
        return _bf16_round()(xp.ascontiguousarray(x, dtype=xp.float32)).view(dtype)
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    r = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
    r = xp.where(xp.isnan(x), xp.uint16(0x7FC0), r)
    return r.view(dtype)


@functools.lru_cache(maxsize=None)
def _bf16_round():
    """from_float32's rounding as one CuPy elementwise kernel: float32 -> bfloat16 bits, nearest even, NaN 0x7FC0."""
    import cupy as cp
    return cp.ElementwiseKernel(
        "float32 x", "uint16 y",
        "const unsigned int u = __float_as_uint(x);"
        "y = isnan(x) ? (unsigned short)0x7FC0 : (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);",
        "sandbox_round_to_bf16")


def negate(x, xp):
    """-x for a 16-bit float array: the sign bit flipped (a contiguous copy)."""
    return (xp.ascontiguousarray(x).view(xp.uint16) ^ xp.uint16(0x8000)).view(x.dtype)
