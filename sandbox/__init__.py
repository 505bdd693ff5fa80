"""sandbox: framework-free attention kernels (standard, FlashAttention-1/-2), swappable from Python.

    import sandbox
    out = sandbox.attention(q, k, v, variant="fa2", causal=True)
    res = sandbox.forward(q, k, v, variant="standard", dropout_p=0.1, seed=1)
    dq, dk, dv = sandbox.backward(dout, res)
    sandbox.variants()                      # what is registered, with capabilities

See docs/ARCHITECTURE.md for the contracts, README.md for the tools.
"""
from . import masks, oracle
from .api import Result, attention, backward, forward
from .philox import dropout_mask
from .registry import get_variant, variants

__all__ = ["attention", "forward", "backward", "variants", "get_variant", "dropout_mask",
           "oracle", "masks", "Result"]
