"""fa2-tc, fa2-tc-deterministic: FlashAttention-2 on tensor cores (fp16, bf16), kernels_cu/fa2_tc.cu
(forward) and kernels_cu/fa2_tc_bwd.cu (backward).

Seed: FA2 paper Algorithm 1 (forward), Sec. 3.1 (exp2 with the scale folded in, one rescale of O at
the end), Sec. 3.3 (warp partitioning) and Algorithm 2 (backward). The forward rung: mma.sync.m16n8k16
with fp32 accumulation, ldmatrix from XOR-swizzled shared memory, cp.async copies overlapped with
the two GEMMs (V_j during S = Q K_j^T, K_{j+1} during softmax and P V_j), P kept in registers.
Forward parameters: Br (`block_r`), Bc (`block_c`, auto per head dim), `warps`, `min_blocks` (the
occupancy axis), `split` ("q": warps own rows, "k": warps own keys and reduce through shared memory),
`philox_rounds`. Backward: column-parallel (one block per K/V tile) with fp32 float4 dQ atomics
(`fa2-tc`), or a dK/dV column kernel plus a row-parallel dQ kernel with a fixed summation order
(`fa2-tc-deterministic`); `bwd_block_r`, `bwd_block_c` and `bwd_min_blocks` pick its tile and occupancy,
`bwd_pre` its preprocessing D = rowsum(dO o O) (one kernel, or the CuPy expression: the rung below).
The backward also serves the Hopper rungs' forwards (fa3_wgmma.py, fa3_ws.py) up to d = 256: D = 192 and 256
(`bwd_d_pad`) run fa2_tc_bwd_wide (two warps per 16-key strip, each with dK / dV for half the head dim; one
tile, Br = Bc = 64, 8 warps; atomic dQ only).
Features: causal (tiles above the diagonal never loaded), window, block-sparse (host tile table),
GQA/MQA, any Nq and Nk, dead rows, dropout bit-exact with the RNG contract, negative and zero scale.
Envelope: head dim a multiple of 8 up to 128 (zero-filled to 64 or 128), 16-byte aligned rows
(cp.async copies 16 bytes); ValueError before launch otherwise.
Status and speed (H100, bench/results/h100/): more than 5,000 oracle-checked examples per dtype and
direction, 0 failures, sanitizer clean. Forward 0.92-1.00x PyTorch SDPA flash at d = 64 and
0.90-0.94x at d = 128 with the defaults (N = 2k-16k, causal and not); forward + backward 0.71-0.88x
and 0.73-0.86x (638f5f8). The rung below is fa2-tc-naive.
"""
from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass

import numpy as np

from sandbox import arrays, modifiers
from sandbox.device import SMEM_PER_BLOCK_OPTIN
from sandbox.launch import (LaunchPlan, _cached, cuda_options, dropout_args, f32, i32, i64, mask_args, strides4,
                            tile_table, u32, u64)
from sandbox.loader import CompileUnit, PackedLaunch, Slot, get_kernel, launch
from sandbox.masks import classify_tiles, classify_tiles_mod
from sandbox.precision import dtype_name
from sandbox.registry import Capabilities, Param, Variant, philox_rounds_param, register

from . import mask_tiles

LOG2E = 1.4426950408889634      # exp(x) = exp2(x * LOG2E): the kernel's scores are in log2 units
SMEM_LIMIT = SMEM_PER_BLOCK_OPTIN["sm_90"]  # H100/H200 per-block opt-in maximum
CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
ITEMSIZE = 2
MAX_FLOAT_POSITION = 2 ** 24     # i, j as floats (a score modifier's fi, fj) are exact up to here


def d_pad(d: int) -> int:
    return 64 if d <= 64 else 128


BWD_HEAD_DIMS = (64, 128, 192, 256)     # the backward's padded head dims (fa2_tc_bwd: 64, 128; fa2_tc_bwd_wide: 192, 256)


def bwd_d_pad(d: int) -> int:
    """The backward kernel's head dim D of a head dim d: the next of BWD_HEAD_DIMS (d = 96 runs D = 128, d = 136
    D = 192, d = 200 D = 256; the forward of fa2-tc stops at 128, the fa3 rungs' forwards pad the same way).
    Past 256: 256 + 64, which no kernel holds (backward_errors refuses it by name)."""
    return next((D for D in BWD_HEAD_DIMS if d <= D), BWD_HEAD_DIMS[-1] + 64)


SCALE_LOG2_FLOOR = 2.0 ** -100


def scale_log2(scale: float) -> float:
    """|scale| log2(e), at least 2^-100: the kernels need a positive factor. A zero scale becomes
    2^-100, which leaves every score's exponent 2^(s 2^-100 - m) equal to 1 in fp32, as it should."""
    return max(abs(scale) * LOG2E, SCALE_LOG2_FLOOR)


def seeds_bias(p) -> bool:
    """A distance bias (ScoreMod.cuda_distance_slope) goes into the S accumulator as slope (j - i) / |scale|
    (kernels_cu/tc_mods.cuh), which needs |scale| log2 e above the floor of scale_log2: at scale 0 the seed
    would be infinite, and below the floor the softmax's factor would not be |scale| log2 e. There the
    modifier's text runs instead (FA_SCORE_MOD on the scaled scores)."""
    sm = p.score_mod
    return sm is not None and sm.cuda_distance_slope is not None and abs(p.scale) * LOG2E >= SCALE_LOG2_FLOOR


def score_text(p) -> bool:
    """Whether p's forward module compiles a score modifier's text (FA_SCORE_MOD, modifiers.cuda_defines): a score
    modifier that is neither the identity (sinks alone) nor a distance bias the S accumulator starts from."""
    sm = p.score_mod
    return sm is not None and not sm.is_identity and not seeds_bias(p)


# ---- config

