"""python -m sandbox {list, run, fuzz, compile-report}

  list             registered variants, their parameters and capabilities
  run              one problem: check every chosen variant against the oracle, then time it (a table)
  fuzz             Hypothesis against the oracle for chosen variants, N examples, with a progress line
  compile-report   NVRTC compile of every CUDA variant (no GPU needed): registers, spills, shared memory

Without a GPU, `run` and `fuzz` use the Numba variants under the CUDA simulator and say so: with no
--variants they skip the CUDA variants (named on stderr), and a CUDA variant named in --variants is
an error. `run` takes --batch/--heads/--seqlen/--headdim in both modes; the ones not given default
to a small problem in the simulator. A user error (unknown variant, bad parameter, a variant this
machine cannot run) is one `error: ...` line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from . import api, fuzz
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
            "small problem by default, wall-clock times of the simulation (not GPU figures)")


class UsageError(Exception):
    """A mistake in the command line (an unknown variant, a bad parameter, a variant this machine
    cannot run): main() prints it as one `error: ...` line and exits 2, without a traceback."""


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a problem dimension, a repetition or example count)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return n


def _why_not_here(backend: str) -> str | None:
    """Why this machine cannot run a variant of `backend`, or None if it can. Numba variants run
    everywhere (on the GPU, or under the CUDA simulator); CUDA variants need a GPU and CuPy."""
    if backend == "numba":
        return None
    if not has_gpu():
        return "no CUDA GPU was found (without one only the Numba variants run, under the CUDA simulator)"
    if cupy_or_none() is None:
        return "CuPy is not installed (pip install -e .[cuda13])"
    return None


def _bind(spec: str):
    """A --variants entry ('name' or 'name:key=value+...') bound to its parameters; a bad name or
    parameter is a UsageError carrying the registry's message."""
    name, params = parse_spec(spec)
    try:
        return get_variant(name, **params)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _chosen(names):
    """[(spec, bound variant)] for --variants, all checked before anything runs.

    Explicitly named variants must all run here, else a UsageError says which cannot and why. With
    no --variants, every registered variant this machine can run; the others are named on stderr.
    """
    if names is None:
        specs, explicit = sorted(all_variants()), False
    else:
        specs, explicit = [n.strip() for n in names.split(",") if n.strip()], True
        if not specs:
            raise UsageError(f"--variants {names!r} names no variant; see `python -m sandbox list`")
    bound = [(spec, _bind(spec)) for spec in specs]
    why = {spec: _why_not_here(b.variant.backend) for spec, b in bound}
    blocked = {}                                   # reason -> the specs it stops
    for spec, reason in why.items():
        if reason:
            blocked.setdefault(reason, []).append(spec)
    said = [f"{', '.join(stopped)}: {reason}" for reason, stopped in blocked.items()]
    if said and explicit:
        raise UsageError("cannot run " + "; ".join(said))
    for line in said:
        print(f"skipping {line}", file=sys.stderr, flush=True)
    runnable = [(spec, b) for spec, b in bound if why[spec] is None]
    if not runnable:
        raise UsageError("no registered variant can run on this machine")
    return runnable


def _write_json(path: str, obj) -> None:
    """--json output; a path that cannot be written (no such folder) is the user's to fix."""
    try:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1, default=str)
    except OSError as e:
        raise UsageError(f"cannot write --json {path}: {e.strerror or e}") from None


GPU_PROBLEM = {"batch": 4, "heads": 8, "seqlen": 1024, "headdim": 64}
SIMULATOR_PROBLEM = {"batch": 1, "heads": 2, "seqlen": 16, "headdim": 8}   # the simulator is slow


def _problem_dims(args, gpu: bool) -> tuple[int, int, int, int]:
    """(B, H, N, d): the options the user gave, the rest from the GPU or simulator default."""
    default = GPU_PROBLEM if gpu else SIMULATOR_PROBLEM
    B, H, N, d = (getattr(args, k) if getattr(args, k) is not None else default[k] for k in default)
    return B, H, N, d


def _dims_text(dims) -> str:
    """'1..128' as the summary gives it; a list in steps of one stride as 'a..b step s' (8..256 step 8)."""
    if isinstance(dims, str) or len(dims) < 3:
        return str(dims)
    step = dims[1] - dims[0]
    if all(b - a == step for a, b in zip(dims, dims[1:])):
        return f"{dims[0]}..{dims[-1]} step {step}"
    return str(dims)


