"""python -m bench.startup --out DIR: how long the research loop waits on compiles (issue 16, item 5).

Three numbers, each in fresh processes, on a GPU machine:
  run cold    `python -m sandbox run` with an empty module cache (SANDBOX_CACHE_DIR in a new folder)
  run warm    the same command again, the cache now filled by the cold run
  first call  per CUDA variant of the tensor-core ladder: a new process whose cache already holds
              the variant's modules; the seconds from just before its first `sandbox.attention` to
              the synchronised result (module load, first launch, the result), and the import time

Writes DIR/startup.md and DIR/startup.json and prints the table.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIRST_CALL = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np, cupy as cp, sandbox
t1 = time.perf_counter()
name = sys.argv[1]
rng = np.random.default_rng(0)
q, k, v = (cp.asarray(rng.standard_normal((1, 4, 512, 64)).astype(np.float16)) for _ in range(3))
cp.cuda.Device().synchronize()
t2 = time.perf_counter()
out = sandbox.attention(q, k, v, variant=name)
cp.cuda.Device().synchronize()
t3 = time.perf_counter()
out = sandbox.attention(q, k, v, variant=name)
cp.cuda.Device().synchronize()
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "first_call_s": t3 - t2, "second_call_s": t4 - t3}))
"""


def _timed(cmd, env):
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return time.perf_counter() - start, proc


def _ladder() -> list[str]:
    import sandbox
    return [v["name"] for v in sandbox.variants()
            if v["backend"] == "cuda" and "float16" in v["capabilities"].get("dtypes", ("float16",))
            and ({"tc-ladder", "flagship"} & set(v.get("tags", ())))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out")
    ap.add_argument("--run-args", default="", help="extra arguments of `sandbox run` (space separated)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = tempfile.mkdtemp(prefix="sandbox-cache-")
    env = {**os.environ, "SANDBOX_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1"}
    run_cmd = [sys.executable, "-m", "sandbox", "run", *args.run_args.split()]
    rows = {}
    for label in ("run cold", "run warm"):
        seconds, proc = _timed(run_cmd, env)
        (out / f"startup-{label.replace(' ', '-')}.log").write_text(proc.stdout + proc.stderr)
        rows[label] = {"seconds": round(seconds, 2), "rc": proc.returncode}
        print(f"{label}: {seconds:.1f} s (exit {proc.returncode})", flush=True)
    first = {}
    for name in _ladder():
        subprocess.run([sys.executable, "-c", FIRST_CALL, name], capture_output=True, env=env)   # fills the cache
        seconds, proc = _timed([sys.executable, "-c", FIRST_CALL, name], env)
        if proc.returncode != 0:
            first[name] = {"error": proc.stderr.strip().splitlines()[-1:]}
        else:
            first[name] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": round(seconds, 2)}
        print(f"first call {name}: {first[name]}", flush=True)
    result = {"sandbox_run": rows, "first_call": first, "run_cmd": " ".join(run_cmd[1:])}
    (out / "startup.json").write_text(json.dumps(result, indent=1))
    lines = ["| measure | seconds | target |", "|---|---|---|",
             f"| `{' '.join(run_cmd[1:])}`, empty cache | {rows['run cold']['seconds']} | < 60 |",
             f"| same, second run | {rows['run warm']['seconds']} | < 15 |"]
    for name, r in first.items():
        if "error" in r:
            lines.append(f"| first call {name} | error: {r['error']} | < 1 |")
        else:
            lines.append(f"| first call {name} (import {r['import_s']:.2f} s, second call "
                         f"{r['second_call_s'] * 1e3:.1f} ms) | {r['first_call_s']:.3f} | < 1 |")
    (out / "startup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["rc"] == 0 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
