"""python -m bench.loop_trace --out DIR: where a warp-specialized kernel's loop spends its clocks, per consumer warpgroup.

A registered variant with a `trace` parameter (the registry says which: the overlapped Hopper rung, whose
kernels_cu/fa3_ws.cu compiles in FA_TRACE with trace=True) stores clock64() at eight points of every loop iteration of the
grid's block 0 (its first Q tile of head 0: the longest causal walk). From them, per warpgroup, the median clocks
of each phase of an iteration:

  operands   the K_{j+1} / V_j mbarrier waits        turn      the ping-pong barrier (0 work without ping-pong)
  S issue    issuing S_{j+1} = Q K_{j+1}^T's wgmmas   PV issue  issuing O += P_j V_j's
  S wait     until S_{j+1} is done                    softmax   the modifiers, masks and softmax of S_{j+1}
  PV wait    until P_j V_j is done                    tail      the rescale, P's conversion, the loop's top

and the period (top to top), and how much of one warpgroup's softmax runs while the other's does too (the
overlap FA3's ping-pong is meant to remove); per case, the share of the traced window with none, one, or two or more
warpgroups in their softmax. With softmax_turns the softmax phase includes the wait for the
warpgroup's turn, so its overlap with the other's counts that wait, not two softmaxes at once. The clock is the SM's; the stores add a few instructions per event.
Writes DIR/loop_trace.md, .json and .png (matplotlib) and prints the table. Cases: bench.modifiers_bench's
(causal, softcap, alibi, document, ...); N = --seqlen, B N = 16k tokens, hidden 2048, fp16.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

from sandbox.cli import positive_int

from .common import csv_of
from .modifiers_bench import CASES

PHASES = ("operands", "turn", "S issue", "PV issue", "S wait", "softmax", "PV wait")   # event e-1 -> e, e = 1..7


def complete_rows(t: np.ndarray, wg: int) -> np.ndarray:
    """The iterations of warpgroup wg that recorded every event (clock64 is never 0 on a running SM)."""
    x = t[wg]
    return x[(x != 0).all(axis=1)]


def warpgroups(t: np.ndarray) -> list[int]:
    return [c for c in range(t.shape[0]) if len(complete_rows(t, c))]


def phase_medians(t: np.ndarray, wg: int) -> dict:
    """Median clocks of each phase (PHASES, then tail) and the period of warpgroup wg's iterations."""
    x = complete_rows(t, wg)
    out = {"iterations": int(len(x))}
    for e, name in enumerate(PHASES, start=1):
        out[name] = float(np.median(x[:, e] - x[:, e - 1]))
    out["tail"] = float(np.median(x[1:, 0] - x[:-1, 7])) if len(x) > 1 else float("nan")
    out["period"] = float(np.median(np.diff(x[:, 0]))) if len(x) > 1 else float("nan")
    return out


def softmax_overlap(t: np.ndarray, a: int, b: int) -> float:
    """The fraction of warpgroup a's softmax clocks (event 5 -> 6) during which warpgroup b is in its softmax."""
    xa, xb = complete_rows(t, a), complete_rows(t, b)
    a0, a1, b0, b1 = xa[:, 5], xa[:, 6], xb[:, 5], xb[:, 6]
    both = np.clip(np.minimum(a1[:, None], b1[None, :]) - np.maximum(a0[:, None], b0[None, :]), 0, None).sum()
    total = (a1 - a0).sum()
    return float(both / total) if total else float("nan")


