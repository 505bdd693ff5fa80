"""fa1: FlashAttention-1 in exact float32 on CUDA cores (kernels_cu/fa1_exact.cu).

Seeds: FA1 paper Algorithm 1 (forward), Algorithm 2 (dropout and masking), and Algorithm 4 of
004_d1f618a8657308c1.txt (backward with masking and dropout).
- forward: one thread block per (batch, head); K/V tiles outer, Q tiles inner; O, l and m live in
  HBM and are read and written back on every step (the IO FA2 later removed); the logsumexp is
  formed at the end. `split="k"` (the default, FA1's partitioning: warps split the keys of a tile
  and reduce through shared memory) or `split="q"` (warps own query rows).
- backward: one thread block per (batch, K/V head): K/V tiles outer, Q tiles inner, P recomputed
  from the logsumexp, dropout replayed, dQ read-modified-written in HBM (no atomics: the block owns
  its rows). Deterministic by construction.
Br, Bc, warps and `block="auto-fa1"` (the paper's Bc = ceil(M/4d), Br = min(Bc, d)) as for `fa2`.
"""
from __future__ import annotations

from dataclasses import dataclass

from sandbox.launch import cuda_options, dropout_args, f32, i32, mask_args
from sandbox.loader import CompileUnit, launch
from sandbox.registry import Capabilities, Param, Variant, philox_rounds_param, register

from .fa2_exact import BLOCK_C, BLOCK_R, DROPOUT_STORE, FA2Config, FA2Exact, _qkv_strides, d_pad, packed_mask


@dataclass(frozen=True)
class FA1Config(FA2Config):
    def forward_name(self, D: int) -> str:
        sq = "true" if self.split == "q" else "false"
        return f"fa1_forward<{D}, {self.block_r}, {self.block_c}, {self.warps}, {sq}, {self.philox_rounds}>"

    def forward_smem(self, D: int) -> int:
        return super().forward_smem(D) + 4 * 2 * self.block_r       # + this step's m~ and l~

    def backward_name(self, D: int) -> str:
        br, bc, w = self.bwd_tiles(D)
        return f"fa1_backward<{D}, {br}, {bc}, {w}, {self.philox_rounds}>"

    def unit(self, D: int) -> CompileUnit:
        names = (self.forward_name(D), self.backward_name(D), "bwd_preprocess")
        br, bc, _ = self.bwd_tiles(D)
        ld = D + 4
        smem = {self.forward_name(D): self.forward_smem(D),
                self.backward_name(D): 4 * (2 * bc * ld + 2 * br * ld + 2 * bc * (br + 4))}
        return CompileUnit("fa1_exact.cu", names, cuda_options(), smem, label=f"fa1[D={D}]")


class FA1Exact(FA2Exact):
    def __init__(self):
        super().__init__(deterministic=True)
        self.name = "fa1"

    def configure(self, split="k", block_r=16, block_c=128, warps=4, philox_rounds=10, block="manual",
                  dropout_store="replay"):
        return FA1Config(split, block_r, block_c, warps, philox_rounds, True, block, dropout_store)

    def report_configs(self):
        return [{}, {"split": "q"}, {"split": "q", "block_r": 64, "block_c": 64}, {"block": "auto-fa1"}]

    TUNED = {("k", 16, 128, 4), ("q", 16, 128, 4), ("q", 64, 64, 4)}

    def forward(self, p, q, k, v, config):
        import cupy as xp
        D = d_pad(p.d)
        config = config.for_head_dim(D)
        unit = config.unit(D)
        out = xp.zeros((p.B, p.Hq, p.Nq, p.d), dtype=xp.float32)
        m = xp.full((p.B, p.Hq, p.Nq), -xp.inf, dtype=xp.float32)
        l = xp.zeros((p.B, p.Hq, p.Nq), dtype=xp.float32)
        lse = xp.empty((p.B, p.Hq, p.Nq), dtype=xp.float32)
        tiles, tile_heads = self._tiles(p, config.block_r, config.block_c, xp)
        name = config.forward_name(D)
        packed, saved = packed_mask(p, config, xp)
        launch(unit, name, (1, p.B * p.Hq), (32 * config.warps,),
               (q, *_qkv_strides(q), k, *_qkv_strides(k), v, *_qkv_strides(v), out, m, l, lse, tiles, tile_heads,
                i32(p.Hq), i32(p.group), i32(p.Nq), i32(p.Nk), i32(p.d), f32(p.scale),
                *mask_args(p, xp), *dropout_args(p), *packed),
               shared_mem=unit.dynamic_smem[name])
        return out, lse, saved

    def backward(self, p, dout, q, k, v, out, lse, config, saved=None):
        import cupy as xp
        D = d_pad(p.d)
        config = config.for_head_dim(D)
        packed = packed_mask(p, config, xp, saved, forward=False)[0]     # rejects a missing mask first
        unit = config.unit(D)
        br, bc, w = config.bwd_tiles(D)
        rows = p.B * p.Hq * p.Nq
        Dv = xp.empty((p.B, p.Hq, p.Nq), dtype=xp.float32)
        launch(unit, "bwd_preprocess", (-(-rows // 8),), (256,),
               (dout, *_qkv_strides(dout), out, Dv, i32(p.Hq), i32(p.Nq), i32(p.d), i32(rows)))
        dq = xp.zeros((p.B, p.Hq, p.Nq, p.d), dtype=xp.float32)
        dk = xp.zeros((p.B, p.Hkv, p.Nk, p.d), dtype=xp.float32)     # K/V tiles no row sees stay 0
        dv = xp.zeros((p.B, p.Hkv, p.Nk, p.d), dtype=xp.float32)
        tiles, tile_heads = self._tiles(p, br, bc, xp)
        name = config.backward_name(D)
        launch(unit, name, (1, p.B * p.Hkv), (32 * w,),
               (q, *_qkv_strides(q), k, *_qkv_strides(k), v, *_qkv_strides(v), dout, *_qkv_strides(dout),
                lse, Dv, dq, dk, dv, tiles, tile_heads, i32(p.Hq), i32(p.Hkv), i32(p.group),
                i32(p.Nq), i32(p.Nk), i32(p.d), f32(p.scale), *mask_args(p, xp), *dropout_args(p), *packed),
               shared_mem=unit.dynamic_smem[name])
        return dq, dk, dv


PARAMS = (
    Param("split", ("k", "q"), "k", "warp partitioning: k = FA1 (warps split keys), q = FA2 (warps own rows)"),
    Param("block_r", BLOCK_R, 16, "Br: query rows per inner step"),
    Param("block_c", BLOCK_C, 128, "Bc: keys per K/V tile (outer step)"),
    Param("warps", (2, 4, 8), 4, "warps per thread block"),
    philox_rounds_param(),
    Param("block", ("manual", "auto-fa1"), "manual",
          "auto-fa1: Br, Bc from the FA1 paper's rule Bc = ceil(M/4d), Br = min(Bc, d) on this device"),
    DROPOUT_STORE,
)

register(Variant(
    name="fa1", family="fa1", backend="cuda",
    description="FA1 exact fp32: K/V-outer tiles, O/l/m through HBM, split-K/Q warps, KV-outer backward",
    impl=FA1Exact(), params=PARAMS, caps=Capabilities(dtypes=("float32",), head_dims=tuple(range(1, 129))),
    seed_ref="FA1 paper Algorithms 1, 2 and 4 (004 Algorithm 4)",
    tags=("exact-ladder", "io:kv-outer"), bench_configs=({"split": "q"},),
    bench_sweep={"split": ("k", "q"), "block_r": (16, 64), "block_c": (64, 128), "warps": (4,)}))
