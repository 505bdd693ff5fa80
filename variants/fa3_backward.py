"""The wgmma backwards of the Hopper rungs (sm_90a): `bwd_kernel="wgmma"` (kernels_cu/fa3_bwd.cu) and
`bwd_kernel="wgmma2"` (kernels_cu/fa3_bwd2.cu, the rung above it).

Seed: FA2 paper Algorithm 2 (column-parallel, P recomputed from the logsumexp, D = rowsum(dO o O)
precomputed, dQ accumulated in fp32 across key blocks) with its five GEMMs on wgmma (FA3 paper Sec. 3).
The preprocessing D = rowsum(dO o O) is fa2-tc's kernel (fa2_tc_bwd_rowdot) for wgmma, fa3_bwd2_pre (D, lse in
padded rows for bulk copies, the dQ accumulator zeroed) for wgmma2. Tile: 128 keys per block
(64 per warpgroup), 64 query rows per step; wgmma2 takes 128 at d <= 64 without dropout (`rows2`: FA3's
128 x 128 tile for head dim 64).
- wgmma: dQ by float4 atomics of each warpgroup's key half into an fp32 dq, cast at the end (as
  fa2-tc's atomic backward).
- wgmma2: one dQ partial per block and Q tile (the warpgroups split its columns), staged in shared
  memory and added by one bulk reduction per warpgroup into an fp32 buffer in accumulator order
  (`dq_acc`, [B*Hq, ceil(Nq / 64), 64 D]), which fa3_bwd2_dq turns into dq (scaled, q's dtype); the
  GEMMs of a tile overlap its element-wise steps (the kernel header has the design and the predicted
  gains). SANDBOX_BWD2_SERIAL=1 (read at import) builds it with every GEMM waited for at once: the dQ
  change alone, for measuring the two changes apart.
Neither is deterministic (atomics, reductions); `bwd_kernel="mma"` keeps fa2-tc's kernels.
Modifiers (`backward_mods`): both take attention sinks alone (P is recomputed from lse, which holds the
sink: nothing changes); wgmma2 also takes a distance bias (ALiBi, ScoreMod.cuda_distance_slope), which
seeds its S^T accumulator as the forward's S (kernels_cu/tc_mods.cuh), any other score modifier with
a derivative (its text compiled in, as fa2-tc's backward does), and mask modifiers (their predicate
compiled in, their tile classes folded into the tile table).
"""
from __future__ import annotations

import os

from sandbox import arrays, tma
from sandbox.launch import LaunchPlan, cuda_options, dropout_args, f32, i32, i64, mask_args, strides4, tile_table
from sandbox.loader import CompileUnit, PackedLaunch, Slot, get_kernel, launch

from .fa2_tc import (CTYPE, ITEMSIZE, ModKernel, TCConfig, _check_aligned, _check_row_strides, _dropout_slots,
                     backward_mods, check_alignment, d_pad, factored_args, modifier_args, modifier_tiles, module_mods)

BR, BC, THREADS = 64, 128, 256
ARCHS = ("sm_90a",)
KERNELS = ("wgmma", "wgmma2")      # the bwd_kernel values these kernels serve ("mma" is fa2-tc's)
SERIAL = os.environ.get("SANDBOX_BWD2_SERIAL", "0") == "1"    # wgmma2 ablation: GEMMs not overlapped
TMA_ROWS = 64                      # wgmma2's Q and dO tensor maps: boxes of 64 rows x 64 columns


def takes_mods(kernel: str, p) -> bool:
    """Whether bwd_kernel `kernel` ("wgmma", "wgmma2") runs problem p's modifiers: wgmma2 all of them,
    wgmma (fa3_bwd.cu) sinks alone."""
    return backward_mods(p) == "none" or kernel == "wgmma2"


def dq_scale(p, need: str):
    """fa3_bwd2_dq's factor: the scale, times the factored form's post pre where fa3_bwd2 compiles its core (dS then
    leaves that factor to the epilogues: fa3_bwd2.cu ds_scale)."""
    fac = factored_args(p, need)
    return f32(p.scale * float(fac[2])) if fac else f32(p.scale)


def name(dtype: str, D: int, dropout: bool, rounds: int) -> str:
    return f"fa3_bwd<{CTYPE[dtype]}, {D}, {rounds}, {'true' if dropout else 'false'}>"


