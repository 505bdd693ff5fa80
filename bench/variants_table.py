"""Family `variants`: warp partitioning x Br/Bc x warps for one shape family at a time, the best
configuration marked (FA2 paper Sec. 3.3: split-Q over split-K; FA1 paper Sec. 3.1: block sizes).

Variants: every registered variant with a `bench_sweep` (its registration: parameter -> values),
in each shape family whose dtype it supports; every combination of the sweep's values is checked
against the oracle (the grid family's row-slice check on the very problem timed), then timed with
sandbox.timing.time_fn (CUDA events, L2 flushed, median) through bench.harness. A combination the
variant rejects (shared memory, registers, envelope) is listed with the reason and not timed.
Shape families (B * N = 16k tokens, hidden 2048, forward, non-causal; SHAPES):
  exact:  fp32, d = 64, N = 2048
  tc:     fp16, d = 64 and 128, N = 4096

    python -m bench variants --shapes exact,tc
"""
from __future__ import annotations

import itertools
from pathlib import Path

import sandbox
from sandbox.problem import make_problem
from sandbox.timing import tflops

from . import selection
from .common import Progress, csv_of, stamp, write
from .grid import check_slice
from .harness import check_then_time

# shape family -> (dtype, head dims, N)
SHAPES = {"exact": ("float32", (64,), 2048), "tc": ("float16", (64, 128), 4096)}
ROW_KEYS = {"shape", "variant", "dtype", "d", "N", "B", "H", "status", "ms", "p10_ms", "p90_ms", "tflops", "best"}


def swept(shape: str) -> list[tuple]:
    """(variant name, dtype, head dims, N, axes) of every registered variant with a bench_sweep that
    runs the shape family's dtype (and at least one of its head dims)."""
    dtype, dims, N = SHAPES[shape]
    out = []
    for v in selection.select(dtype=dtype, where=lambda v: bool(v.bench_sweep)):
        ds = tuple(d for d in dims if d in v.caps.head_dims)
        if ds:
            out.append((v.name, dtype, ds, N, dict(v.bench_sweep)))
    return out


def plan() -> list[dict]:
    rows = []
    for shape in SHAPES:
        for name, dtype, dims, N, axes in swept(shape):
            n = len(list(configs(axes)))
            rows.append(selection.row("variants", name, dtype, dims, "forward", f"{shape}: N = {N}, {n} configs: "
                                      + " x ".join(f"{k} {'|'.join(map(str, vs))}" for k, vs in axes.items())))
    return rows


def configs(axes: dict):
    keys = list(axes)
    for values in itertools.product(*(axes[k] for k in keys)):
        yield dict(zip(keys, values))


def run(shapes=("exact", "tc"), reps=10, tokens=16384, hidden=2048):
    import cupy as cp
    todo = [(s, name, dtype, d, N, params) for s in shapes for name, dtype, dims, N, axes in swept(s)
            for d in dims for params in configs(axes)]
    progress = Progress(len(todo), "variants")
    rows, inputs = [], {}
    for shape, name, dtype, d, N, params in todo:
        label = " ".join(f"{k}={v}" for k, v in params.items())
        progress(f"{name} d={d} {label}")
        key = (dtype, d, N)
        if key not in inputs:
            inputs.clear()
            cp.get_default_memory_pool().free_all_blocks()
            gen = cp.random.default_rng(N)
            B, H = max(1, tokens // N), hidden // d
            inputs[key] = tuple(gen.standard_normal((B, H, N, d), dtype=cp.float32).astype(dtype) for _ in range(3))
        q, k, v = inputs[key]
        flops = make_problem(q, k, v).flops()
        row = {"shape": shape, "variant": name, "dtype": dtype, "d": d, "N": N, "B": q.shape[0], "H": q.shape[1], **params}
        bound = []

        def check():
            bound.append(sandbox.get_variant(name, **params))
            bound[0].check(make_problem(q, k, v))
            return check_slice(bound[0], q, k, v, sandbox.forward(q, k, v, variant=bound[0]), False, dtype)
        # RuntimeError: a launch the driver refuses
        row.update(check_then_time(check, lambda: (lambda: sandbox.forward(q, k, v, variant=bound[0])), reps,
                                   rejects=(ValueError, RuntimeError), rejected="rejected", reason=reason))
        if "ms" in row:
            row["tflops"] = tflops(flops, row["ms"])
        rows.append(row)
    mark_best(rows)
    return rows


def reason(e: Exception) -> str:
    """The envelope errors of a rejection, without the variant and config that the table shows."""
    return str(e).split("): ", 1)[-1] if "Config(" in str(e) else str(e)


def mark_best(rows):
    """best = True on the fastest timed row of each (variant, dtype, d)."""
    groups = {}
    for r in rows:
        if "tflops" in r:
            g = (r["variant"], r["dtype"], r["d"])
            if g not in groups or r["tflops"] > groups[g]["tflops"]:
                groups[g] = r
    for r in rows:
        r["best"] = any(r is b for b in groups.values())


def markdown(rows) -> str:
    out = []
    for g in dict.fromkeys((r["variant"], r["dtype"], r["d"], r["N"]) for r in rows):
        sub = [r for r in rows if (r["variant"], r["dtype"], r["d"], r["N"]) == g]
        axes = [k for k in sub[0] if k not in ROW_KEYS]
        out += [f"{g[0]}, {g[1]}, d = {g[2]}, N = {g[3]}, B = {sub[0]['B']}, H = {sub[0]['H']}, forward: TFLOP/s "
                "(best marked **)", "", "| " + " | ".join(axes) + " | TFLOP/s | ms |", "|" + "---|" * (len(axes) + 2)]
        for r in sorted(sub, key=lambda r: -r.get("tflops", -1)):
            perf = (f"**{r['tflops']:.2f}**" if r["best"] else f"{r['tflops']:.2f}") if "tflops" in r else r["status"][:80]
            ms = f"{r['ms']:.3f}" if "ms" in r else "-"
            out.append("| " + " | ".join(str(r[a]) for a in axes) + f" | {perf} | {ms} |")
        if "split" in axes:
            best = {s: max((r["tflops"] for r in sub if r.get("split") == s and "tflops" in r), default=None) for s in "qk"}
            if best["q"] and best["k"]:
                out.append(f"| split-Q / split-K (best of each) | | | | {best['q'] / best['k']:.2f}x | |")
        out.append("")
    return "\n".join(out).rstrip()


def add_arguments(ap):
    ap.add_argument("--shapes", type=csv_of(tuple(SHAPES)), default=("exact", "tc"), help="shape families: " + ",".join(SHAPES))


def main(args, out: Path):
    rows = run(tuple(args.shapes), args.reps)
    write(out, "variants", "variants", stamp(shapes=",".join(args.shapes)), rows, markdown(rows))
