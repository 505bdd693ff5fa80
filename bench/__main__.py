"""python -m bench FAMILY [options] --out DIR | all --out DIR | plot DIR | plan [FAMILY] [--json PATH]
| session --out DIR [--parts tests,sanitize,bench,profile] (see bench/__init__.py, bench/session.py).

A mistake on the command line, a family this machine cannot run (no GPU, no CuPy) or a plot folder
without family JSON is one `error: ...` line on stderr and exit status 2, found before anything runs.
"""
import argparse
import json
import sys
import time
from pathlib import Path

from . import FAMILIES, family, plan, run_family, selection, session
from sandbox.cli import positive_int

from .common import UsageError, missing_for_gpu_families, parse_variant


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in FAMILIES:
        s = sub.add_parser(name, help=(family(name).__doc__ or "").splitlines()[0])
        family(name).add_arguments(s)
        s.add_argument("--reps", type=positive_int, default=10, help="timed repetitions (median reported)")
        s.add_argument("--out", default="out")
    s = sub.add_parser("all", help="every family with its defaults, one after another")
    s.add_argument("--families", default=",".join(FAMILIES))
    s.add_argument("--reps", type=positive_int, default=10)
    s.add_argument("--out", default="out")
    s = sub.add_parser("plot", help="a PNG beside every family JSON in a folder (needs matplotlib)")
    s.add_argument("folder")
    s = sub.add_parser("plan", help="which variants and configurations each family would time (no GPU needed)")
    s.add_argument("family", nargs="?", default=None, help="one family (default: every one)")
    s.add_argument("--json", default=None, help="also write the plan as JSON")
    s = sub.add_parser("session", help="one GPU machine call: GPU tests, sanitizer, benchmark, profile, summary",
                       description=session.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    session.add_arguments(s)
    return ap


def _families(text: str) -> list[str]:
    """--families of `all`: known family names, checked before the first one runs."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError(f"--families {text!r} names no family; families: {', '.join(FAMILIES)}")
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise UsageError(f"unknown family {', '.join(map(repr, unknown))}; families: {', '.join(FAMILIES)}")
    return names


def _check_variant_specs(args) -> None:
    """The variant specs a family takes (grid --variants, dropout --variant) resolve to registered
    variants with valid parameters: a typo is reported here, not after minutes of other work."""
    specs = []
    if getattr(args, "variants", None) is not None:
        specs += args.variants.split(",")
    if getattr(args, "variant", None) is not None:
        specs.append(args.variant)
    for spec in specs:
        try:
            parse_variant(spec)
        except ValueError as e:
            raise UsageError(str(e)) from None


def _require_gpu() -> None:
    """Every table family times CUDA kernels through CuPy: say what is missing before any starts."""
    missing = missing_for_gpu_families()
    if missing:
        raise UsageError(f"the benchmark families time CUDA kernels through CuPy on a CUDA GPU: {missing}")


def _plot(folder: str) -> None:
    from .plots import plot_dir
    try:
        paths = plot_dir(folder)
    except ImportError:
        raise UsageError("plot needs matplotlib (pip install -e .[bench])") from None
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    for p in paths:
        print(p)


def _run_all(names: list[str], out: str, reps: int) -> int:
    """Every family in turn (one's failure does not lose the others), then the PNGs; exit status."""
    failed = []
    for name in names:
        t0 = time.perf_counter()
        print(f"== family {name}", file=sys.stderr, flush=True)
        try:
            run_family(name, out, reps)
        except Exception as e:     # noqa: BLE001 -- one family's failure must not lose the others
            failed.append(name)
            print(f"family {name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        print(f"== family {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    try:
        from .plots import plot_dir
        plot_dir(out)
    except ImportError:
        print("matplotlib not installed: no PNGs here; draw them with `python -m bench plot DIR`", file=sys.stderr)
    except FileNotFoundError as e:
        print(f"no PNGs: {e}", file=sys.stderr)
    return 1 if failed else 0


def _plan(name, json_path) -> None:
    """The plan table (and JSON): every family's variants and configurations, then any CUDA or Numba
    variant no family times."""
    if name is not None and name not in FAMILIES:
        raise UsageError(f"unknown family {name!r}; families: {', '.join(FAMILIES)}")
    rows = plan(name)
    missing = selection.unplanned(plan()) if name is None else []
    if json_path:
        try:
            Path(json_path).write_text(json.dumps({"families": {n: [r for r in rows if r["family"] == n]
                                                                for n in dict.fromkeys(r["family"] for r in rows)},
                                                   "unplanned": missing}, indent=1))
        except OSError as e:
            raise UsageError(f"cannot write --json {json_path}: {e.strerror or e}") from None
    print(selection.table(rows))
    if name is None:
        print(f"\nCUDA and Numba variants no family times: {', '.join(missing) or 'none'}")


def _dispatch(args) -> int:
    if args.cmd == "plot":
        _plot(args.folder)
        return 0
    if args.cmd == "plan":
        _plan(args.family, args.json)
        return 0
    if args.cmd == "session":
        return session.main(args)
    names = _families(args.families) if args.cmd == "all" else [args.cmd]
    _check_variant_specs(args)
    _require_gpu()
    if args.cmd == "all":
        return _run_all(names, args.out, args.reps)
    family(args.cmd).main(args, Path(args.out))
    return 0


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        status = _dispatch(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