def softmax_concurrency(t: np.ndarray) -> dict:
    """How many of the block's warpgroups are in their softmax (event 5 -> 6) at once: the fractions of the window
    that every warpgroup's trace covers (the latest first top to the earliest last iteration's end) with none, one,
    and two or more of them there. With one block an SM, "none" is time in which these warpgroups give the MUFU no
    softmax work; whether the softmaxes run together or take turns is what the session-22 bound on the soft-cap
    turns on (README, "What the modifiers cost now")."""
    rows = [complete_rows(t, c) for c in warpgroups(t)]
    lo, hi = (max(x[0, 0] for x in rows), min(x[-1, 7] for x in rows)) if rows else (0, 0)
    if hi <= lo:
        return {"none": float("nan"), "one": float("nan"), "two or more": float("nan")}
    edges = [(a, +1) for x in rows for a in x[:, 5]] + [(b, -1) for x in rows for b in x[:, 6]]
    edges.sort()
    spent = {0: 0, 1: 0, 2: 0}
    depth, at = 0, lo
    for x, step in edges:
        x = min(max(x, lo), hi)
        spent[min(depth, 2)] += x - at
        depth, at = depth + step, x
    spent[min(depth, 2)] += hi - at
    total = hi - lo
    return {"none": spent[0] / total, "one": spent[1] / total, "two or more": spent[2] / total}


def summarize(t: np.ndarray) -> list[dict]:
    """One row per warpgroup: phase medians, and the softmax overlap with the next warpgroup (cyclically)."""
    wgs = warpgroups(t)
    rows = []
    for i, c in enumerate(wgs):
        row = {"warpgroup": c, **phase_medians(t, c)}
        row["softmax overlap"] = softmax_overlap(t, c, wgs[(i + 1) % len(wgs)]) if len(wgs) > 1 else 0.0
        rows.append(row)
    return rows


def markdown(results: list[dict]) -> str:
    cols = ["period", *PHASES, "tail"]
    lines = ["| d | N | case | config | wg | iterations | " + " | ".join(cols) + " | softmax beside another's |",
             "|---|---|---|---|---|---|" + "---|" * len(cols) + "---|"]
    for r in results:
        for w in r["warpgroups"]:
            lines.append(f"| {r['d']} | {r['N']} | {r['case']} | {r['config'] or 'default'} | {w['warpgroup']} | "
                         f"{w['iterations']} | "
                         + " | ".join(f"{w[c]:.0f}" for c in cols) + f" | {w['softmax overlap']:.2f} |")
    if any("softmax concurrency" in r for r in results):
        lines += ["", "Share of the traced window with none, one, or two or more of the block's warpgroups in their "
                  "softmax:", "", "| d | N | case | config | none | one | two or more |", "|---|---|---|---|---|---|---|"]
        for r in results:
            if "softmax concurrency" in r:
                k = r["softmax concurrency"]
                lines.append(f"| {r['d']} | {r['N']} | {r['case']} | {r['config'] or 'default'} | {k['none']:.2f} | "
                             f"{k['one']:.2f} | {k['two or more']:.2f} |")
    return "\n".join(lines)


