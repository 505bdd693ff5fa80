"""torchrun --nproc_per_node=W -m bench.context_parallel --out DIR: context-parallel attention (issue 19).

What it measures, per GPU, at each per-GPU length n (the whole sequence N = W n; B = 1, H = 16,
d = 128, bfloat16 and the dtype's default variant, sandbox.api.DEFAULT_VARIANTS):

  method                   how the sequence is spread
  1 GPU                    the plain kernel on n tokens: the baseline at the same per-GPU length
  ring contiguous          sandbox.distributed.ring_attention, rank r holds chunk r (non-causal)
  ring contiguous causal   the same, causal: unbalanced (rank W-1 does the most), for contrast
  ring zigzag causal       causal on the zig-zag layout (chunks r and 2W-1-r): balanced
  ulysses, ulysses causal  sandbox.distributed.ulysses_attention (all-to-all to head sharding)

Columns, forward and forward + backward: ms (median over --reps of the slowest rank), tokens/s per
GPU (n / time), TFLOP/s per GPU (the whole problem's FLOPs, 4 B H N^2 d, halved for causal, x3.5
with the backward, divided by W and the time), and the scaling efficiency, the TFLOP/s per GPU
over the 1 GPU row's at the same n, causal-ness and direction. For the ring rows also: compute-only
ms (the same ring with its transfers replaced by a loopback, so the same blocks are computed),
transfer-only ms (the ring's P2P hops alone), and the fraction of the transfer time hidden,
(compute + transfer - total) / transfer, clipped to [0, 1].

Longest sequence that fits (B = 1, H = 16, d = 128, bf16 by default): ring zig-zag causal forward +
backward with a loopback ring that copies each hop (the ring's buffers, without NCCL's own), n
doubled from --fit-start until out of memory, then --fit-steps bisection steps; each rank probes
alone (no communication, so an out-of-memory error cannot hang the others) and the smallest result
over ranks is reported, as N = W n, beside one GPU's longest N by the same probe.

Timing: warm-up calls, then per repetition a barrier, CUDA events around the call on each rank, the
maximum over ranks (all_reduce); the median of --reps. `--device cpu` runs the same code on gloo
with a Numba variant under the simulator: a smoke run of the code paths (tests/test_distributed_cpu.py
runs it), whose times are host wall-clock and mean nothing about GPUs. Before any timing each distributed method is
checked against the float64 oracle (forward and backward) on a small problem, and a method that
fails is not timed. Writes DIR/context_parallel.md, .csv and .json stamped with the device, the
world size, the commit and the date.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

METHODS = {          # name -> (function, causal, layout); function None is the single-GPU kernel
    "1 GPU": (None, False, None),
    "1 GPU causal": (None, True, None),
    "ring contiguous": ("ring", False, "contiguous"),
    "ring contiguous causal": ("ring", True, "contiguous"),
    "ring zigzag causal": ("ring", True, "zigzag"),
    "ulysses": ("ulysses", False, "contiguous"),
    "ulysses causal": ("ulysses", True, "contiguous"),
}
DIRECTIONS = ("fwd", "fwd+bwd")


def _parser() -> argparse.ArgumentParser:
    from bench.common import csv_of
    ap = argparse.ArgumentParser(prog="torchrun --nproc_per_node=W -m bench.context_parallel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out")
    ap.add_argument("--seqlens", type=csv_of(kind=int, low=2, high=2**22), default=(4096, 8192, 16384, 32768),
                    help="per-GPU lengths n (comma separated); the whole sequence is W n")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--variant", default=None, help="a registered variant spec (name:key=value+...); default: "
                    "the dtype's default variant (sandbox.api.DEFAULT_VARIANTS)")
    ap.add_argument("--methods", type=csv_of(allowed=tuple(METHODS)), default=tuple(METHODS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fit-start", type=int, default=16384, help="first per-GPU length of the memory probe")
    ap.add_argument("--fit-max", type=int, default=2**20, help="largest per-GPU length the probe tries")
    ap.add_argument("--fit-steps", type=int, default=2, help="bisection steps after doubling (0: powers of 2)")
    ap.add_argument("--fit-unit", type=int, default=128, help="the probe's per-GPU lengths are multiples of this "
                    "(even, for the zig-zag layout)")
    ap.add_argument("--no-fit", action="store_true", help="skip the longest-sequence probe")
    ap.add_argument("--check-chunk", type=int, default=64,
                    help="chunk length of the oracle check before timing (its N is 2 W x this)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: gloo + a Numba variant under the simulator, a smoke run of the code paths only")
    return ap


# ---- process group and timing

def _init_group(device: str):
    """The process group from torchrun's environment (NCCL, one GPU per local rank; gloo on the
    CPU); (world, rank)."""
    import torch
    import torch.distributed as dist
    if "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
        raise SystemExit("error: run under torchrun, e.g. torchrun --nproc_per_node=2 -m bench.context_parallel "
                         "--out DIR")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: bench.context_parallel needs CUDA GPUs, one per rank (--device cpu: smoke run)")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.get_world_size(), dist.get_rank()


def _reduce(value, op: str, device: str):
    """value reduced over ranks (op 'MAX' or 'MIN')."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t.item()


