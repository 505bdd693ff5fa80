"""Family `blocksparse`: forward time against block density for block-sparse FlashAttention (FA1
paper Sec. 3.3, Proposition 4: IO, and so time, proportional to the fraction of non-zero blocks),
with the ideal proportional line (dense time x density) and causal as a special case.

Setting: B * N = 16k tokens, hidden 2048, N = 4096, d = 64, mask blocks of 128 x 128 shared by all
heads; at each density a layout with round(density x blocks) blocks chosen at random (seeded).
Series (bench/selection.py): every registered flagship variant with block-sparse masks, in its first
dtype. Causal appears twice: `causal=True` (the element mask, with
block skipping) and the block-lower-triangular layout (density 0.52). Check before timing: the
first (batch, head) against the float64 oracle with the same layout. Timing: sandbox.timing.time_fn
(CUDA events, L2 flushed, median), through bench.harness.

    python -m bench blocksparse [--densities 0.05,0.1,0.2,0.3,0.5,0.7,1.0]
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

import sandbox
from sandbox import oracle, tolerance
from sandbox.masks import BlockSparse

from . import selection
from .common import Progress, csv_of, stamp, write
from .harness import check_then_time

N, D, BLOCK, TOKENS, HIDDEN = 4096, 64, 128, 16384, 2048
DENSITIES = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)


def series() -> list[tuple[str, str]]:
    """(variant, dtype): the flagship variants with block-sparse masks, each in its first dtype."""
    return [(v.name, v.caps.dtypes[0]) for v in selection.select("flagship", block_sparse=True, head_dim=D)]


def plan() -> list[dict]:
    return [selection.row("blocksparse", n, dt, D, "forward", f"N = {N}, {BLOCK} x {BLOCK} blocks, densities "
                          f"{DENSITIES[0]}-{DENSITIES[-1]}, block-causal layout, causal=True") for n, dt in series()]


def layout(density: float, nb: int, seed: int = 0) -> np.ndarray:
    """[1, nb, nb] with round(density nb^2) blocks set, chosen at random."""
    flat = np.zeros(nb * nb, dtype=bool)
    flat[np.random.default_rng(seed).permutation(nb * nb)[:round(density * nb * nb)]] = True
    return flat.reshape(1, nb, nb)


def check_head(bound, q, k, v, res, dtype, **opts):
    """(ok, verdict) of the first (batch, head) against the oracle."""
    qs, ks, vs = (x[:1, :1].get() for x in (q, k, v))
    ref, _ = oracle.forward(qs, ks, vs, **opts)
    naive = oracle.forward(qs, ks, vs, precision=dtype, **opts)[0] if dtype != "float32" else None
    terms = oracle.term_bounds(np.zeros_like(qs), qs, ks, vs, **opts)["out"] if dtype == "float32" else 0.0
    verdict = tolerance.compare("out", res.out[:1, :1].get(), ref, dtype, naive, "out", terms)
    return verdict.ok, verdict


def run(densities=DENSITIES, reps=10):
    import cupy as cp
    B, H, nb = TOKENS // N, HIDDEN // D, N // BLOCK
    cases = [(f"random {dens:g}", dens, {"block_mask": BlockSparse(layout(dens, nb), (BLOCK, BLOCK))}) for dens in densities]
    tri = np.tril(np.ones((nb, nb), dtype=bool))[None]
    cases += [("block-causal layout", float(tri.mean()), {"block_mask": BlockSparse(tri, (BLOCK, BLOCK))}),
              ("causal=True", (N * (N + 1) / 2) / N**2, {"causal": True})]
    todo = series()
    progress = Progress(len(todo) * len(cases), "blocksparse")
    rows = []
    for name, dtype in todo:
        bound = sandbox.get_variant(name)
        gen = cp.random.default_rng(0)
        q, k, v = (gen.standard_normal((B, H, N, D), dtype=cp.float32).astype(dtype) for _ in range(3))
        dense_ms = None
        for label, density, opts in sorted(cases, key=lambda c: -c[1] if c[0].startswith("random") else 2):
            progress(f"{name} {label}")
            row = {"variant": name, "dtype": dtype, "case": label, "density": density, "N": N, "B": B, "H": H, "d": D}
            row.update(check_then_time(
                lambda: check_head(bound, q, k, v, sandbox.forward(q, k, v, variant=bound, **opts), dtype, **opts),
                lambda: (lambda: sandbox.forward(q, k, v, variant=bound, **opts)), reps))
            if label == "random 1" and "ms" in row:
                dense_ms = row["ms"]
            rows.append(row)
        for r in rows:
            if r["variant"] == name and dense_ms and "ms" in r:
                r["ideal_ms"] = dense_ms * r["density"]
                r["time_over_ideal"] = r["ms"] / r["ideal_ms"]
        del q, k, v
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def markdown(rows) -> str:
    out = [f"Block-sparse forward, N = {N}, d = {D}, B*N = 16k tokens, hidden 2048, {BLOCK} x {BLOCK} mask blocks: "
           "time against density, ideal = dense time x density", "",
           "| variant | case | density | ms | ideal ms | time / ideal |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "ms" in r:
            out.append(f"| {r['variant']} ({r['dtype']}) | {r['case']} | {r['density']:.3f} | {r['ms']:.3f} | "
                       f"{r.get('ideal_ms', float('nan')):.3f} | {r.get('time_over_ideal', float('nan')):.2f} |")
        else:
            out.append(f"| {r['variant']} ({r['dtype']}) | {r['case']} | {r['density']:.3f} | {r['status'][:60]} | | |")
    return "\n".join(out)


def add_arguments(ap):
    ap.add_argument("--densities", type=csv_of(kind=float, low=1e-6, high=1.0), default=DENSITIES,
                    help="block densities in (0, 1] (the ideal line divides by them)")


def main(args, out: Path):
    densities = tuple(args.densities)
    if 1.0 not in densities:
        densities += (1.0,)         # the dense time is the ideal line's anchor
    rows = run(densities, args.reps)
    write(out, "blocksparse", "blocksparse", stamp(N=N, d=D, block=BLOCK), rows, markdown(rows))
