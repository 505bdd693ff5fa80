"""fa3-wgmma: the first Hopper rung of the tensor-core ladder, kernels_cu/fa3_wgmma.cu (sm_90a).

Seed: FA3 paper (Shah et al. 2024) Sec. 3.1, its first ingredient: warpgroup MMA. Each warpgroup
(4 warps, 64 query rows) issues S = Q K^T with both operands read from 128-byte-swizzled shared
memory by the tensor cores, and O += P V with P in registers as the A operand (wgmma.mma_async);
everything else is fa2-tc's forward (cp.async copies one tile ahead, online softmax on raw scores,
masks, dropout, epilogue: kernels_cu/tc_softmax.cuh). The rung below is fa2-tc (mma.sync); TMA, warp
specialization and ping-pong scheduling are the rungs above.
Forward parameters: Bc (`block_c`), warpgroups per block (`warpgroups`, Br = 64 x warpgroups),
`philox_rounds`. The backward (`bwd_kernel`): fa2-tc's (kernels_cu/fa2_tc_bwd.cu, mma.sync) with its
defaults, or the wgmma one (variants/fa3_backward.py); either reads only q, k, v, out and lse, which
this forward writes in the same layout.
Features: fa2-tc's (causal with tile skipping, window, block-sparse, GQA/MQA, dropout bit-exact with
the RNG contract, any Nq and Nk, dead rows, negative and zero scale), fp16 and bf16, d a multiple of
8 up to 128. Runs on sm_90 GPUs only (H100, H200): wgmma exists on the sm_90a target alone, whose code
runs on no other architecture; elsewhere check() raises a ValueError naming it.
Status and speed: bench/results/h100/ (the tensor-core table lists it beside fa2-tc).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sandbox.device import SMEM_PER_BLOCK_OPTIN, arch, has_gpu
from sandbox.launch import cuda_options
from sandbox.loader import CompileUnit
from sandbox.registry import Capabilities, Param, Variant, philox_rounds_param, register

from . import fa3_backward
from .fa2_tc import CTYPE, ITEMSIZE, FA2TensorCore, TCConfig, d_pad

SMEM_LIMIT = SMEM_PER_BLOCK_OPTIN["sm_90"]
ARCHS = ("sm_90a",)          # wgmma.mma_async: the architecture-specific target


# ---- config

@dataclass(frozen=True)
class WgmmaConfig:
    block_c: int = 128
    warpgroups: int = 2
    philox_rounds: int = 10
    bwd: TCConfig = field(default_factory=TCConfig)     # fa2-tc's backward config (its defaults; rowdot)
    bwd_kernel: str = "mma"                              # "mma": fa2-tc's kernels; "wgmma": fa3_bwd.cu

    # what FA2TensorCore's launch path reads of a forward config
    @property
    def block_r(self) -> int:
        return 64 * self.warpgroups

    @property
    def warps(self) -> int:
        return 4 * self.warpgroups

    def bc(self, D: int, dropout: bool = False) -> int:
        return self.block_c

    def forward_name(self, dtype: str, D: int, dropout: bool) -> str:
        return (f"fa3_wgmma_forward<{CTYPE[dtype]}, {D}, {self.block_c}, {self.warpgroups}, {self.philox_rounds}, "
                f"{'true' if dropout else 'false'}>")

    def forward_smem(self, D: int, dropout: bool = False) -> int:
        """Q, K, V tiles, plus 1024 bytes of slack to align them (kernels_cu/fa3_wgmma.cu)."""
        return ITEMSIZE * D * (self.block_r + 2 * self.block_c) + 1024

    def unit(self, dtype: str, D: int) -> CompileUnit:
        names = tuple(self.forward_name(dtype, D, drop) for drop in (False, True))
        return CompileUnit("fa3_wgmma.cu", names, cuda_options(), {n: self.forward_smem(D) for n in names},
                           label=f"fa3-wgmma[{dtype}, D={D}]", archs=ARCHS)

    def envelope_errors(self, D: int) -> list[str]:
        smem = self.forward_smem(D)
        return [f"shared memory {smem} B exceeds {SMEM_LIMIT} B"] if smem > SMEM_LIMIT else []


# ---- launch: fa2-tc's forward path (same kernel signature, grid and tile table), fa2-tc's backward

class FA3Wgmma(FA2TensorCore):
    name = "fa3-wgmma"
    has_backward = True
    # spill-free in the compile report (NVRTC 13, sm_90a) at D = 64 and 128: (block_c, warpgroups). The CI
    # gate builds the defaults and this table; block_c=64 and warpgroups=1 compiled clean too (this
    # session's reports) but are left to compile on first use: each Hopper kernel costs seconds of NVRTC.
    TUNED = {(128, 2)}

    def configure(self, block_c=128, warpgroups=2, philox_rounds=10, bwd_kernel="mma"):
        return WgmmaConfig(block_c, warpgroups, philox_rounds, TCConfig(philox_rounds=philox_rounds), bwd_kernel)

    def check(self, problem, config, direction):
        if has_gpu() and arch() != "sm_90":
            raise ValueError(f"variant {self.name!r} needs an sm_90 GPU (H100, H200): its wgmma kernels build for "
                             f"the sm_90a target only; this GPU is {arch()}")
        errs = config.envelope_errors(d_pad(problem.d))
        if direction in ("backward", "both"):
            errs += config.bwd.backward_errors(d_pad(problem.d))
        if problem.d % 8:
            errs.append(f"head dim {problem.d} is not a multiple of 8 (rows move in 16-byte chunks)")
        if errs:
            raise ValueError(f"variant {self.name!r} with {config}: " + "; ".join(errs))

    def report_configs(self):
        """The defaults, the tuned table, the wgmma backward (every launchable instantiation the CI gate
        builds; other parameter choices compile on first use)."""
        return [{}, {"bwd_kernel": "wgmma"}]

    # fa3_bwd.cu: spill-free at D = 64; at D = 128 the kernel without dropout spills 28 bytes (NVRTC 13)
    FA3_BWD_TUNED_DIMS = (64,)

    def tuned(self, config, unit=None) -> bool:
        if unit is not None and unit.source == "fa3_bwd.cu":     # names: fa3_bwd<T, D, R, DROPOUT>
            return all(int(n.split(",")[1]) in self.FA3_BWD_TUNED_DIMS for n in unit.names)
        if unit is not None and unit.source not in ("fa3_wgmma.cu", "fa3_ws.cu"):
            return super().tuned(config.bwd, unit)
        return (config.block_c, config.warpgroups) in self.TUNED

    def compile_units(self, config):
        """The forward units of `config`; the backward's with the default config (fa2-tc's kernels, which
        also hold the wgmma backward's preprocessing) and with bwd_kernel="wgmma" (fa3_bwd.cu)."""
        units = [config.unit(dt, D) for dt in CAPS.dtypes for D in (64, 128) if not config.envelope_errors(D)]
        if config == self.configure():
            units += [config.bwd.backward_unit(dt, D) for dt in CAPS.dtypes for D in (64, 128)
                      if not config.bwd.backward_errors(D)]
        if config.bwd_kernel == "wgmma":
            units += [fa3_backward.unit(dt, D, config.philox_rounds) for dt in CAPS.dtypes for D in (64, 128)]
        return units

    def backward(self, p, dout, q, k, v, out, lse, config):
        if config.bwd_kernel == "wgmma":
            return fa3_backward.backward(self.name, p, dout, q, k, v, out, lse, config.bwd)
        return super().backward(p, dout, q, k, v, out, lse, config.bwd)

    def backward_plan(self, p, config, strides):
        if config.bwd_kernel == "wgmma":
            return fa3_backward.backward_plan(self.name, p, config.bwd, strides)
        return super().backward_plan(p, config.bwd, strides)


