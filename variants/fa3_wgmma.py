"""fa3-wgmma: the first Hopper rung of the tensor-core ladder, kernels_cu/fa3_wgmma.cu (sm_90a).

Seed: FA3 paper (Shah et al. 2024) Sec. 3.1, its first ingredient: warpgroup MMA. Each warpgroup
(4 warps, 64 query rows) issues S = Q K^T with both operands read from 128-byte-swizzled shared
memory by the tensor cores, and O += P V with P in registers as the A operand (wgmma.mma_async);
everything else is fa2-tc's forward (cp.async copies one tile ahead, online softmax on raw scores,
masks, dropout, epilogue: kernels_cu/tc_softmax.cuh). The rung below is fa2-tc (mma.sync); TMA, warp
specialization and ping-pong scheduling are the rungs above.
Forward parameters: Bc (`block_c`), warpgroups per block (`warpgroups`, Br = 64 x warpgroups),
`philox_rounds`. The backward (`bwd_kernel`): "auto" (the default) runs the wgmma backward rung 2
(kernels_cu/fa3_bwd2.cu, variants/fa3_backward.py) for d <= 128 without modifiers or with score
modifiers and sinks, and fa2-tc's (kernels_cu/fa2_tc_bwd.cu, mma.sync, modifiers compiled in) otherwise;
"mma", "wgmma", "wgmma2" pick one. Each reads only q, k, v, out and lse, which this forward writes in the same layout.
Features: fa2-tc's (causal with tile skipping, window, block-sparse, GQA/MQA, dropout bit-exact with
the RNG contract, any Nq and Nk, dead rows, negative and zero scale), fp16 and bf16, d a multiple of
8 up to 256: kernels for D = 64, 128, 192 and 256, d zero-padded to the next (`d_pad`: d = 96 runs the
D = 128 kernel). Bc "auto" (the default) is FA3's key tile per head dim (AUTO_BC: 128 up to D = 128,
112 at 192, 80 at 256: the largest whose S, P and O registers and Q, K, V shared memory fit). The
backward runs every head dim of the forward: past d = 128 fa2-tc's wide kernel (kernels_cu/fa2_tc_bwd.cu
fa2_tc_bwd_wide, D = 192 and 256: two warps per key strip, each holding dK and dV for half the head dim),
which "auto" picks there; bwd_kernel="wgmma" / "wgmma2" (dK and dV of the whole head dim in registers) stop
at d = 128, refused past it with a ValueError naming the head dim.
Score and mask modifiers (issue 18, sandbox/modifiers.py): fa2-tc's, compiled into the forward module
(kernels_cu/tc_mods.cuh by -D switches; one module per modifier text and dropout switch; fa2_tc.ModKernel),
the mask modifier's empty tiles skipped through the tile table; the backward of such a forward is
wgmma2 with the same modifiers compiled in ("auto" up to d = 128: fa3_backward.backward_mods), fa2-tc's
past 128 or with "mma", and a config naming "wgmma" refuses them but sinks.
Runs on sm_90 GPUs only (H100, H200): wgmma exists on the sm_90a target alone, whose code runs on no
other architecture; elsewhere check() raises a ValueError naming it.
Status and speed: bench/results/h100/ (the tensor-core table lists it beside fa2-tc).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from sandbox import arrays, modifiers
from sandbox.device import SMEM_PER_BLOCK_OPTIN, arch, has_gpu
from sandbox.launch import LaunchPlan, cuda_options, dropout_args, f32, i32, i64, mask_args, strides4, tile_table
from sandbox.masks import classify_tiles
from sandbox.loader import CompileUnit, PackedLaunch, Slot, get_kernel, launch
from sandbox.registry import Capabilities, Param, Variant, philox_rounds_param, register

from . import fa3_backward
from .fa2_tc import CTYPE, ITEMSIZE, MAX_FLOAT_POSITION, FA2TensorCore, ModKernel, TCConfig, _check_aligned, \
    _check_row_strides, _dropout_slots, check_alignment, forward_scale_log2, modifier_args, modifier_tiles, scale_log2

SMEM_LIMIT = SMEM_PER_BLOCK_OPTIN["sm_90"]
ARCHS = ("sm_90a",)          # wgmma.mma_async: the architecture-specific target
HEAD_DIMS = (64, 128, 192, 256)  # the padded head dims D the forward kernels are built for
BWD_MAX_D = 256              # fa2-tc's backward ("mma"; fa2_tc_bwd_wide past 128) stops here
WGMMA_BWD_MAX_D = 128        # fa3_bwd.cu and fa3_bwd2.cu ("wgmma", "wgmma2") stop here


def d_pad(d: int) -> int:
    """The kernel head dim D of a head dim d (a multiple of 8 up to 256): the next of HEAD_DIMS; the
    columns past d are zero-filled in shared memory and never written back."""
    return next(D for D in HEAD_DIMS if d <= D)


def backward_head_dim_errors(d: int, bwd_kernel: str = "mma") -> list[str]:
    """The backward's envelope in head dim for a bwd_kernel choice ("auto" resolves to "mma" past 128)."""
    if d > BWD_MAX_D:
        return [f"backward at head dim {d}: the backward kernels stop at d = {BWD_MAX_D}"]
    if bwd_kernel in fa3_backward.KERNELS and d > WGMMA_BWD_MAX_D:
        return [f"backward at head dim {d}: bwd_kernel={bwd_kernel!r} (kernels_cu/fa3_bwd*.cu) stops at "
                f"d = {WGMMA_BWD_MAX_D}; bwd_kernel=\"mma\" (or \"auto\") runs fa2-tc's backward up to d = {BWD_MAX_D}"]
    return []


