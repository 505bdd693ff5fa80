"""fa2, fa2-deterministic: FlashAttention-2 in exact float32 on CUDA cores (kernels_cu/fa2_exact.cu).

Seeds: FA2 paper Algorithm 1 (forward) and Algorithm 2 (backward), Sec. 3.3 (warp partitioning).
- forward: grid over (Q tiles, batch x heads); Q-outer loop over K/V tiles; online softmax with
  the rescaling deferred to the end; lse saved. `split="q"` (FA2: warps own query rows) or
  `split="k"` (FA1's partitioning: warps split the keys of each tile and reduce through shared
  memory). Br (`block_r`), Bc (`block_c`) and `warps` are template parameters chosen per call.
- backward: one block per K/V tile (column-parallel) with dQ by fp32 atomics (`fa2`), or the same
  dK/dV kernel plus a row-parallel dQ kernel with a fixed summation order (`fa2-deterministic`,
  bitwise reproducible). D = rowsum(dO * O) is a preprocessing kernel.
Tiles are classified on the host (empty / full / partial) for causal, window and block-sparse
masks; empty tiles are never loaded. Dropout replays the contract's Philox counters.
Status and speed: bench/results/ (this tier is the reference the tensor-core tier is checked
against; it runs on CUDA cores, so its ceiling is the fp32 FMA rate).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sandbox import arrays
from sandbox.device import SMEM_PER_BLOCK_OPTIN
from sandbox.launch import cuda_options, dropout_args, f32, i32, mask_args, strides4, tile_table
from sandbox.loader import CompileUnit, launch
from sandbox.registry import Capabilities, Param, Variant, philox_rounds_param, register

D_PADS = (32, 64, 96, 128)
SMEM_LIMIT = SMEM_PER_BLOCK_OPTIN["sm_90"]   # H100/H200 per-block opt-in maximum
ACC_REGS = 64                    # per-thread accumulator budget (rows x head-dim columns / 32)


def d_pad(d: int) -> int:
    return next(p for p in D_PADS if p >= d)


def device_smem_bytes() -> int:
    """Per-block opt-in shared memory of the current GPU; without one, the H100's."""
    from sandbox.device import cupy_or_none
    cp = cupy_or_none()
    if cp is None:
        return SMEM_LIMIT
    return int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["sharedMemPerBlockOptin"])


def fa1_rule(d: int, smem_bytes: int) -> tuple[int, int]:
    """The FA1 paper's block sizes (Algorithm 1, line 1): Bc = ceil(M / 4d), Br = min(Bc, d), with
    M the on-chip memory in elements (fp32 here)."""
    M = smem_bytes // 4
    bc = math.ceil(M / (4 * d))
    return min(bc, d), bc


# ---- config

