"""Family `dropout` (the dropout axis): replay the mask from (seed, offset) in the backward (the papers' choice) vs store it
bit-packed in the forward and read it in the backward.

Variants (bench/selection.py): every registered flagship variant with dropout and a `dropout_store`
parameter offering both modes, in its first dtype (--variant names one instead); dropout_p = 0.1,
FA2 grid shapes (B*N = 16k tokens, hidden 2048, d = 64). Check before timing (bench.harness): each
mode against the oracle with dropout on a small problem, forward and backward; then, at every N,
the two modes' gradients against each other (same keep pattern, same values to 1e-5): a mode or
an N that fails is not timed. Timing: sandbox.timing.time_fn (CUDA events, L2 flushed, median).
Extra memory: the stored mask, B*H*Nq*ceil(Nk/32)*4 bytes.

    python -m bench dropout [--seqlens 1024,2048,4096,8192] [--variant NAME]
"""
from __future__ import annotations

from pathlib import Path

import sandbox

from . import selection
from .common import UsageError, csv_of, parse_variant, stamp, write
from .harness import check_then_time, oracle_check

P = 0.1
D = 64
STORES = ("replay", "packed")


def _two_modes(v) -> bool:
    return any(p.name == "dropout_store" and set(STORES) <= set(p.choices) for p in v.params)


def series() -> list[tuple[str, str]]:
    """(variant, dtype) of the flagship variants with dropout and both mask stores."""
    return [(v.name, v.caps.dtypes[0]) for v in selection.select("flagship", dropout=True, head_dim=D, where=_two_modes)]


def plan() -> list[dict]:
    return [selection.row("dropout", n, dt, D, "forward,backward", f"dropout_p = {P}: dropout_store "
                          + " vs ".join(STORES) + ", N = 1k-8k") for n, dt in series()]


def run(seqlens, d, reps, spec, dtype):
    import cupy as cp
    rows = []
    base = parse_variant(spec)[1]
    bounds = {store: base.variant.bind(**{**base.params, "dropout_store": store}) for store in STORES}
    opts = {"dropout_p": P, "seed": 7}
    small = {store: oracle_check(b, dtype, d, "backward", n=200, options=opts) for store, b in bounds.items()}
    for n in seqlens:
        B, H = 16384 // n, 2048 // d
        rng = cp.random.default_rng(n)
        q, k, v, do = (rng.standard_normal((B, H, n, d), dtype=cp.float32).astype(dtype) for _ in range(4))
        results = {store: sandbox.forward(q, k, v, variant=b, **opts) for store, b in bounds.items()}
        grads = {store: sandbox.backward(do, r) for store, r in results.items()}
        same = all(bool(cp.array_equal(a != 0, b != 0)) and bool(cp.allclose(a, b, rtol=1e-4, atol=1e-5))
                   for a, b in zip(grads["replay"], grads["packed"]))
        del grads
        for store, bound in bounds.items():
            r = results[store]

            def check(store=store):
                ok, verdict = small[store]
                if not ok:
                    return False, verdict
                return same, "packed and replayed masks give different gradients"
            tf = check_then_time(check, lambda: (lambda: sandbox.forward(q, k, v, variant=bound, **opts)), reps)
            tb = check_then_time(check, lambda: (lambda: sandbox.backward(do, r)), reps)
            extra = int(r.saved["dropout_bits"].nbytes) if "dropout_bits" in r.saved else 0
            row = {"variant": spec, "dtype": dtype, "N": n, "B": B, "H": H, "d": d, "store": store,
                   "status": tf["status"], "extra_bytes": extra}
            if "ms" in tf and "ms" in tb:
                row.update(fwd_ms=tf["ms"], bwd_ms=tb["ms"])
                print(f"  {spec} N={n:5d} {store:6s} fwd {tf['ms']:8.2f} ms  bwd {tb['ms']:8.2f} ms  "
                      f"mask {extra / 2**20:7.1f} MiB", flush=True)
            rows.append(row)
        del results
    return rows


def markdown(rows, variant=None):
    out = []
    for spec in dict.fromkeys(r.get("variant", variant) for r in rows):
        sub = [r for r in rows if r.get("variant", variant) == spec]
        dtype = sub[0].get("dtype", "float32").replace("float", "fp")
        out += [f"Dropout axis ({spec}, {dtype}, p = {P}, d = {D}, B*N = 16k, hidden 2048): replay vs packed mask", "",
                "| N | fwd replay ms | fwd packed ms | bwd replay ms | bwd packed ms | bwd packed/replay | mask memory |",
                "|---|---|---|---|---|---|---|"]
        by = {(r["N"], r["store"]): r for r in sub}
        for n in sorted({r["N"] for r in sub}):
            a, b = by.get((n, "replay"), {}), by.get((n, "packed"), {})
            if "bwd_ms" not in a or "bwd_ms" not in b:
                out.append(f"| {n} | {(a.get('status') or b.get('status') or '-')[:80]} | | | | | |")
                continue
            out.append(f"| {n} | {a['fwd_ms']:.2f} | {b['fwd_ms']:.2f} | {a['bwd_ms']:.2f} | {b['bwd_ms']:.2f} | "
                       f"{b['bwd_ms'] / a['bwd_ms']:.2f}x | {b['extra_bytes'] / 2**20:.0f} MiB |")
        out.append("")
    return "\n".join(out).rstrip()


def add_arguments(ap):
    ap.add_argument("--seqlens", type=csv_of(kind=int, low=1), default=(1024, 2048, 4096, 8192))
    ap.add_argument("--variant", default=None,
                    help="a variant spec with a dropout_store parameter; default: the registry's (python -m bench plan dropout)")


def main(args, out: Path):
    if args.variant is not None:
        bound = parse_variant(args.variant)[1]
        if not _two_modes(bound.variant):
            raise UsageError(f"variant {bound.name!r} has no dropout_store parameter with {' and '.join(STORES)}")
        todo = [(args.variant, bound.variant.caps.dtypes[0])]
    else:
        todo = series()
    rows = [r for spec, dtype in todo for r in run(list(args.seqlens), D, args.reps, spec, dtype)]
    write(out, "dropout", "dropout", stamp(p=P, variants=[s for s, _ in todo]), rows, markdown(rows))