def plot(results: list[dict], traces: list[np.ndarray], path: Path, iterations: int = 8) -> bool:
    """A timeline per case: each warpgroup's GEMM issue (blue), waits (grey) and softmax (orange) for the first
    iterations. False where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.3 + 0.9 * len(results)), squeeze=False)
    for ax, r, t in zip(axes[:, 0], results, traces):
        wgs = warpgroups(t)
        start = min(complete_rows(t, c)[0, 0] for c in wgs)
        for y, c in enumerate(wgs):
            x = complete_rows(t, c)[:iterations] - start
            spans = {"issue": (2, 4, "tab:blue"), "wait": (4, 5, "0.7"), "softmax": (5, 6, "tab:orange"),
                     "operands": (0, 2, "0.85"), "pv wait": (6, 7, "0.7")}
            for label, (e0, e1, colour) in spans.items():
                ax.broken_barh([(a, b - a) for a, b in zip(x[:, e0], x[:, e1])], (y - 0.35, 0.7), color=colour,
                               label=label if y == 0 else None)
        ax.set_yticks(range(len(wgs)), [f"wg {c}" for c in wgs])
        ax.set_title(f"{r['case']}, {r['config'] or 'default'} (d = {r['d']}, N = {r['N']})", fontsize=9)
    axes[-1, 0].set_xlabel("SM clocks from block 0's first traced iteration")
    axes[0, 0].legend(loc="upper right", fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def configs(variant: str, text: str) -> list[tuple[str, dict]]:
    """--configs: comma-separated parameter sets in the benchmark specs' syntax (sandbox.registry.parse_spec:
    'pingpong=true+stages=3'; an empty one is the defaults), each bound to the variant with trace=True here, so that
    a bad name or value is an error before anything runs on the GPU."""
    from sandbox.registry import get_variant, parse_spec
    out = []
    for text_ in (t.strip() for t in text.split(",")):
        _, params = parse_spec(f"{variant}:{text_}")
        try:
            get_variant(variant, **params, trace=True)
        except (ValueError, TypeError) as e:
            raise SystemExit(f"error: --configs {text_!r}: {e}") from None
        out.append((text_, params))
    return out


def traced_variants() -> list[str]:
    """The registered variants that take trace=True (their impl has clear_traces / read_trace)."""
    from sandbox.registry import all_variants
    return [v.name for v in all_variants().values() if any(p.name == "trace" for p in v.params)]


def run(variant: str, d: int, N: int, case: str, params: dict):
    """Trace one forward of `variant` (after warm-up launches); returns the trace array."""
    import cupy as cp
    import sandbox
    from sandbox.registry import get_variant
    from .modifiers_bench import modifier_options
    impl = get_variant(variant).variant.impl
    B, H = max(1, 16384 // N), 2048 // d
    g = cp.random.default_rng(0)
    q, k, v = (g.standard_normal((B, H, N, d), dtype=cp.float32).astype(cp.float16) for _ in range(3))
    params = {**params, "trace": True}
    opts = modifier_options(case, H, N)
    for _ in range(2):
        sandbox.forward(q, k, v, variant=variant, **params, **opts)
    cp.cuda.Device().synchronize()
    impl.clear_traces()
    sandbox.forward(q, k, v, variant=variant, **params, **opts)
    return impl.read_trace()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.loop_trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out")
    ap.add_argument("--headdim", type=csv_of(kind=int, low=1, high=256), default=(128,), help="comma-separated head dims")
    ap.add_argument("--seqlen", type=positive_int, default=4096)
    ap.add_argument("--cases", type=csv_of(allowed=CASES), default=("causal", "softcap"),
                    help=f"comma-separated bench.modifiers_bench cases ({', '.join(CASES)})")
    ap.add_argument("--configs", default=",pingpong=true", help="comma-separated parameter sets of the variant, each "
                    "in the spec syntax (pingpong=true+stages=3; empty: the defaults)")
    ap.add_argument("--variant", default=None, help="a variant with a trace parameter (default: the first registered)")
    args = ap.parse_args(argv)
    names = traced_variants()
    variant = args.variant or (names[0] if names else None)
    if variant not in names:
        raise SystemExit(f"error: --variant must be one of {names} (variants with a trace parameter); got {variant!r}")
    sets = configs(variant, args.configs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, traces = [], []
    for d in args.headdim:
        for case in args.cases:
            for config, params in sets:
                t = run(variant, d, args.seqlen, case, params)
                rows = summarize(t)
                results.append({"d": d, "N": args.seqlen, "case": case, "config": config, "warpgroups": rows,
                                "softmax concurrency": softmax_concurrency(t)})
                traces.append(t)
                print(f"d={d} {case} {config or 'default'}: period "
                      + ", ".join(f"wg{w['warpgroup']} {w['period']:.0f}" for w in rows) + " clk", flush=True)
    from .common import stamp, stamp_line
    meta, table = stamp(), markdown(results)
    (out / "loop_trace.md").write_text(f"# {variant} loop trace (median SM clocks per iteration)\n\n{stamp_line(meta)}"
                                       f"\n\n{table}\n")
    (out / "loop_trace.json").write_text(json.dumps({**meta, "variant": variant, "results": results}, indent=1))
    if not plot(results, traces, out / "loop_trace.png"):
        print("matplotlib not installed: no loop_trace.png", file=sys.stderr)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
