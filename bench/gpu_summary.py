"""Summarise a GPU session's folder (`python -m bench session`) as markdown: a table of the parts,
device, date, commit, test results, oracle-checked example counts, sanitizer verdicts, the
benchmark tables with their ratios to SDPA, and the Nsight Compute profile.

    python -m bench session ...                       # prints this summary last, writes summary.md
    COMMIT=<sha> python bench/gpu_summary.py OUT [OUT2 ...]
Several folders or session archives (session.tgz; a tests call and a bench call of one session) are
merged: each file is read from the first that has it. Folders of the former bench/gpu_session.sh
(tables.md, tc_tables.md, tc.json, bench.json) are read too. Standard library only: it runs where
the session's folder lands, without the sandbox installed.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


class Folders:
    """Files read from the first of several folders that has them."""

    def __init__(self, paths):
        self.dirs = []
        for p in map(Path, paths):
            if p.is_file() and p.name.endswith((".tgz", ".tar.gz")):
                tmp = Path(tempfile.mkdtemp(prefix="session-"))
                with tarfile.open(p) as tar:
                    try:
                        tar.extractall(tmp, filter="data")
                    except TypeError:            # Python without extraction filters
                        tar.extractall(tmp)
                self.dirs.append(tmp)
            else:
                self.dirs.append(p)

    def read(self, name: str) -> str:
        for d in self.dirs:
            if (d / name).is_file():
                return (d / name).read_text(errors="replace")
        return ""

    def glob(self, pattern: str) -> list[Path]:
        seen = {}
        for d in self.dirs:
            for p in sorted(d.glob(pattern)):
                seen.setdefault(p.relative_to(d), p)
        return list(seen.values())


def commit_of() -> str:
    """COMMIT from the environment (a device copy of the tree may carry a stale .git), else git's."""
    commit = os.environ.get("COMMIT")
    if commit:
        return commit
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_lines(f: Folders) -> tuple[str, str]:
    """(device, software): from device.txt (nvidia-smi's CSV header, its row, the versions line), else
    from an earlier summary."""
    text = f.read("device.txt").strip()
    if text:
        lines = text.splitlines()
        return (lines[1] if len(lines) > 2 else lines[0]), lines[-1]
    found = dict(re.findall(r"^- (device|software): (.*)$", f.read("summary.md"), re.M))
    return found.get("device", "unknown"), found.get("software", "")


def pytest_verdict(log: str) -> str | None:
    """pytest -q's last verdict ("90 passed, 1 skipped in 364.40s"), bare or between '=' rules."""
    m = re.findall(r"^=*\s*(\d+ (?:passed|failed|error|skipped|deselected).*?)\s*=*$", log, re.M)
    return m[-1] if m else None


def sanitizer_verdicts(f: Folders) -> list[str]:
    text = f.read("sanitizer.txt") or "\n".join(
        line for line in f.read("sanitizer.log").splitlines() if re.match(r"(memcheck|racecheck) \S+ .*rc=", line))
    return [line for line in text.splitlines() if line.strip()]


NCU_KERNEL = re.compile(r"^\s{0,4}(\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\), Context \d+")
NCU_METRICS = ("Duration", "Memory Throughput", "DRAM Throughput", "Compute (SM) Throughput", "Registers Per Thread",
               "Achieved Occupancy", "Theoretical Occupancy")


def parse_ncu_details(text: str) -> list[dict]:
    """`ncu --page details` text -> one dict per profiled kernel: name and the NCU_METRICS found
    (value with its unit)."""
    kernels, current = [], None
    for line in text.splitlines():
        m = NCU_KERNEL.match(line)
        if m:
            current = {"kernel": m.group(1)}
            kernels.append(current)
            continue
        if current is None:
            continue
        for name in NCU_METRICS:
            m = re.match(rf"^\s+{re.escape(name)}\s+(\S+)\s+([\d.,]+)\s*$", line)
            if m and name not in current:
                current[name] = f"{m.group(2)} {m.group(1)}"
    return kernels


