"""`python -m bench session --out DIR`: everything a GPU machine is borrowed for, in one call.

Parts (--parts, default all four; tests and sanitize run side by side, then bench, then profile):
  tests     `pytest -m gpu tests` (pytest-xdist workers when installed, else one process; Hypothesis
            profile gpu with --examples examples per fuzz test, each fuzz pair in --shards shards):
            pytest.log, fuzz.json (the oracle-checked example counts of every worker, added up)
  sanitize  compute-sanitizer memcheck and racecheck on one small case (B = 1, H = 2, N = 70, causal;
            N = max_query_rows for a variant with fewer, e.g. a decoding kernel)
            per configuration of every CUDA variant: its defaults at d = 40, forward + backward where it
            has one, and at d = 128 with the backward; its bench_configs (forward ones forward, bwd_*
            ones with the backward, at the same head dims; --sanitize-configs defaults leaves them out),
            --sanitize-jobs processes at once: sanitizer.txt (a verdict per run), sanitizer.log
  bench     the benchmark families of --families (default run, grid, softmax, dropout; "run" is
            `python -m sandbox run`, non-causal and causal; "grid" runs once per --grid dtype:headdim,
            default float32:64 and float16:64, each its tier's ladder from the registry, in
            --grid-directions, default forward: add backward for the backward rungs; the fp16 GEMM
            ceiling beside an fp16 run): families/ (each family's md, csv, json), bench.md, bench.log;
            `python -m bench plan` shows what each family times
  profile   Nsight Compute (SpeedOfLight, memory workload, launch, occupancy sections) on one warm
            forward + backward of --profile (default: the flagship tensor-core variant of the registry)
            on the FA2 grid's shape: profile.ncu-rep, profile.txt (`ncu --page details`)
A part whose tool is missing (no compute-sanitizer, no ncu) is one line: an error when --parts names
it, a skipped part otherwise; without a CUDA GPU and CuPy the session is one `error:` line, exit 2.
Output: DIR/summary.md (bench/gpu_summary.py) and DIR/session.tgz holding every log and table (the
device tool returns at most 8 files; --no-archive keeps the folder DIR/session instead); the
summary is printed last. Exit status 1 when a part failed (a test, a sanitizer run, a family, the
profile). --time-limit S stops starting work S - 30 seconds after the start, so that the summary and
the archive are written inside a device call's limit; --dry-run prints the commands and runs none.

    COMMIT=<sha> python -m bench session --out out --time-limit 570
    COMMIT=<sha> python -m bench session --out out --parts bench --families grid --grid float16:64,float16:128
"""
from __future__ import annotations

import concurrent.futures
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from sandbox.registry import all_variants, parse_spec

from . import FAMILIES, selection
from .common import UsageError, missing_for_gpu_families, parse_variant

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("tests", "sanitize", "bench", "profile")
TOOLS = {"sanitize": ("compute-sanitizer", "compute-sanitizer (CUDA toolkit)"), "profile": ("ncu", "ncu (Nsight Compute)")}
DEFAULT_FAMILIES = ("run", "grid", "softmax", "dropout")
SANITIZE_CASE = ["--batch", "1", "--heads", "2", "--seqlen", "70", "--reps", "1", "--no-baselines", "--causal"]
NCU_SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "LaunchStats", "Occupancy")
INTERRUPT_GRACE_S = 20  # between SIGINT and SIGKILL at the time limit
MARGIN_S = 30          # left for the summary and the archive under --time-limit


def sanitize_case(spec: str) -> list[str]:
    """SANITIZE_CASE for one variant: N = 70, or the variant's max_query_rows where that is fewer
    (`sandbox run` uses N query rows and N keys; a decoding kernel refuses more rows)."""
    rows = all_variants()[parse_spec(spec)[0]].caps.max_query_rows
    at = SANITIZE_CASE.index("--seqlen") + 1
    n = int(SANITIZE_CASE[at]) if rows is None else min(int(SANITIZE_CASE[at]), rows)
    return SANITIZE_CASE[:at] + [str(n)] + SANITIZE_CASE[at + 1:]