@dataclass(frozen=True)
class FA2Config:
    split: str = "q"
    block_r: int = 64
    block_c: int = 64
    warps: int = 4
    philox_rounds: int = 10
    deterministic: bool = False
    block: str = "manual"
    dropout_store: str = "replay"

    def for_head_dim(self, D: int) -> "FA2Config":
        """block="auto-fa1": Br, Bc from the FA1 paper's rule on this device, rounded down to the
        sizes the kernel is built for and stepped down until the config fits its envelope."""
        if self.block == "manual":
            return self
        br_rule, bc_rule = fa1_rule(D, device_smem_bytes())
        brs = [b for b in BLOCK_R if b <= br_rule] or [min(BLOCK_R)]
        bcs = [b for b in BLOCK_C if b <= bc_rule] or [min(BLOCK_C)]
        for bc in sorted(bcs, reverse=True):
            for br in sorted(brs, reverse=True):
                cfg = replace(self, block_r=br, block_c=bc, block="manual")
                if not cfg.envelope_errors(D):
                    return cfg
        return replace(self, block_r=min(brs), block_c=min(bcs), block="manual")

    # forward geometry
    def rows_per_warp(self) -> int:
        return self.block_r // self.warps if self.split == "q" else self.block_r

    def cols_per_warp(self) -> int:
        return self.block_c if self.split == "q" else self.block_c // self.warps

    def forward_name(self, D: int) -> str:
        sq = "true" if self.split == "q" else "false"
        return f"fa2_forward<{D}, {self.block_r}, {self.block_c}, {self.warps}, {sq}, {self.philox_rounds}>"

    def forward_smem(self, D: int) -> int:
        ld = D + 4
        return 4 * (self.block_r * ld + 2 * self.block_c * ld
                    + self.warps * self.rows_per_warp() * (self.cols_per_warp() + 4) + self.warps * self.block_r)

    # backward geometry: fixed per head dim (keeps dK/dV accumulators within ACC_REGS)
    @staticmethod
    def bwd_tiles(D: int) -> tuple[int, int, int]:
        """(Br, Bc, warps) of the backward kernels."""
        return (64, 64, 4) if D <= 64 else (64, 32, 4)

    def dkdv_name(self, D: int) -> str:
        br, bc, w = self.bwd_tiles(D)
        atomic = "false" if self.deterministic else "true"
        return f"fa2_bwd_dkdv<{D}, {br}, {bc}, {w}, {atomic}, {self.philox_rounds}>"

    @staticmethod
    def dq_tiles(D: int) -> tuple[int, int, int]:
        """(Br, Bc, warps) of the deterministic dQ kernel (16 rows x 128 columns per warp spilled)."""
        return (64, 64, 4) if D <= 64 else (32, 32, 4)

    def dq_name(self, D: int) -> str:
        br, bc, w = self.dq_tiles(D)
        return f"fa2_bwd_dq<{D}, {br}, {bc}, {w}, {self.philox_rounds}>"

    def bwd_smem(self, D: int) -> dict:
        br, bc, w = self.bwd_tiles(D)
        qbr, qbc, qw = self.dq_tiles(D)
        ld = D + 4
        return {self.dkdv_name(D): 4 * (2 * bc * ld + 2 * br * ld + 2 * bc * (br + 4)),
                self.dq_name(D): 4 * (2 * qbr * ld + 2 * qbc * ld + 2 * qw * (qbr // qw) * (qbc + 4))}

    def unit(self, D: int) -> CompileUnit:
        names = [self.forward_name(D), self.dkdv_name(D), "bwd_preprocess"]
        if self.deterministic:
            names.append(self.dq_name(D))
        smem = {self.forward_name(D): self.forward_smem(D), **self.bwd_smem(D)}
        return CompileUnit("fa2_exact.cu", tuple(names), cuda_options(), smem, label=f"fa2[D={D}]")

    def envelope_errors(self, D: int) -> list[str]:
        """What this config cannot do at head dim D (empty: it can)."""
        errs = []
        rows, cols = self.rows_per_warp(), self.cols_per_warp()
        if self.block_r % self.warps:
            errs.append(f"block_r={self.block_r} is not a multiple of warps={self.warps}")
        if cols % 32:
            errs.append(f"each warp needs a multiple of 32 keys per tile; split={self.split!r} gives {cols}")
        if rows * D // 32 > ACC_REGS:
            errs.append(f"{rows} rows x head dim {D} per warp exceeds the {ACC_REGS}-register accumulator "
                        f"budget (split={self.split!r}: lower block_r or raise warps)")
        if rows * max(cols // 32, 1) > ACC_REGS:
            errs.append(f"{rows} rows x {cols} keys per warp exceeds the score-register budget")
        if self.forward_smem(D) > SMEM_LIMIT:
            errs.append(f"shared memory {self.forward_smem(D)} B exceeds {SMEM_LIMIT} B")
        return errs


# ---- launch

def _qkv_strides(x):
    return strides4(x)[:3]


def packed_mask(p, config, xp, saved=None, forward=True):
    """PACKED_PARAMS of exact_tiles.cuh and what the forward saves: with dropout_store="packed" the
    forward allocates the bit-packed keep mask [B, Hq, Nq, ceil(Nk/32)] uint32 and the backward
    reads it back from the forward's Result."""
    words = -(-p.Nk // 32)
    if config.dropout_store != "packed" or not p.dropout_p:
        return (xp.zeros(1, dtype=xp.uint32), i32(words), i32(0)), {}
    if forward:
        bits = xp.empty((p.B, p.Hq, p.Nq, words), dtype=xp.uint32)
        return (bits, i32(words), i32(1)), {"dropout_bits": bits}
    if not saved or "dropout_bits" not in saved:
        raise ValueError("dropout_store='packed': the backward reads the keep mask the forward stored; "
                         "pass the forward's Result to backward()")
    return (saved["dropout_bits"], i32(words), i32(1)), saved


class FA2Exact:
    def __init__(self, deterministic: bool):
        self.deterministic = deterministic
        self.name = "fa2-deterministic" if deterministic else "fa2"

    def configure(self, split="q", block_r=64, block_c=64, warps=4, philox_rounds=10, block="manual",
                  dropout_store="replay"):
        return FA2Config(split, block_r, block_c, warps, philox_rounds, self.deterministic, block, dropout_store)

    def to_backend(self, x, name="array"):
        return arrays.to_device(x, name)

    def check(self, problem, config, direction):
        config = config.for_head_dim(d_pad(problem.d))
        errs = config.envelope_errors(d_pad(problem.d))
        if errs:
            raise ValueError(f"variant {self.name!r} with {config}: " + "; ".join(errs))

    def report_configs(self):
        return [{}, {"split": "k", "block_r": 16, "block_c": 128}, {"split": "k", "block_r": 32, "block_c": 128},
                {"block_r": 32, "block_c": 32}, {"block_r": 128, "warps": 8}]

    # Configs whose compile report shows no spills at D = 64 and 128: the CI check holds them to it.
    # Split-K holds all Br rows per warp in registers: reported, not tuned.
    TUNED = {("q", 64, 64, 4), ("q", 128, 64, 8)}

    def tuned(self, config, unit=None) -> bool:
        if config.block != "manual":          # resolved per head dim and device: reported, not held
            return False
        return (config.split, config.block_r, config.block_c, config.warps) in self.TUNED

    def compile_units(self, config):
        return [config.for_head_dim(D).unit(D) for D in (64, 128) if not config.for_head_dim(D).envelope_errors(D)]

    def _tiles(self, p, br, bc, xp):
        return tile_table(p, br, bc, xp)

    def forward(self, p, q, k, v, config):
        import cupy as xp
        D = d_pad(p.d)
        config = config.for_head_dim(D)
        unit = config.unit(D)
        out = xp.empty((p.B, p.Hq, p.Nq, p.d), dtype=xp.float32)
        lse = xp.empty((p.B, p.Hq, p.Nq), dtype=xp.float32)
        tiles, tile_heads = self._tiles(p, config.block_r, config.block_c, xp)
        name = config.forward_name(D)
        packed, saved = packed_mask(p, config, xp)
        launch(unit, name, (-(-p.Nq // config.block_r), p.B * p.Hq), (32 * config.warps,),
               (q, *_qkv_strides(q), k, *_qkv_strides(k), v, *_qkv_strides(v), out, lse, tiles, tile_heads,
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
        dk = xp.empty((p.B, p.Hkv, p.Nk, p.d), dtype=xp.float32)
        dv = xp.empty((p.B, p.Hkv, p.Nk, p.d), dtype=xp.float32)
        tiles, tile_heads = self._tiles(p, br, bc, xp)
        masks, drop = mask_args(p, xp), dropout_args(p) + packed
        inputs = (q, *_qkv_strides(q), k, *_qkv_strides(k), v, *_qkv_strides(v), dout, *_qkv_strides(dout))
        name = config.dkdv_name(D)
        launch(unit, name, (-(-p.Nk // bc), p.B * p.Hkv), (32 * w,),
               (*inputs, lse, Dv, dq, dk, dv, tiles, tile_heads, i32(p.Hq), i32(p.Hkv), i32(p.group),
                i32(p.Nq), i32(p.Nk), i32(p.d), f32(p.scale), *masks, *drop),
               shared_mem=unit.dynamic_smem[name])
        if self.deterministic:
            name = config.dq_name(D)
            br, bc, w = config.dq_tiles(D)
            tiles, tile_heads = self._tiles(p, br, bc, xp)
            launch(unit, name, (-(-p.Nq // br), p.B * p.Hq), (32 * w,),
                   (*inputs, lse, Dv, dq, tiles, tile_heads, i32(p.Hq), i32(p.group), i32(p.Nq), i32(p.Nk),
                    i32(p.d), f32(p.scale), *masks, *drop),
                   shared_mem=unit.dynamic_smem[name])
        return dq, dk, dv


BLOCK_R, BLOCK_C = (16, 32, 64, 128), (32, 64, 128)
DROPOUT_STORE = Param("dropout_store", ("replay", "packed"), "replay",
                      "replay: the backward regenerates the mask from (seed, offset); packed: the forward "
                      "stores it bit-packed (Nq*Nk/8 bytes per head) and the backward reads it")
PARAMS = (
    Param("split", ("q", "k"), "q", "warp partitioning: q = FA2 (warps own rows), k = FA1 (warps split keys)"),
    Param("block_r", BLOCK_R, 64, "Br: query rows per thread block"),
    Param("block_c", BLOCK_C, 64, "Bc: keys per K/V tile"),
    Param("warps", (2, 4, 8), 4, "warps per thread block"),
    philox_rounds_param(),
    Param("block", ("manual", "auto-fa1"), "manual",
          "auto-fa1: Br, Bc from the FA1 paper's rule Bc = ceil(M/4d), Br = min(Bc, d) on this device"),
    DROPOUT_STORE,
)
CAPS = Capabilities(dtypes=("float32",), head_dims=tuple(range(1, 129)))

register(Variant(
    name="fa2", family="fa2", backend="cuda",
    description="FA2 exact fp32: Q-outer tiles, split-Q/K warps, column-parallel backward with atomic dQ",
    impl=FA2Exact(deterministic=False), params=PARAMS, caps=CAPS,
    seed_ref="FA2 paper Algorithms 1 and 2, Sec. 3.3",
    tags=("exact-ladder", "flagship", "io:q-outer"), bench_configs=({"split": "k", "block_r": 16, "block_c": 128},),
    bench_sweep={"split": ("q", "k"), "block_r": (16, 64, 128), "block_c": (64, 128), "warps": (4, 8)}))

register(Variant(
    name="fa2-deterministic", family="fa2", backend="cuda",
    description="FA2 exact fp32 with a deterministic backward (row-parallel dQ, no atomics)",
    impl=FA2Exact(deterministic=True), params=PARAMS, caps=CAPS,
    seed_ref="FA2 paper Algorithms 1 and 2 (dQ without atomics)",
    tags=("exact-ladder", "backward-rung")))