def cmd_list(args):
    rows = []
    for v in variants():
        caps = v["capabilities"]
        feats = [f for f in ("backward", "causal", "window", "block_sparse", "dropout", "gqa", "score_mod", "mask_mod") if caps[f]]
        if caps.get("max_query_rows") is not None:
            feats.append(f"Nq<={caps['max_query_rows']}")
        params = ", ".join(f"{k}∈{p['choices']}" for k, p in v["params"].items()) or "-"
        rows.append((v["name"], v["family"], v["backend"], "/".join(caps["dtypes"]), _dims_text(caps["head_dims"]),
                     " ".join(feats), params))
    print(_table(("variant", "family", "backend", "dtypes", "head dims", "features", "parameters"), rows))
    if args.json:
        _write_json(args.json, variants())


def _prebuild(bounds):
    """Build every module the chosen CUDA variants can launch, in parallel threads, into the disk
    cache before the first check: a cold start compiles once per core instead of one module after
    another, and a warm one reads every CUBIN from the cache (sandbox/loader.py)."""
    from . import kernel_cache, loader
    from .device import arch
    if not kernel_cache.enabled():       # SANDBOX_CACHE_DIR=off: CuPy compiles each module itself
        return
    units = [u for b in bounds if b.variant.backend == "cuda" for u in b.variant.impl.compile_units(b.config)]
    if not units:
        return
    t0 = time.perf_counter()

    def progress(i, n, unit, target, build, seconds):
        print(f"\r  modules: {i}/{n} ({seconds:.0f} s)", end="", file=sys.stderr, flush=True)

    try:
        loader.prebuild(units, arch(), progress=progress)
    except Exception as e:      # noqa: BLE001 the lazy path builds (or falls back to CuPy's NVRTC) per module
        print(f"\n  prebuild skipped ({type(e).__name__}: {str(e).splitlines()[0][:120]})", file=sys.stderr)
        return
    print(f"\r  modules: {len(units)} ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def cmd_run(args):
    from .timing import time_fn, tflops
    gpu = has_gpu()
    start = time.perf_counter()
    chosen = _chosen(args.variants)
    B, H, N, d = _problem_dims(args, gpu)
    print(_mode_line(), flush=True)
    print(f"problem: B={B} H={H} N={N} d={d} causal={args.causal} (forward; FLOPs = 4 B H N^2 d"
          f"{' / 2' if args.causal else ''})", flush=True)
    if gpu:
        _prebuild([bound for _, bound in chosen])
    rows, records = [], []
    # per dtype, made once: the timed inputs, and the check case whose oracle answers every variant of
    # that dtype shares (float64 NumPy, twice for 16-bit: exact and same-precision). The check runs on
    # one batch of two heads of the same N, d and options: at B = 4, H = 8 it was most of a run's time,
    # and computed per variant it was half of a warm run (0.5 s a row on the H100's host)
    timed, checks, references = {}, {}, {}
    for name, bound in chosen:
        for dtype in ([args.dtype] if args.dtype else bound.variant.caps.dtypes):
            if dtype not in timed:
                timed[dtype] = fuzz.Case(B, H, H, N, N, d, dtype, {"causal": args.causal}, 0).inputs()
                checks[dtype] = fuzz.Case(1, min(H, 2), min(H, 2), N, N, d, dtype, {"causal": args.causal}, 0)
            q, k, v, dout = timed[dtype]
            check = checks[dtype]
            try:
                bound.check(make_problem(q, k, v, causal=args.causal), "backward" if args.backward else "forward")
            except ValueError as e:
                rows.append((name, dtype, "unsupported", "-", "-", str(e)[:60])); continue
            verdicts = fuzz.check_case(bound, check, "backward" if args.backward else "forward", references)
            ok = all(v.ok for v in verdicts)
            worst = max(verdicts, key=lambda v: v.err / max(v.tol, 1e-30))
            if not ok:
                rows.append((name, dtype, f"FAIL ({worst})", "-", "-", "not timed")); continue
            xs = [bound.variant.impl.to_backend(x) for x in (q, k, v)]
            fn = lambda: api.forward(*xs, variant=bound, causal=args.causal)  # noqa: E731
            print(f"  [{time.perf_counter() - start:5.1f} s] checked, timing {name} [{dtype}] ...",
                  file=sys.stderr, flush=True)
            t = time_fn(fn, reps=args.reps)
            flops = make_problem(q, k, v, causal=args.causal).flops("forward")
            rows.append((name, dtype, f"ok ({worst.name} err {worst.err:.2g} <= {worst.tol:.2g})",
                         f"{t.median_ms:.3f}", f"{tflops(flops, t.median_ms):.2f}" if gpu else "-", t.clock))
            records.append({"variant": name, "dtype": dtype, "ms": t.median_ms, "tflops": tflops(flops, t.median_ms)})
    if gpu and not args.no_baselines:
        print(f"  [{time.perf_counter() - start:5.1f} s] timing the SDPA baselines ...", file=sys.stderr, flush=True)
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
    print()
    print(_table(("variant", "dtype", "check vs oracle (B=1, H<=2)", "median ms", "TFLOP/s", "clock"), rows))
    if args.json:
        _write_json(args.json, {"mode": _mode_line(), "B": B, "H": H, "N": N, "d": d, "causal": args.causal,
                                "rows": records})
    if any(r[2].startswith("FAIL") for r in rows):
        raise SystemExit(1)


def cmd_fuzz(args):
    from hypothesis import HealthCheck, given, settings
    chosen = _chosen(args.variants)
    print(_mode_line(), flush=True)
    limits = fuzz.Limits() if has_gpu() else fuzz.Limits.simulator()
    failures = 0
    for name, bound in chosen:
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
                except KeyboardInterrupt:
                    # Ctrl-C or a time limit's SIGINT: what ran so far is still a result (the example in flight
                    # is not counted)
                    done = fuzz.EXAMPLES[f"{bound.name}/{dtype}/{direction}"]
                    print(f"\n  interrupted: {name} {dtype} {direction} after {done} examples", file=sys.stderr)
                    print(f"examples checked: {sum(fuzz.EXAMPLES.values())}, failing configurations: {failures} "
                          f"(interrupted)")
                    raise SystemExit(130)
    print(f"examples checked: {sum(fuzz.EXAMPLES.values())}, failing configurations: {failures}")
    if failures:
        raise SystemExit(1)


def cmd_compile_report(args):
    from . import compile_report
    rows = compile_report.report(tuple(args.arch.split(",")), gate=args.gate)
    print(compile_report.markdown(rows))
    spills = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    tuned_spills = [r for r in spills if r["tuned"]]
    print(f"\n{len(rows)} kernel builds, {len(spills)} with spills, {len(tuned_spills)} of them in tuned configs")
    if args.json:
        _write_json(args.json, rows)
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
    for k in GPU_PROBLEM:
        s.add_argument(f"--{k}", type=positive_int,
                       help=f"default {GPU_PROBLEM[k]} on a GPU, {SIMULATOR_PROBLEM[k]} in the CUDA simulator")
    s.add_argument("--dtype", choices=("float32", "float16", "bfloat16"))
    s.add_argument("--causal", action="store_true")
    s.add_argument("--backward", action="store_true", help="also check the backward before timing")
    s.add_argument("--reps", type=positive_int, default=20)
    s.add_argument("--no-baselines", action="store_true")
    s.add_argument("--json")
    s.set_defaults(fn=cmd_run)
    s = sub.add_parser("fuzz", help="Hypothesis against the oracle")
    s.add_argument("--variants")
    s.add_argument("--examples", type=positive_int, default=100)
    s.add_argument("--dtype", choices=("float32", "float16", "bfloat16"))
    s.add_argument("--direction", choices=("forward", "backward", "both"), default="both")
    s.add_argument("--derandomize", action="store_true")
    s.set_defaults(fn=cmd_fuzz)
    s = sub.add_parser("compile-report", help="NVRTC build of every CUDA variant, resources per kernel")
    s.add_argument("--arch", default="sm_80,sm_90")
    s.add_argument("--gate", action="store_true", help="the defaults and tuned configs only (the CI gate); "
                   "without it every config of report_configs()")
    s.add_argument("--json")
    s.set_defaults(fn=cmd_compile_report)
    args = p.parse_args(argv)
    try:
        args.fn(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