def add_arguments(ap):
    ap.add_argument("--out", default="out", help="folder for summary.md and session.tgz")
    ap.add_argument("--parts", default=None, help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    ap.add_argument("--families", default=",".join(DEFAULT_FAMILIES),
                    help="the bench part's families: run (python -m sandbox run) and " + ", ".join(FAMILIES))
    ap.add_argument("--grid", default="float32:64,float16:64",
                    help="dtype:headdim runs of the grid family (each times its tier's ladder)")
    ap.add_argument("--grid-directions", default="forward", help="--directions of the grid runs")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions of the families")
    ap.add_argument("--examples", type=int, default=int(os.environ.get("GPU_EXAMPLES", "150")),
                    help="Hypothesis examples per fuzz test (GPU_EXAMPLES)")
    ap.add_argument("--shards", type=int, default=int(os.environ.get("GPU_SHARDS", "1")),
                    help="independent tests per fuzz pair (GPU_SHARDS)")
    ap.add_argument("--workers", type=int, default=int(os.environ.get("WORKERS", "8")), help="pytest-xdist workers (WORKERS)")
    ap.add_argument("--pytest-k", default=os.environ.get("PYTEST_K"), help="pytest -k expression (PYTEST_K)")
    ap.add_argument("--sanitize-jobs", type=int, default=6, help="sanitizer processes at once")
    ap.add_argument("--sanitize-configs", choices=("all", "defaults"), default="all",
                    help="sanitize each CUDA variant's bench_configs too (all) or its defaults only")
    ap.add_argument("--profile", default=None, help="variant spec to profile (default: the registry's flagship "
                                                    "tensor-core variant)")
    ap.add_argument("--profile-n", type=int, default=4096)
    ap.add_argument("--profile-d", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=0.0, help="seconds for the whole call (0: none)")
    ap.add_argument("--no-archive", action="store_true", help="keep DIR/session/ instead of DIR/session.tgz")
    ap.add_argument("--dry-run", action="store_true", help="print the commands of each part, run nothing")


# ---- the request, checked before anything runs

def _csv(text: str) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def grid_runs(text: str) -> list[tuple[str, int]]:
    runs = []
    for item in _csv(text):
        dtype, _, d = item.partition(":")
        if dtype not in ("float32", "float16") or not d.isdigit() or int(d) < 1:
            raise UsageError(f"--grid {item!r}: expected dtype:headdim with dtype float32 or float16")
        runs.append((dtype, int(d)))
    return runs


def default_profile_spec() -> str | None:
    """The flagship CUDA variant with a tensor-core dtype and a backward; failing that any CUDA one."""
    for kw in ({"tag": "flagship", "backward": True}, {"tag": "flagship"}, {}):
        chosen = [v for v in selection.select(backend="cuda", **kw) if selection.tensor_core_dtypes(v)]
        if chosen:
            return selection.spec(chosen[0].name)
    chosen = selection.select(backend="cuda")
    return selection.spec(chosen[0].name) if chosen else None


def check_request(args) -> tuple[list[str], dict]:
    """(parts to run, {part: why it is skipped}); UsageError for a mistake or a machine that cannot run."""
    parts = _csv(args.parts) if args.parts is not None else list(PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise UsageError(f"--parts {args.parts!r}: parts are {', '.join(PARTS)}")
    families = _csv(args.families)
    bad = [f for f in families if f != "run" and f not in FAMILIES]
    if "bench" in parts and (bad or not families):
        raise UsageError(f"--families {args.families!r}: families are run, {', '.join(FAMILIES)}")
    grid_runs(args.grid)
    for dr in _csv(args.grid_directions):
        if dr not in selection.DIRECTIONS:
            raise UsageError(f"--grid-directions {dr!r}: directions are {', '.join(selection.DIRECTIONS)}")
    for name in ("reps", "examples", "shards", "workers", "sanitize_jobs", "profile_n", "profile_d"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if "profile" in parts:
        spec = args.profile or default_profile_spec()
        if spec is None:
            raise UsageError("no CUDA variant is registered to profile")
        try:
            parse_variant(spec)
        except ValueError as e:
            raise UsageError(f"--profile: {e}") from None
    if args.dry_run:
        return parts, {}
    missing = missing_for_gpu_families()
    if missing:
        raise UsageError(f"the session runs the GPU tests, the sanitizer, the benchmark and the profiler on a CUDA GPU: "
                         f"{missing}")
    skipped = {}
    for part in parts:
        if part in TOOLS and shutil.which(TOOLS[part][0]) is None:
            why = f"{TOOLS[part][1]} is not on PATH"
            if args.parts is not None:
                raise UsageError(f"part {part} needs {why}")
            skipped[part] = f"skipped: {why}"
    return [p for p in parts if p not in skipped], skipped


# ---- running things

class Session:
    def __init__(self, args, stage: Path):
        self.args, self.stage = args, stage
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.time_limit - MARGIN_S if args.time_limit > 0 else None
        self.results: dict[str, str] = {}
        self.failed = False
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def out_of_time(self) -> bool:
        return self.deadline is not None and self.left() <= 0

    def step(self, text: str):
        print(f"== {text} ({time.monotonic() - self.t0:.0f} s)", file=sys.stderr, flush=True)

    def run(self, cmd, log: Path, env=None, append=False) -> int:
        """Run cmd (its own process group) with stdout and stderr to log; at the time limit its group
        gets SIGINT and INTERRUPT_GRACE_S to finish (pytest then prints its failures and summary so
        far), then SIGKILL: status 124."""
        if self.args.dry_run:
            print(" ".join(map(str, cmd)))
            return 0
        left = self.left()
        if left is not None and left <= 0:
            return 124
        with open(log, "a" if append else "w") as f:
            f.write(f"$ {' '.join(map(str, cmd))}\n")
            f.flush()
            proc = subprocess.Popen(list(map(str, cmd)), cwd=ROOT, env=env or self.env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                return proc.wait(timeout=None if left is None else max(1.0, left - INTERRUPT_GRACE_S))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=INTERRUPT_GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                f.write("\n(stopped: the session's time limit)\n")
                return 124


def device_info(s: Session):
    lines = []
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm", "--format=csv"],
                           capture_output=True, text=True)
        lines += r.stdout.strip().splitlines()[:2]
    if not lines:
        from sandbox.device import device_name
        lines = ["name", device_name()]
    versions = []
    for mod in ("cupy", "numba", "numpy", "torch"):
        if importlib.util.find_spec(mod) is not None:
            try:
                versions.append(f"{mod} {__import__(mod).__version__}")
            except Exception:        # noqa: BLE001 -- a broken install is reported, not fatal
                versions.append(f"{mod} (import failed)")
    (s.stage / "device.txt").write_text("\n".join(lines + [", ".join(versions)]) + "\n")


def tests_command(args) -> tuple[list[str], dict]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-p", "xdist", "-n", str(args.workers)]
    cmd += ["-m", "gpu", "--durations=15", "tests"] + (["-k", args.pytest_k] if args.pytest_k else [])
    # third-party pytest plugins on GPU images can break `import torch` inside pytest: load none.
    # One BLAS thread per worker: the workers already fill the cores (the oracle's matmuls are small).
    env = {"HYPOTHESIS_PROFILE": "gpu", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "GPU_EXAMPLES": str(args.examples),
           "GPU_SHARDS": str(args.shards), "FUZZ_REPORT": "/tmp/bench-session-fuzz/fuzz.json",
           **({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
              if importlib.util.find_spec("xdist") is not None else {})}
    return cmd, env


def prebuild_defaults(s: Session):
    """Every module of every CUDA variant's default config into the disk cache, one NVRTC program per
    core, before the pytest workers start: otherwise each worker compiles the same modules at once
    on its first examples (the cache is shared, but nobody has written it yet)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-c", "import sandbox.cli as c, sandbox.registry as r; "
           "c._prebuild([v.bind() for v in r.all_variants().values() if v.backend == 'cuda'])"]
    rc = s.run(cmd, s.stage / "prebuild.log")
    print(f"prebuild of the default configs' modules: rc {rc}, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def run_tests(s: Session):
    s.step(f"GPU test suite: pytest -m gpu ({s.args.examples} examples per fuzz test)")
    cmd, extra = tests_command(s.args)
    if not s.args.dry_run:
        shutil.rmtree("/tmp/bench-session-fuzz", ignore_errors=True)
        os.makedirs("/tmp/bench-session-fuzz")
    log = s.stage / "pytest.log"
    if s.args.dry_run:
        print(" ".join(f"{k}={v}" for k, v in extra.items()), end=" ")
    else:
        prebuild_defaults(s)
    rc = s.run(cmd, log, env={**s.env, **extra})
    if s.args.dry_run:
        return
    with open(log, "a") as f:
        f.write(f"pytest rc={rc}\n")
    counts, feats = {}, {}
    for part in glob.glob("/tmp/bench-session-fuzz/fuzz.json.*"):
        if part.endswith(".tmp"):
            continue
        report = json.load(open(part))
        for key, n in report["by_variant"].items():
            counts[key] = counts.get(key, 0) + n
        for key, n in report.get("by_feature", {}).items():
            feats[key] = feats.get(key, 0) + n
    (s.stage / "fuzz.json").write_text(json.dumps({"total": sum(counts.values()), "by_variant": counts,
                                                   "by_feature": dict(sorted(feats.items()))}, indent=1))
    from .gpu_summary import pytest_verdict
    verdict = pytest_verdict(log.read_text(errors="replace")) or "no verdict"
    s.results["tests"] = f"{verdict} (rc {rc}); {sum(counts.values())} oracle-checked examples"
    s.failed |= rc != 0
    print("\n".join(log.read_text(errors="replace").splitlines()[-25:]), file=sys.stderr, flush=True)


def sanitizer_cases(configs: str = "all") -> list[tuple[str, int, bool]]:
    """(spec, head dim, with backward) of every CUDA variant's defaults and (configs "all") its bench
    configs: at d = 40 (or its smallest head dim) and, with a backward, d = 128."""
    cases = []
    for v in selection.select(backend="cuda"):
        small = 40 if 40 in v.caps.head_dims else min(v.caps.head_dims)
        dims = [small] + ([128] if 128 in v.caps.head_dims and small != 128 else [])
        extra = v.bench_configs if configs == "all" else ()
        fwd_cfgs = [c for c in extra if not selection.is_backward_config(c)]
        bwd_cfgs = [c for c in extra if any(k.startswith("bwd_") for k in c)] if v.caps.backward else []
        cases.append((selection.spec(v.name), dims[0], v.caps.backward))
        cases += [(selection.spec(v.name, c), dims[0], False) for c in fwd_cfgs]
        for d in dims[1:] if v.caps.backward else []:
            cases.append((selection.spec(v.name), d, True))
        cases += [(selection.spec(v.name, c), d, True) for d in dims if v.caps.backward for c in bwd_cfgs]
    return list(dict.fromkeys(cases))


def run_sanitizer(s: Session):
    cases = sanitizer_cases(s.args.sanitize_configs)
    s.step(f"compute-sanitizer memcheck + racecheck: {len(cases)} cases, {s.args.sanitize_jobs} processes at once")
    logs = s.stage / "sanitizer"
    if not s.args.dry_run:
        logs.mkdir(exist_ok=True)

    def one(i, tool, spec, d, backward):
        log = logs / f"{i:02d}-{tool}.log"
        cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "9", sys.executable, "-m", "sandbox", "run",
               "--variants", spec, "--headdim", str(d), *sanitize_case(spec)] + (["--backward"] if backward else [])
        rc = s.run(cmd, log)
        text = "" if s.args.dry_run else log.read_text(errors="replace")
        m = re.search(r"(ERROR SUMMARY|RACECHECK SUMMARY).*", text)
        return f"{tool} {spec} d={d} {'backward' if backward else 'forward'} rc={rc} {m.group(0) if m else ''}".rstrip()
    jobs = [(i, tool, *case) for i, case in enumerate(cases) for tool in ("memcheck", "racecheck")]
    workers = 1 if s.args.dry_run else s.args.sanitize_jobs
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        verdicts = list(pool.map(lambda j: one(*j), jobs))
    if s.args.dry_run:
        return
    (s.stage / "sanitizer.txt").write_text("\n".join(verdicts) + "\n")
    with open(s.stage / "sanitizer.log", "w") as f:
        for p in sorted(logs.glob("*.log")):
            f.write(f"### {p.name}\n{p.read_text(errors='replace')}\n")
    shutil.rmtree(logs)
    bad = [v for v in verdicts if " rc=0" not in v]
    s.results["sanitize"] = f"{len(verdicts) - len(bad)} of {len(verdicts)} runs clean" + (
        "; not clean: " + "; ".join(v.split(" rc=")[0] for v in bad[:6]) if bad else "")
    s.failed |= bool(bad)
    print("\n".join(verdicts), file=sys.stderr, flush=True)


def _last_error(s: Session, fam: str) -> str:
    """': <the last error line>' of a failed family's log, for the summary's parts table."""
    if s.args.dry_run:
        return ""
    log = s.stage / ("bench.md" if fam == "run" else "bench.log")
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()] if log.exists() else []
    errors = [x for x in lines if re.match(r"(error|\w*Error|family \w+ failed)\b", x)]
    return f": {(errors or lines or [''])[-1][:120]}".replace("|", "/") if lines else ""


def run_bench(s: Session):
    a, fam_dir, log = s.args, s.stage / "families", s.stage / "bench.log"
    py, status = sys.executable, {}
    for fam in _csv(a.families):
        if s.out_of_time():
            status[fam] = "not run (time limit)"
            continue
        s.step(f"bench {fam}")
        t0 = time.monotonic()
        if fam == "run":
            rcs = []
            for extra, js in (([], "run.json"), (["--causal"], "run_causal.json")):
                rcs.append(s.run([py, "-m", "sandbox", "run", "--json", s.stage / js, *extra], s.stage / "bench.md",
                                 append=bool(extra)))
            rc = max(rcs)
        elif fam == "grid":
            rcs = []
            if any(dt == "float16" for dt, _ in grid_runs(a.grid)):
                code = ("from sandbox import baselines; from sandbox.timing import time_fn, tflops\n"
                        "fn, flops = baselines.gemm_fp16(8192); t = time_fn(fn, reps=20)\n"
                        "print(f'fp16 GEMM (cuBLAS via CuPy, 8192^3): {tflops(flops, t.median_ms):.1f} TFLOP/s')")
                s.run([py, "-c", code], s.stage / "gemm.txt")
            for dtype, d in grid_runs(a.grid):
                rcs.append(s.run([py, "-m", "bench", "grid", "--dtype", dtype, "--headdim", d, "--directions",
                                  a.grid_directions, "--reps", a.reps, "--out", fam_dir], log, append=True))
            rc = max(rcs)
        else:
            rc = s.run([py, "-m", "bench", fam, "--reps", a.reps, "--out", fam_dir], log, append=True)
        status[fam] = "ok" if rc == 0 else "timed out" if rc == 124 else f"failed (rc {rc}{_last_error(s, fam)})"
        s.failed |= rc != 0
        print(f"   {fam}: {status[fam]}, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    if (Path("/tmp/io_ncu_raw.txt")).exists() and "io" in status:
        shutil.copy("/tmp/io_ncu_raw.txt", fam_dir / "io_ncu_raw.txt")
    s.results["bench"] = "; ".join(f"{k} {v}" for k, v in status.items())


def profile_command(s: Session) -> tuple[list, list, str]:
    a = s.args
    spec = a.profile or default_profile_spec()
    rep = s.stage / "profile"
    sections = [x for sec in NCU_SECTIONS for x in ("--section", sec)]
    cmd = ["ncu", "--profile-from-start", "off", *sections, "-o", rep, "--force-overwrite", sys.executable, "-m",
           "bench.session", "--profile-target", spec, str(a.profile_n), str(a.profile_d)]
    show = ["ncu", "--import", f"{rep}.ncu-rep", "--page", "details"]
    return cmd, show, spec


def run_profile(s: Session):
    cmd, show, spec = profile_command(s)
    s.step(f"Nsight Compute: {spec}, N = {s.args.profile_n}, d = {s.args.profile_d}")
    log = s.stage / "profile.log"
    rc = s.run(cmd, log)
    if rc == 0:
        rc = s.run(show, s.stage / "profile.txt")
    if s.args.dry_run:
        return
    (s.stage / "profile_case.txt").write_text(f"{spec}, N = {s.args.profile_n}, d = {s.args.profile_d}\n")
    from .gpu_summary import parse_ncu_details
    kernels = parse_ncu_details((s.stage / "profile.txt").read_text(errors="replace")) if rc == 0 else []
    if rc == 0 and kernels:
        s.results["profile"] = f"{len(kernels)} kernels profiled ({spec})"
    else:
        text = log.read_text(errors="replace") if log.exists() else ""
        why = [x.strip() for x in text.splitlines() if "ERR" in x or "rror" in x] or ["no kernel in the report"]
        s.results["profile"] = f"failed (rc {rc}: {why[-1][:120]})".replace("|", "/")
    s.failed |= rc != 0 or not kernels


def profile_target(spec: str, n: int, d: int) -> None:
    """Inside ncu: the case once untimed (compiles the kernels), then once between
    cudaProfilerStart and Stop: the warm forward (+ backward) is what ncu profiles."""
    import cupy as cp
    import numpy as np
    import sandbox
    _, bound = parse_variant(spec)
    dtype = bound.variant.caps.dtypes[0]
    B, H = max(1, 16384 // n), max(1, 2048 // d)        # the FA2 paper's grid: 16k tokens, hidden 2048
    rng = np.random.default_rng(0)
    q, k, v, do = (cp.asarray(rng.standard_normal((B, H, n, d)).astype(np.float32)).astype(dtype) for _ in range(4))

    def case():
        res = sandbox.forward(q, k, v, variant=bound)
        if bound.variant.caps.backward:
            sandbox.backward(do, res)
    case()
    cp.cuda.Device().synchronize()
    cp.cuda.runtime.profilerStart()
    case()
    cp.cuda.Device().synchronize()
    cp.cuda.runtime.profilerStop()
    print("profiled", spec, B, H, n, d, dtype)


def main(args) -> int:
    parts, skipped = check_request(args)
    out = Path(args.out)
    stage = out / "session"
    if not args.dry_run:
        if stage.exists():
            shutil.rmtree(stage)
        (stage / "families").mkdir(parents=True)
    s = Session(args, stage)
    for part, why in skipped.items():
        print(f"session: part {part} {why}", file=sys.stderr, flush=True)
        s.results[part] = why
    if not args.dry_run:
        s.step("device")
        device_info(s)
    sanitizer = None
    with concurrent.futures.ThreadPoolExecutor(1) as background:
        if "sanitize" in parts and "tests" in parts and not args.dry_run:
            sanitizer = background.submit(run_sanitizer, s)     # beside the tests, as CPU-bound as they are
        elif "sanitize" in parts:
            run_sanitizer(s)
        if "tests" in parts:
            run_tests(s)
        if sanitizer is not None:
            sanitizer.result()
    for part, fn in (("bench", run_bench), ("profile", run_profile)):
        if part in parts:
            if s.out_of_time():
                s.results[part] = "not run (time limit)"
                continue
            fn(s)
    if args.dry_run:
        return 0
    for part in parts:
        s.results.setdefault(part, "not run (time limit)" if s.out_of_time() else "done")
    s.results = {p: s.results[p] for p in PARTS if p in s.results}
    (stage / "parts.json").write_text(json.dumps(s.results, indent=1))
    from .gpu_summary import summarize
    summary = summarize([stage])
    (out / "summary.md").write_text(summary)
    if not args.no_archive:
        with tarfile.open(out / "session.tgz", "w:gz") as tar:
            tar.add(stage, arcname=".")
        shutil.rmtree(stage)
    print(f"session: {'summary.md and session.tgz' if not args.no_archive else 'summary.md and session/'} in {out}",
          file=sys.stderr, flush=True)
    print(summary, end="", flush=True)
    return 1 if s.failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--profile-target":
        profile_target(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit("run through `python -m bench session`")
