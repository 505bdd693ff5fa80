"""Family `softmax`: the softmax table (lecture 003, Algorithms 1-3): naive vs safe vs online, fp32, 4,000 vectors.

Each kernel is checked against its float64 NumPy reference on the first rows of the very input it is
timed on (inputs in [-4, 4]: the naive version stays finite), then timed with
sandbox.timing.time_fn (CUDA events, L2 flushed, median). GB/s counts the minimal traffic, one read
and one write of the batch (8 bytes per element), for every algorithm, so the column compares times;
the copy bandwidth (a device-to-device copy of the same array, same accounting) is the roof. The
lecture reports online ~1.3x faster than safe (two passes over x instead of three).

    python -m bench softmax [--rows 4000] [--lengths 1024,...,65536] [--backends cuda,numba]
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from sandbox import softmax
from sandbox.timing import time_fn

from . import selection
from .common import csv_of, stamp, write
from .harness import check_then_time

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
CHECK_ROWS = 8
BACKENDS = ("cuda", "numba")


def plan() -> list[dict]:
    """The softmax kernels (sandbox.softmax, not attention variants) and the copy roof."""
    return [selection.row("softmax", f"{alg} softmax ({backend})", "float32", "-", "forward",
                          f"4000 vectors, n = {LENGTHS[0]}-{LENGTHS[-1]}") for backend in BACKENDS
            for alg in softmax.ALGORITHMS]


def run(rows, lengths, backends, reps):
    import cupy as cp
    results = []
    for n in lengths:
        x = cp.asarray((np.random.default_rng(n).random((rows, n), dtype=np.float32) * 8 - 4))
        nbytes = 8 * rows * n
        y = cp.empty_like(x)
        t = time_fn(lambda: cp.copyto(y, x), reps=reps)
        results.append({"n": n, "kernel": "copy", "ms": t.median_ms, "gbps": nbytes / t.median_ms / 1e6})
        for backend in backends:
            for alg in softmax.ALGORITHMS:
                def check():
                    got = softmax.softmax(x, alg, backend)
                    ref = softmax.reference(x[:CHECK_ROWS].get(), alg)
                    return np.allclose(got[:CHECK_ROWS].get(), ref, rtol=2e-6, atol=1e-9), "FAILED"
                timed = check_then_time(check, lambda: (lambda: softmax.softmax(x, alg, backend)), reps)
                status = timed["status"]
                row = {"n": n, "kernel": f"{alg} ({backend})",
                       "check": "ok" if "ms" in timed else "FAILED" if status.startswith("FAIL") else status}
                if "ms" in timed:
                    row.update(ms=timed["ms"], gbps=nbytes / timed["ms"] / 1e6)
                results.append(row)
                print(f"  n={n:6d} {row['kernel']:16s} {row.get('gbps', 0):8.1f} GB/s {row['check']}", flush=True)
    return results


def markdown(results, rows):
    lengths = sorted({r["n"] for r in results})
    kernels = list(dict.fromkeys(r["kernel"] for r in results))
    cell = {(r["kernel"], r["n"]): r for r in results}
    out = [f"Softmax, fp32, {rows} vectors: GB/s (8 bytes per element: one read, one write)", "",
           "| kernel | " + " | ".join(f"n={n}" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for k in kernels:
        out.append(f"| {k} | " + " | ".join(f"{cell[(k, n)]['gbps']:.0f}" if "gbps" in cell.get((k, n), {}) else
                                            cell.get((k, n), {}).get("check", "-") for n in lengths) + " |")
    for backend in sorted({k.split("(")[1][:-1] for k in kernels if "(" in k}):
        s, o = (f"safe ({backend})", f"online ({backend})")
        ratios = [cell[(s, n)]["ms"] / cell[(o, n)]["ms"] if "ms" in cell.get((s, n), {}) and "ms" in cell.get((o, n), {})
                  else float("nan") for n in lengths]
        out.append(f"| online/safe speed-up ({backend}; lecture: 1.3x) | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    return "\n".join(out)


def add_arguments(ap):
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--lengths", type=csv_of(kind=int, low=1), default=LENGTHS)
    ap.add_argument("--backends", type=csv_of(BACKENDS), default=BACKENDS)


def main(args, out: Path):
    results = run(args.rows, list(args.lengths), list(args.backends), args.reps)
    write(out, "softmax", "softmax", stamp(rows=args.rows), results, markdown(results, args.rows))
