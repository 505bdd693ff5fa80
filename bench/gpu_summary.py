"""Summarise a GPU session's $OUT folder (bench/gpu_session.sh) as markdown: device, date, commit,
test results, oracle-checked example counts, sanitizer verdicts, and the benchmark tables."""
import datetime
import json
import os
import re
import sys
from pathlib import Path

out = Path(sys.argv[1])


def read(name):
    p = out / name
    return p.read_text() if p.exists() else ""


lines = [f"# GPU session summary", "",
         f"- date: {datetime.date.today().isoformat()}",
         f"- commit: {os.environ.get('COMMIT', 'unknown')}",
         f"- device: {read('device.txt').strip().splitlines()[1] if read('device.txt') else 'unknown'}",
         f"- software: {read('device.txt').strip().splitlines()[-1] if read('device.txt') else ''}", ""]
log = read("pytest.log")
m = re.findall(r"^=+ (.*(?:passed|failed|error).*) =+$", log, re.M)
lines += ["## Tests", "", f"- pytest: {m[-1] if m else 'not run in this call'}"]
if (out / "fuzz.json").exists():
    fz = json.loads(read("fuzz.json"))
    lines.append(f"- oracle-checked Hypothesis examples: {fz['total']}")
    lines += [f"  - {k}: {n}" for k, n in sorted(fz["by_variant"].items())]
failed = re.findall(r"^FAILED (.*)$", log, re.M)
lines += [f"- FAILED {f}" for f in failed]
lines += ["", "## Sanitizer", "", "```", read("sanitizer.txt").strip(), "```", ""]   # verdict lines
comp = read("compile.md")
lines += ["## Compile report (sm_90)", "", comp.strip().splitlines()[-2] if comp.strip() else "", ""]
table = [l if l.startswith("|") else "\n" + l + "\n" for l in read("bench.md").splitlines()
         if l.startswith("|") or l.startswith("problem:")]
lines += ["## Benchmark (forward, fp16 baselines: PyTorch SDPA)", "", *table, ""]
lines += ["## Exact-tier grid", "", read("grid.md").strip(), ""]
print("\n".join(lines))
