import numpy as np, cupy as cp
try:
    import ml_dtypes; print("ml_dtypes", ml_dtypes.__version__)
    a = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16)
    try: print("cupy.asarray(ml bf16):", cp.asarray(a).dtype)
    except Exception as e: print("cupy.asarray(ml bf16) fails:", type(e).__name__, e)
except ImportError as e: print("no ml_dtypes", e)
import torch
t = torch.arange(6, dtype=torch.bfloat16, device="cuda")
try: print("from_dlpack(torch bf16):", cp.from_dlpack(t).dtype)
except Exception as e: print("from_dlpack(torch bf16) fails:", type(e).__name__, e)
print("cupy", cp.__version__, "has bfloat16 attr:", hasattr(cp, "bfloat16"))
