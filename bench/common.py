"""What every table family shares: the stamp (device, commit, date), progress lines, variant specs,
and the writer of markdown + CSV + JSON (the PNG comes from bench/plots.py, which reads the JSON).

JSON layout of a family: {"family": ..., "meta": {device, commit, date, ...}, "rows": [...]}.
"""
from __future__ import annotations

import csv
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import sandbox


class UsageError(Exception):
    """A mistake in the command line or a machine that cannot run the request: `python -m bench`
    prints it as one `error: ...` line and exits 2, without a traceback."""


def missing_for_gpu_families() -> str | None:
    """What this machine lacks to run the table families (they time CUDA kernels through CuPy), as
    one sentence with what to do about it, or None when nothing is missing. CuPy is looked up, not
    imported, so the check is cheap and works the same with or without a GPU."""
    from sandbox.device import has_gpu
    missing = []
    if not has_gpu():
        missing.append("no CUDA GPU was found")
    if importlib.util.find_spec("cupy") is None:
        missing.append("CuPy is not installed (pip install -e .[cuda13], or .[cuda12] for a CUDA 12 driver)")
    return "; ".join(missing) or None


def stamp(**extra) -> dict:
    """Device, commit and date of this run (COMMIT in the environment wins over git: the GPU machine
    gets a copy of the tree without .git)."""
    from sandbox.device import cupy_or_none
    cp = cupy_or_none()
    device = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode() if cp else "no GPU"
    commit = os.environ.get("COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {"device": device, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **extra}


def stamp_line(meta: dict) -> str:
    return f"_{meta['device']} · commit {meta['commit']} · {meta['date']}_"


class Progress:
    """`[i/n] label (elapsed)` lines on stderr, for runs that take minutes."""

    def __init__(self, total: int, name: str):
        self.total, self.name, self.i, self.t0 = total, name, 0, time.perf_counter()

    def __call__(self, label: str):
        self.i += 1
        print(f"[{self.name} {self.i}/{self.total} {time.perf_counter() - self.t0:6.1f}s] {label}",
              file=sys.stderr, flush=True)


def parse_variant(spec: str):
    """'NAME:split=k+block_r=16' -> ('NAME split=k block_r=16', the variant bound to those parameters)."""
    from sandbox.registry import parse_spec
    name, params = parse_spec(spec)
    label = name + (" " + " ".join(f"{k}={v}" for k, v in params.items()) if params else "")
    return label, sandbox.get_variant(name, **params)


def csv_of(allowed=None, kind=str, low=None, high=None):
    """argparse type: a comma-separated list of `kind` values, each in `allowed` or [low, high];
    a bad entry is an argparse error naming it, before anything runs on the GPU."""
    import argparse

    def parse(text: str) -> tuple:
        items = []
        for raw in filter(None, (t.strip() for t in text.split(","))):
            try:
                x = kind(raw)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{raw!r} is not a {kind.__name__}") from None
            if allowed is not None and x not in allowed:
                raise argparse.ArgumentTypeError(f"{raw!r} is not one of {', '.join(map(str, allowed))}")
            if (low is not None and x < low) or (high is not None and x > high):
                raise argparse.ArgumentTypeError(f"{raw!r} is outside [{low}, {high}]")
            items.append(x)
        return tuple(items)
    return parse


def write(out: Path, stem: str, family: str, meta: dict, rows: list, markdown: str, keys=None) -> None:
    """stem.json (meta + rows), stem.csv (rows, `keys` columns or all), stem.md (stamp + markdown)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"family": family, "meta": meta, "rows": rows}, indent=1))
    keys = keys or list(dict.fromkeys(k for r in rows for k in r))
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / f"{stem}.md").write_text(f"{markdown}\n\n{stamp_line(meta)}\n")
    print(markdown, flush=True)


def load(path) -> dict:
    """A family's JSON; the older list-of-rows files (before the stamp) are wrapped."""
    data = json.loads(Path(path).read_text())
    return data if isinstance(data, dict) else {"family": Path(path).stem, "meta": {}, "rows": data}
