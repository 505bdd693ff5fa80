"""Rounding to kernel dtypes in NumPy (bf16 included, which NumPy lacks) and dtype facts."""
from __future__ import annotations

import numpy as np

DTYPES = ("float32", "float16", "bfloat16")
# Machine epsilon (spacing at 1.0) of each dtype: the "rounding noise" unit of the tolerance rule.
EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def dtype_name(x) -> str:
    """Canonical dtype name of an array or dtype (cupy/numpy/torch/str): float32/float16/bfloat16."""
    dt = getattr(x, "dtype", x)
    name = str(dt).replace("torch.", "")
    return {"float": "float32", "half": "float16"}.get(name, name)


def numpy_dtype(name: str):
    """The NumPy dtype of a dtype name; bfloat16 is ml_dtypes' (NumPy has none)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as e:
            raise RuntimeError("bfloat16 arrays need ml_dtypes (pip install ml_dtypes)") from e
        return np.dtype(ml_dtypes.bfloat16)
    if name in ("float32", "float16", "float64"):
        return np.dtype(name)
    raise ValueError(f"unknown dtype {name!r}; expected one of {DTYPES}")


def round_to(x, dtype: str) -> np.ndarray:
    """x rounded (to nearest even) to `dtype`, returned as float64."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float64":
        return x
    if dtype in ("float32", "float16"):
        return x.astype(dtype).astype(np.float64)
    if dtype == "bfloat16":
        f = x.astype(np.float32)
        bits = f.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16   # round half to even
        out = rounded.astype(np.uint32).view(np.float32).astype(np.float64)
        return np.where(np.isnan(f), np.nan, out)
    raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")

