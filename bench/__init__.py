"""The benchmark harness: table families that check every variant against the oracle, then time it.

    python -m bench all --out bench/results/h100          # every family, one run
    python -m bench grid --dtype float16 --headdim 128 ... # one family with its options
    python -m bench plot bench/results/h100                # the PNGs, from the JSON

Families (DESIGN.md "Benchmarks"; each module's docstring states its method): grid, variants,
softmax, io, memory, blocksparse, dropout, host (the per-call host cost from PyTorch and speed as a
PyTorch user times it). Each writes <name>.md / .csv / .json (+ .png) stamped
with the device, the commit and the date. Python API: `bench.run_family("blocksparse", out)`.
"""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

FAMILIES = {"grid": "grid", "variants": "variants_table", "softmax": "softmax_bench", "io": "io_bytes",
            "memory": "memory", "blocksparse": "blocksparse", "dropout": "dropout_bench", "host": "host_cost"}


def family(name: str):
    return importlib.import_module(f"bench.{FAMILIES[name]}")


def run_family(name: str, out, reps: int = 10, **options) -> None:
    """Run one family with its defaults, overridden by options (its command-line names, '-' as '_')."""
    mod = family(name)
    ap = argparse.ArgumentParser()
    mod.add_arguments(ap)
    args = ap.parse_args([])
    args.reps = reps
    for k, v in options.items():
        setattr(args, k, v)
    mod.main(args, Path(out))
