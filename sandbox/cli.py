"""python -m sandbox {list, run, fuzz, compile-report}

  list             registered variants, their parameters and capabilities
  run              one problem: check every chosen variant against the oracle, then time it (a table)
  fuzz             Hypothesis against the oracle for chosen variants, N examples, with a progress line
  compile-report   NVRTC compile of every CUDA variant (no GPU needed): registers, spills, shared memory

Without a GPU, `run` and `fuzz` use the Numba variants under the CUDA simulator and say so.
"""
from __future__ import annotations

import argparse
import json
import sys

from . import api, fuzz, oracle, tolerance
from .device import cupy_or_none, device_name, has_gpu
from .problem import make_problem
from .registry import all_variants, get_variant, parse_spec, variants


def _table(header, rows) -> str:
    cols = [str(h) for h in header]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _mode_line() -> str:
    if has_gpu():
        return f"device: {device_name()}"
    return ("device: none found -> CUDA SIMULATOR (NUMBA_ENABLE_CUDASIM=1): Numba variants only, "
            "small problem, wall-clock times of the simulation (not GPU figures)")


def _chosen(names, need_gpu_backend=True):
    """Variant specs ('name' or 'name:key=value+...') from --variants, those this machine can run."""
    registry = all_variants()
    picked = names.split(",") if names else sorted(registry)
    for n in picked:
        if parse_spec(n)[0] not in registry:
            raise SystemExit(f"unknown variant {n!r}; registered: {sorted(registry)}")
    backend = lambda spec: registry[parse_spec(spec)[0]].backend  # noqa: E731
    if not has_gpu():
        picked = [n for n in picked if backend(n) == "numba"]
    elif cupy_or_none() is None:
        print("CuPy is not installed: skipping the CUDA variants (pip install -e .[cuda13])", file=sys.stderr)
        picked = [n for n in picked if backend(n) != "cuda"]
    return picked


def cmd_list(args):
    rows = []
    for v in variants():
        caps = v["capabilities"]
        feats = [f for f in ("backward", "causal", "window", "block_sparse", "dropout", "gqa") if caps[f]]
        params = ", ".join(f"{k}∈{p['choices']}" for k, p in v["params"].items()) or "-"
        rows.append((v["name"], v["family"], v["backend"], "/".join(caps["dtypes"]), caps["head_dims"],
                     " ".join(feats), params))
    print(_table(("variant", "family", "backend", "dtypes", "head dims", "features", "parameters"), rows))
    if args.json:
        json.dump(variants(), open(args.json, "w"), indent=1, default=str)


def cmd_run(args):
    from .timing import time_fn, tflops
    import numpy as np
    print(_mode_line(), flush=True)
    gpu = has_gpu()
    B, H, N, d = (args.batch, args.heads, args.seqlen, args.headdim) if gpu else (1, 2, 16, 8)
    rows, records = [], []
    for name in _chosen(args.variants):
        vname, params = parse_spec(name)
        bound = get_variant(vname, **params)
        for dtype in ([args.dtype] if args.dtype else bound.variant.caps.dtypes):
            case = fuzz.Case(B, H, H, N, N, d, dtype, {"causal": args.causal}, 0)
            q, k, v, dout = case.inputs()
            try:
                bound.check(make_problem(q, k, v, causal=args.causal), "backward" if args.backward else "forward")
            except ValueError as e:
                rows.append((name, dtype, "unsupported", "-", "-", str(e)[:60])); continue
            verdicts = fuzz.check_case(bound, case, "backward" if args.backward else "forward")
            ok = all(v.ok for v in verdicts)
            worst = max(verdicts, key=lambda v: v.err / max(v.tol, 1e-30))
            if not ok:
                rows.append((name, dtype, f"FAIL ({worst})", "-", "-", "not timed")); continue
            xs = [bound.variant.impl.to_backend(x) for x in (q, k, v)]
            fn = lambda: api.forward(*xs, variant=bound, causal=args.causal)  # noqa: E731
            print(f"  timing {name} [{dtype}] ...", file=sys.stderr, flush=True)
            t = time_fn(fn, reps=args.reps)
            flops = make_problem(q, k, v, causal=args.causal).flops("forward")
            rows.append((name, dtype, f"ok ({worst.name} err {worst.err:.2g} <= {worst.tol:.2g})",
                         f"{t.median_ms:.3f}", f"{tflops(flops, t.median_ms):.2f}" if gpu else "-", t.clock))
            records.append({"variant": name, "dtype": dtype, "ms": t.median_ms, "tflops": tflops(flops, t.median_ms)})
    if gpu and not args.no_baselines:
        from . import baselines
        for be in baselines.SDPA_BACKENDS:
            fn = baselines.sdpa(be, B, H, N, N, d, "float16", args.causal)
            if fn is None:
                continue
            t = time_fn(fn, reps=args.reps)
            flops = 4.0 * B * H * N * N * d * (0.5 if args.causal else 1.0)
            rows.append((f"torch sdpa {be}", "float16", "baseline", f"{t.median_ms:.3f}",
                         f"{tflops(flops, t.median_ms):.2f}", t.clock))
            records.append({"variant": f"sdpa-{be}", "dtype": "float16", "ms": t.median_ms, "tflops": tflops(flops, t.median_ms)})
    print(f"\nproblem: B={B} H={H} N={N} d={d} causal={args.causal} (forward; FLOPs = 4 B H N^2 d"
          f"{' / 2' if args.causal else ''})")
    print(_table(("variant", "dtype", "check vs oracle", "median ms", "TFLOP/s", "clock"), rows))
    if args.json:
        json.dump({"mode": _mode_line(), "B": B, "H": H, "N": N, "d": d, "causal": args.causal,
                   "rows": records}, open(args.json, "w"), indent=1)
    if any(r[2].startswith("FAIL") for r in rows):
        raise SystemExit(1)


