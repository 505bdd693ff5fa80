"""python -m bench.mufu_rate --out DIR: the MUFU rate (tanh, exp2 per SM clock) that the soft-capped softmax body
sustains with 1-4 warps per SM sub-partition (kernels_cu/mufu_rate.cu, one block an SM).

Why: the overlapped Hopper rung's soft-capped forward at d = 64 needs two MUFU ops per score, and its two consumer
warps per sub-partition spend about a third of each iteration outside the softmax, so the rate one warp alone can
sustain bounds the whole forward (README, "What the modifiers cost now"; bench/results/h100/2026-11-27-session-22.md: one warp ~68% of the
peak, two ~95%, whatever the source order). Since session 24 that rung runs large soft-capped problems at d = 64 on three
consumer warps per sub-partition without the overlap (variants/fa3_ws.serial_three); the rate at two, three and four
warps also gives the soft-cap's floor: two MUFU ops per visible score at the sustained rate (session 24's results file).

Rows: the plain body (one exp2 a score), the soft-capped one (tanh, then exp2), and the two source orders of the
soft-cap that issue every tanh first; results per ns per SM and per clock at the device's maximum clock (the peak is
16 per clock on the H100: 4 per sub-partition). Writes DIR/mufu_rate.md and .json and prints the table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from sandbox.cli import positive_int
from sandbox.loader import CompileUnit

from .common import csv_of

MODES = {0: "exp2 only", 1: "tanh, exp2", 2: "every tanh first", 3: "every tanh first, sums last"}
MUFU_OPS = {0: 1, 1: 2, 2: 2, 3: 2}             # MUFU ops a score
SCORES = 64                                      # a thread's scores per iteration (kernels_cu/mufu_rate.cu)
UNIT = CompileUnit("mufu_rate.cu", tuple(f"mufu_body<{m}>" for m in MODES), label="mufu_rate")


def rate(mode: int, warps: int, iters: int, sms: int, clock_hz: float) -> dict:
    """One mode at `warps` warps per sub-partition (128 x warps threads a block, one block an SM): the median of
    sandbox.timing.time_fn's CUDA-event timings (no L2 flush: the body touches no memory until its one store)."""
    import cupy as cp
    from sandbox import loader
    from sandbox.timing import time_fn
    threads = 128 * warps
    out = cp.empty(sms * threads, cp.float32)
    args = (out, np.int32(iters), np.float32(0.02), np.float32(1.4426950))
    name = f"mufu_body<{mode}>"
    timing = time_fn(lambda: loader.launch(UNIT, name, (sms,), (threads,), args), reps=5, flush_l2=False)
    seconds = timing.median_ms / 1e3
    ops = sms * threads * iters * SCORES * MUFU_OPS[mode]
    per_ns = ops / seconds / sms / 1e9
    return {"mode": MODES[mode], "warps": warps, "ms": seconds * 1e3, "per_ns_per_sm": per_ns,
            "per_clock": per_ns * 1e9 / clock_hz}


def markdown(rows: list[dict], clock_hz: float) -> str:
    warps = sorted({r["warps"] for r in rows})
    modes = [m for m in MODES.values() if any(r["mode"] == m for r in rows)]
    cell = {(r["mode"], r["warps"]): r for r in rows}
    lines = [f"MUFU results per ns per SM (per clock at the {clock_hz / 1e9:.2f} GHz maximum clock)", "",
             "| warps / sub-partition | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for w in warps:
        lines.append(f"| {w} | " + " | ".join(f"{cell[m, w]['per_ns_per_sm']:.1f} ({cell[m, w]['per_clock']:.2f})"
                                              if (m, w) in cell else "-" for m in modes) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.mufu_rate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out")
    ap.add_argument("--warps", type=csv_of(kind=int, low=1, high=4), default=(1, 2, 3, 4),
                    help="comma-separated warps per sub-partition (1-4: 64 scores a thread fit 4 at most)")
    ap.add_argument("--iters", type=positive_int, default=200, help="iterations of the body per launch")
    args = ap.parse_args(argv)
    from sandbox.device import cupy_or_none
    cp = cupy_or_none()
    if cp is None:
        raise SystemExit("error: bench.mufu_rate needs a CUDA GPU with CuPy")
    attrs = cp.cuda.Device().attributes
    sms, clock_hz = attrs["MultiProcessorCount"], attrs["ClockRate"] * 1e3
    rows = [rate(m, w, args.iters, sms, clock_hz) for m in MODES for w in args.warps]
    from .common import stamp, stamp_line
    meta, table = stamp(), markdown(rows, clock_hz)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mufu_rate.md").write_text(f"# MUFU rate of the softmax body\n\n{stamp_line(meta)}\n\n{table}\n")
    (out / "mufu_rate.json").write_text(json.dumps({**meta, "clock_hz": clock_hz, "rows": rows}, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