# Bc "auto", per padded head dim: FA3's key tiles (hopper/tile_size.h, 128 query rows): 128 up to D = 128;
# 112 at D = 192 and 80 at D = 256, where the O accumulator (D / 2 floats per consumer thread) leaves room
# for S and P of that many keys, and fa3-ws's two K and V ring slots still fit 227 KB beside Q.
AUTO_BC = {64: 128, 128: 128, 192: 112, 256: 80}
# A thread's registers beyond its O (D / 2), S (Bc / 2) and P (Bc / 4) accumulators: the envelope refuses a
# D > 128 config whose sum passes its register cap (the wide head dims only: at D <= 128 the compile report
# decides). Calibrated on the compile report (NVRTC 13, sm_90a; README, Hopper ladder).
OVERHEAD_REGS = 40


def register_errors(D: int, bc: int, cap: int, who: str) -> list[str]:
    need = D // 2 + bc // 2 + bc // 4 + OVERHEAD_REGS
    if D <= 128 or need <= cap:
        return []
    return [f"head dim D = {D} with Bc = {bc} needs about {need} registers per thread (O {D // 2}, S {bc // 2}, "
            f"P {bc // 4}, {OVERHEAD_REGS} more), over the {cap} of {who}; take block_c=\"auto\" or a smaller Bc"]


# ---- score and mask modifiers (issue 18): fa2-tc's (kernels_cu/tc_mods.cuh, fa2_tc.ModKernel)

_WGMMA_BWD_MODS = ("bwd_kernel=\"wgmma\" (kernels_cu/fa3_bwd.cu) takes no modifiers but sinks; bwd_kernel="
                   "\"wgmma2\", \"mma\" (fa2-tc's backward) and \"auto\" (the default: wgmma2 up to d = 128) "
                   "take them all")


def has_mods(p) -> bool:
    return p.score_mod is not None or p.mask_mod is not None


AUTO_BWD = "wgmma2"       # what bwd_kernel="auto" runs where it can (2x "mma" on the H100: bench/results/h100/)


def resolve_bwd_kernel(bwd_kernel: str, p) -> str:
    """The backward kernel a config runs for problem p: "auto" is AUTO_BWD for d <= 128 (the wgmma backwards
    hold dK / dV for D <= 128) where it takes the modifiers (wgmma2: all of them, fa3_backward.takes_mods),
    else fa2-tc's ("mma")."""
    if bwd_kernel != "auto":
        return bwd_kernel
    return AUTO_BWD if p.d <= 128 and fa3_backward.takes_mods(AUTO_BWD, p) else "mma"