def smem(D: int) -> int:
    """K, V, two buffers of Q and dO, the dS^T panel, two buffers of lse and D, 1024 bytes of alignment slack."""
    return ITEMSIZE * (2 * BC * D + 4 * BR * D + BC * BR) + 4 * 4 * BR + 1024


def unit(dtype: str, D: int, rounds: int) -> CompileUnit:
    names = tuple(name(dtype, D, drop, rounds) for drop in (False, True))
    return CompileUnit("fa3_bwd.cu", names, cuda_options(), {n: smem(D) for n in names},
                       label=f"fa3-bwd[{dtype}, D={D}]", archs=ARCHS)


def backward(variant: str, p, dout, q, k, v, out, lse, tc: TCConfig):
    """dq, dk, dv on the caller's CuPy stream (the api's caller_stream context)."""
    import cupy as xp
    for x, nm in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout"), (out, "out")):
        check_alignment(x, nm, variant)
    D, dropout = d_pad(p.d), p.dropout_p > 0
    pre = tc.backward_unit(p.dtype, D)
    Dv = xp.empty((p.B, p.Hq, p.Nq), dtype=xp.float32)
    rows = p.B * p.Hq * p.Nq
    launch(pre, tc.rowdot_name(p.dtype), (-(-rows // 32),), (256,),
           (dout, *strides4(dout)[:3], out, *strides4(out)[:3], Dv, i32(p.Hq), i32(p.Nq), i32(p.d), i64(rows)))
    dq = xp.zeros((p.B, p.Hq, p.Nq, p.d), dtype=xp.float32)
    dk = xp.empty((p.B, p.Hkv, p.Nk, p.d), dtype=q.dtype)
    dv = xp.empty((p.B, p.Hkv, p.Nk, p.d), dtype=q.dtype)
    tiles, tile_heads = tile_table(p, BR, BC, xp)
    u, kname = unit(p.dtype, D, tc.philox_rounds), name(p.dtype, D, dropout, tc.philox_rounds)
    launch(u, kname, (-(-p.Nk // BC), p.B * p.Hkv), (THREADS,),
           (q, *strides4(q)[:3], k, *strides4(k)[:3], v, *strides4(v)[:3], dout, *strides4(dout)[:3], lse, Dv,
            dq, dk, dv, tiles, tile_heads, i32(p.Hq), i32(p.Hkv), i32(p.group), i32(p.Nq), i32(p.Nk), i32(p.d),
            f32(p.scale), *mask_args(p, xp), *dropout_args(p)),
           shared_mem=u.dynamic_smem[kname])
    return arrays.from_float32(dq, q.dtype, xp), dk, dv


def backward_plan(variant: str, p, tc: TCConfig, strides) -> LaunchPlan:
    """The pointer-level plan (sandbox/fastpath.py): rowdot, then fa3_bwd; dq an fp32 buffer zeroed by
    the caller and cast after the run (as fa2-tc's atomic plan)."""
    import cupy as xp
    for nm in ("q", "k", "v", "out", "dout"):
        _check_row_strides(strides[nm], nm, variant)
    D, dropout = d_pad(p.d), p.dropout_p > 0
    pre = tc.backward_unit(p.dtype, D)
    u, kname = unit(p.dtype, D, tc.philox_rounds), name(p.dtype, D, dropout, tc.philox_rounds)
    tiles, tile_heads = tile_table(p, BR, BC, xp)
    st = {nm: tuple(i64(x) for x in strides[nm][:3]) for nm in strides}
    rows = p.B * p.Hq * p.Nq
    operands = tuple(x for nm in ("q", "k", "v", "dout") for x in (Slot(nm), *st[nm])) + (Slot("lse"), Slot("D"))
    kernels = [
        PackedLaunch(get_kernel(pre, tc.rowdot_name(p.dtype)).kernel, (-(-rows // 32),), (256,), 0,
                     (Slot("dout"), *st["dout"], Slot("out"), *st["out"], Slot("D"), i32(p.Hq), i32(p.Nq), i32(p.d),
                      i64(rows))),
        PackedLaunch(get_kernel(u, kname).kernel, (-(-p.Nk // BC), p.B * p.Hkv), (THREADS,), u.dynamic_smem[kname],
                     (*operands, Slot("dq"), Slot("dk"), Slot("dv"), tiles, tile_heads, i32(p.Hq), i32(p.Hkv),
                      i32(p.group), i32(p.Nq), i32(p.Nk), i32(p.d), f32(p.scale), *mask_args(p, xp),
                      *_dropout_slots(p)))]

    def run(ptr, seed, offset, stream):
        _check_aligned(ptr, ("q", "k", "v", "out", "dout"), variant)
        ptr["seed"], ptr["offset"] = seed, offset
        for kernel in kernels:
            kernel(ptr, stream)

    kv = (p.B, p.Hkv, p.Nk, p.d)
    buffers = {"D": ((p.B, p.Hq, p.Nq), "float32", False), "dq": ((p.B, p.Hq, p.Nq, p.d), "float32", True),
               "dk": (kv, p.dtype, False), "dv": (kv, p.dtype, False)}
    return LaunchPlan(buffers, run, keep=(tiles,))


# ---- bwd_kernel="wgmma2": kernels_cu/fa3_bwd2.cu

def rows2(D: int, dropout: bool) -> int:
    """fa3_bwd2's query rows per step (BR): 128 at D = 64 without dropout (FA3's 128 x 128 tile for head dim 64:
    each warpgroup's S^T and dP^T are m64n128, twice the work per barrier and per operand byte of m64n64, and
    the two warpgroups' dQ blocks are whole, not partials over their keys), else 64 (dropout's keep bits or
    D = 128's accumulators leave no registers for 128). A score modifier's text fits at 128 since session 20
    (kernels_cu/fa3_bwd2.cu chain_rows): the built-ins in 250-254 registers without spills (the CPU spill gate,
    tests/test_fa3_bwd.py); a heavier user text may spill there, which costs time, not correctness."""
    return 128 if D == 64 and not dropout else 64


def name2(dtype: str, D: int, dropout: bool, rounds: int) -> str:
    rows = rows2(D, dropout)
    return f"fa3_bwd2<{CTYPE[dtype]}, {D}, {rows}, {rounds}, {'true' if dropout else 'false'}>"


def dq_name(dtype: str) -> str:
    return f"fa3_bwd2_dq<{CTYPE[dtype]}>"


def pre_name(dtype: str) -> str:
    return f"fa3_bwd2_pre<{CTYPE[dtype]}>"


def padded_rows(Nq: int) -> int:
    """fa3_bwd2's lse and D rows per (b, h): Nq rounded up to 128 (whole BR tiles, 16-byte aligned bulk copies)."""
    return -(-Nq // 128) * 128


def smem2(D: int, rows: int = BR) -> int:
    """K, V, two buffers of Q and dO (`rows` each), the dS^T panels, the dQ staging (two 16 KB fp32 blocks
    per warpgroup), two buffers of lse and D, the two buffers' mbarriers (TMA), 1024 bytes of alignment slack:
    215056 bytes at D = 128, 149520 at D = 64 with 64 rows, 199696 with 128."""
    return ITEMSIZE * (2 * BC * D + 4 * rows * D + BC * rows) + 2 * 2 * 64 * 64 * 4 + 4 * 4 * rows + 2 * 8 + 1024


def acc_shape(p, D: int) -> tuple:
    """fa3_bwd2's fp32 dQ accumulator: per (b, h) and 64-row Q tile (whatever the kernel's BR), 64 D floats
    in accumulator order."""
    return (p.B * p.Hq, -(-p.Nq // 64), 64 * D)


def unit2(dtype: str, D: int, rounds: int, serial: bool | None = None, mods: ModKernel | None = None) -> CompileUnit:
    """Both dropout switches (each with its rows2) and the dq kernel in one module; `serial` (default
    SERIAL) adds -DFA3_BWD2_SERIAL (a separate module and cache entry, never in the CI gate). `mods`: a
    score modifier's options (backward_mods "seed": the forward's, ModKernel.of(p); "text" and "mask": the
    backward's, module_mods), one dropout switch."""
    serial = SERIAL if serial is None else serial
    drops = (False, True) if mods is None else (mods.dropout,)
    main = tuple(name2(dtype, D, drop, rounds) for drop in drops)
    shared = {n: smem2(D, rows2(D, drop)) for n, drop in zip(main, drops)}
    shared[dq_name(dtype)] = shared[pre_name(dtype)] = 0
    opts = cuda_options() + (("-DFA3_BWD2_SERIAL",) if serial else ()) + (mods.options if mods else ())
    return CompileUnit("fa3_bwd2.cu", (*main, dq_name(dtype), pre_name(dtype)), opts, shared,
                       label=f"fa3-bwd2[{dtype}, D={D}{', serial' if serial else ''}{mods.label if mods else ''}]",
                       archs=ARCHS)


def kernel_unit(kernel: str, dtype: str, D: int, rounds: int) -> CompileUnit:
    """The module of bwd_kernel `kernel` ("wgmma" or "wgmma2")."""
    return unit(dtype, D, rounds) if kernel == "wgmma" else unit2(dtype, D, rounds)


def dispatch_backward(kernel: str, variant: str, p, dout, q, k, v, out, lse, tc: TCConfig):
    return (backward if kernel == "wgmma" else backward2)(variant, p, dout, q, k, v, out, lse, tc)


def dispatch_plan(kernel: str, variant: str, p, tc: TCConfig, strides) -> LaunchPlan:
    return (backward_plan if kernel == "wgmma" else backward_plan2)(variant, p, tc, strides)


def _args2(p, q_args, acc, dk, dv, tiles, tile_heads, xp, dropout_rest) -> tuple:
    """fa3_bwd2's arguments after the input operands (Q, K, V, dO with their strides, lse, D)."""
    return (*q_args, acc, dk, dv, tiles, tile_heads, i32(p.Hq), i32(p.Hkv), i32(p.group), i32(p.Nq), i32(p.Nk),
            i32(p.d), f32(p.scale), *mask_args(p, xp), *dropout_rest)


def backward2(variant: str, p, dout, q, k, v, out, lse, tc: TCConfig):
    """dq, dk, dv on the caller's CuPy stream: fa3_bwd2_pre (D, padded lse, the dQ accumulator zeroed), fa3_bwd2 (dK,
    dV, dQ accumulated), fa3_bwd2_dq."""
    need = backward_mods(p)
    import cupy as xp
    for x, nm in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout"), (out, "out")):
        check_alignment(x, nm, variant)
    D, dropout = d_pad(p.d), p.dropout_p > 0
    npad = padded_rows(p.Nq)
    lse_pad = xp.empty((p.B * p.Hq, npad), dtype=xp.float32)
    Dv = xp.empty((p.B * p.Hq, npad), dtype=xp.float32)
    acc = xp.empty(acc_shape(p, D), dtype=xp.float32)          # zeroed by fa3_bwd2_pre
    dq = xp.empty((p.B, p.Hq, p.Nq, p.d), dtype=q.dtype)
    dk = xp.empty((p.B, p.Hkv, p.Nk, p.d), dtype=q.dtype)
    dv = xp.empty((p.B, p.Hkv, p.Nk, p.d), dtype=q.dtype)
    rows = rows2(D, dropout)
    # the tile table with a mask modifier's classes folded in ([B or 1] x [Hq or 1] rows; without one the usual)
    tiles, tile_heads, tile_b = modifier_tiles(p, rows, BC, xp)
    mods = module_mods(p, need)
    u = unit2(p.dtype, D, tc.philox_rounds, mods=mods)
    kname = name2(p.dtype, D, dropout, tc.philox_rounds)
    launch(u, pre_name(p.dtype), (npad // 64, p.B * p.Hq), (256,),
           (dout, *strides4(dout)[:3], out, *strides4(out)[:3], lse, lse_pad, Dv, acc, i32(p.Hq), i32(p.Nq), i32(p.d),
            i32(D)))
    held = [x if tma.usable_strides(x.shape, arrays.element_strides(x)) else xp.array(x, copy=True, order="C")
            for x in (q, dout)]       # a layout TMA cannot describe (a zero stride): a fresh copy
    maps = [tma.map_of(x, TMA_ROWS) for x in held]
    operands = (maps[0], k, *strides4(k)[:3], v, *strides4(v)[:3], maps[1], lse_pad, Dv)
    main = PackedLaunch(get_kernel(u, kname).kernel, (-(-p.Nk // BC), p.B * p.Hkv), (THREADS,), u.dynamic_smem[kname],
                        _args2(p, operands, acc, dk, dv, tiles, tile_heads, xp, dropout_args(p))
                        + (modifier_args(p, int(tile_b), xp) + factored_args(p, need) if mods is not None else ()))
    main({}, xp.cuda.get_current_stream())
    launch(u, dq_name(p.dtype), (-(-p.Nq // 64), p.B * p.Hq), (256,), (acc, dq, i32(p.Nq), i32(p.d), i32(D),
                                                                     dq_scale(p, need)))
    return dq, dk, dv


def backward_plan2(variant: str, p, tc: TCConfig, strides) -> LaunchPlan:
    """The pointer-level plan: fa3_bwd2_pre (D, padded lse, `dq_acc` zeroed), fa3_bwd2, fa3_bwd2_dq; dq written
    in q's dtype (no cast after the run). With modifiers as backward2 resolves them (module, rows, tile table with
    a mask modifier's classes, their arguments), once: a mask modifier's table on the caller's stream, which keys
    the plan (sandbox/fastpath.py mods_key)."""
    import cupy as xp
    for nm in ("q", "k", "v", "out", "dout"):
        _check_row_strides(strides[nm], nm, variant)
    D, dropout = d_pad(p.d), p.dropout_p > 0
    npad = padded_rows(p.Nq)
    need = backward_mods(p)
    rows = rows2(D, dropout)
    mods = module_mods(p, need)
    u, kname = unit2(p.dtype, D, tc.philox_rounds, mods=mods), name2(p.dtype, D, dropout, tc.philox_rounds)
    tiles, tile_heads, tile_b = modifier_tiles(p, rows, BC, xp)
    mod_rest = modifier_args(p, int(tile_b), xp) + factored_args(p, need) if mods is not None else ()
    st = {nm: tuple(i64(x) for x in strides[nm][:3]) for nm in strides}
    shape = (p.B, p.Hq, p.Nq, p.d)
    if any(tma.usable_strides(shape, strides[nm]) is None for nm in ("q", "dout")):
        return None                   # a layout TMA cannot describe: the generic path copies it
    operands = (Slot("map_q", "map"), *(x for nm in ("k", "v") for x in (Slot(nm), *st[nm])), Slot("map_dout", "map"),
                Slot("lse_pad"), Slot("D"))
    kernels = [
        PackedLaunch(get_kernel(u, pre_name(p.dtype)).kernel, (npad // 64, p.B * p.Hq), (256,), 0,
                     (Slot("dout"), *st["dout"], Slot("out"), *st["out"], Slot("lse"), Slot("lse_pad"), Slot("D"),
                      Slot("dq_acc"), i32(p.Hq), i32(p.Nq), i32(p.d), i32(D))),
        PackedLaunch(get_kernel(u, kname).kernel, (-(-p.Nk // BC), p.B * p.Hkv), (THREADS,), u.dynamic_smem[kname],
                     _args2(p, operands, Slot("dq_acc"), Slot("dk"), Slot("dv"), tiles, tile_heads, xp,
                            _dropout_slots(p)) + mod_rest),
        PackedLaunch(get_kernel(u, dq_name(p.dtype)).kernel, (-(-p.Nq // 64), p.B * p.Hq), (256,), 0,
                     (Slot("dq_acc"), Slot("dq"), i32(p.Nq), i32(p.d), i32(D), dq_scale(p, need)))]

    dtype = p.dtype           # the closure keeps no Problem: a plan must not hold the modifiers (fastpath.Plan)

    def run(ptr, seed, offset, stream):
        _check_aligned(ptr, ("q", "k", "v", "out", "dout"), variant)
        ptr["seed"], ptr["offset"] = seed, offset
        held = [tma.tensor_map(ptr[nm], dtype, shape, strides[nm], TMA_ROWS) for nm in ("q", "dout")]
        ptr["map_q"], ptr["map_dout"] = (m.address for m in held)
        for kernel in kernels:
            kernel(ptr, stream)

    kv = (p.B, p.Hkv, p.Nk, p.d)
    buffers = {"D": ((p.B * p.Hq, npad), "float32", False), "lse_pad": ((p.B * p.Hq, npad), "float32", False),
               "dq_acc": (acc_shape(p, D), "float32", False),                # zeroed by fa3_bwd2_pre
               "dq": ((p.B, p.Hq, p.Nq, p.d), p.dtype, False), "dk": (kv, p.dtype, False),
               "dv": (kv, p.dtype, False)}
    return LaunchPlan(buffers, run, keep=(tiles,))
