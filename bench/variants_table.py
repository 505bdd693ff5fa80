"""Family `variants`: warp partitioning x Br/Bc x warps for one shape family at a time, the best
configuration marked (FA2 paper Sec. 3.3: split-Q over split-K; FA1 paper Sec. 3.1: block sizes).

Every legal combination of a variant's partitioning and tile parameters is checked against the
oracle (the grid family's row-slice check on the very problem timed), then timed with
sandbox.timing.time_fn (CUDA events, L2 flushed, median). A combination the variant rejects
(shared memory, registers, envelope) is listed with the reason and not timed.
Shape families (B * N = 16k tokens, hidden 2048, forward, non-causal):
  exact:  fa1 and fa2, fp32, d = 64, N = 2048
  tc:     fa2-tc, fp16, d = 64 and 128, N = 4096

    python -m bench variants --shapes exact,tc
"""
from __future__ import annotations

import itertools
from pathlib import Path

import sandbox
from sandbox.problem import make_problem
from sandbox.timing import tflops, time_fn

from .common import Progress, csv_of, stamp, write
from .grid import check_slice

# (variant, dtype, head dims, N, the swept axes: param -> values)
SHAPES = {
    "exact": [("fa1", "float32", (64,), 2048, {"split": ("k", "q"), "block_r": (16, 64), "block_c": (64, 128),
                                                 "warps": (4,)}),
              ("fa2", "float32", (64,), 2048, {"split": ("q", "k"), "block_r": (16, 64, 128), "block_c": (64, 128),
                                                 "warps": (4, 8)})],
    "tc": [("fa2-tc", "float16", (64, 128), 4096, {"block_r": (64, 128), "block_c": (32, 64, 128), "warps": (4, 8),
                                                    "min_blocks": ("auto", 1, 2)})],
}


def configs(axes: dict):
    keys = list(axes)
    for values in itertools.product(*(axes[k] for k in keys)):
        yield dict(zip(keys, values))


def run(shapes=("exact", "tc"), reps=10, tokens=16384, hidden=2048):
    import cupy as cp
    plan = [(s, name, dtype, d, N, params) for s in shapes for name, dtype, dims, N, axes in SHAPES[s]
            for d in dims for params in configs(axes)]
    progress = Progress(len(plan), "variants")
    rows, inputs = [], {}
    for shape, name, dtype, d, N, params in plan:
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
        try:
            bound = sandbox.get_variant(name, **params)
            bound.check(make_problem(q, k, v))
            res = sandbox.forward(q, k, v, variant=bound)
        except (ValueError, RuntimeError) as e:       # RuntimeError: a launch the driver refuses
            rows.append({**row, "status": f"rejected: {reason(e)}"}); continue
        ok, verdict = check_slice(bound, q, k, v, res, False, dtype)
        del res
        if not ok:
            rows.append({**row, "status": f"FAIL {verdict}"}); continue
        t = time_fn(lambda: sandbox.forward(q, k, v, variant=bound), reps=reps)
        rows.append({**row, "status": "ok", "ms": t.median_ms, "tflops": tflops(flops, t.median_ms)})
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
        axes = [k for k in ("split", "block_r", "block_c", "warps", "min_blocks") if k in sub[0]]
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