def modifier_errors(p, config, direction) -> list[str]:
    """fa2-tc's checks of a problem's modifiers (their CUDA text and buffers, the float positions), and
    the backward's kernel where a config names one: fa3_backward.takes_mods (wgmma2: score modifiers and
    sinks and mask modifiers; wgmma: sinks alone; fa2-tc's, "mma": everything)."""
    if not has_mods(p):
        return []
    for mod in (p.score_mod, p.mask_mod):          # their CUDA text and buffers, before any launch
        if mod is not None:
            modifiers.cuda_buffers(mod)
    ModKernel.of(p, direction in ("backward", "both"))
    errs = []
    if p.score_mod is not None and max(p.Nq, p.Nk) > MAX_FLOAT_POSITION:
        errs.append(f"a score modifier sees positions as floats fi, fj (kernels_cu/tc_mods.cuh), exact up to "
                    f"{MAX_FLOAT_POSITION}; Nq = {p.Nq}, Nk = {p.Nk}")
    if (direction in ("backward", "both") and config.bwd_kernel in fa3_backward.KERNELS
            and not fa3_backward.takes_mods(config.bwd_kernel, p)):
        errs.append(_WGMMA_BWD_MODS)          # "auto" routes by fa3_backward.takes_mods
    return errs


def forward_tiles(p, config, D, mods, xp, row_shift: int = 0) -> tuple:
    """(tile table, tile_heads, MOD_PARAMS arguments) of the forward: without modifiers the usual table
    and nothing more; with them the table with the mask modifier's classes folded in (batch axis) and
    modifier_args. xp None: host arrays (the argument-packing tests run without a GPU). A config whose tile
    depends on the head dim (fa3-ws consumers="auto") is resolved at D first. `row_shift`: bottom-aligned Q
    tiles (fa3_ws.cu; not with a mask modifier, whose classes are top-aligned)."""
    if hasattr(config, "for_head_dim"):
        config = config.for_head_dim(D, mods is not None)
    if mods is None:
        if xp is not None:
            return (*tile_table(p, config.block_r, config.bc(D), xp, row_shift), ())
        t = classify_tiles(p.Nq, p.Nk, config.block_r, config.bc(D), p.band, p.block_mask, row_shift)
        return t, i32(t.shape[0]), ()
    tiles, tile_heads, tile_b = modifier_tiles(p, config.block_r, config.bc(D), xp, row_shift)
    return tiles, tile_heads, modifier_args(p, tile_b, xp, forward=True)


# ---- config

