"""fa2-tc-naive: the first rung of the tensor-core ladder, kernels_cu/fa2_tc_naive.cu.

Seed: FA2 paper Algorithm 1 (forward), Sec. 3.1 and 3.3, as fa2-tc. The rung: mma.sync.m16n8k16
with fp32 accumulation and P in registers, but operands loaded into registers by plain 32/16-bit
shared-memory loads from unswizzled tiles (no ldmatrix, bank conflicts) and K/V tiles copied
synchronously between barriers (no cp.async overlap). fa2-tc is the next rung: ldmatrix from
XOR-swizzled tiles and cp.async copies in flight during the GEMMs. Same features and envelope as
fa2-tc (softmax, masks, dropout and epilogue are shared code: kernels_cu/tc_softmax.cuh).
Status and speed: bench/results/<gpu>/ (the tensor-core table lists both rungs).
"""
from __future__ import annotations

from dataclasses import dataclass

from sandbox.launch import cuda_options
from sandbox.loader import CompileUnit
from sandbox.registry import Param, Variant, philox_rounds_param, register

from .fa2_tc import CAPS, CTYPE, FA2TensorCore, TCConfig


# ---- config

@dataclass(frozen=True)
class NaiveConfig(TCConfig):
    block_r: int = 64
    block_c: int = 64
    min_blocks: object = "auto"
    def forward_name(self, dtype: str, D: int, dropout: bool) -> str:
        return (f"fa2_tc_naive_forward<{CTYPE[dtype]}, {D}, {self.block_r}, {self.block_c}, {self.warps}, "
                f"{self.philox_rounds}, {'true' if dropout else 'false'}>")

    def unit(self, dtype: str, D: int) -> CompileUnit:
        names = tuple(self.forward_name(dtype, D, drop) for drop in (False, True))
        return CompileUnit("fa2_tc_naive.cu", names, cuda_options(), {n: self.forward_smem(D) for n in names},
                           label=f"fa2-tc-naive[{dtype}, D={D}]")


# ---- launch (fa2-tc's: same signature, grid and tile table)

class FA2TensorCoreNaive(FA2TensorCore):
    name = "fa2-tc-naive"
    has_backward = False
    # keys as FA2TensorCore.tuned compares them: (block_r, block_c, warps, min_blocks, split)
    TUNED = {(64, 64, 4, "auto", "q")}

    def configure(self, block_r=64, block_c=64, warps=4, philox_rounds=10):
        return NaiveConfig(block_r, block_c, warps, "auto", philox_rounds)

    def report_configs(self):
        return [{}]


register(Variant(
    name="fa2-tc-naive", family="fa2", backend="cuda",
    description="FA2 forward on tensor cores, rung 1: mma.sync with plain shared loads, synchronous copies",
    impl=FA2TensorCoreNaive(),
    params=(Param("block_r", (64, 128), 64, "Br: query rows per thread block"),
            Param("block_c", (32, 64), 64, "Bc: keys per K/V tile"),
            Param("warps", (4, 8), 4, "warps per thread block (Br / warps rows each, a multiple of 16)"),
            philox_rounds_param()),
    caps=CAPS, seed_ref="FA2 paper Algorithm 1, Sec. 3.1 and 3.3",
    tags=("tc-ladder",)))
