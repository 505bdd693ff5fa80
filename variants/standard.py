"""standard: standard attention, FA1 paper Algorithm 0, as raw CUDA (kernels_cu/standard.cu).

Forward:  S = scale * Q K^T -> HBM;  P = dropout(softmax(mask(S))) -> HBM (in place);  O = P V.
Backward: S recomputed, P_drop, dV = P_drop^T dO, dP_drop = dO V^T, D = rowsum(dO * O),
          dS = P * (dP - D), dQ = scale * dS K, dK = scale * dS^T Q (GQA: group-summed GEMMs).
Every N x N intermediate goes through HBM: Theta(N d + N^2) memory traffic, the IO the FlashAttention
variants remove. fp32 (exact tier) and fp16 (S, P stored in fp16, fp32 accumulation).
Status: correct against the oracle on the GPU; figures in bench/results/.
"""
from __future__ import annotations

from dataclasses import dataclass

from sandbox import arrays
from sandbox.launch import cuda_options, dropout_args, f32, i32, i64, mask_args, strides4
from sandbox.loader import CompileUnit, launch
from sandbox.registry import Capabilities, Variant, philox_rounds_param, register

CTYPE = {"float32": "float", "float16": "__half"}
ROW_THREADS = 256          # kernels_cu/standard.cu ROW_THREADS
GEMM_TILE, GEMM_THREADS = 64, 256


# ---- config

@dataclass(frozen=True)
class StandardConfig:
    philox_rounds: int = 10

    def unit(self, dtype: str) -> CompileUnit:
        return CompileUnit("standard.cu", self.names(dtype), cuda_options(), label=f"standard[{dtype}]")

    def names(self, dtype: str) -> tuple:
        t, r = CTYPE[dtype], self.philox_rounds
        return (f"standard_gemm<{t}, {t}, {t}>", f"standard_softmax<{t}, {r}>", f"standard_probs<{t}, {r}>",
                f"standard_rowdot<{t}>", f"standard_dscores<{t}, {r}>")


# ---- launch

class Operand:
    """A GEMM operand: array + element strides (batch, head, row, col) + head map (h * hmul + g) / hdiv."""

    def __init__(self, x, sb, sh, srow, scol, hmul=1, hdiv=1):
        self.args = (x, i64(sb), i64(sh), i64(srow), i64(scol), i32(hmul), i32(hdiv))


def rows_of(x, hmul=1, hdiv=1) -> Operand:
    """x [B, H, R, C] as an [R, C] operand."""
    sb, sh, sr, sc = arrays.element_strides(x)
    return Operand(x, sb, sh, sr, sc, hmul, hdiv)


def transposed(x, hmul=1, hdiv=1) -> Operand:
    """x [B, H, R, C] as a [C, R] operand."""
    sb, sh, sr, sc = arrays.element_strides(x)
    return Operand(x, sb, sh, sc, sr, hmul, hdiv)


def gemm(unit, dtype, a: Operand, b: Operand, c, H, M, N, K, G=1, alpha=1.0):
    t = CTYPE[dtype]
    B = c.shape[0]
    grid = (-(-N // GEMM_TILE), -(-M // GEMM_TILE), B * H)
    launch(unit, f"standard_gemm<{t}, {t}, {t}>", grid, (GEMM_THREADS,),
           (*a.args, *b.args, c, *strides4(c), i32(H), i32(M), i32(N), i32(K), i32(G), f32(alpha)))


class Standard:
    def configure(self, philox_rounds=10):
        return StandardConfig(philox_rounds)

    def to_backend(self, x, name="array"):
        return arrays.to_device(x, name)

    def compile_units(self, config):
        return [config.unit(dt) for dt in CTYPE]

    def _scores(self, p, q, k, unit, xp):
        S = xp.empty((p.B, p.Hq, p.Nq, p.Nk), dtype=q.dtype)
        gemm(unit, p.dtype, rows_of(q), transposed(k, 1, p.group), S, p.Hq, p.Nq, p.Nk, p.d, alpha=p.scale)
        return S

    def forward(self, p, q, k, v, config):
        import cupy as xp
        unit, t, r = config.unit(p.dtype), CTYPE[p.dtype], config.philox_rounds
        S = self._scores(p, q, k, unit, xp)
        lse = xp.empty((p.B, p.Hq, p.Nq), dtype=xp.float32)
        launch(unit, f"standard_softmax<{t}, {r}>", (p.B * p.Hq * p.Nq,), (ROW_THREADS,),
               (S, lse, i32(p.Hq), i32(p.Nq), i32(p.Nk), *mask_args(p, xp), *dropout_args(p)))
        out = xp.empty((p.B, p.Hq, p.Nq, p.d), dtype=q.dtype)
        gemm(unit, p.dtype, rows_of(S), rows_of(v, 1, p.group), out, p.Hq, p.Nq, p.d, p.Nk)
        return out, lse

    def backward(self, p, dout, q, k, v, out, lse, config):
        import cupy as xp
        unit, t, r = config.unit(p.dtype), CTYPE[p.dtype], config.philox_rounds
        G, rows = p.group, p.B * p.Hq * p.Nq
        common = (i32(p.Hq), i32(p.Nq), i32(p.Nk), *mask_args(p, xp), *dropout_args(p))
        S = self._scores(p, q, k, unit, xp)
        P = xp.empty_like(S)
        launch(unit, f"standard_probs<{t}, {r}>", (rows,), (ROW_THREADS,), (S, lse, P, *common))
        dv = xp.empty(v.shape, dtype=v.dtype)
        gemm(unit, p.dtype, transposed(P, G), rows_of(dout, G), dv, p.Hkv, p.Nk, p.d, p.Nq, G=G)
        dP = xp.empty_like(S)
        gemm(unit, p.dtype, rows_of(dout), transposed(v, 1, G), dP, p.Hq, p.Nq, p.Nk, p.d)
        D = xp.empty((p.B, p.Hq, p.Nq), dtype=xp.float32)
        (dsb, dsh, dsm, _), (osb, osh, osm, _) = strides4(dout), strides4(out)
        launch(unit, f"standard_rowdot<{t}>", (-(-rows // 8),), (256,),
               (dout, dsb, dsh, dsm, out, osb, osh, osm, D, i32(p.Hq), i32(p.Nq), i32(p.d), i32(rows)))
        launch(unit, f"standard_dscores<{t}, {r}>", (rows,), (ROW_THREADS,), (S, lse, D, dP, *common))
        dq = xp.empty(q.shape, dtype=q.dtype)
        gemm(unit, p.dtype, rows_of(dP), rows_of(k, 1, G), dq, p.Hq, p.Nq, p.d, p.Nk, alpha=p.scale)
        dk = xp.empty(k.shape, dtype=k.dtype)
        gemm(unit, p.dtype, transposed(dP, G), rows_of(q, G), dk, p.Hkv, p.Nk, p.d, p.Nq, G=G, alpha=p.scale)
        return dq, dk, dv


register(Variant(
    name="standard", family="standard", backend="cuda",
    description="Algorithm 0: S and P materialised in HBM; tiled fp32-accumulate GEMMs",
    impl=Standard(),
    params=(philox_rounds_param(),),
    caps=Capabilities(dtypes=("float32", "float16"), head_dims=tuple(range(1, 257))),
    seed_ref="FA1 paper Algorithm 0 (standard attention) and its backward",
    tags=("exact-ladder", "baseline", "io:materialised"),
))