@dataclass(frozen=True)
class TCConfig:
    block_r: int = 128           # defaults: the fastest spill-free config measured on the H100 (bench/results/h100/)
    block_c: object = "auto"
    warps: int = 4
    min_blocks: object = 1
    philox_rounds: int = 10
    split: str = "q"             # warp partitioning (FA2 Sec. 3.3): "q" rows per warp, "k" keys per warp
    deterministic: bool = False  # backward: dQ by a row-parallel kernel instead of atomics
    bwd_block_r: object = "auto"  # backward Q tile Br (with bwd_block_c a pair in BWD_GEOMETRY), or auto
    bwd_min_blocks: object = "auto"  # backward column kernel: blocks per SM its registers must allow
    stages: int = 2               # forward copies: 2 one tile ahead of the GEMMs, 1 waited for at once
    bwd_pre: str = "kernel"       # D = rowsum(dO o O): "kernel" (fa2_tc_bwd_rowdot) or "cupy" (fp32 casts)
    bwd_block_c: object = "auto"  # backward K/V tile Bc: auto (BWD_AUTO, or BWD_AUTO_BC of a given Br)

    # block_c="auto": the fastest Bc whose kernels compile without spills for sm_80 and sm_90 (NVRTC 13;
    # Br=128, 4 warps). D=64: Bc=64; Bc=128 ran 6-10% faster on the H100 (block_c=128) but spills
    # 16 bytes on sm_80 and 272 with dropout. D=128: Bc=32; Bc=64 ran 2-6% faster and spills 8 bytes
    # (112 with dropout).
    AUTO_BC = {(64, False): 64, (64, True): 64, (128, False): 32, (128, True): 32}

    def bc(self, D: int, dropout: bool = False) -> int:
        """Bc of the kernel for head dim D (padded) and the dropout switch; split-K's auto gives each
        warp at least 16 keys."""
        if self.block_c != "auto":
            return self.block_c
        return self.AUTO_BC[(D, dropout)] if self.split == "q" else max(self.AUTO_BC[(D, dropout)], 16 * self.warps)

    def forward_name(self, dtype: str, D: int, dropout: bool) -> str:
        return (f"fa2_tc_forward<{CTYPE[dtype]}, {D}, {self.block_r}, {self.bc(D, dropout)}, {self.warps}, "
                f"{'true' if self.split == 'q' else 'false'}, {self.stages}, {self.blocks_per_sm(D, dropout)}, "
                f"{self.philox_rounds}, "
                f"{'true' if dropout else 'false'}>")

    def warp_tile(self, D: int, dropout: bool = False) -> tuple[int, int]:
        """(query rows, keys per tile) of one warp: split-Q divides the rows, split-K the keys."""
        bc = self.bc(D, dropout)
        return (self.block_r // self.warps, bc) if self.split == "q" else (self.block_r, bc // self.warps)

    # Registers a thread needs beyond its accumulators (addresses, loop state, fragments in flight):
    # about 96 in the compile reports of this kernel (NVRTC 13, sm_90).
    OVERHEAD_REGS = 96

    def blocks_per_sm(self, D: int, dropout: bool = False) -> int:
        """min_blocks, or with "auto" the most blocks whose register share still holds the O and S
        accumulators plus OVERHEAD_REGS (e.g. D=64, Br=64, 4 warps: 32 + 32 + 96 = 160 -> 3 blocks)."""
        if self.min_blocks != "auto":
            return self.min_blocks
        rows, cols = self.warp_tile(D, dropout)
        need = rows * (D + cols) // 32 + self.OVERHEAD_REGS      # O and S floats per lane
        return max(1, min(4, 65536 // (32 * self.warps * need)))

    def forward_smem(self, D: int, dropout: bool = False) -> int:
        """Q, K, V tiles; split-K reuses them for its partial sums ([Br][D + 8] O and [Br][4] l, fp32)
        and adds the warps' row maxima ([warps][Br] fp32), as kernels_cu/fa2_tc.cu lays them out."""
        tiles = ITEMSIZE * D * (self.block_r + 2 * self.bc(D, dropout))
        if self.split == "q":
            return tiles
        return max(tiles, 4 * self.block_r * (D + 8 + 4)) + 4 * self.warps * self.block_r

    # backward geometry of the column kernel (kernels_cu/fa2_tc_bwd.cu), (Br, Bc) -> (warps, MK m16 key tiles
    # per warp): every warp owns 16 MK keys and a 16-row block of dQ (Br = 64, Bc = 128: half its columns).
    # Bc = 128 (FA2's tile at d = 64): half the dQ atomics and Q / dO reads per key of Bc = 64, 8 warps.
    BWD_GEOMETRY = {(64, 64): (4, 1), (32, 64): (2, 2), (128, 128): (8, 1), (64, 128): (8, 1)}
    # auto, (head dim, deterministic) -> (Br, Bc), H100 (bench/results/h100/):
    # d = 64 (2026-11-22-bf00f14.md): Br = 64 with 3 blocks per SM (168 registers, 84 bytes of spills)
    # 150-176 TFLOP/s, Br = 32 (2 warps x 32 keys, no spills) 140-165, Br = 64 with 2 blocks (215 registers,
    # no spills) 135-157: the kernel is latency-bound (8 warps per SM), so occupancy beats the spills. Bc =
    # 128 (8 warps, 211 registers, one block per SM) 157-170 and Br = Bc = 128 165-181 against 172-184
    # (non-causal, 2026-11-22-6ae585e.md). d = 128 (6ae585e): Bc = 128 (255 registers, no spills on sm_90)
    # 195-212 against Bc = 64's 168-185 (non-causal), fwd + bwd 0.75-0.86x SDPA flash against 0.67-0.84x;
    # the deterministic column kernel (no dQ) runs slower with it (189 against 194 at N = 16k): Bc = 64.
    BWD_AUTO = {(64, False): (64, 64), (128, False): (64, 128), (64, True): (64, 64), (128, True): (64, 64)}
    BWD_AUTO_BC = {32: 64, 64: 64, 128: 128}           # Bc when only Br is given
    BWD_AUTO_MIN_BLOCKS = {(64, 64, 64): 3}            # (head dim, Br, Bc): blocks per SM; 1 where not listed
    # S^T, dP^T, dK and dV accumulators per lane: MK (Br + d) floats; past 192 the kernel cannot hold them
    BWD_MAX_ACC = 192
    # the deterministic dQ kernel: Br, Bc, warps
    DQ_BR, DQ_BC, DQ_WARPS = 64, 64, 4

    # The wide head dims (D = 192, 256; kernels_cu/fa2_tc_bwd.cu fa2_tc_bwd_wide, the header says why): one tile,
    # Br = Bc = 64 with 8 warps (4 key strips x 2 halves of the head dim), as FA2's own d = 256 backward. Shared
    # memory (K, V, 2x (Q, dO), P^T, dS^T, 2x (lse, D)): 164,864 B at D = 192 (fits sm_80's 166,912), 214,016 B at
    # D = 256 (sm_90 only). No deterministic form: no forward that fa2-tc-deterministic runs reaches d > 128.
    BWD_WIDE = (64, 64, 8)       # Br, Bc, warps
    BWD_WIDE_MAX_D = 256

    def bwd_tile(self, D: int) -> tuple[int, int]:
        """(Br, Bc) of the column kernel at head dim D (padded)."""
        if D > 128:
            return self.BWD_WIDE[:2]
        if self.bwd_block_r == "auto":
            br, bc = self.BWD_AUTO[(D, self.deterministic)]
            return br, bc if self.bwd_block_c == "auto" else self.bwd_block_c
        bc = self.BWD_AUTO_BC.get(self.bwd_block_r) if self.bwd_block_c == "auto" else self.bwd_block_c
        return self.bwd_block_r, bc

    def bwd_geometry(self, D: int) -> tuple[int, int, int, int]:
        """(Br, Bc, warps, MK) of the column kernel; at D > 128 the wide kernel's (MK: 1 strip of 16 keys)."""
        br, bc = self.bwd_tile(D)
        if D > 128:
            return (br, bc, self.BWD_WIDE[2], 1)
        return (br, bc, *self.BWD_GEOMETRY[(br, bc)])

    def bwd_blocks_per_sm(self, D: int) -> int:
        if D > 128:
            return 1
        if self.bwd_min_blocks != "auto":
            return self.bwd_min_blocks
        return self.BWD_AUTO_MIN_BLOCKS.get((D, *self.bwd_tile(D)), 1)

    def backward_errors(self, D: int) -> list[str]:
        """Why this config has no backward at padded head dim D (bwd_d_pad); [] where it has one. Independent of
        the GPU (the shared memory against sm_90's limit; backward_device_errors checks the current GPU's)."""
        if self.bwd_pre not in ("kernel", "cupy"):
            return [f"bwd_pre={self.bwd_pre!r}: 'kernel' or 'cupy'"]
        if D > 128:
            return self._wide_backward_errors(D)
        if self.bwd_tile(D) not in self.BWD_GEOMETRY:
            return [f"bwd_block_r={self.bwd_block_r!r}, bwd_block_c={self.bwd_block_c!r}: (Br, Bc) one of "
                    f"{sorted(self.BWD_GEOMETRY)}"]
        br, bc, warps, mk = self.bwd_geometry(D)
        if mk * (br + D) > self.BWD_MAX_ACC:
            return [f"bwd_block_r={br}, bwd_block_c={bc} keeps {mk * (br + D)} accumulator floats per lane at d = {D} "
                    f"(limit {self.BWD_MAX_ACC}); it needs d <= {self.BWD_MAX_ACC // mk - br}"]
        if 32 * warps // (D // 8) % 8:          # load_tile_async: each thread keeps one 16-byte chunk column
            return [f"bwd_block_r={br} runs {warps} warps, too few to copy rows of d = {D} in steps of 8"]
        return []

    def _wide_backward_errors(self, D: int) -> list[str]:
        if D > self.BWD_WIDE_MAX_D:
            return [f"backward at head dim D = {D}: the backward kernels stop at d = {self.BWD_WIDE_MAX_D}"]
        errs = []
        br, bc, _ = self.BWD_WIDE
        if self.bwd_block_r not in ("auto", br) or self.bwd_block_c not in ("auto", bc):
            errs.append(f"bwd_block_r={self.bwd_block_r!r}, bwd_block_c={self.bwd_block_c!r}: the backward at "
                        f"d > 128 (fa2_tc_bwd_wide, D = {D}) runs Br = {br}, Bc = {bc} only (\"auto\")")
        if self.bwd_min_blocks not in ("auto", 1):
            errs.append(f"bwd_min_blocks={self.bwd_min_blocks!r}: the backward at d > 128 (D = {D}) runs one block "
                        "per SM (its shared memory); \"auto\" or 1")
        if self.deterministic:
            errs.append(f"the deterministic backward stops at d = 128 (D = {D} has the atomic dQ kernel only)")
        if self.backward_smem(D) > SMEM_LIMIT:
            errs.append(f"backward shared memory {self.backward_smem(D)} B at D = {D} exceeds {SMEM_LIMIT} B")
        return errs

    def backward_device_errors(self, D: int) -> list[str]:
        """The backward's shared memory against the current GPU's per-block opt-in limit (sm_90's without a GPU):
        at D = 256 the wide kernel needs 214,016 B, which sm_80 (166,912 B) lacks; refused by name before launch."""
        from sandbox.device import arch, smem_per_block_optin
        need, limit = self.backward_smem(D), smem_per_block_optin()
        if need <= limit:
            return []
        return [f"the backward at head dim D = {D} needs {need} B of shared memory per block; this GPU "
                f"({arch() or 'unknown'}) allows {limit} B (an H100 / H200, sm_90, allows {SMEM_LIMIT} B)"]

    def backward_name(self, dtype: str, D: int, dropout: bool) -> str:
        """The column-parallel dK / dV kernel; it also adds dQ by atomics unless `deterministic`. At D > 128 the
        wide kernel (atomic dQ always)."""
        if D > 128:
            br, bc, warps = self.BWD_WIDE
            return (f"fa2_tc_bwd_wide<{CTYPE[dtype]}, {D}, {br}, {bc}, {warps}, {self.philox_rounds}, "
                    f"{'true' if dropout else 'false'}>")
        br, bc, warps, mk = self.bwd_geometry(D)
        return (f"fa2_tc_bwd<{CTYPE[dtype]}, {D}, {br}, {bc}, {warps}, {mk}, {self.bwd_blocks_per_sm(D)}, "
                f"{self.philox_rounds}, {'true' if dropout else 'false'}, {'false' if self.deterministic else 'true'}>")

    @staticmethod
    def rowdot_name(dtype: str) -> str:
        return f"fa2_tc_bwd_rowdot<{CTYPE[dtype]}>"

    def dq_name(self, dtype: str, D: int, dropout: bool) -> str:
        """The deterministic backward's row-parallel dQ kernel."""
        return (f"fa2_tc_bwd_dq<{CTYPE[dtype]}, {D}, {self.DQ_BR}, {self.DQ_BC}, {self.DQ_WARPS}, "
                f"{self.philox_rounds}, {'true' if dropout else 'false'}>")

    def backward_smem(self, D: int) -> int:
        br, bc, _, _ = self.bwd_geometry(D)
        if D > 128:      # K, V, 2x (Q, dO), P^T and dS^T; 2x (lse, D)
            return ITEMSIZE * (2 * bc * D + 4 * br * D + 2 * bc * br) + 4 * 4 * br
        return ITEMSIZE * (2 * bc * D + 4 * br * D + bc * br) + 4 * 4 * br   # K, V, 2x (Q, dO), dS^T; 2x (lse, D)

    def dq_smem(self, D: int) -> int:
        return ITEMSIZE * D * (2 * self.DQ_BR + 4 * self.DQ_BC)                # Q, dO, 2x (K, V)

    def backward_unit(self, dtype: str, D: int, mods=None) -> CompileUnit:
        """Both dropout switches in one module; with `mods` (ModKernel) its dropout switch only."""
        drops = (False, True) if mods is None else (mods.dropout,)
        smem = {self.backward_name(dtype, D, drop): self.backward_smem(D) for drop in drops}
        smem[self.rowdot_name(dtype)] = 0
        if self.deterministic and D <= 128:          # no deterministic dQ kernel at D > 128 (backward_errors)
            smem.update({self.dq_name(dtype, D, drop): self.dq_smem(D) for drop in drops})
        return CompileUnit("fa2_tc_bwd.cu", tuple(smem), cuda_options() + (mods.options if mods else ()), smem,
                           label=f"fa2-tc-bwd[{dtype}, D={D}{', deterministic' if self.deterministic else ''}"
                                 f"{mods.label if mods else ''}]")

    def unit(self, dtype: str, D: int, mods=None) -> CompileUnit:
        """Both dropout switches in one module (the no-dropout kernel carries no Philox code); with `mods`
        (ModKernel: the modifiers compiled in) the one switch it names, since every modifier is a module."""
        drops = (False, True) if mods is None else (mods.dropout,)
        names = tuple(self.forward_name(dtype, D, drop) for drop in drops)
        return CompileUnit("fa2_tc.cu", names, cuda_options() + (mods.options if mods else ()),
                           {n: self.forward_smem(D, drop) for n, drop in zip(names, drops)},
                           label=f"fa2-tc[{dtype}, D={D}{mods.label if mods else ''}]")

    VARLEN_OPTION = "-DFA_VARLEN"

    def varlen_unit(self, dtype: str, D: int) -> CompileUnit:
        """The packed-sequence forward (sandbox/varlen.py): the forward kernel compiled with -DFA_VARLEN,
        no dropout; a module of its own, so the units above stay the ones without the switch."""
        name = self.forward_name(dtype, D, False)
        names = (name, *(varlen_seqs_name(idx, dtype) for idx in VARLEN_OFFSET_TYPES))
        return CompileUnit("fa2_tc.cu", names, cuda_options() + (self.VARLEN_OPTION,), {name: self.forward_smem(D)},
                           label=f"fa2-tc-varlen[{dtype}, D={D}]")

    # split-K: every warp holds Br x D accumulators; past 128 floats per lane the kernel spills
    MAX_O_REGS = 128

    def envelope_errors(self, D: int) -> list[str]:
        errs = []
        if self.split not in ("q", "k"):
            errs.append(f"split={self.split!r}: 'q' or 'k'")
            return errs
        for drop in (False, True):
            rows, cols = self.warp_tile(D, drop)
            if rows % 16 or cols % 16:
                errs.append(f"split={self.split!r}, block_r={self.block_r}, block_c={self.bc(D, drop)}, "
                            f"warps={self.warps} gives each warp {rows} rows x {cols} keys; the m16n8k16 tiles need "
                            "each to be a multiple of 16")
                break
        if self.split == "k" and self.block_r * D // 32 > self.MAX_O_REGS:
            errs.append(f"split='k' keeps block_r x d = {self.block_r} x {D} accumulators in every warp "
                        f"({self.block_r * D // 32} registers per lane, limit {self.MAX_O_REGS}): lower block_r")
        smem = max(self.forward_smem(D, drop) for drop in (False, True))
        if smem > SMEM_LIMIT:
            errs.append(f"shared memory {smem} B exceeds {SMEM_LIMIT} B")
        return errs


# ---- modifiers (issue 18): compiled into the module, kernels_cu/tc_mods.cuh

@dataclass(frozen=True)
class ModKernel:
    """What a problem's score / mask modifiers add to a kernel module: the NVRTC -D options that
    compile their CUDA C text in (modifiers.cuda_defines; the module cache is keyed by them), the
    dropout switch of the one kernel such a module holds, and a label for compile reports."""

    options: tuple
    dropout: bool
    label: str

    @classmethod
    def of(cls, p, backward: bool = False, factored: bool = False) -> "ModKernel | None":
        """None without modifiers: the module and kernels are the ones without them. factored: the kernel takes
        FA_SCORE_FACTORED's arguments (modifiers.cuda_defines)."""
        if p.score_mod is None and p.mask_mod is None:
            return None
        opts = modifiers.cuda_defines(p.score_mod, p.mask_mod, backward, seed=seeds_bias(p), factored=factored)
        names = [f"{m.name}:{m.cuda_key}" for m in (p.score_mod, p.mask_mod) if m is not None]
        return cls(opts, p.dropout_p > 0, f", {', '.join(names)}")


BIG_BUFFER_BYTES = 1 << 20
_BIG_COPIES: dict = {}


def _device_copy(arr: np.ndarray, xp):
    """A device copy of a host array, cached by content (a loop over one modifier uploads once); with
    xp None the host array itself (the argument-packing tests run without a GPU). A buffer past
    BIG_BUFFER_BYTES (a dense mask: B Nq Nk bytes) is neither hashed per call nor held by the shared cache:
    its copy lives as long as the (read-only) host array it was made from. A device buffer (modifiers.DeviceBuffer's
    array) is used in place, on its own GPU only."""
    if xp is None:
        return arr
    if not isinstance(arr, np.ndarray):
        here = xp.cuda.Device().id
        if arr.device.id != here:
            raise ValueError(f"a modifier's buffer lives on GPU {arr.device.id} and the call runs on GPU {here}: "
                             "make the modifier from arrays on the GPU it runs on")
        return arr
    if arr.nbytes > BIG_BUFFER_BYTES and not arr.flags.writeable:
        owner = arr if arr.base is None else arr.base            # a byte view of a bool buffer: its owner
        key = (xp.cuda.Device().id, id(owner), arr.dtype.str, arr.shape)
        hit = _BIG_COPIES.get(key)
        if hit is None:
            hit = _BIG_COPIES[key] = xp.asarray(arr)
            weakref.finalize(owner, _BIG_COPIES.pop, key, None)
        return hit
    key = ("mod-buffer", arr.dtype.str, arr.shape, hashlib.blake2b(arr.tobytes(), digest_size=16).digest())
    return _cached(key, lambda: xp.asarray(arr), xp)


def modifier_tiles(p, block_r: int, block_c: int, xp=None, row_shift: int = 0) -> tuple:
    """(tile table [Bm * Hm, ceil(Nq/Br), ceil(Nk/Bc)] int8, i32(Hm) its heads, i32(Bm) its batch extent):
    the classes of band AND block mask AND mask modifier (on the GPU: variants/mask_tiles.py; xp None:
    masks.classify_tiles_mod on the host; each cached per mask) so
    that the kernels skip empty tiles and run the predicate in partial ones only; without a mask
    modifier the usual table (Bm = 1), bottom-aligned by `row_shift` rows where asked (fa3_ws.cu; a mask
    modifier's classes are top-aligned: refused there). xp None: host arrays."""
    if p.mask_mod is None:
        if xp is None:
            t = classify_tiles(p.Nq, p.Nk, block_r, block_c, p.band, p.block_mask, row_shift)
            return t, i32(t.shape[0]), i32(1)
        return (*tile_table(p, block_r, block_c, xp, row_shift), i32(1))
    if row_shift:
        raise ValueError("row_shift: a mask modifier's tile tables are top-aligned")
    if xp is None:
        cls = classify_tiles_mod(p.mask_mod, p.B, p.Hq, p.Nq, p.Nk, block_r, block_c, p.band, p.block_mask)
    else:                       # on the GPU from the modifier's CUDA form (variants/mask_tiles.py), cached per mask
        cls = mask_tiles.device_classes(p, block_r, block_c, xp, lambda: _buffer_args(p.mask_mod, xp))
    Bm, Hm = cls.shape[:2]
    return cls.reshape(Bm * Hm, *cls.shape[2:]), i32(Hm), i32(Bm)


def forward_scale_log2(p) -> float:
    """The forward kernels' scale_log2 argument: the factor that takes the scores their softmax sees to log2
    units. Raw scores (no score modifier, or sinks alone): |scale| log2 e; a score modifier's output (natural
    units): log2 e, times the post factor of its factored form (modifiers.ScoreMod.cuda_factored); a distance
    bias in the S accumulator (cuda_distance_slope) keeps the raw scores' factor."""
    sm = p.score_mod
    if sm is None or sm.is_identity or seeds_bias(p):
        return scale_log2(p.scale)
    return LOG2E * sm.forward_scales()[1]


def modifier_args(p, tile_b, xp=None, forward: bool = False) -> tuple:
    """MOD_PARAMS of kernels_cu/tc_mods.cuh after DROPOUT_PARAMS: the tile table's batch extent, |scale|
    (the forward's modifier sees |scale| q.(-k) = scale q.k where the host negated K; a forward module
    of a factored modifier, `forward`, takes |scale| pre), the sink logits [Hq] (float32), then each
    buffer of the score modifier and of the mask modifier in declaration order as the kernel's type
    (modifiers.cuda_buffers) followed by its shape (int32 each)."""
    pre = p.score_mod.forward_scales()[0] if forward and p.score_mod is not None else 1.0
    args = (i32(tile_b), f32(abs(p.scale) * pre), _device_copy(modifiers.sink_vector(p.score_mod, p.Hq), xp))
    for mod in (p.score_mod, p.mask_mod):
        if mod is not None:
            args += _buffer_args(mod, xp)
    return args


def _buffer_args(mod, xp) -> tuple:
    """A modifier's buffers as its CUDA form takes them: each (a device copy) followed by its int32 shape."""
    args = ()
    for arr in modifiers.cuda_buffers(mod):
        args += (_device_copy(arr, xp), *(i32(n) for n in arr.shape))
    return args


# ---- modifiers in the backward kernels (kernels_cu/fa2_tc_bwd.cu; fa3_bwd2.cu through variants/fa3_backward.py)

def backward_mods(p) -> str:
    """What a problem's modifiers ask of a backward kernel: "none" (no modifiers, or attention sinks alone:
    the backward recomputes P from lse, which holds the sink), "seed" (a distance bias, with or without
    sinks: the kernel seeds its S^T accumulator with it), "text" (another score modifier: its text and derivative
    compiled in, or its factored core and the core's derivative), "mask" (a mask modifier, with any score
    modifier's text and derivative: its predicate and tile classes compiled in)."""
    sm, mm = p.score_mod, p.mask_mod
    if mm is not None:
        return "mask"
    if sm is None or sm.is_identity:
        return "none"
    return "seed" if seeds_bias(p) else "text"


def module_mods(p, need: str) -> ModKernel | None:
    """A backward module's modifier options for backward_mods' `need`: a distance bias the forward's (FA_DIST_BIAS;
    FA_SINKS harmless), a score modifier's text or a mask modifier the backward's (text and derivative, or the
    factored core and its derivative; the predicate), sinks alone none (the module without modifiers)."""
    return None if need == "none" else ModKernel.of(p, backward=need != "seed", factored=True)


def factored_args(p, need: str) -> tuple:
    """FA_SCORE_FACTORED's kernel arguments (pre, post log2 e, post pre: kernels_cu/tc_mods.cuh FACTORED_PARAMS)
    where the backward module compiles a score modifier's factored core (modifiers.cuda_defines), else ()."""
    sm = p.score_mod
    if need not in ("text", "mask") or sm is None or sm.is_identity or not sm.backward_factored:
        return ()
    return tuple(f32(x) for x in sm.backward_factors())


# ---- launch

VL_SEQ_INTS = 6    # kernels_cu/fa2_tc.cu VL_SEQ_INTS (sandbox/varlen.py SEQ_INTS)


VARLEN_OFFSET_TYPES = {"int32": "int", "int64": "long long"}     # cu_seqlens dtypes fa2_varlen_seqs reads


def varlen_seqs_name(offsets: str, dtype: str) -> str:
    return f"fa2_varlen_seqs<{VARLEN_OFFSET_TYPES[offsets]}, {CTYPE[dtype]}>"


def _varlen_outputs(q, xp):
    """out (total_q, Hq, d) and lse (Hq, total_q) of the packed-sequence forward, uninitialised."""
    total_q, Hq, d = q.shape
    return xp.empty((total_q, Hq, d), dtype=q.dtype), xp.empty((Hq, total_q), dtype=xp.float32)


def varlen_args(q, k, v, out, lse, seqs, blocks, scale: float, no_layout) -> tuple:
    """The packed-sequence kernel's arguments (kernels_cu/fa2_tc.cu with FA_VARLEN): q, k, v as [1, H,
    total, d] views, out, lse, the tile table slot (a dummy: the band classifies the tiles), Hq, the
    GQA group, total_q in the Nq slot (the LSE row length), total_k, d, the scale, MASK_PARAMS with a
    band the sequence table overrides and no layout, DROPOUT_PARAMS off, then the two tables."""
    Hq, Hkv = q.shape[1], k.shape[1]
    return (q, *strides4(q)[:3], k, *strides4(k)[:3], v, *strides4(v)[:3], out, lse,
            no_layout, i32(1), i32(Hq), i32(Hq // Hkv), i32(q.shape[2]), i32(k.shape[2]), i32(q.shape[3]),
            f32(scale_log2(scale)), i32(0), i32(0), no_layout, i32(0), i32(1), i32(1), i32(1), i32(1),
            u32(0), f32(1.0), u64(0), u32(0), seqs, blocks)


def check_alignment(x, name, variant="fa2-tc"):
    """cp.async moves 16-byte chunks: row strides a multiple of 8 elements, base 16-byte aligned.
    Takes CuPy arrays (what the launch sees) and NumPy ones (tests without a GPU)."""
    st = arrays.element_strides(x)
    ptr = x.data.ptr if hasattr(x.data, "ptr") else x.__array_interface__["data"][0]
    if any(s % 8 for s in st[:3]) or ptr % 16:
        raise ValueError(f"variant {variant!r}: {name} needs 16-byte aligned rows (strides {st} elements, "
                         f"address {ptr:#x}); pass a contiguous copy")


class FA2TensorCore:
    name = "fa2-tc"

    def __init__(self, deterministic: bool = False):
        self.deterministic = deterministic
        if deterministic:
            self.name = "fa2-tc-deterministic"

    def configure(self, block_r=128, block_c="auto", warps=4, min_blocks=1, philox_rounds=10, split="q",
                  bwd_block_r="auto", bwd_min_blocks="auto", stages=2, bwd_pre="kernel", bwd_block_c="auto"):
        return TCConfig(block_r, block_c, warps, min_blocks, philox_rounds, split, self.deterministic, bwd_block_r,
                        bwd_min_blocks, stages, bwd_pre, bwd_block_c)

    def to_backend(self, x, name="array"):
        return arrays.to_device(x, name)

    def check(self, problem, config, direction):
        errs = config.envelope_errors(d_pad(problem.d))
        if direction in ("backward", "both"):
            errs += config.backward_errors(bwd_d_pad(problem.d)) or config.backward_device_errors(bwd_d_pad(problem.d))
        if problem.d % 8:
            errs.append(f"head dim {problem.d} is not a multiple of 8 (rows move in 16-byte chunks)")
        for mod in (problem.score_mod, problem.mask_mod):     # their CUDA text and buffers, before any launch
            if mod is not None:
                modifiers.cuda_buffers(mod)
        if problem.score_mod is not None or problem.mask_mod is not None:
            ModKernel.of(problem, direction in ("backward", "both"))
        if problem.score_mod is not None and max(problem.Nq, problem.Nk) > MAX_FLOAT_POSITION:
            errs.append(f"a score modifier sees positions as floats fi, fj (kernels_cu/tc_mods.cuh), exact up to "
                        f"{MAX_FLOAT_POSITION}; Nq = {problem.Nq}, Nk = {problem.Nk}")
        if errs:
            raise ValueError(f"variant {self.name!r} with {config}: " + "; ".join(errs))

    def report_configs(self):
        return [{}, {"block_c": 64}, {"block_c": 128}, {"block_r": 64, "block_c": 64, "min_blocks": "auto"},
                {"block_r": 64, "block_c": 64, "min_blocks": 2}, {"warps": 8, "block_c": 64, "min_blocks": "auto"},
                {"warps": 8, "block_c": 64, "min_blocks": 2}, {"split": "k", "block_r": 64, "block_c": 64},
                {"split": "k", "block_r": 32, "block_c": 64}, {"stages": 1}]

    # Configs whose compile report shows no spills at D = 64 and 128: the CI check holds them to it.
    TUNED = {(128, "auto", 4, 1, "q"), (64, 64, 4, "auto", "q"), (64, 64, 4, 2, "q"), (128, 64, 8, "auto", "q"),
             (64, 64, 4, 1, "k"), (32, 64, 4, 1, "k")}

    # The backward's default is not marked tuned at D = 64 and 128: at D = 64 it trades 48-84 bytes of spills for
    # 3 blocks per SM (measured faster, TCConfig.BWD_AUTO); at D = 128 the atomic column kernel (Bc = 128) compiles
    # clean for sm_90 but spills 40-76 bytes for sm_80, the deterministic one (Bc = 64) 16-72 bytes (255
    # registers: the dK and dV accumulators alone take 128). bwd_block_r=32 at D = 64 compiles clean. The wide
    # kernel (D = 192, 256) compiles clean for sm_90 and sm_80 (NVRTC 13: 229-253 registers), so the gate holds it.
    BWD_TUNED_DIMS = (192, 256)

    def tuned(self, config, unit=None) -> bool:
        if unit is not None and unit.source == "fa2_tc_bwd.cu":     # names: fa2_tc_bwd<T, D, ...> (rowdot<T>: no D)
            return all(int(n.split(",")[1]) in self.BWD_TUNED_DIMS for n in unit.names if "," in n)
        return (config.block_r, config.block_c, config.warps, config.min_blocks, config.split) in self.TUNED \
            and config.stages == 2

    def compile_units(self, config):
        """The forward units of `config`; the backward's (one geometry) with the default config only."""
        units = [config.unit(dt, D) for dt in CAPS.dtypes for D in (64, 128) if not config.envelope_errors(D)]
        if self.has_backward and config == self.configure():
            units += [config.backward_unit(dt, D) for dt in CAPS.dtypes for D in (64, 128) if not config.backward_errors(D)]
        if self.varlen_forward and config == self.configure():       # the packed-sequence forward (default config)
            units += [config.varlen_unit(dt, D) for dt in CAPS.dtypes for D in (64, 128)]
        return units

    has_backward = True

    def backward(self, p, dout, q, k, v, out, lse, config):
        """FA2 Algorithm 2: D = rowsum(dO o O) (fa2_tc_bwd_rowdot), then one block per K/V tile. dQ: fp32
        atomics cast to the input dtype at the end, or with `deterministic` a row-parallel dQ kernel
        that adds the K/V tiles in a fixed order (and the column kernel leaves dQ alone)."""
        D, dropout = bwd_d_pad(p.d), p.dropout_p > 0
        self._refuse_backward(D, config)
        import cupy as xp
        for x, nm in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout"), (out, "out")):
            check_alignment(x, nm, self.name)
        need = backward_mods(p)
        mods = module_mods(p, need)                 # None without modifiers (or sinks alone): the kernels without them
        unit = config.backward_unit(p.dtype, D, mods)
        name = config.backward_name(p.dtype, D, dropout)
        if config.bwd_pre == "cupy":
            Dv = xp.sum(arrays.to_float32(dout, xp) * arrays.to_float32(out, xp), axis=-1)
        else:
            Dv = xp.empty((p.B, p.Hq, p.Nq), dtype=xp.float32)
            rows = p.B * p.Hq * p.Nq
            launch(unit, config.rowdot_name(p.dtype), (-(-rows // 32),), (256,),
                   (dout, *strides4(dout)[:3], out, *strides4(out)[:3], Dv, i32(p.Hq), i32(p.Nq), i32(p.d),
                    i64(rows)))
        # the atomic path accumulates in fp32; the deterministic column kernel never reads its dQ
        dq = xp.zeros((p.B, p.Hq, p.Nq, p.d) if not config.deterministic else (1,), dtype=xp.float32)
        dk = xp.empty((p.B, p.Hkv, p.Nk, p.d), dtype=q.dtype)
        dv = xp.empty((p.B, p.Hkv, p.Nk, p.d), dtype=q.dtype)
        br, bc, warps, _ = config.bwd_geometry(D)
        operands = (q, *strides4(q)[:3], k, *strides4(k)[:3], v, *strides4(v)[:3], dout, *strides4(dout)[:3], lse, Dv)
        rest = (i32(p.Nq), i32(p.Nk), i32(p.d), f32(p.scale), *mask_args(p, xp), *dropout_args(p))
        if mods is None:
            tiles, tile_heads = tile_table(p, br, bc, xp)
            mod_rest = ()
        else:
            tiles, tile_heads, tile_b = modifier_tiles(p, br, bc, xp)
            mod_rest = modifier_args(p, tile_b, xp) + factored_args(p, need)
        launch(unit, name, (-(-p.Nk // bc), p.B * p.Hkv), (32 * warps,),
               (*operands, dq, dk, dv, tiles, tile_heads, i32(p.Hq), i32(p.Hkv), i32(p.group), *rest, *mod_rest),
               shared_mem=unit.dynamic_smem[name])
        if not config.deterministic:
            return arrays.from_float32(dq, q.dtype, xp), dk, dv
        dq = xp.empty((p.B, p.Hq, p.Nq, p.d), dtype=q.dtype)
        name = config.dq_name(p.dtype, D, dropout)
        if (br, bc) != (config.DQ_BR, config.DQ_BC):
            if mods is None:
                tiles, tile_heads = tile_table(p, config.DQ_BR, config.DQ_BC, xp)
            else:
                tiles, tile_heads, tile_b = modifier_tiles(p, config.DQ_BR, config.DQ_BC, xp)
                mod_rest = modifier_args(p, tile_b, xp) + factored_args(p, need)
        launch(unit, name, (-(-p.Nq // config.DQ_BR), p.B * p.Hq), (32 * config.DQ_WARPS,),
               (*operands, dq, tiles, tile_heads, i32(p.Hq), i32(p.group), *rest, *mod_rest),
               shared_mem=unit.dynamic_smem[name])
        return dq, dk, dv

    def _refuse_backward(self, D: int, config):
        """check() refuses these first; a direct call of backward / backward_plan (the fa3 rungs' backward is this
        one with their TCConfig) is refused here too, before any launch: the config's envelope at D, and the
        current GPU's shared memory (the wide kernel at D = 256 does not fit sm_80)."""
        errs = config.backward_errors(D) or config.backward_device_errors(D)
        if errs:
            raise ValueError(f"variant {self.name!r} with {config}: " + "; ".join(errs))

    @property
    def varlen_forward(self) -> bool:
        """Whether forward_varlen runs this variant's own kernel: fa2-tc's (and fa2-tc-deterministic's,
        the same forward); the subclasses (fa2-tc-naive, fa1-tc, fa3) run other kernels and keep the
        per-sequence path of sandbox/varlen.py."""
        return type(self) is FA2TensorCore

    def varlen_tiles(self, config, d: int) -> tuple[int, int]:
        """(Br, Bc) of the packed-sequence kernel at head dim d (sandbox/varlen.py builds its tables with
        them); ValueError naming the variant where the config is outside the envelope."""
        errs = config.envelope_errors(d_pad(d))
        if errs:
            raise ValueError(f"variant {self.name!r} with {config}: " + "; ".join(errs))
        return config.block_r, config.bc(d_pad(d))

    def forward_varlen(self, q, k, v, seqs, blocks, scale: float, config, device_offsets=None):
        """The packed-sequence forward (kernels_cu/fa2_tc.cu, FA_VARLEN) on CuPy arrays, on CuPy's current
        stream: q (total_q, Hq, d), k and v (total_k, Hkv, d), any strides with unit stride along d;
        seqs, blocks the device int32 tables of sandbox.varlen.tables. Returns (out (total_q, Hq, d) contiguous,
        lse (Hq, total_q) float32). Every row of out and lse is written (a sequence without queries
        has none), so both start uninitialised.
        device_offsets=(cu_q, cu_k, band_lo, band_hi, tiles): the offsets on the device (CuPy arrays of one type,
        int32 or int64, S + 1 each), `seqs` and `blocks` None: both tables are made on the device first
        (fa2_varlen_seqs: no host copy of the offsets, no upload), `tiles` Q tiles per sequence."""
        if device_offsets is not None:
            seqs_shape, blocks = (len(device_offsets[0]) - 1, VL_SEQ_INTS), None
        else:
            seqs_shape = tuple(seqs.shape)
        if (blocks is not None and (blocks.ndim != 2 or blocks.shape[1] != 2)) or len(seqs_shape) != 2 or \
                seqs_shape[1] != VL_SEQ_INTS:
            # grid.x is the number of (sequence, Q tile) rows: a flat block table would launch 2x the blocks,
            # whose second half reads its entries past the table's end (wild sequence / tile indices)
            raise ValueError(f"forward_varlen: tables of shapes [S, {VL_SEQ_INTS}] and [blocks, 2] expected, "
                             f"got {seqs_shape} and {None if blocks is None else tuple(blocks.shape)}")
        import cupy as xp
        total_q, Hq, d = q.shape
        views = [x.transpose(1, 0, 2)[None] for x in (q, k, v)]       # [1, H, total, d], zero-copy
        for x, nm in zip(views, ("q", "k", "v")):
            check_alignment(x, nm, self.name)
        if device_offsets is not None:
            seqs, blocks, out, lse = self._device_seqs(q, k, *device_offsets, config)
        else:
            out, lse = _varlen_outputs(q, xp)
        if scale < 0:              # softmax(scale Q K^T) = softmax(|scale| Q (-K)^T), as `launch` does
            views[1] = arrays.negate(views[1], xp)
        D, dtype = d_pad(d), dtype_name(q)
        unit = config.varlen_unit(dtype, D)
        name = config.forward_name(dtype, D, False)
        n = blocks.shape[0]
        if n == 0:
            return out, lse
        no_layout = _cached(("no-layout",), lambda: xp.zeros(1, dtype=xp.uint8), xp)
        launch(unit, name, (n, Hq), (32 * config.warps,), varlen_args(*views, out, lse, seqs, blocks, scale, no_layout),
               shared_mem=unit.dynamic_smem[name])
        return out, lse

    def _device_seqs(self, q, k, cu_q, cu_k, band_lo: int, band_hi: int, tiles: int, config):
        """(sequence table [S, VL_SEQ_INTS], block table [S tiles, 2], out, lse): the tables made on the device
        from device offsets (fa2_varlen_seqs) on CuPy's current stream, and the forward's outputs, which it sets
        to NaN where no forward block writes."""
        import cupy as xp
        offsets = dtype_name(cu_q)
        if offsets not in VARLEN_OFFSET_TYPES or dtype_name(cu_k) != offsets:
            raise TypeError(f"cu_seqlens_q / cu_seqlens_k on the GPU must both be int32 or int64; got {offsets} and "
                            f"{dtype_name(cu_k)}")
        S = cu_q.shape[0] - 1
        dtype, (total_q, Hq, d) = dtype_name(q), q.shape
        unit = config.varlen_unit(dtype, d_pad(d))
        out, lse = _varlen_outputs(q, xp)
        seqs = xp.empty((S, VL_SEQ_INTS), dtype=xp.int32)
        blocks = xp.empty((S * tiles, 2), dtype=xp.int32)
        launch(unit, varlen_seqs_name(offsets, dtype), (S,), (128,),
               (cu_q, cu_k, i32(S), i64(total_q), i64(k.shape[0]), i32(band_lo), i32(band_hi), i32(tiles),
                i32(config.block_r), i32(Hq), i32(d), seqs, blocks, out, lse))
        return seqs, blocks, out, lse

    def forward(self, p, q, k, v, config):
        if p.score_mod is not None or p.mask_mod is not None:
            return self.launch_mods(p, q, k, v, config)
        return self.launch(p, q, k, v, config, (-(-p.Nq // config.block_r), p.B * p.Hq))

    def launch_mods(self, p, q, k, v, config):
        """The forward with score / mask modifiers compiled into its module (ModKernel): the launch of
        `launch` with the modifiers' tile table (mask modifier classes folded in) and MOD_PARAMS."""
        import cupy as xp
        for x, nm in ((q, "q"), (k, "k"), (v, "v")):
            check_alignment(x, nm, self.name)
        if p.scale < 0:
            k = arrays.negate(k, xp)
        D, dropout = d_pad(p.d), p.dropout_p > 0
        mods = ModKernel.of(p)
        unit = config.unit(p.dtype, D, mods)
        name = config.forward_name(p.dtype, D, dropout)
        out = xp.empty((p.B, p.Hq, p.Nq, p.d), dtype=q.dtype)
        lse = xp.empty((p.B, p.Hq, p.Nq), dtype=xp.float32)
        tiles, tile_heads, tile_b = modifier_tiles(p, config.block_r, config.bc(D, dropout), xp)
        launch(unit, name, (-(-p.Nq // config.block_r), p.B * p.Hq), (32 * config.warps,),
               (q, *strides4(q)[:3], k, *strides4(k)[:3], v, *strides4(v)[:3], out, lse,
                tiles, tile_heads, i32(p.Hq), i32(p.group), i32(p.Nq), i32(p.Nk), i32(p.d),
                f32(forward_scale_log2(p)), *mask_args(p, xp), *dropout_args(p),
                *modifier_args(p, tile_b, xp, forward=True)),
               shared_mem=unit.dynamic_smem[name])
        return out, lse

    def launch(self, p, q, k, v, config, grid, scratch=()):
        """The shared signature of the tensor-core forward kernels; `scratch`: arrays a kernel takes
        between lse and the tile table (fa1-tc's O, m, l)."""
        import cupy as xp
        for x, nm in ((q, "q"), (k, "k"), (v, "v")):
            check_alignment(x, nm, self.name)
        if p.scale < 0:          # the kernels take the row max on raw scores: scale > 0 (tc_softmax.cuh)
            k = arrays.negate(k, xp)   # softmax(scale Q K^T) = softmax(|scale| Q (-K)^T); one copy of K
        D = d_pad(p.d)
        unit = config.unit(p.dtype, D)
        name = config.forward_name(p.dtype, D, p.dropout_p > 0)
        out = xp.empty((p.B, p.Hq, p.Nq, p.d), dtype=q.dtype)
        lse = xp.empty((p.B, p.Hq, p.Nq), dtype=xp.float32)
        tiles, tile_heads = tile_table(p, config.block_r, config.bc(D, p.dropout_p > 0), xp)
        launch(unit, name, grid, (32 * config.warps,),
               (q, *strides4(q)[:3], k, *strides4(k)[:3], v, *strides4(v)[:3], out, lse, *scratch,
                tiles, tile_heads, i32(p.Hq), i32(p.group), i32(p.Nq), i32(p.Nk), i32(p.d),
                f32(scale_log2(p.scale)), *mask_args(p, xp), *dropout_args(p)),
               shared_mem=unit.dynamic_smem[name])
        return out, lse

    # ---- pointer-level plans (sandbox/fastpath.py): a repeated call of one problem and stride layout
    # resolves the kernel, grid, shared memory, tile table and typed scalars once; each call then packs
    # device pointers and launches. The buffers are allocated by the caller (torch's allocator for
    # torch tensors) on the caller's stream.

    def forward_plan(self, p, config, strides) -> LaunchPlan | None:
        """`strides`: element strides of q, k, v. None where the generic path must run (a negative
        scale negates K into a copy first). With modifiers (launch_mods' launch): their module, buffers and tile
        table resolved once (a mask modifier's table on the caller's stream, which keys the plan)."""
        import cupy as xp
        if p.scale < 0:
            return None
        for nm in ("q", "k", "v"):
            _check_row_strides(strides[nm], nm, self.name)
        D, dropout = d_pad(p.d), p.dropout_p > 0
        mods = ModKernel.of(p)     # None without modifiers (fa2-tc-naive's config, which takes none, inherits this)
        unit = config.unit(p.dtype, D) if mods is None else config.unit(p.dtype, D, mods)
        name = config.forward_name(p.dtype, D, dropout)
        if mods is None:
            tiles, tile_heads = tile_table(p, config.block_r, config.bc(D, dropout), xp)
            sl2, mod_rest = scale_log2(p.scale), ()
        else:
            tiles, tile_heads, tile_b = modifier_tiles(p, config.block_r, config.bc(D, dropout), xp)
            sl2, mod_rest = forward_scale_log2(p), modifier_args(p, tile_b, xp, forward=True)
        sq, sk, sv = (tuple(i64(x) for x in strides[nm][:3]) for nm in ("q", "k", "v"))
        args = (Slot("q"), *sq, Slot("k"), *sk, Slot("v"), *sv, Slot("out"), Slot("lse"), tiles, tile_heads,
                i32(p.Hq), i32(p.group), i32(p.Nq), i32(p.Nk), i32(p.d), f32(sl2), *mask_args(p, xp),
                *_dropout_slots(p), *mod_rest)
        kernel = PackedLaunch(get_kernel(unit, name).kernel, (-(-p.Nq // config.block_r), p.B * p.Hq),
                              (32 * config.warps,), unit.dynamic_smem[name], args)

        def run(ptr, seed, offset, stream):
            _check_aligned(ptr, ("q", "k", "v"), self.name)
            ptr["seed"], ptr["offset"] = seed, offset
            kernel(ptr, stream)

        buffers = {"out": ((p.B, p.Hq, p.Nq, p.d), p.dtype, False), "lse": ((p.B, p.Hq, p.Nq), "float32", False)}
        return LaunchPlan(buffers, run, keep=(tiles,))

    def backward_plan(self, p, config, strides) -> LaunchPlan | None:
        """`strides`: element strides of q, k, v, out and dout. The buffers: D = rowsum(dO o O), dq (an
        fp32 accumulator zeroed by the caller and cast to the input dtype after the run, unless
        deterministic), dk, dv."""
        D, dropout = bwd_d_pad(p.d), p.dropout_p > 0
        self._refuse_backward(D, config)
        import cupy as xp
        if config.bwd_pre != "kernel" or p.score_mod is not None or p.mask_mod is not None:
            return None
        for nm in ("q", "k", "v", "out", "dout"):
            _check_row_strides(strides[nm], nm, self.name)
        unit = config.backward_unit(p.dtype, D)
        name = config.backward_name(p.dtype, D, dropout)
        br, bc, warps, _ = config.bwd_geometry(D)
        tiles, tile_heads = tile_table(p, br, bc, xp)
        st = {nm: tuple(i64(x) for x in strides[nm][:3]) for nm in strides}
        rows = p.B * p.Hq * p.Nq
        rest = (i32(p.Nq), i32(p.Nk), i32(p.d), f32(p.scale), *mask_args(p, xp), *_dropout_slots(p))
        operands = tuple(x for nm in ("q", "k", "v", "dout") for x in (Slot(nm), *st[nm])) + (Slot("lse"), Slot("D"))
        kernels = [
            PackedLaunch(get_kernel(unit, config.rowdot_name(p.dtype)).kernel, (-(-rows // 32),), (256,), 0,
                         (Slot("dout"), *st["dout"], Slot("out"), *st["out"], Slot("D"), i32(p.Hq), i32(p.Nq),
                          i32(p.d), i64(rows))),
            PackedLaunch(get_kernel(unit, name).kernel, (-(-p.Nk // bc), p.B * p.Hkv), (32 * warps,),
                         unit.dynamic_smem[name],
                         (*operands, Slot("dq"), Slot("dk"), Slot("dv"), tiles, tile_heads, i32(p.Hq), i32(p.Hkv),
                          i32(p.group), *rest))]
        keep = [tiles]
        if config.deterministic:
            dq_name = config.dq_name(p.dtype, D, dropout)
            dq_tiles = tile_table(p, config.DQ_BR, config.DQ_BC, xp)
            keep.append(dq_tiles[0])
            kernels.append(PackedLaunch(get_kernel(unit, dq_name).kernel, (-(-p.Nq // config.DQ_BR), p.B * p.Hq),
                                        (32 * config.DQ_WARPS,), unit.dynamic_smem[dq_name],
                                        (*operands, Slot("dq"), *dq_tiles, i32(p.Hq), i32(p.group), *rest)))

        def run(ptr, seed, offset, stream):
            _check_aligned(ptr, ("q", "k", "v", "out", "dout"), self.name)
            ptr["seed"], ptr["offset"] = seed, offset
            for kernel in kernels:
                kernel(ptr, stream)

        kv = (p.B, p.Hkv, p.Nk, p.d)
        buffers = {"D": ((p.B, p.Hq, p.Nq), "float32", False),
                   "dq": ((p.B, p.Hq, p.Nq, p.d), p.dtype if config.deterministic else "float32",
                          not config.deterministic),
                   "dk": (kv, p.dtype, False), "dv": (kv, p.dtype, False)}
        return LaunchPlan(buffers, run, keep=tuple(keep))


def _dropout_slots(p):
    """DROPOUT_PARAMS of common.cuh with seed and offset filled per call."""
    return (u32(p.dropout_threshold), f32(1.0 / (1.0 - p.dropout_p)), Slot("seed", "u64"), Slot("offset", "u32"))


def _check_row_strides(st, name, variant):
    if any(s % 8 for s in st[:3]):
        raise ValueError(f"variant {variant!r}: {name} needs 16-byte aligned rows (strides {tuple(st)} elements); "
                         "pass a contiguous copy")


def _check_aligned(ptr, names, variant):
    for nm in names:
        if ptr[nm] % 16:
            raise ValueError(f"variant {variant!r}: {nm} needs a 16-byte aligned base address "
                             f"({ptr[nm]:#x}); pass a contiguous copy")


PARAMS = (
    Param("block_r", (32, 64, 128), 128, "Br: query rows per thread block"),
    Param("block_c", ("auto", 32, 64, 128), "auto", "Bc: keys per K/V tile; auto: per head dim and dropout "
          "(TCConfig.AUTO_BC)"),
    Param("warps", (4, 8), 4, "warps per thread block (Br / warps rows each, a multiple of 16)"),
    Param("min_blocks", ("auto", 1, 2, 3, 4), 1, "blocks per SM the register allocation must allow "
          "(__launch_bounds__): fewer registers, more warps in flight, spills past the kernel's need; "
          "auto: from the accumulator count (TCConfig.blocks_per_sm)"),
    philox_rounds_param(),
    Param("split", ("q", "k"), "q", "warp partitioning (FA2 paper Sec. 3.3): q, each warp owns Br / warps rows "
          "and every key of a tile; k, each warp owns all Br rows and Bc / warps keys, the warps agree on "
          "row maxima through shared memory every tile and add partial outputs at the end (Br x d "
          "accumulators per warp: Br = 64 at d <= 64, 32 at d = 128)"),
    Param("stages", (1, 2), 2, "forward copy pipeline: 2, V_j during S = Q K_j^T and K_{j+1} during softmax and "
          "P V_j (the flash-attn order); 1, each tile's copies waited for before its GEMMs (the rung below)"),
    Param("bwd_block_r", ("auto", 32, 64, 128), "auto", "backward column kernel: Q tile rows Br; with Bc "
          "(bwd_block_c) one of TCConfig.BWD_GEOMETRY: (32, 64) 2 warps of 32 keys, (64, 64) 4 warps of 16 keys, "
          "(64, 128) and (128, 128) 8 warps of 16 keys; auto: TCConfig.BWD_AUTO per head dim; at d > 128 (the "
          "fa3 rungs' wide head dims) the one tile of fa2_tc_bwd_wide, Br = Bc = 64 (auto or 64)"),
    Param("bwd_block_c", ("auto", 64, 128), "auto", "backward column kernel: keys per block Bc; auto: with bwd_block_r "
          "auto TCConfig.BWD_AUTO, else TCConfig.BWD_AUTO_BC of that Br; at d > 128: 64 (auto or 64)"),
    Param("bwd_min_blocks", ("auto", 1, 2, 3), "auto", "backward column kernel: blocks per SM the register "
          "allocation must allow (__launch_bounds__): more warps in flight, spills past the kernel's need; auto: "
          "TCConfig.BWD_AUTO_MIN_BLOCKS per head dim and tile (3 at d = 64, Br = Bc = 64); at d > 128: 1 (auto or 1)"),
    Param("bwd_pre", ("kernel", "cupy"), "kernel", "backward preprocessing D = rowsum(dO o O): one kernel over the "
          "16-bit inputs (fa2_tc_bwd_rowdot), or the CuPy expression with fp32 casts (the rung below)"),
)
CAPS = Capabilities(backward=False, dtypes=("float16", "bfloat16"), head_dims=tuple(range(8, 129, 8)))
# fa2-tc and fa2-tc-deterministic: score and mask modifiers compiled into the module (ModKernel)
CAPS_MODS = Capabilities(backward=True, dtypes=("float16", "bfloat16"), head_dims=tuple(range(8, 129, 8)),
                         score_mod=True, mask_mod=True)

register(Variant(
    name="fa2-tc", family="fa2", backend="cuda",
    description="FA2 on tensor cores: mma.sync m16n8k16, ldmatrix, swizzled smem, cp.async overlap; atomic dQ",
    impl=FA2TensorCore(), params=PARAMS, caps=CAPS_MODS,
    seed_ref="FA2 paper Algorithms 1 and 2, Sec. 3.1 and 3.3",
    tags=("tc-ladder", "flagship", "io:q-outer"),
    bench_configs=({"block_r": 64, "block_c": 64, "min_blocks": "auto"}, {"warps": 8, "block_c": 64, "min_blocks": 2},
                   {"split": "k", "block_r": 64, "block_c": 64}, {"split": "k", "block_r": 32, "block_c": 64},
                   {"block_c": 64}, {"block_c": 128}, {"bwd_pre": "cupy"}, {"bwd_block_c": 64}),
    bench_sweep={"block_r": (64, 128), "block_c": (32, 64, 128), "warps": (4, 8), "min_blocks": ("auto", 1, 2)}))

register(Variant(
    name="fa2-tc-deterministic", family="fa2", backend="cuda",
    description="fa2-tc with a deterministic backward: dK / dV column kernel plus a row-parallel dQ kernel, no atomics",
    impl=FA2TensorCore(deterministic=True), params=PARAMS, caps=CAPS_MODS,
    seed_ref="FA2 paper Algorithm 1 and 2, Sec. 3.3",
    tags=("tc-ladder", "backward-rung")))