BWD_KERNEL = Param("bwd_kernel", ("mma", "wgmma"), "mma", "backward kernels: mma, fa2-tc's (mma.sync, the default "
                   "until the wgmma one has the tier's GPU evidence); wgmma, kernels_cu/fa3_bwd.cu (five wgmma GEMMs, "
                   "128 keys per block, dQ by atomics)")
CAPS = Capabilities(backward=True, dtypes=("float16", "bfloat16"), head_dims=tuple(range(8, 129, 8)))

register(Variant(
    name="fa3-wgmma", family="fa3", backend="cuda",
    description="Hopper rung 1: both GEMMs on wgmma (sm_90a), Q/K/V in 128B-swizzled smem, P in registers; "
                "cp.async loads; fa2-tc's backward",
    impl=FA3Wgmma(),
    params=(Param("block_c", (64, 128, 192), 128, "Bc: keys per K/V tile (the n of S = Q K^T's wgmma)"),
            Param("warpgroups", (1, 2, 3), 2, "warpgroups per block, 64 query rows each (Br = 64 x warpgroups)"),
            philox_rounds_param(), BWD_KERNEL),
    caps=CAPS, seed_ref="FA3 paper Sec. 3.1 (wgmma); FA2 paper Algorithm 1, Sec. 3.1",
    tags=("tc-ladder",),
    bench_configs=({"block_c": 64}, {"warpgroups": 3}, {"warpgroups": 1}),
    bench_sweep={"block_c": (64, 128, 192), "warpgroups": (1, 2, 3)}))
