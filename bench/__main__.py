"""python -m bench FAMILY [options] --out DIR | all --out DIR | plot DIR (see bench/__init__.py)."""
import argparse
import sys
import time
from pathlib import Path

from . import FAMILIES, family, run_family


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in FAMILIES:
        s = sub.add_parser(name, help=(family(name).__doc__ or "").splitlines()[0])
        family(name).add_arguments(s)
        s.add_argument("--reps", type=int, default=10, help="timed repetitions (median reported)")
        s.add_argument("--out", default="out")
    s = sub.add_parser("all", help="every family with its defaults, one after another")
    s.add_argument("--families", default=",".join(FAMILIES))
    s.add_argument("--reps", type=int, default=10)
    s.add_argument("--out", default="out")
    s = sub.add_parser("plot", help="a PNG beside every family JSON in a folder (needs matplotlib)")
    s.add_argument("folder")
    args = ap.parse_args(argv)
    if args.cmd == "plot":
        from .plots import plot_dir
        for p in plot_dir(args.folder):
            print(p)
        return
    if args.cmd == "all":
        failed = []
        for name in args.families.split(","):
            t0 = time.perf_counter()
            print(f"== family {name}", file=sys.stderr, flush=True)
            try:
                run_family(name, args.out, args.reps)
            except Exception as e:     # noqa: BLE001 -- one family's failure must not lose the others
                failed.append(name)
                print(f"family {name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            print(f"== family {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        try:
            from .plots import plot_dir
            plot_dir(args.out)
        except ImportError:
            print("matplotlib not installed: no PNGs here; draw them with `python -m bench plot DIR`", file=sys.stderr)
        sys.exit(1 if failed else 0)
    family(args.cmd).main(args, Path(args.out))


if __name__ == "__main__":
    main()
