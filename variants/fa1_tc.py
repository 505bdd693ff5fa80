"""fa1-tc: FlashAttention-1 forward on tensor cores (fp16), kernels_cu/fa1_tc.cu.

Seed: FA1 paper Algorithm 1 (K/V-outer loop, O, l and m read from and written back to HBM on
every step, O kept normalised) and Algorithm 2 (dropout). One thread block per (batch, head), as in
FA1; the block's warps split each Q tile's rows. Built from the same parts as fa2-tc (mma.sync,
ldmatrix from swizzled tiles, cp.async, the softmax of kernels_cu/tc_softmax.cuh), so that the
FA2-over-FA1 ratio is measured on equal hardware footing: what differs is the loop order, the HBM
round trips of O, l, m (fp32 scratch, allocated per call) and the parallelism over batch x heads only.
Same features and envelope as fa2-tc. Status and speed: bench/results/<gpu>/ (tensor-core grid).
"""
from __future__ import annotations

from dataclasses import dataclass

from sandbox.launch import cuda_options
from sandbox.loader import CompileUnit
from sandbox.registry import Param, Variant, philox_rounds_param, register

from .fa2_tc import CAPS, CTYPE, FA2TensorCore, TCConfig


# ---- config

@dataclass(frozen=True)
class FA1TCConfig(TCConfig):
    block_r: int = 128
    block_c: int = 64
    warps: int = 8
    min_blocks: object = "auto"
    def forward_name(self, dtype: str, D: int, dropout: bool) -> str:
        return (f"fa1_tc_forward<{CTYPE[dtype]}, {D}, {self.block_r}, {self.block_c}, {self.warps}, "
                f"{self.philox_rounds}, {'true' if dropout else 'false'}>")

    def unit(self, dtype: str, D: int) -> CompileUnit:
        names = tuple(self.forward_name(dtype, D, drop) for drop in (False, True))
        return CompileUnit("fa1_tc.cu", names, cuda_options(), {n: self.forward_smem(D) for n in names},
                           label=f"fa1-tc[{dtype}, D={D}]")


# ---- launch

class FA1TensorCore(FA2TensorCore):
    name = "fa1-tc"
    has_backward = False
    # no spills at D = 64 and 128 (Br=64 with 4 warps spills 88 bytes at D = 128 with dropout)
    # keys as FA2TensorCore.tuned compares them: (block_r, block_c, warps, min_blocks, split)
    TUNED = {(128, 64, 8, "auto", "q")}

    # FA2TensorCore's pointer-level plans launch fa2_tc's grid without fa1's O / m / l scratch: not
    # for this kernel, which takes the generic path (sandbox/fastpath.py)
    forward_plan = None
    backward_plan = None

    def configure(self, block_r=128, block_c=64, warps=8, philox_rounds=10):
        return FA1TCConfig(block_r, block_c, warps, "auto", philox_rounds)

    def report_configs(self):
        return [{}, {"block_r": 64, "warps": 4}]

    def forward(self, p, q, k, v, config):
        import cupy as xp
        o_acc = xp.zeros((p.B, p.Hq, p.Nq, p.d), dtype=xp.float32)          # O, m, l in HBM (Algorithm 1, line 2)
        m_acc = xp.full((p.B, p.Hq, p.Nq), -xp.inf, dtype=xp.float32)
        l_acc = xp.zeros((p.B, p.Hq, p.Nq), dtype=xp.float32)
        return self.launch(p, q, k, v, config, (1, p.B * p.Hq), (o_acc, m_acc, l_acc))

register(Variant(
    name="fa1-tc", family="fa1", backend="cuda",
    description="FA1 forward on tensor cores: K/V-outer loop, O/l/m through HBM, one block per (batch, head)",
    impl=FA1TensorCore(),
    params=(Param("block_r", (64, 128), 128, "Br: query rows per inner step"),
            Param("block_c", (32, 64, 128), 64, "Bc: keys per K/V tile (outer step)"),
            Param("warps", (4, 8), 8, "warps per thread block (Br / warps rows each, a multiple of 16)"),
            philox_rounds_param()),
    caps=CAPS, seed_ref="FA1 paper Algorithms 1 and 2",
    tags=("tc-ladder",)))