@dataclass(frozen=True)
class WgmmaConfig:
    block_c: object = "auto"
    warpgroups: int = 2
    philox_rounds: int = 10
    bwd: TCConfig = field(default_factory=TCConfig)     # fa2-tc's backward config (its defaults; rowdot)
    bwd_kernel: str = "auto"                             # "mma": fa2-tc's; "wgmma": fa3_bwd.cu; "wgmma2": fa3_bwd2.cu;
                                                         # "auto": resolve_bwd_kernel

    # what FA2TensorCore's launch path reads of a forward config
    @property
    def block_r(self) -> int:
        return 64 * self.warpgroups

    @property
    def warps(self) -> int:
        return 4 * self.warpgroups

    def bc(self, D: int, dropout: bool = False) -> int:
        return AUTO_BC[D] if self.block_c == "auto" else self.block_c

    def forward_name(self, dtype: str, D: int, dropout: bool) -> str:
        return (f"fa3_wgmma_forward<{CTYPE[dtype]}, {D}, {self.bc(D)}, {self.warpgroups}, {self.philox_rounds}, "
                f"{'true' if dropout else 'false'}>")

    def forward_smem(self, D: int, dropout: bool = False) -> int:
        """Q, K, V tiles, plus 1024 bytes of slack to align them (kernels_cu/fa3_wgmma.cu)."""
        return ITEMSIZE * D * (self.block_r + 2 * self.bc(D)) + 1024

    @property
    def register_cap(self) -> int:
        """Registers per thread of one block per SM (__launch_bounds__(128 WG, 1)): 65536 / threads, at
        most 255, in ptxas's steps of 8."""
        return min(255, 65536 // (128 * self.warpgroups) // 8 * 8)

    def unit(self, dtype: str, D: int, mods=None) -> CompileUnit:
        """Both dropout switches in one module; with `mods` (fa2_tc.ModKernel: the modifiers compiled in)
        the one switch it names."""
        drops = (False, True) if mods is None else (mods.dropout,)
        names = tuple(self.forward_name(dtype, D, drop) for drop in drops)
        return CompileUnit("fa3_wgmma.cu", names, cuda_options() + (mods.options if mods else ()),
                           {n: self.forward_smem(D) for n in names},
                           label=f"fa3-wgmma[{dtype}, D={D}{mods.label if mods else ''}]", archs=ARCHS)

    def envelope_errors(self, D: int) -> list[str]:
        smem = self.forward_smem(D)
        errs = [f"shared memory {smem} B exceeds {SMEM_LIMIT} B"] if smem > SMEM_LIMIT else []
        return errs + register_errors(D, self.bc(D), self.register_cap, f"warpgroups={self.warpgroups}")


# ---- launch: fa2-tc's forward path (same kernel signature, grid and tile table), fa2-tc's backward

class FA3Wgmma(FA2TensorCore):
    name = "fa3-wgmma"
    has_backward = True
    # spill-free in the compile report (NVRTC 13, sm_90a) at D = 64, 128, 192 and 256: (block_c, warpgroups);
    # "auto" is Bc = 128 at D <= 128 (the kernels of the former default block_c=128). The CI gate builds the
    # defaults and this table; block_c=64 and warpgroups=1 compiled clean too at D <= 128 (this session's
    # reports) but are left to compile on first use: each Hopper kernel costs seconds of NVRTC.
    TUNED = {("auto", 2)}

    def configure(self, block_c="auto", warpgroups=2, philox_rounds=10, bwd_kernel="auto"):
        return WgmmaConfig(block_c, warpgroups, philox_rounds, TCConfig(philox_rounds=philox_rounds), bwd_kernel)

    def check(self, problem, config, direction):
        if has_gpu() and arch() != "sm_90":
            raise ValueError(f"variant {self.name!r} needs an sm_90 GPU (H100, H200): its wgmma kernels build for "
                             f"the sm_90a target only; this GPU is {arch()}")
        if problem.d > HEAD_DIMS[-1]:
            raise ValueError(f"variant {self.name!r}: head dim {problem.d} exceeds {HEAD_DIMS[-1]}")
        errs = config.envelope_errors(d_pad(problem.d))
        if direction in ("backward", "both"):
            bwd = backward_head_dim_errors(problem.d, config.bwd_kernel)
            errs += bwd or config.bwd.backward_errors(d_pad(problem.d))
        if problem.d % 8:
            errs.append(f"head dim {problem.d} is not a multiple of 8 (rows move in 16-byte chunks)")
        errs += modifier_errors(problem, config, direction)
        if errs:
            raise ValueError(f"variant {self.name!r} with {config}: " + "; ".join(errs))

    def report_configs(self):
        """The defaults, the tuned table, the wgmma backward (every launchable instantiation the CI gate
        builds; other parameter choices compile on first use)."""
        return [{}, {"bwd_kernel": "wgmma"}, {"bwd_kernel": "wgmma2"}]

    # fa3_bwd.cu: spill-free at D = 64; at D = 128 the kernel without dropout spills 28 bytes (NVRTC 13)
    FA3_BWD_TUNED_DIMS = (64,)

    def tuned(self, config, unit=None) -> bool:
        if unit is not None and unit.source == "fa3_bwd.cu":     # names: fa3_bwd<T, D, R, DROPOUT>
            return all(int(n.split(",")[1]) in self.FA3_BWD_TUNED_DIMS for n in unit.names)
        if unit is not None and unit.source == "fa3_bwd2.cu":    # spill-free at D = 64 and 128 (NVRTC 13)
            return True
        if unit is not None and unit.source not in ("fa3_wgmma.cu", "fa3_ws.cu"):
            return super().tuned(config.bwd, unit)
        return (config.block_c, config.warpgroups) in self.TUNED

    def compile_units(self, config):
        """The forward units of `config`; the backward's with the default config (fa2-tc's kernels, which
        also hold the wgmma backward's preprocessing) and with bwd_kernel="wgmma" (fa3_bwd.cu)."""
        units = [config.unit(dt, D) for dt in CAPS.dtypes for D in HEAD_DIMS if not config.envelope_errors(D)]
        if getattr(config, "persistent", None) == "auto":     # fa3-ws / fa3: D = 64's persistent default (short walks)
            short = config.for_head_dim(64, short=True)        # refused configs build nothing (their static_asserts)
            units += [u for u in (short.unit(dt, 64) for dt in CAPS.dtypes)
                      if u not in units and not short.envelope_errors(64)]
        if config == self.configure():
            units += [config.bwd.backward_unit(dt, D) for dt in CAPS.dtypes for D in HEAD_DIMS
                      if not config.bwd.backward_errors(D)]
        kernel = AUTO_BWD if config.bwd_kernel == "auto" else config.bwd_kernel
        if kernel in fa3_backward.KERNELS:
            units += [fa3_backward.kernel_unit(kernel, dt, D, config.philox_rounds)
                      for dt in CAPS.dtypes for D in (64, 128)]
        return units

    def config_caps(self, config, caps):
        """A config naming a wgmma backward lists what it takes (fa3_backward.takes_mods): wgmma2 (fa3_bwd2.cu)
        every modifier; wgmma (fa3_bwd.cu) none (sinks alone, which the capabilities cannot say apart, are
        taken there: P comes from lse)."""
        if config.bwd_kernel == "wgmma":
            return dataclasses.replace(caps, score_mod=False, mask_mod=False)
        return caps

    def backward(self, p, dout, q, k, v, out, lse, config):
        self._refuse_wide_backward(p, config)
        kernel = resolve_bwd_kernel(config.bwd_kernel, p)
        if kernel in fa3_backward.KERNELS and not fa3_backward.takes_mods(kernel, p):
            raise ValueError(f"variant {self.name!r}: " + _WGMMA_BWD_MODS)
        if kernel in fa3_backward.KERNELS:
            return fa3_backward.dispatch_backward(kernel, self.name, p, dout, q, k, v, out, lse, config.bwd)
        return super().backward(p, dout, q, k, v, out, lse, config.bwd)

    def _refuse_wide_backward(self, p, config):
        """check() refuses it first; this guard keeps a direct call from launching a D = 128 kernel on wider rows."""
        errs = backward_head_dim_errors(p.d, config.bwd_kernel)
        if errs:
            raise ValueError(f"variant {self.name!r}: " + "; ".join(errs))

    # ---- the forward: fa2-tc's signature, grid and tile table, with this rung's head-dim padding

    def launch_mods(self, p, q, k, v, config):
        """fa2-tc's forward() sends a problem with modifiers here: `launch` handles both."""
        return self.launch(p, q, k, v, config, (-(-p.Nq // config.block_r), p.B * p.Hq))

    def launch(self, p, q, k, v, config, grid, scratch=()):
        import cupy as xp
        for x, nm in ((q, "q"), (k, "k"), (v, "v")):
            check_alignment(x, nm, self.name)
        if p.scale < 0:          # the kernels take the row max on raw scores: scale > 0 (tc_softmax.cuh)
            k = arrays.negate(k, xp)
        D, dropout = d_pad(p.d), p.dropout_p > 0
        mods = ModKernel.of(p)     # None without modifiers: the module and arguments without them
        unit, name = config.unit(p.dtype, D, mods), config.forward_name(p.dtype, D, dropout)
        out = xp.empty((p.B, p.Hq, p.Nq, p.d), dtype=q.dtype)
        lse = xp.empty((p.B, p.Hq, p.Nq), dtype=xp.float32)
        tiles, tile_heads, mod_rest = forward_tiles(p, config, D, mods, xp)
        launch(unit, name, grid, (32 * config.warps,),
               (q, *strides4(q)[:3], k, *strides4(k)[:3], v, *strides4(v)[:3], out, lse, *scratch,
                tiles, tile_heads, i32(p.Hq), i32(p.group), i32(p.Nq), i32(p.Nk), i32(p.d),
                f32(forward_scale_log2(p)), *mask_args(p, xp), *dropout_args(p), *mod_rest),
               shared_mem=unit.dynamic_smem[name])
        return out, lse

    def forward_plan(self, p, config, strides) -> LaunchPlan | None:
        """fa2-tc's pointer-level plan with this rung's padding (None for a negative scale: the generic
        path negates K into a copy)."""
        import cupy as xp
        if p.scale < 0 or has_mods(p):
            return None
        for nm in ("q", "k", "v"):
            _check_row_strides(strides[nm], nm, self.name)
        D, dropout = d_pad(p.d), p.dropout_p > 0
        unit, name = config.unit(p.dtype, D), config.forward_name(p.dtype, D, dropout)
        tiles, tile_heads = tile_table(p, config.block_r, config.bc(D), xp)
        sq, sk, sv = (tuple(i64(x) for x in strides[nm][:3]) for nm in ("q", "k", "v"))
        args = (Slot("q"), *sq, Slot("k"), *sk, Slot("v"), *sv, Slot("out"), Slot("lse"), tiles, tile_heads,
                i32(p.Hq), i32(p.group), i32(p.Nq), i32(p.Nk), i32(p.d), f32(scale_log2(p.scale)), *mask_args(p, xp),
                *_dropout_slots(p))
        kernel = PackedLaunch(get_kernel(unit, name).kernel, (-(-p.Nq // config.block_r), p.B * p.Hq),
                              (32 * config.warps,), unit.dynamic_smem[name], args)

        def run(ptr, seed, offset, stream):
            _check_aligned(ptr, ("q", "k", "v"), self.name)
            ptr["seed"], ptr["offset"] = seed, offset
            kernel(ptr, stream)

        buffers = {"out": ((p.B, p.Hq, p.Nq, p.d), p.dtype, False), "lse": ((p.B, p.Hq, p.Nq), "float32", False)}
        return LaunchPlan(buffers, run, keep=(tiles,))

    def backward_plan(self, p, config, strides):
        self._refuse_wide_backward(p, config)
        kernel = resolve_bwd_kernel(config.bwd_kernel, p)
        if has_mods(p) and kernel != "wgmma2":  # the generic path (fa2-tc's backward, the modifiers compiled in)
            return None
        if kernel in fa3_backward.KERNELS:
            return fa3_backward.dispatch_plan(kernel, self.name, p, config.bwd, strides)
        return super().backward_plan(p, config.bwd, strides)


BWD_KERNEL = Param("bwd_kernel", ("auto", "mma", "wgmma", "wgmma2"), "auto", "backward kernels: mma, fa2-tc's "
                   "(mma.sync; modifiers compiled in); wgmma, kernels_cu/fa3_bwd.cu (five wgmma GEMMs, 128 keys per "
                   "block, dQ by atomics); wgmma2, kernels_cu/fa3_bwd2.cu (one dQ partial per tile by bulk reductions, "
                   "the GEMMs overlapped with the element-wise steps; 2x mma on the H100; score and mask modifiers "
                   "compiled in); auto: wgmma2 for d <= 128, else mma")
# head dims: the forward's (multiples of 8 up to 256), the backward's the same with "mma" / "auto"; "wgmma" and
# "wgmma2" stop at 128 (check() refuses past it: the registry has one head-dim list for both directions)
# score_mod / mask_mod: compiled into the forward (tc_mods.cuh) and into the backward (wgmma2 to d = 128, fa2-tc's
# past it; fa3_backward.backward_mods)
CAPS = Capabilities(backward=True, dtypes=("float16", "bfloat16"), head_dims=tuple(range(8, 257, 8)),
                    score_mod=True, mask_mod=True)

register(Variant(
    name="fa3-wgmma", family="fa3", backend="cuda",
    description="Hopper rung 1: both GEMMs on wgmma (sm_90a), Q/K/V in 128B-swizzled smem, P in registers; "
                "cp.async loads; fa2-tc's backward",
    impl=FA3Wgmma(),
    params=(Param("block_c", ("auto", 64, 80, 112, 128, 192), "auto", "Bc: keys per K/V tile (the n of S = Q K^T's "
                  "wgmma); auto: 128 up to d = 128, 112 at d <= 192, 80 at d <= 256 (AUTO_BC)"),
            Param("warpgroups", (1, 2, 3), 2, "warpgroups per block, 64 query rows each (Br = 64 x warpgroups)"),
            philox_rounds_param(), BWD_KERNEL),
    caps=CAPS, seed_ref="FA3 paper Sec. 3.1 (wgmma); FA2 paper Algorithm 1, Sec. 3.1",
    tags=("tc-ladder",),
    bench_configs=({"block_c": 64}, {"warpgroups": 3}, {"warpgroups": 1}),
    bench_sweep={"block_c": (64, 128, 192), "warpgroups": (1, 2, 3)}))
