"""The wgmma backward of the Hopper rungs (kernels_cu/fa3_bwd.cu, sm_90a), chosen by `bwd_kernel="wgmma"`.

Seed: FA2 paper Algorithm 2 (column-parallel, P recomputed from the logsumexp, D = rowsum(dO o O)
precomputed, dQ by fp32 atomics) with its five GEMMs on wgmma (FA3 paper Sec. 3). The preprocessing
D = rowsum(dO o O) is fa2-tc's kernel (fa2_tc_bwd_rowdot), dQ is accumulated in fp32 and cast at the
end, as fa2-tc's atomic backward does. Tile: 128 keys per block (64 per warpgroup), 64 query rows per
step. Not deterministic (atomics); `bwd_kernel="mma"` keeps fa2-tc's kernels (the default until
this one has the GPU evidence the tier asks for).
"""
from __future__ import annotations

from sandbox import arrays
from sandbox.launch import LaunchPlan, cuda_options, dropout_args, f32, i32, i64, mask_args, strides4, tile_table
from sandbox.loader import CompileUnit, PackedLaunch, Slot, get_kernel, launch

from .fa2_tc import CTYPE, ITEMSIZE, TCConfig, _check_aligned, _check_row_strides, _dropout_slots, check_alignment, d_pad

BR, BC, THREADS = 64, 128, 256
ARCHS = ("sm_90a",)


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
