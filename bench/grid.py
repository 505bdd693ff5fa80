"""The FA2 paper's benchmark grid (Sec. 4.1) for the sandbox's variants, forward pass.

Protocol: B * N = 16k tokens, hidden 2048 (H = 2048 / d), N from 512 to 16k, causal and not.
Method: each variant is first checked against the float64 oracle on the last 1024 query rows of the
first and last (batch, head) of the very problem it is timed on (bottom-right causal alignment
makes a row slice exact); a variant that fails is not timed. Then sandbox.timing.time_fn: CUDA
events, warm-up, L2 flushed between repetitions, median. FLOPs = 4 B H N^2 d (halved if causal).
Baselines in the same run: PyTorch SDPA (flash = FlashAttention-2, cuDNN, math = standard
attention) in fp16 (their kernels have no fp32 path except math).

    python bench/grid.py --dtype float32 --headdim 64 --seqlens 1024,2048,4096,8192 \
        --variants standard,fa1,fa1:split=q,fa2,fa2:split=k+block_r=16+block_c=128 --out out/
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

import sandbox
from sandbox import baselines, oracle, tolerance
from sandbox.problem import make_problem
from sandbox.timing import tflops, time_fn

CHECK_ROWS = 1024
# the exact-tier ladder: standard, FA1 split-K (its own partitioning) and split-Q, FA2 split-Q (its
# own) and split-K, the Numba versions
DEFAULT_VARIANTS = ("standard", "fa1", "fa1:split=q", "fa2", "fa2:split=k+block_r=16+block_c=128",
                    "numba-fa1", "numba-fa2", "numba-rowwise")


def parse_variant(spec: str):
    """'fa2:split=k+block_r=16' -> (label, bound variant)."""
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split("+")):
        key, _, value = item.partition("=")
        params[key] = int(value) if value.isdigit() else value
    label = name + (" " + " ".join(f"{k}={v}" for k, v in params.items()) if params else "")
    return label, sandbox.get_variant(name, **params)


def check_slice(bound, q, k, v, res, causal, dtype):
    """Oracle on the last CHECK_ROWS query rows of the first and last (b, h): (ok, worst verdict)."""
    B, H = q.shape[0], q.shape[1]
    worst = None
    for b, h in ((0, 0), (B - 1, H - 1)):
        hk = h // (H // k.shape[1])
        qs = q[b:b + 1, h:h + 1, -CHECK_ROWS:].get()
        ks, vs = k[b:b + 1, hk:hk + 1].get(), v[b:b + 1, hk:hk + 1].get()
        ref_out, ref_lse = oracle.forward(qs, ks, vs, causal=causal)
        got = res.out[b:b + 1, h:h + 1, -CHECK_ROWS:].get()
        naive = oracle.forward(qs, ks, vs, causal=causal, precision=dtype)[0] if dtype != "float32" else None
        terms = oracle.term_bounds(np.zeros_like(qs), qs, ks, vs, causal=causal)["out"] if dtype == "float32" else 0.0
        verdict = tolerance.compare("out", got, ref_out, dtype, naive, "out", terms)
        if worst is None or not verdict.ok or verdict.err / max(verdict.tol, 1e-30) > worst.err / max(worst.tol, 1e-30):
            worst = verdict
        if not verdict.ok:
            break
    return worst.ok, worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--seqlens", default="1024,2048,4096,8192")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--baselines", default="flash,cudnn,math", help="SDPA backends timed beside the variants")
    ap.add_argument("--out", default="out")
    args = ap.parse_args(argv)
    import cupy as cp

    d, dtype = args.headdim, args.dtype
    npdt = {"float32": cp.float32, "float16": cp.float16}[dtype]
    H = args.hidden // d
    variants = [parse_variant(s) for s in args.variants.split(",")]
    rows = []
    backends = [] if args.no_baselines else args.baselines.split(",")
    total = len(args.seqlens.split(",")) * 2 * (len(variants) + len(backends))
    step = 0
    for N in (int(n) for n in args.seqlens.split(",")):
        B = max(1, args.tokens // N)
        gen = cp.random.default_rng(N)
        q, k, v = (gen.standard_normal((B, H, N, d), dtype=cp.float32).astype(npdt) for _ in range(3))
        for causal in (False, True):
            flops = make_problem(q, k, v, causal=causal).flops()
            for label, bound in variants:
                step += 1
                print(f"[{step}/{total}] N={N} causal={causal} {label}", file=sys.stderr, flush=True)
                row = {"N": N, "B": B, "H": H, "d": d, "causal": causal, "dtype": dtype, "variant": label}
                try:
                    bound.check(make_problem(q, k, v, causal=causal))
                    res = sandbox.forward(q, k, v, variant=bound, causal=causal)
                except (ValueError, cp.cuda.memory.OutOfMemoryError) as e:
                    rows.append({**row, "status": f"skipped: {str(e)[:80]}"}); continue
                ok, verdict = check_slice(bound, q, k, v, res, causal, dtype)
                del res
                if not ok:
                    rows.append({**row, "status": f"FAIL {verdict}"}); continue
                t = time_fn(lambda: sandbox.forward(q, k, v, variant=bound, causal=causal), reps=args.reps)
                rows.append({**row, "status": "ok", "ms": t.median_ms, "p10_ms": t.p10_ms, "p90_ms": t.p90_ms,
                             "tflops": tflops(flops, t.median_ms)})
            for be in backends:
                step += 1
                fn = baselines.sdpa(be, B, H, N, N, d, "float16", causal)
                if fn is None:
                    continue
                t = time_fn(fn, reps=args.reps)
                rows.append({"N": N, "B": B, "H": H, "d": d, "causal": causal, "dtype": "float16",
                             "variant": f"sdpa-{be} (fp16)", "status": "baseline", "ms": t.median_ms,
                             "tflops": tflops(flops, t.median_ms)})
        del q, k, v
        cp.get_default_memory_pool().free_all_blocks()
    write(rows, Path(args.out), f"grid_{dtype}_d{d}")


def write(rows, out: Path, stem: str):
    out.mkdir(parents=True, exist_ok=True)
    json.dump(rows, open(out / f"{stem}.json", "w"), indent=1)
    keys = ["N", "B", "H", "d", "causal", "dtype", "variant", "status", "ms", "tflops"]
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    # markdown: one row per (variant, causal), one column per N, TFLOP/s
    Ns = sorted({r["N"] for r in rows})
    lines = [f"TFLOP/s, forward, d = {rows[0]['d']}, B*N = 16k tokens, hidden 2048 (median of CUDA-event timings)", "",
             "| variant | causal | " + " | ".join(f"N={n}" for n in Ns) + " |", "|---|---|" + "---|" * len(Ns)]
    for label in dict.fromkeys(r["variant"] for r in rows):
        for causal in (False, True):
            cells = []
            for n in Ns:
                r = next((r for r in rows if r["variant"] == label and r["causal"] == causal and r["N"] == n), None)
                cells.append("-" if r is None else f"{r['tflops']:.2f}" if "tflops" in r else r["status"][:30])
            lines.append(f"| {label} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    (out / f"{stem}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
