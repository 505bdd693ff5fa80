"""Baselines timed in the same run as the sandbox's variants: PyTorch SDPA's backends (flash =
FlashAttention-2, cuDNN, memory-efficient, math = standard attention), a plain CuPy standard
attention (cuBLAS matmuls and CuPy elementwise kernels, S and P materialised) and a cuBLAS fp16
GEMM (the tensor-core ceiling). Each returns a zero-argument callable, or None where unavailable."""
from __future__ import annotations

SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")


def torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def sdpa(backend: str, B, H, Nq, Nk, d, dtype="float16", causal=False, direction="forward", Hkv=None):
    """A callable running SDPA with one backend forced, or None if it cannot run this problem."""
    torch = torch_or_none()
    if torch is None:
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    need_grad = direction != "forward"
    q = torch.randn(B, H, Nq, d, device="cuda", dtype=tdt, generator=gen, requires_grad=need_grad)
    k = torch.randn(B, Hkv or H, Nk, d, device="cuda", dtype=tdt, generator=gen, requires_grad=need_grad)
    v = torch.randn(B, Hkv or H, Nk, d, device="cuda", dtype=tdt, generator=gen, requires_grad=need_grad)
    kw = dict(is_causal=causal, enable_gqa=(Hkv or H) != H)
    fn = torch.nn.functional.scaled_dot_product_attention
    try:
        with sdpa_kernel([be]):
            out = fn(q, k, v, **kw)
            dout = torch.randn_like(out)
            if need_grad:
                out.backward(dout)
    except RuntimeError:
        return None

    def run_forward():
        with sdpa_kernel([be]), torch.no_grad():
            fn(q, k, v, **kw)

    def run_both():
        with sdpa_kernel([be]):
            o = fn(q, k, v, **kw)
        o.backward(dout)

    if direction != "backward":
        return run_forward if direction == "forward" else run_both
    # backward alone, as the sandbox's backward is timed: one forward kept, its graph replayed. (Until
    # 2026-11-22 this timed run_both with the backward's FLOPs, which understated SDPA's backward.)
    with sdpa_kernel([be]):
        o_kept = fn(q, k, v, **kw)

    def run_backward():
        torch.autograd.grad(o_kept, (q, k, v), dout, retain_graph=True)

    return run_backward


def cupy_standard_attention(q, k, v, causal=False):
    """softmax(scale Q K^T) V in plain CuPy, [B, H, N, d] arrays: S by cuBLAS in the input dtype,
    softmax in fp32 (safe: row max subtracted), P cast back, O = P V by cuBLAS; causal aligned
    bottom-right like the sandbox."""
    import math
    import cupy as cp
    Nq, Nk = q.shape[-2], k.shape[-2]
    s = cp.matmul(q, k.swapaxes(-1, -2)).astype(cp.float32) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        s[..., cp.triu(cp.ones((Nq, Nk), dtype=bool), k=Nk - Nq + 1)] = -cp.inf
    s = cp.exp(s - s.max(axis=-1, keepdims=True))
    return cp.matmul((s / s.sum(axis=-1, keepdims=True)).astype(q.dtype), v)


def cupy_standard(B, H, Nq, Nk, d, dtype="float16", causal=False, direction="forward"):
    """A callable timing cupy_standard_attention on random inputs; forward only (None otherwise)."""
    if direction != "forward":
        return None
    import cupy as cp
    gen = cp.random.default_rng(0)
    q, k, v = (gen.standard_normal((B, H, n, d), dtype=cp.float32).astype(dtype) for n in (Nq, Nk, Nk))
    return lambda: cupy_standard_attention(q, k, v, causal)


def gemm_fp16(n: int = 8192):
    """(callable, flops) of an n^3 fp16 matrix product through cuBLAS (via CuPy)."""
    import cupy as cp
    a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    return (lambda: cp.matmul(a, b)), 2.0 * n**3
