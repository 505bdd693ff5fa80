"""The benchmark harness: table families that check every variant against the oracle, then time it.

    python -m bench all --out bench/results/h100          # every family, one run
    python -m bench grid --dtype float16 --headdim 128 ... # one family with its options
    python -m bench plot bench/results/h100                # the PNGs, from the JSON
    python -m bench plan [FAMILY] [--json PATH]            # what each family would time (no GPU needed)
    python -m bench session --out DIR                      # a GPU machine's call: tests, sanitizer,
                                                           # benchmark, profile, summary (bench/session.py)

Families (DESIGN.md "Benchmarks"; each module's docstring states its method): grid, variants,
softmax, io, memory, blocksparse, dropout, host (the per-call host cost from PyTorch and speed as a
PyTorch user times it), modifiers (score / mask modifiers over plain causal, beside FlexAttention).
Each writes <name>.md / .csv / .json (+ .png) stamped with the device, the commit and the date. Python API: `bench.run_family("blocksparse", out)`.
The variants and configurations each family times come from the registry (tags, capabilities,
bench_configs, bench_sweep: sandbox/registry.py; bench/selection.py); `bench.plan()` lists them.
"""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

FAMILIES = {"grid": "grid", "variants": "variants_table", "softmax": "softmax_bench", "io": "io_bytes",
            "memory": "memory", "blocksparse": "blocksparse", "dropout": "dropout_bench", "host": "host_cost",
            "decode": "decode_bench",
            "modifiers": "modifiers_bench", "varlen": "varlen_bench"}


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


def plan(name: str | None = None) -> list[dict]:
    """What each family (or one) would time: rows of bench/selection.py's PLAN_KEYS, from the registry."""
    return [r for n in ([name] if name else FAMILIES) for r in family(n).plan()]
