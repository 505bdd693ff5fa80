"""Family `dropout` (the dropout axis): replay the mask from (seed, offset) in the backward (the papers' choice) vs store it
bit-packed in the forward and read it in the backward.

FA2 exact tier (fp32, split-Q 64 x 64), dropout_p = 0.1, FA2 grid shapes (B*N = 16k tokens,
hidden 2048, d = 64). Before timing, each mode's gradients are checked against the other's (same
keep pattern, same values to 1e-5). Timing: sandbox.timing.time_fn (CUDA events, L2 flushed,
median). Extra memory: the stored mask, B*H*Nq*ceil(Nk/32)*4 bytes.

    python -m bench dropout [--seqlens 1024,2048,4096,8192]
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

import sandbox
from sandbox.timing import time_fn

from .common import csv_of, stamp, write

P = 0.1


def run(seqlens, d, reps, variant):
    import cupy as cp
    rows = []
    for n in seqlens:
        B, H = 16384 // n, 2048 // d
        rng = cp.random.default_rng(n)
        q, k, v, do = (rng.standard_normal((B, H, n, d), dtype=cp.float32) for _ in range(4))
        res = {}
        for store in ("replay", "packed"):
            bound = sandbox.get_variant(variant, dropout_store=store)
            fwd = lambda: sandbox.forward(q, k, v, variant=bound, dropout_p=P, seed=7)
            r = fwd()
            grads = sandbox.backward(do, r)
            res[store] = grads
            tf = time_fn(fwd, reps=reps)
            tb = time_fn(lambda: sandbox.backward(do, r), reps=reps)
            extra = int(r.saved["dropout_bits"].nbytes) if "dropout_bits" in r.saved else 0
            rows.append({"N": n, "B": B, "H": H, "d": d, "store": store, "fwd_ms": tf.median_ms,
                         "bwd_ms": tb.median_ms, "extra_bytes": extra})
            print(f"  N={n:5d} {store:6s} fwd {tf.median_ms:8.2f} ms  bwd {tb.median_ms:8.2f} ms  "
                  f"mask {extra / 2**20:7.1f} MiB", flush=True)
        for a, b in zip(res["replay"], res["packed"]):
            same = bool(cp.array_equal(a != 0, b != 0)) and bool(cp.allclose(a, b, rtol=1e-4, atol=1e-5))
            if not same:
                raise SystemExit(f"N={n}: packed and replayed masks give different gradients")
    return rows


def markdown(rows, variant):
    out = [f"Dropout axis ({variant}, fp32, p = {P}, d = 64, B*N = 16k, hidden 2048): replay vs packed mask", "",
           "| N | fwd replay ms | fwd packed ms | bwd replay ms | bwd packed ms | bwd packed/replay | mask memory |",
           "|---|---|---|---|---|---|---|"]
    by = {(r["N"], r["store"]): r for r in rows}
    for n in sorted({r["N"] for r in rows}):
        a, b = by[(n, "replay")], by[(n, "packed")]
        out.append(f"| {n} | {a['fwd_ms']:.2f} | {b['fwd_ms']:.2f} | {a['bwd_ms']:.2f} | {b['bwd_ms']:.2f} | "
                   f"{b['bwd_ms'] / a['bwd_ms']:.2f}x | {b['extra_bytes'] / 2**20:.0f} MiB |")
    return "\n".join(out)


def add_arguments(ap):
    ap.add_argument("--seqlens", type=csv_of(kind=int, low=1), default=(1024, 2048, 4096, 8192))
    ap.add_argument("--variant", default="fa2")


def main(args, out: Path):
    rows = run(list(args.seqlens), 64, args.reps, args.variant)
    write(out, "dropout", "dropout", stamp(p=P, variant=args.variant), rows, markdown(rows, args.variant))