def _sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, reps: int, device: str, warmup: int = 2) -> float:
    """Median over reps of the slowest rank's time of fn (CUDA events; wall-clock on the CPU), the
    ranks starting each repetition after a barrier."""
    import torch
    import torch.distributed as dist
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        _sync(device)
        dist.barrier()
        if device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            ms = start.elapsed_time(stop)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        samples.append(_reduce(ms, "MAX", device))
    return statistics.median(samples)


def flops(n_total: int, heads: int, d: int, causal: bool, direction: str) -> float:
    """FLOPs of the whole problem (B = 1): 4 H N^2 d, halved for causal, x3.5 with the backward."""
    f = 4.0 * heads * n_total * n_total * d * (0.5 if causal else 1.0)
    return f * (3.5 if direction == "fwd+bwd" else 1.0)


# ---- the callables

class _Loopback:
    """sandbox.distributed's ring interface with the transfers left out: `shift` hands back the
    tensor itself (compute-only timing) or a copy (the memory probe: the ring's buffers)."""

    def __init__(self, world: int, rank: int, copy: bool):
        self.world, self.rank, self.copy = world, rank, copy

    def shift(self, tensor, tag):
        import sandbox.distributed as sd
        return sd._Pending([], tensor.clone() if self.copy else tensor, None)


def _tensors(args, n: int, heads: int, grad: bool, seed: int = 0):
    import torch
    g = torch.Generator(device=args.device).manual_seed(seed)
    dt = getattr(torch, args.dtype)
    q, k, v, dout = (torch.randn(1, heads, n, args.headdim, device=args.device, dtype=dt, generator=g)
                     for _ in range(4))
    return [x.requires_grad_(grad) for x in (q, k, v)] + [dout]


def _call(args, method: str, n: int, direction: str):
    """A zero-argument callable running `method` on this rank's n tokens in `direction`."""
    import sandbox
    import sandbox.distributed as sd
    kind, causal, layout = METHODS[method]
    q, k, v, dout = _tensors(args, n, args.heads, grad=direction == "fwd+bwd")
    variant = _bound(args.variant)
    if kind is None:
        def single():
            res = sandbox.forward(q, k, v, variant=variant, causal=causal)
            if direction == "fwd+bwd":
                sandbox.backward(dout, res)
        return single
    fn = sd.ring_attention if kind == "ring" else sd.ulysses_attention

    def distributed():
        out = fn(q, k, v, causal=causal, layout=layout, variant=variant)
        if direction == "fwd+bwd":
            out.backward(dout)
    return distributed


def _ring_parts(args, method: str, n: int, direction: str, world: int, rank: int):
    """(compute-only, transfer-only) callables of a ring method: the same blocks with a loopback
    ring, and the same hops (K/V, and the float32 dK/dV accumulators in the backward) with no compute."""
    import torch
    import sandbox.distributed as sd
    _, causal, layout = METHODS[method]
    q, k, v, dout = _tensors(args, n, args.heads, grad=False)
    cfg = sd._configure(q, k, v, None, causal, None, 0.0, _bound(args.variant), {}, layout, "ring")
    loop, ring = _Loopback(world, rank, copy=False), sd._Ring(cfg)

    def compute():
        out, lse = sd._ring_forward(q, k, v, cfg, loop)
        if direction == "fwd+bwd":
            sd._ring_backward(dout, q, k, v, out, lse, cfg, loop)

    def transfer():
        kv = torch.stack((k, v))
        for _ in range(world - 1):
            kv = ring.shift(kv, sd._KV_TAG).wait()
        if direction == "fwd+bwd":            # both rings of the backward, in flight together per step
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for step in range(world):
                kv_hop = ring.shift(kv, sd._KV_TAG) if step + 1 < world else None
                dkv = ring.shift(dkv, sd._DKV_TAG).wait()
                kv = kv_hop.wait() if kv_hop is not None else kv
    return compute, transfer