def cmd_fuzz(args):
    from hypothesis import HealthCheck, given, settings
    print(_mode_line(), flush=True)
    limits = fuzz.Limits() if has_gpu() else fuzz.Limits.simulator()
    failures = 0
    for name in _chosen(args.variants):
        vname, params = parse_spec(name)
        bound = get_variant(vname, **params)
        dirs = ["forward", "backward"] if bound.variant.caps.backward else ["forward"]
        for dtype in ([args.dtype] if args.dtype else bound.variant.caps.dtypes):
            for direction in (dirs if args.direction == "both" else [args.direction]):
                seen = [0]

                @settings(max_examples=args.examples, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck), derandomize=args.derandomize)
                @given(fuzz.cases(bound, dtype, limits))
                def run(case):
                    seen[0] += 1
                    print(f"\r  {name} {dtype} {direction}: {seen[0]}/{args.examples}", end="", file=sys.stderr, flush=True)
                    fuzz.assert_case(bound, case, direction)

                try:
                    run()
                    print(f"\r  {name} {dtype} {direction}: {seen[0]} examples ok" + " " * 10, file=sys.stderr)
                except AssertionError as e:
                    failures += 1
                    print(f"\n  FAILED {name} {dtype} {direction}: {e}", file=sys.stderr)
    print(f"examples checked: {sum(fuzz.EXAMPLES.values())}, failing configurations: {failures}")
    if failures:
        raise SystemExit(1)


def cmd_compile_report(args):
    from . import compile_report
    rows = compile_report.report(tuple(args.arch.split(",")))
    print(compile_report.markdown(rows))
    spills = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    tuned_spills = [r for r in spills if r["tuned"]]
    print(f"\n{len(rows)} kernel builds, {len(spills)} with spills, {len(tuned_spills)} of them in tuned configs")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)
    if tuned_spills:
        raise SystemExit(1)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m sandbox", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("list", help="registered variants and capabilities")
    s.add_argument("--json")
    s.set_defaults(fn=cmd_list)
    s = sub.add_parser("run", help="check and time variants on one problem")
    s.add_argument("--variants", help="comma-separated names (default: all)")
    s.add_argument("--batch", type=int, default=4)
    s.add_argument("--heads", type=int, default=8)
    s.add_argument("--seqlen", type=int, default=1024)
    s.add_argument("--headdim", type=int, default=64)
    s.add_argument("--dtype", choices=("float32", "float16", "bfloat16"))
    s.add_argument("--causal", action="store_true")
    s.add_argument("--backward", action="store_true", help="also check the backward before timing")
    s.add_argument("--reps", type=int, default=20)
    s.add_argument("--no-baselines", action="store_true")
    s.add_argument("--json")
    s.set_defaults(fn=cmd_run)
    s = sub.add_parser("fuzz", help="Hypothesis against the oracle")
    s.add_argument("--variants")
    s.add_argument("--examples", type=int, default=100)
    s.add_argument("--dtype", choices=("float32", "float16", "bfloat16"))
    s.add_argument("--direction", choices=("forward", "backward", "both"), default="both")
    s.add_argument("--derandomize", action="store_true")
    s.set_defaults(fn=cmd_fuzz)
    s = sub.add_parser("compile-report", help="NVRTC build of every CUDA variant, resources per kernel")
    s.add_argument("--arch", default="sm_80,sm_90")
    s.add_argument("--json")
    s.set_defaults(fn=cmd_compile_report)
    args = p.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
