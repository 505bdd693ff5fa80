"""Family `grid`: the FA2 paper's benchmark grid (Sec. 4.1, Figures 4-7), forward, backward and both.

Variants (bench/selection.py): the ladder of the dtype's tier from the registry, each rung with its
defaults and its bench_configs (exact-ladder at float32, tc-ladder at float16; backward-rung variants
and backward configs only in the backward directions); --variants times given specs instead.

Protocol: B * N = 16k tokens, hidden 2048 (H = 2048 / d), N from 512 to 16k, causal and not.
Check before timing: a forward is checked against the float64 oracle on the last 1024 query rows of
the first and last (batch, head) of the very problem it is timed on (bottom-right causal alignment
makes a row slice exact); a backward (whose dK, dV need every row) is checked on a (1, 2, 256, d)
problem with the same options through sandbox.fuzz.check_case. A variant that fails is not timed.
Timing: sandbox.timing.time_fn (CUDA events, warm-up, L2 flushed between repetitions, median).
FLOPs (DESIGN.md): forward 4 B H N^2 d, halved if causal; backward 2.5x forward; both 3.5x.
Baselines in the same run, fp16 (their kernels have no fp32 path except math): PyTorch SDPA
(flash = FlashAttention-2, cuDNN, efficient, math = materialised attention) and a plain CuPy
materialised attention (cuBLAS matmuls, forward only).

    python -m bench grid --dtype float16 --headdim 128 --directions forward,backward
    python -m bench grid --dtype float32 --variants NAME,NAME:split=k+block_r=16
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

import sandbox
from sandbox import baselines, oracle, tolerance
from sandbox.problem import make_problem
from sandbox.timing import tflops, time_fn

from . import selection
from .common import Progress, csv_of, parse_variant, stamp, write
from .harness import check_then_time, oracle_check

CHECK_ROWS = 1024
# the runs of the protocol `plan` lists: each tier's dtype at the paper's head dims
TIER_RUNS = (("float32", (64, 128)), ("float16", (64, 128)))
BASELINES = ("flash", "cudnn", "efficient", "math", "cupy")


def selection_for(dtype: str, d: int, directions) -> list[tuple[str, tuple]]:
    """(spec, directions it is timed in) of the registry's ladder for this dtype and head dim."""
    entries = {}
    for direction in directions:
        for s in selection.ladder(dtype, d, direction):
            entries.setdefault(s, []).append(direction)
    return [(s, tuple(drs)) for s, drs in entries.items()]


def plan() -> list[dict]:
    """What the grid times at each tier run (dtype, head dims), per spec: the directions it is in."""
    rows = []
    for dtype, dims in TIER_RUNS:
        seen = {}
        for d in dims:
            for s, drs in selection_for(dtype, d, selection.DIRECTIONS):
                seen.setdefault((s, drs), []).append(d)
        rows += [selection.row("grid", s, dtype, ds, drs, "B*N = 16k, hidden 2048, N = 1k-8k; beside SDPA, CuPy")
                 for (s, drs), ds in seen.items()]
    return rows


# The oracle's answers for the slices check_slice compares, per input arrays and options: every variant
# of a grid point is checked against one float64 computation (at N = 16k, d = 128 it takes seconds).
# Emptied at the start of each run(): the keys hold device addresses, which a later run may reuse.
_REFERENCE: dict = {}


def _reference(q, k, v, b, h, hk, causal, dtype):
    key = (q.data.ptr, k.data.ptr, v.data.ptr, q.shape, k.shape, b, h, causal, dtype)
    if key not in _REFERENCE:
        qs = q[b:b + 1, h:h + 1, -CHECK_ROWS:].get()
        ks, vs = k[b:b + 1, hk:hk + 1].get(), v[b:b + 1, hk:hk + 1].get()
        ref_out = oracle.forward(qs, ks, vs, causal=causal)[0]
        naive = oracle.forward(qs, ks, vs, causal=causal, precision=dtype)[0] if dtype != "float32" else None
        terms = oracle.term_bounds(np.zeros_like(qs), qs, ks, vs, causal=causal)["out"] if dtype == "float32" else 0.0
        _REFERENCE[key] = (ref_out, naive, terms)
    return _REFERENCE[key]


def check_slice(bound, q, k, v, res, causal, dtype):
    """Oracle on the last CHECK_ROWS query rows of the first and last (b, h): (ok, worst verdict)."""
    B, H = q.shape[0], q.shape[1]
    worst = None
    for b, h in ((0, 0), (B - 1, H - 1)):
        hk = h // (H // k.shape[1])
        ref_out, naive, terms = _reference(q, k, v, b, h, hk, causal, dtype)
        got = res.out[b:b + 1, h:h + 1, -CHECK_ROWS:].get()
        verdict = tolerance.compare("out", got, ref_out, dtype, naive, "out", terms)
        if worst is None or not verdict.ok or verdict.err / max(verdict.tol, 1e-30) > worst.err / max(worst.tol, 1e-30):
            worst = verdict
        if not verdict.ok:
            break
    return worst.ok, worst


FLOP_FACTOR = {"forward": 1.0, "backward": 2.5, "both": 3.5}


def label_of(backend: str) -> str:
    return "cupy-standard (fp16)" if backend == "cupy" else f"sdpa-{backend} (fp16)"


def check_backward(bound, d, dtype, causal):
    """(ok, worst verdict) of a (1, 2, 256, d) forward + backward against the oracle."""
    return oracle_check(bound, dtype, d, "backward", options={"causal": True} if causal else {}, seed=d)