def _bound(text: str):
    """The variant spec of --variant (name:key=value+...) bound to its parameters."""
    import sandbox
    from sandbox.registry import parse_spec
    name, params = parse_spec(text)
    return sandbox.get_variant(name, **params)


# ---- correctness before timing

def _check(args, method: str, world: int, rank: int) -> str:
    """'ok' or the failing verdicts: `method` forward and backward on a small problem (N = 2W x 64,
    the benchmark's heads and head dim) against the float64 oracle, tensor-core tier."""
    import torch
    import torch.distributed as dist
    import sandbox.distributed as sd
    from sandbox import oracle, tolerance
    kind, causal, layout = METHODS[method]
    full = _tensors(args, 2 * world * args.check_chunk, args.heads, grad=False, seed=1234)
    local = [sd.shard(x, rank, world, causal, layout).contiguous().requires_grad_(i < 3) for i, x in enumerate(full)]
    fn = sd.ring_attention if kind == "ring" else sd.ulysses_attention
    out = fn(*local[:3], causal=causal, layout=layout, variant=_bound(args.variant))
    out.backward(local[3])
    got = {}
    for name, x in zip(("out", "dq", "dk", "dv"), (out.detach(), *(t.grad for t in local[:3]))):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        got[name] = sd.unshard(parts, causal, layout).double().cpu().numpy()
    q, k, v, dout = (x.double().cpu().numpy() for x in full)
    refs = dict(zip(("out", "dq", "dk", "dv"), (oracle.forward(q, k, v, causal=causal)[0],
                                                *oracle.backward(dout, q, k, v, causal=causal))))
    naive = dict(zip(("out", "dq", "dk", "dv"), (oracle.forward(q, k, v, causal=causal, precision=args.dtype)[0],
                                                 *oracle.backward(dout, q, k, v, causal=causal, precision=args.dtype))))
    rounding = oracle.output_rounding_bounds(dout, q, k, v, causal=causal)
    verdicts = [tolerance.compare(name, got[name], refs[name], args.dtype, naive[name],
                                  "out" if name == "out" else "grad", 0.0, rounding.get(name, 0.0)) for name in refs]
    bad = [str(v) for v in verdicts if not v.ok]
    return "ok" if not bad else "FAIL " + "; ".join(bad)


# ---- the table

def _rows_for(args, n: int, world: int, rank: int, checks: dict) -> list[dict]:
    import torch
    rows = []
    for method in args.methods:
        kind, causal, _ = METHODS[method]
        for direction in DIRECTIONS:
            row = {"method": method, "n_per_gpu": n, "N": n * (1 if kind is None else world), "direction": direction,
                   "causal": causal}
            if kind is not None and checks[method] != "ok":
                rows.append({**row, "status": checks[method]})
                continue
            ms = _time_ms(_call(args, method, n, direction), args.reps, args.device)
            row.update(status="ok", ms=ms, tokens_per_s_per_gpu=n / (ms * 1e-3),
                       tflops_per_gpu=flops(row["N"], args.heads, args.headdim, causal, direction)
                       / (1 if kind is None else world) / (ms * 1e-3) / 1e12)
            if kind == "ring":
                compute, transfer = _ring_parts(args, method, n, direction, world, rank)
                row["compute_ms"] = _time_ms(compute, args.reps, args.device)
                row["transfer_ms"] = _time_ms(transfer, args.reps, args.device)
                overlap = (row["compute_ms"] + row["transfer_ms"] - ms) / row["transfer_ms"]
                row["hidden"] = min(1.0, max(0.0, overlap))
            rows.append(row)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    _efficiency(rows)
    return rows


def _efficiency(rows: list[dict]) -> None:
    """scaling_efficiency: TFLOP/s per GPU over the 1 GPU row's at the same n, causal-ness, direction."""
    base = {(r["n_per_gpu"], r["causal"], r["direction"]): r["tflops_per_gpu"] for r in rows
            if r["method"].startswith("1 GPU") and r.get("status") == "ok"}
    for r in rows:
        b = base.get((r["n_per_gpu"], r["causal"], r["direction"]))
        if r.get("status") == "ok" and b:
            r["scaling_efficiency"] = r["tflops_per_gpu"] / b


# ---- the longest sequence that fits

def _fits(args, n: int, world: int, rank: int, distributed: bool) -> bool:
    """Whether `_probe` runs on n tokens per GPU without running out of memory (the probe's tensors
    are gone, and the cache emptied, before the next try)."""
    import torch
    try:
        _probe(args, n, world, rank, distributed)
        ok = True
    except _oom_errors():
        ok = False
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return ok


