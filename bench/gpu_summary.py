"""Summarise a GPU session's $OUT folder (bench/gpu_session.sh) as markdown: device, date, commit,
test results, oracle-checked example counts, sanitizer verdicts, and the benchmark tables.

    COMMIT=<sha> python bench/gpu_summary.py OUT [OUT2 ...]
Several folders (a tests call and a bench call of one session) are merged: each file is read from
the first folder that has it."""
import datetime
import json
import os
import re
import sys
from pathlib import Path

outs = [Path(a) for a in sys.argv[1:]]
out = outs[0]


def read(name):
    for o in outs:
        if (o / name).exists():
            return (o / name).read_text()
    return ""


def device_lines():
    """(device, software): from device.txt while the session runs, else from an earlier summary."""
    if read("device.txt"):
        lines = read("device.txt").strip().splitlines()
        return lines[1], lines[-1]
    found = dict(re.findall(r"^- (device|software): (.*)$", read("summary.md"), re.M))
    return found.get("device", "unknown"), found.get("software", "")


lines = [f"# GPU session summary", "",
         f"- date: {datetime.date.today().isoformat()}",
         f"- commit: {os.environ.get('COMMIT', 'unknown')}",
         f"- device: {device_lines()[0]}",
         f"- software: {device_lines()[1]}", ""]
log = read("pytest.log")
# pytest -q prints its verdict bare ("90 passed, 1 skipped in 364.40s"), otherwise between "=" rules
m = re.findall(r"^=*\s*(\d+ (?:passed|failed|error).*?)\s*=*$", log, re.M)
lines += ["## Tests", "", f"- pytest: {m[-1] if m else 'not run in this call'}"]
if read("fuzz.json"):
    fz = json.loads(read("fuzz.json"))
    lines.append(f"- oracle-checked Hypothesis examples: {fz['total']}")
    lines += [f"  - {k}: {n}" for k, n in sorted(fz["by_variant"].items())]
failed = re.findall(r"^FAILED (.*)$", log, re.M)
lines += [f"- FAILED {f}" for f in failed]
verdicts = read("sanitizer.txt") or "\n".join(   # one verdict line per tool and variant
    l for l in read("sanitizer.log").splitlines() if re.match(r"(memcheck|racecheck) \S+ (--\w+ )?rc=", l))
lines += ["", "## Sanitizer", "", "```", verdicts.strip(), "```", ""]
table = [l if l.startswith("|") else "\n" + l + "\n" for l in read("bench.md").splitlines()
         if l.startswith("|") or l.startswith("problem:")]
if table:
    lines += ["## Benchmark (forward, fp16 baselines: PyTorch SDPA)", "", *table, ""]
if read("tables.md"):
    lines += ["## Tables (exact-tier grid, softmax)", "", read("tables.md").strip(), ""]
print("\n".join(lines))


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


if read("bench.json"):
    for entry in json.loads(read("bench.json")):
        if isinstance(entry, dict):
            for name, rows in entry.items():
                if not name.startswith("grid"):
                    continue
                print(f"\n## Ratios ({name})\n")
                print("\n".join(grid_ratios(rows)))


if read("tc_tables.md"):       # the tensor-core part (PARTS=tc): its tables, then ratios to SDPA and the GEMM
    tc = read("tc_tables.md")
    m = re.search(r"fp16 GEMM .*?: ([\d.]+) TFLOP/s", tc)
    gemm = float(m.group(1)) if m else None
    print("\n## Tensor-core tier (fp16)\n")
    print(tc.strip())
    for entry in json.loads(read("tc.json") or "[]"):
        for name, rows in entry.items():
            print(f"\n## Ratios ({name})\n")
            print("\n".join(grid_ratios(rows, gemm)))