def grid_ratios(rows, gemm=None):
    """Ratios read off the grid: each variant against SDPA's backends (same N, causal and direction),
    the causal speed-up in time, split-Q over split-K. Ratios of fp32 kernels to fp16 baselines say how
    far the exact tier is from the tensor-core one, not a like-for-like contest."""
    rows = rows["rows"] if isinstance(rows, dict) else rows        # a family JSON (bench/common.py) or bare rows
    key = lambda r: (r["variant"], r["N"], r["causal"], r.get("direction", "forward"))  # noqa: E731
    by = {key(r): r for r in rows if r.get("ms")}
    variants = [v for v in dict.fromkeys(r["variant"] for r in rows) if "sdpa" not in v]
    out = ["| variant | direction | causal | N | TFLOP/s | / sdpa-flash | / sdpa-cudnn | / sdpa-math | causal speed-up (time) |"
           + (" % of fp16 GEMM |" if gemm else ""), "|---|---|---|---|---|---|---|---|---|" + ("---|" if gemm else "")]
    for v in variants:
        for (vv, n, c, dr), r in sorted(by.items(), key=lambda kv: (kv[0][3], kv[0][2], kv[0][1])):
            if vv != v:
                continue
            base = {b: by.get((f"sdpa-{b} (fp16)", n, c, dr)) for b in ("flash", "cudnn", "math")}
            ratio = [f"{r['tflops'] / base[b]['tflops']:.3f}" if base[b] else "-" for b in base]
            nc = by.get((v, n, False, dr))
            speed = f"{nc['ms'] / r['ms']:.2f}x" if c and nc else ""
            out.append(f"| {v} | {dr} | {'yes' if c else 'no'} | {n} | {r['tflops']:.2f} | " + " | ".join(ratio)
                       + f" | {speed} |" + (f" {100 * r['tflops'] / gemm:.0f}% |" if gemm else ""))
    return out


def gemm_tflops(text: str) -> float | None:
    m = re.search(r"fp16 GEMM .*?: ([\d.]+) TFLOP/s", text)
    return float(m.group(1)) if m else None


def summarize(paths) -> str:
    f = Folders(paths)
    device, software = device_lines(f)
    parts = f.read("parts.json")
    lines = ["# GPU session summary", "", f"- date: {datetime.date.today().isoformat()}", f"- commit: {commit_of()}",
             f"- device: {device}", f"- software: {software}", ""]
    if parts:
        lines += ["| part | result |", "|---|---|"] + [f"| {p} | {r} |" for p, r in json.loads(parts).items()] + [""]
    log = f.read("pytest.log")
    lines += ["## Tests", "", f"- pytest: {pytest_verdict(log) or 'not run in this call'}"]
    if f.read("fuzz.json"):
        fz = json.loads(f.read("fuzz.json"))
        lines.append(f"- oracle-checked Hypothesis examples: {fz['total']}")
        lines += [f"  - {k}: {n}" for k, n in sorted(fz["by_variant"].items())]
    lines += [f"- FAILED {x}" for x in re.findall(r"^FAILED (.*)$", log, re.M)]
    verdicts = sanitizer_verdicts(f)
    clean = sum(" rc=0 " in v + " " for v in verdicts)
    lines += ["", "## Sanitizer", "", f"{clean} of {len(verdicts)} runs clean" if verdicts else "not run in this call",
              "", "```", *verdicts, "```", ""]
    table = [x if x.startswith("|") else "\n" + x + "\n" for x in f.read("bench.md").splitlines()
             if x.startswith("|") or x.startswith("problem:")]
    if table:
        lines += ["## Benchmark (python -m sandbox run; fp16 baselines: PyTorch SDPA)", "", *table, ""]
    gemm = gemm_tflops(f.read("gemm.txt") or f.read("tc_tables.md"))
    if gemm:
        lines += [f"fp16 GEMM ceiling (cuBLAS via CuPy, 8192^3): {gemm:.1f} TFLOP/s", ""]
    for md in f.glob("families/*.md"):
        lines += [f"## {md.stem}", "", md.read_text().strip(), ""]
    for js in f.glob("families/grid_*.json"):
        fp16 = "float16" in js.stem
        lines += [f"## Ratios ({js.stem})", "", *grid_ratios(json.loads(js.read_text()), gemm if fp16 else None), ""]
    if f.read("tables.md"):                      # bench/gpu_session.sh folders
        lines += ["## Tables (exact-tier grid, softmax)", "", f.read("tables.md").strip(), ""]
    for entry in json.loads(f.read("bench.json") or "[]"):
        if isinstance(entry, dict):
            for name, rows in entry.items():
                if name.startswith("grid"):
                    lines += [f"## Ratios ({name})", "", *grid_ratios(rows), ""]
    if f.read("tc_tables.md"):
        lines += ["## Tensor-core tier (fp16)", "", f.read("tc_tables.md").strip(), ""]
        for entry in json.loads(f.read("tc.json") or "[]"):
            for name, rows in entry.items():
                lines += [f"## Ratios ({name})", "", *grid_ratios(rows, gemm), ""]
    kernels = parse_ncu_details(f.read("profile.txt"))
    if kernels:
        cols = [m for m in NCU_METRICS if any(m in k for k in kernels)]
        lines += [f"## Nsight Compute profile ({f.read('profile_case.txt').strip() or 'one case'})", "",
                  "| kernel | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        lines += ["| " + k["kernel"][:70].replace("|", "/") + " | " + " | ".join(k.get(c, "-") for c in cols) + " |"
                  for k in kernels]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if not args:
        sys.exit("usage: python bench/gpu_summary.py OUT [OUT2 ...]")
    print(summarize(args), end="")


if __name__ == "__main__":
    main()