def _probe(args, n: int, world: int, rank: int, distributed: bool) -> None:
    """Ring zig-zag causal forward + backward on n tokens per GPU with a loopback ring that copies
    each hop (the ring's buffers, no communication); not distributed: the plain kernel on n tokens."""
    import sandbox
    import sandbox.distributed as sd
    q, k, v, dout = _tensors(args, n, args.heads, grad=False)
    bound = _bound(args.variant)
    if distributed:
        cfg = sd._configure(q, k, v, None, True, None, 0.0, bound, {}, "zigzag", "ring")
        loop = _Loopback(world, rank, copy=True)
        out, lse = sd._ring_forward(q, k, v, cfg, loop)
        sd._ring_backward(dout, q, k, v, out, lse, cfg, loop)
    else:
        sandbox.backward(dout, sandbox.forward(q, k, v, variant=bound, causal=True))
    _sync(args.device)


def _oom_errors() -> tuple:
    import torch
    from bench.harness import out_of_memory_errors
    return (torch.cuda.OutOfMemoryError, *out_of_memory_errors())


def _longest(args, world: int, rank: int, distributed: bool) -> int:
    """The largest per-GPU n (a multiple of --fit-unit) that fits on every rank: doubling, then bisection."""
    unit = args.fit_unit
    n, best = max(unit, args.fit_start // unit * unit), 0
    while n <= args.fit_max and _fits(args, n, world, rank, distributed):
        best, n = n, 2 * n
    lo, hi = best, min(n, args.fit_max + unit)
    for _ in range(args.fit_steps if best else 0):
        mid = (lo + hi) // 2 // unit * unit
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if _fits(args, mid, world, rank, distributed) else (lo, mid)
    return int(_reduce(lo, "MIN", args.device))


# ---- output

def _markdown(rows: list[dict], fit: dict, meta: dict) -> str:
    head = ("| method | n / GPU | N | direction | ms | tokens/s / GPU | TFLOP/s / GPU | efficiency | compute-only ms "
            "| transfer-only ms | hidden |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"# Context-parallel attention: {meta['world']} GPUs, B = 1, H = {meta['heads']}, "
             f"d = {meta['headdim']}, {meta['dtype']}, {meta['variant']}", "", head]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['method']} | {r['n_per_gpu']} | {r['N']} | {r['direction']} | {r['status']} |"
                         + " |" * 6)
            continue
        cell = lambda key, fmt: format(r[key], fmt) if key in r else ""  # noqa: E731
        lines.append(f"| {r['method']} | {r['n_per_gpu']} | {r['N']} | {r['direction']} | {r['ms']:.3f} | "
                     f"{r['tokens_per_s_per_gpu']:.3g} | {r['tflops_per_gpu']:.1f} | {cell('scaling_efficiency', '.2f')} "
                     f"| {cell('compute_ms', '.3f')} | {cell('transfer_ms', '.3f')} | {cell('hidden', '.2f')} |")
    if fit:
        lines += ["", f"Longest sequence that fits (forward + backward, causal; probe to {fit['resolution']}): "
                  f"ring zig-zag on {meta['world']} GPUs N = {fit['ring_N']} ({fit['ring_n_per_gpu']} per GPU); "
                  f"1 GPU N = {fit['one_gpu_N']}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.variant is None:
        from sandbox.api import DEFAULT_VARIANTS
        args.variant = DEFAULT_VARIANTS[args.dtype]
    world, rank = _init_group(args.device)
    import torch.distributed as dist
    from bench.common import Progress, stamp, write
    checks = {m: _check(args, m, world, rank) for m in args.methods if METHODS[m][0] is not None}
    progress = Progress(len(args.seqlens) + (0 if args.no_fit else 1), "context_parallel") if rank == 0 else None
    rows = []
    for n in args.seqlens:
        if progress:
            progress(f"n = {n} per GPU")
        rows += _rows_for(args, n, world, rank, checks)
    fit = {}
    if not args.no_fit:
        if progress:
            progress("longest sequence that fits")
        ring_n, one_n = _longest(args, world, rank, True), _longest(args, world, rank, False)
        step = "powers of 2" if args.fit_steps == 0 else f"{args.fit_steps} bisection steps after doubling"
        fit = {"ring_n_per_gpu": ring_n, "ring_N": world * ring_n, "one_gpu_N": one_n, "resolution": step}
    if rank == 0:
        meta = stamp(world=world, heads=args.heads, headdim=args.headdim, dtype=args.dtype, variant=args.variant,
                     checks=checks, fit=fit, reps=args.reps)
        write(Path(args.out), "context_parallel", "context_parallel", meta, rows, _markdown(rows, fit, meta))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