def timed_call(bound, q, k, v, causal, direction, dout):
    """The callable timed for one direction (backward: from a stored forward Result)."""
    if direction == "forward":
        return lambda: sandbox.forward(q, k, v, variant=bound, causal=causal)
    if direction == "backward":
        res = sandbox.forward(q, k, v, variant=bound, causal=causal)
        return lambda: sandbox.backward(dout, res)
    return lambda: sandbox.backward(dout, sandbox.forward(q, k, v, variant=bound, causal=causal))


def run(dtype="float32", d=64, seqlens=(1024, 2048, 4096, 8192), variants=None,
        directions=("forward",), backends=BASELINES, reps=10, tokens=16384, hidden=2048):
    """variants: specs timed in every direction, or None: the registry's ladder (selection_for)."""
    import cupy as cp
    _REFERENCE.clear()
    npdt = {"float32": cp.float32, "float16": cp.float16}[dtype]
    H = hidden // d
    entries = (selection_for(dtype, d, directions) if variants is None
               else [(s, tuple(directions)) for s in variants])
    bound_variants = [(*parse_variant(s), drs) for s, drs in entries]
    rows, checked = [], {}
    progress = Progress(len(seqlens) * 2 * (sum(len(drs) for *_, drs in bound_variants) + len(directions) * len(backends)),
                        f"grid d={d}")
    for N in seqlens:
        B = max(1, tokens // N)
        gen = cp.random.default_rng(N)
        q, k, v, dout = (gen.standard_normal((B, H, N, d), dtype=cp.float32).astype(npdt) for _ in range(4))
        for direction in directions:
            for causal in (False, True):
                flops = make_problem(q, k, v, causal=causal).flops() * FLOP_FACTOR[direction]
                base = {"N": N, "B": B, "H": H, "d": d, "causal": causal, "direction": direction}
                for label, bound, drs in bound_variants:
                    if direction not in drs:
                        continue
                    progress(f"N={N} {direction} causal={causal} {label}")

                    def check():
                        bound.check(make_problem(q, k, v, causal=causal), "forward" if direction == "forward" else "backward")
                        if direction == "forward":
                            res = sandbox.forward(q, k, v, variant=bound, causal=causal)
                            return check_slice(bound, q, k, v, res, causal, dtype)
                        if (label, causal) not in checked:
                            checked[(label, causal)] = check_backward(bound, d, dtype, causal)
                        return checked[(label, causal)]
                    row = {**base, "dtype": dtype, "variant": label,
                           **check_then_time(check, lambda: timed_call(bound, q, k, v, causal, direction, dout), reps)}
                    if "ms" in row:
                        row["tflops"] = tflops(flops, row["ms"])
                    rows.append(row)
                for be in backends:
                    progress(f"N={N} {direction} causal={causal} {label_of(be)}")
                    fn = (baselines.cupy_standard(B, H, N, N, d, "float16", causal, direction) if be == "cupy" else
                          baselines.sdpa(be, B, H, N, N, d, "float16", causal, direction=direction))
                    if fn is None:
                        continue
                    try:
                        t = time_fn(fn, reps=reps)
                    except Exception as e:      # noqa: BLE001 -- a baseline out of memory is a table cell
                        rows.append({**base, "dtype": "float16", "variant": label_of(be), "status": f"skipped: {str(e)[:60]}"})
                        continue
                    rows.append({**base, "dtype": "float16", "variant": label_of(be), "status": "baseline",
                                 "ms": t.median_ms, "tflops": tflops(flops, t.median_ms)})
        del q, k, v, dout
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def markdown(rows) -> str:
    """One table per direction: a row per (variant, causal), a column per N, TFLOP/s."""
    Ns = sorted({r["N"] for r in rows})
    out = []
    for direction in dict.fromkeys(r.get("direction", "forward") for r in rows):
        sub = [r for r in rows if r.get("direction", "forward") == direction]
        out += [f"TFLOP/s, {direction}, d = {sub[0]['d']}, B*N = 16k tokens, hidden 2048 (median of CUDA-event timings)", "",
                "| variant | causal | " + " | ".join(f"N={n}" for n in Ns) + " |", "|---|---|" + "---|" * len(Ns)]
        for label in dict.fromkeys(r["variant"] for r in sub):
            for causal in (False, True):
                cells = []
                for n in Ns:
                    r = next((r for r in sub if r["variant"] == label and r["causal"] == causal and r["N"] == n), None)
                    cells.append("-" if r is None else f"{r['tflops']:.2f}" if "tflops" in r else r["status"][:30])
                out.append(f"| {label} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip()


def add_arguments(ap):
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--seqlens", type=csv_of(kind=int, low=1), default=(1024, 2048, 4096, 8192))
    ap.add_argument("--directions", type=csv_of(tuple(FLOP_FACTOR)), default=("forward",), help="forward,backward,both")
    ap.add_argument("--variants", default=None,
                    help="comma-separated specs (name or name:key=value+...); default: the dtype's ladder from "
                         "the registry (python -m bench plan grid)")
    ap.add_argument("--baselines", type=csv_of(BASELINES), default=BASELINES,
                    help="SDPA backends (flash, cudnn, efficient, math) and cupy (plain CuPy materialised attention) "
                         "timed beside the variants ('' for none)")


def main(args, out: Path):
    directions = tuple(args.directions)
    variants = None if args.variants is None else [s for s in args.variants.split(",") if s]
    rows = run(args.dtype, args.headdim, list(args.seqlens), variants, directions, tuple(args.baselines), args.reps)
    stem = f"grid_{args.dtype}_d{args.headdim}" + ("" if directions == ("forward",) else "_" + "_".join(directions))
    write(out, stem, "grid", stamp(dtype=args.dtype, d=args.headdim, directions=list(directions)), rows, markdown(rows),
          ["N", "B", "H", "d", "causal", "direction", "dtype", "variant", "status", "ms", "tflops"])
