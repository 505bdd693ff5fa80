"""Family `io`: HBM bytes read and written per variant, measured with Nsight Compute, against an
analytic IO model of each algorithm (FA1 paper Sec. 3.2, Theorem 2: materialised attention moves
Theta(N d + N^2) elements, FlashAttention Theta(N^2 d^2 / M)).

Variants: every registered variant tagged io:<model> (bench/selection.py), in each of its dtypes
among fp32 and fp16, forward and (with a backward) forward + backward; the model is the tag's
(materialised: S and P in HBM; kv-outer: FA1's loop order, O, l, m through HBM; q-outer: FA2's),
with the tile sizes of the variant's own default config (tiles_of: Br, Bc, the backward's Bc).

Measurement: one `ncu` process runs every case (`--profile-from-start off`, metrics
`dram__bytes_read.sum` and `dram__bytes_write.sum`, `--clock-control none`, base units). Each case is
run once unprofiled (compile, allocation), then inside cudaProfilerStart/Stop: a marker kernel,
then the case. The marker kernels cut ncu's per-kernel rows into cases; every other kernel of a
case (GEMMs, softmax passes, preprocessing, zero fills) counts. Before the profile, each variant
is checked against the oracle on a small problem (sandbox.fuzz.check_case). Times of the paper's
setting come from sandbox.timing.time_fn (CUDA events, L2 flushed, median) in the driver process.

Cases: the FA1 paper's Figure 2 setting (GPT-2 medium: B = 64, H = 16, N = 1024, d = 64; forward and
forward + backward; the paper, on an A100 in fp16: Standard attention 40.3 GB and 41.7 ms, FlashAttention
4.4 GB and 7.3 ms, forward + backward) and a sweep over N (B = 4, H = 16, d = 64, forward).

The model counts each kernel's global loads and stores as the algorithm is written (no cache):
the H100's 50 MB L2 serves repeated K/V tile reads, so measured DRAM bytes can fall below the
model for the tiled kernels; the table shows both, and the compulsory traffic (each input read
once, each output written once).

    python -m bench io [--sweep 512,1024,2048,4096,8192]
"""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
from math import ceil
from pathlib import Path

from sandbox.registry import IO_MODELS

from . import selection
from .common import Progress, UsageError, csv_of, stamp, write
from .harness import oracle_check

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
MARKER = "io_case_marker"
GPT2 = dict(B=64, H=16, N=1024, d=64)
SWEEP_BH = dict(B=4, H=16, d=64)
# PyTorch's SDPA backends profiled beside the variants: (name, model, directions), fp16
SDPA = (("sdpa-flash", None, ("forward", "both")), ("sdpa-math", "materialised", ("forward", "both")))
DTYPES = ("float32", "float16")
RAW = Path("/tmp/io_ncu_raw.txt")


def profiled() -> list[tuple[str, str, str, tuple]]:
    """(variant, model, dtype, directions) of every io-tagged variant in each of its DTYPES."""
    out = []
    for v in selection.select(where=lambda v: selection.io_model(v) is not None, head_dim=GPT2["d"]):
        directions = ("forward", "both") if v.caps.backward else ("forward",)
        out += [(v.name, selection.io_model(v), dt, directions) for dt in DTYPES if dt in v.caps.dtypes]
    return out


def tiles_of(bound, d: int) -> tuple[int, int, int] | None:
    """(Br, Bc, backward Bc) of the variant's kernels at head dim d, read from its own config: Br
    `block_r`; Bc `bc(D)` where the config resolves it per head dim (auto) else `block_c`; the
    backward's Bc from `bwd_tile(D)` or `bwd_tiles(D)` (the forward's Bc without either). D is d
    padded to the 64 or 128 every kernel is built for; a per-device rule (`for_head_dim`) is resolved.
    None for a config without tiles (materialised attention)."""
    cfg, D = bound.config, 64 if d <= 64 else 128
    if hasattr(cfg, "for_head_dim"):
        cfg = cfg.for_head_dim(D)
    if not hasattr(cfg, "block_r"):
        return None
    bc = cfg.bc(D) if callable(getattr(cfg, "bc", None)) else cfg.block_c
    if hasattr(cfg, "bwd_tile"):
        bwd_bc = cfg.bwd_tile(D)[1]
    elif hasattr(cfg, "bwd_tiles"):
        bwd_bc = cfg.bwd_tiles(D)[1]
    else:
        bwd_bc = bc
    return cfg.block_r, bc, bwd_bc


# ---- the analytic model (bytes for one (batch, head); e = element size, 4 = fp32 statistics)

def model_bytes(model: str | None, direction: str, N: int, d: int, e: int, tiles=None) -> float | None:
    """HBM bytes of one head as the algorithm is written, no cache; `tiles` = (Br, Bc, backward Bc)
    of the tiled models (tiles_of). None where no model is kept (model None)."""
    Nd, NN = N * d, N * N
    fwd = bwd = None
    if model is not None and model not in IO_MODELS:
        raise ValueError(f"no byte model {model!r}; models: {', '.join(IO_MODELS)}")
    if model in ("kv-outer", "q-outer") and tiles is None:
        raise ValueError(f"the {model} model needs the variant's tiles (Br, Bc, backward Bc)")
    if model == "materialised":
        # S = QK^T (read Q, K; write S); P = softmax(S) in place (read, write; lse); O = PV (read P, V; write O)
        fwd = e * (2 * Nd + NN) + e * 2 * NN + 4 * N + e * (NN + Nd + Nd)
        # S again; P; dV = P^T dO; dP = dO V^T; D = rowsum(dO o O); dS in place of dP (reads S, dP);
        # dQ = dS K; dK = dS^T Q
        bwd = (e * (2 * Nd + NN) + e * 2 * NN + 4 * N + e * (NN + 2 * Nd) + e * (2 * Nd + NN)
               + e * 2 * Nd + 4 * N + e * 3 * NN + 4 * N + e * (NN + 2 * Nd) + e * (NN + 2 * Nd))
    elif model == "kv-outer":
        br, bc, bwd_bc = tiles
        tc, tcb = ceil(N / bc), ceil(N / bwd_bc)
        # K, V once; per K/V tile every Q row: read Q, O, m, l, write O, m, l (Algorithm 1, lines 8-13)
        fwd = e * 2 * Nd + tc * (e * 3 * Nd + 4 * 4 * N) + 4 * N
        # D = rowsum(dO o O) first; Algorithm 4: K, V read and dK, dV written once; per K/V tile:
        # read Q, dO, dQ, lse, D and write dQ
        bwd = e * 2 * Nd + 4 * N + e * 4 * Nd + tcb * (e * 4 * Nd + 8 * N)
    elif model == "q-outer":
        br, bc, bwd_bc = tiles
        tr, tcb = ceil(N / br), ceil(N / bwd_bc)
        # Q once, O and lse once, K and V once per Q tile (Algorithm 1)
        fwd = e * 2 * Nd + tr * e * 2 * Nd + 4 * N
        # D = rowsum(dO o O); per K/V tile: read Q, dO, lse, D and add into dQ (fp32 read + write);
        # K, V once, dK, dV once; dQ zeroed first (Algorithm 2)
        bwd = e * 2 * Nd + 4 * N + tcb * (e * 2 * Nd + 8 * N + 8 * Nd) + e * 4 * Nd + 4 * Nd
    if fwd is None:
        return None
    return float(fwd if direction == "forward" else fwd + bwd)


def compulsory_bytes(direction: str, N: int, d: int, e: int) -> float:
    """Inputs read once, outputs written once: q, k, v -> o, lse (+ do -> dq, dk, dv)."""
    fwd = e * 4 * N * d + 4 * N
    return float(fwd if direction == "forward" else fwd + e * (2 * N * d + 3 * N * d) + 4 * N)


# ---- the profiled process

def cases(sweep):
    """The profiled cases: every io variant and dtype (and the SDPA backends) in the GPT-2 setting,
    each io variant in its first dtype in the forward sweep over N."""
    todo = [(n, m, dt, drs) for n, m, dt, drs in profiled()] + [(n, m, "float16", drs) for n, m, drs in SDPA]
    out = [{"setting": "gpt2-medium", "variant": name, "model": model, "dtype": dtype, "direction": dr, **GPT2}
           for name, model, dtype, directions in todo for dr in directions]
    first = {}
    for name, model, dtype, _ in profiled():
        first.setdefault(name, (model, dtype))
    out += [{"setting": "sweep", "variant": name, "model": model, "dtype": dtype, "direction": "forward", "N": n,
             **SWEEP_BH} for n in sweep for name, (model, dtype) in first.items()]
    return out


def plan() -> list[dict]:
    rows = []
    for name, model, dtype, directions in profiled():
        tiles = tiles_of(sandbox_variant(name), GPT2["d"])
        what = "" if tiles is None or model == "materialised" else " (Br = {}, Bc = {}, backward Bc = {})".format(*tiles)
        rows.append(selection.row("io", name, dtype, GPT2["d"], directions,
                                  f"ncu bytes vs model {model}{what}: GPT-2 medium, forward sweep over N"))
    return rows


def sandbox_variant(spec: str):
    import sandbox
    from sandbox.registry import parse_spec
    name, params = parse_spec(spec)
    return sandbox.get_variant(name, **params)


def callable_for(case):
    """(zero-argument callable running the case, cleanup) with its inputs allocated."""
    import cupy as cp
    import sandbox
    from sandbox import baselines
    B, H, N, d, dtype = case["B"], case["H"], case["N"], case["d"], case["dtype"]
    if case["variant"].startswith("sdpa-"):
        fn = baselines.sdpa(case["variant"][5:], B, H, N, N, d, dtype, direction=case["direction"])
        if fn is None:
            raise ValueError("SDPA backend unavailable for this problem")
        return fn
    gen = cp.random.default_rng(N)
    q, k, v, dout = (gen.standard_normal((B, H, N, d), dtype=cp.float32).astype(dtype) for _ in range(4))
    bound = sandbox_variant(case["variant"])
    if case["direction"] == "forward":
        return lambda: sandbox.forward(q, k, v, variant=bound)
    return lambda: sandbox.backward(dout, sandbox.forward(q, k, v, variant=bound))


def target(case_file: str):
    """Inside ncu: each case once unprofiled, then marker + case between profiler start and stop."""
    import cupy as cp
    marker = cp.RawKernel(f'extern "C" __global__ void {MARKER}(int* x) {{ if (x) *x = 0; }}', MARKER)
    for case in json.loads(Path(case_file).read_text()):
        try:
            fn = callable_for(case)
            fn()
            cp.cuda.Device().synchronize()
        except (ValueError, cp.cuda.memory.OutOfMemoryError) as e:
            print(f"skip {case}: {e}", file=sys.stderr)
            fn = None
        cp.cuda.runtime.profilerStart()
        marker((1,), (1,), (cp.intp(0),))
        if fn is not None:
            fn()
        cp.cuda.Device().synchronize()
        cp.cuda.runtime.profilerStop()
        del fn
        cp.get_default_memory_pool().free_all_blocks()


def parse_ncu_csv(text: str, n_cases: int) -> list[dict]:
    """ncu --csv rows -> per case {metric: summed bytes, "kernels": count}, cut at the marker kernels.
    The marker's own bytes are not counted; a kernel before the first marker is an error."""
    lines = [l for l in text.splitlines() if l.startswith('"')]
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    per_case, current, seen = [], None, set()
    for row in reader:
        kid = row["ID"]
        if row["Kernel Name"].startswith(MARKER):
            if kid not in seen:
                seen.add(kid)
                current = {m: 0.0 for m in METRICS} | {"kernels": 0, "names": []}
                per_case.append(current)
            continue
        if current is None:
            raise ValueError(f"kernel {row['Kernel Name']!r} profiled before the first case marker")
        if row["Metric Name"] in METRICS:
            current[row["Metric Name"]] += float(row["Metric Value"].replace(",", ""))
            if kid not in seen:
                seen.add(kid)
                current["kernels"] += 1
                current["names"].append(row["Kernel Name"].split("(")[0][:40])
    if len(per_case) != n_cases:
        raise ValueError(f"ncu reported {len(per_case)} case markers for {n_cases} cases")
    return per_case


# ---- the driver

def check_variants(names_dtypes):
    """Oracle check of each profiled variant (forward and, where it has one, backward) on a small case."""
    verdicts = {}
    for name, dtype in names_dtypes:
        bound = sandbox_variant(name)
        direction = "backward" if bound.variant.caps.backward else "forward"
        ok, verdict = oracle_check(bound, dtype, 64, direction, n=200, seed=7)
        verdicts[(name, dtype)] = "ok" if ok else f"FAIL {verdict}"
    return verdicts


def run(sweep=(512, 1024, 2048, 4096, 8192), reps=10, ncu="ncu"):
    from sandbox.timing import time_fn
    if shutil.which(ncu) is None:
        raise UsageError(f"the io family measures bytes with Nsight Compute: {ncu!r} is not on PATH (--ncu PATH)")
    todo = cases(sweep)
    verdicts = check_variants(dict.fromkeys((c["variant"], c["dtype"]) for c in todo if not c["variant"].startswith("sdpa-")))
    todo = [c for c in todo if verdicts.get((c["variant"], c["dtype"]), "ok") == "ok"]
    case_file = Path("/tmp/io_cases.json")
    case_file.write_text(json.dumps(todo))
    cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--metrics", ",".join(METRICS),
           "--csv", "--print-units", "base", sys.executable, "-m", "bench.io_bytes", "--target", str(case_file)]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    RAW.write_text(proc.stdout + "\n# stderr\n" + proc.stderr)      # kept for a failed parse
    if proc.returncode != 0:
        raise RuntimeError(f"ncu failed ({proc.returncode}), output in {RAW}: {proc.stderr[-1500:]}")
    measured = parse_ncu_csv(proc.stdout, len(todo))
    rows = []
    progress = Progress(sum(c["setting"] == "gpt2-medium" for c in todo), "io timing")
    for case, m in zip(todo, measured):
        e = 4 if case["dtype"] == "float32" else 2
        heads = case["B"] * case["H"]
        tiles = (tiles_of(sandbox_variant(case["variant"]), case["d"]) if case["model"] in ("kv-outer", "q-outer")
                 else None)
        model = model_bytes(case["model"], case["direction"], case["N"], case["d"], e, tiles)
        row = {**case, "read_bytes": m[METRICS[0]], "write_bytes": m[METRICS[1]],
               "total_bytes": m[METRICS[0]] + m[METRICS[1]], "kernels": m["kernels"], "kernel_names": " ".join(m["names"]),
               "model_bytes": None if model is None else model * heads,
               "compulsory_bytes": compulsory_bytes(case["direction"], case["N"], case["d"], e) * heads}
        if case["setting"] == "gpt2-medium":
            progress(f"{case['variant']} {case['dtype']} {case['direction']}")
            try:
                row["ms"] = time_fn(callable_for(case), reps=reps).median_ms
            except ValueError:
                pass
        rows.append(row)
    return rows, [f"{n} {dt}: {v}" for (n, dt), v in verdicts.items()]


def model_of(row) -> str | None:
    """A row's byte model; rows written before the model column get it from the registry's tags
    (or the SDPA table)."""
    if "model" in row:
        return row["model"]
    sdpa = {name: model for name, model, _ in SDPA}
    if row["variant"] in sdpa:
        return sdpa[row["variant"]]
    from sandbox.registry import all_variants
    v = all_variants().get(row["variant"].partition(":")[0])
    return selection.io_model(v) if v is not None else None


def gb(x):
    return "-" if x is None else f"{x / 1e9:.2f}"


def markdown(rows, checks) -> str:
    out = ["GPT-2 medium setting (B = 64, H = 16, N = 1024, d = 64): HBM traffic measured by Nsight Compute "
           "(dram__bytes_read.sum + dram__bytes_write.sum) against the model; FA1 paper (A100, fp16, forward + "
           "backward): Standard attention 40.3 GB / 41.7 ms, FlashAttention 4.4 GB / 7.3 ms", "",
           "| variant | dtype | direction | read GB | write GB | total GB | model GB | compulsory GB | kernels | ms |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["setting"] == "gpt2-medium"):
        ms = f"{r['ms']:.2f}" if "ms" in r else "-"
        out.append(f"| {r['variant']} | {r['dtype']} | {r['direction']} | {gb(r['read_bytes'])} | {gb(r['write_bytes'])} | "
                   f"{gb(r['total_bytes'])} | {gb(r['model_bytes'])} | {gb(r['compulsory_bytes'])} | {r['kernels']} | {ms} |")
    g = [r for r in rows if r["setting"] == "gpt2-medium"]
    out += ["", "Materialised over tiled attention (FA1 paper, forward + backward: 9.2x the bytes, 5.7x the time):", ""]
    for dtype in ("float32", "float16"):
        for direction in ("both", "forward"):
            for f in (r for r in g if (r["dtype"], r["direction"]) == (dtype, direction) and model_of(r) != "materialised"):
                sdpa = f["variant"].startswith("sdpa-")     # SDPA's tiled backend against SDPA's math backend
                std = next((r for r in g if (r["dtype"], r["direction"]) == (dtype, direction)
                            and model_of(r) == "materialised" and r["variant"].startswith("sdpa-") == sdpa), None)
                if std and f["total_bytes"] > 0:
                    out.append(f"- {std['variant']} / {f['variant']} ({dtype}, {direction}): "
                               f"{std['total_bytes'] / f['total_bytes']:.1f}x the bytes"
                               + (f", {std['ms'] / f['ms']:.1f}x the time" if "ms" in std and "ms" in f else ""))
    sweep = [r for r in rows if r["setting"] == "sweep"]
    if sweep:
        Ns = sorted({r["N"] for r in sweep})
        out += ["", f"Forward sweep (B = {SWEEP_BH['B']}, H = {SWEEP_BH['H']}, d = {SWEEP_BH['d']}): measured GB / model GB",
                "", "| variant | dtype | " + " | ".join(f"N={n}" for n in Ns) + " |", "|---|---|" + "---|" * len(Ns)]
        for name, dtype in dict.fromkeys((r["variant"], r["dtype"]) for r in sweep):
            cells = []
            for n in Ns:
                r = next((r for r in sweep if (r["variant"], r["dtype"], r["N"]) == (name, dtype, n)), None)
                cells.append("-" if r is None else f"{gb(r['total_bytes'])} / {gb(r['model_bytes'])}")
            out.append(f"| {name} | {dtype} | " + " | ".join(cells) + " |")
    out += ["", "Oracle checks before profiling: " + "; ".join(checks)]
    return "\n".join(out)


def add_arguments(ap):
    ap.add_argument("--sweep", type=csv_of(kind=int, low=1), default=(512, 1024, 2048, 4096, 8192),
                    help="N of the forward sweep")
    ap.add_argument("--ncu", default="ncu")


def main(args, out: Path):
    rows, checks = run(tuple(args.sweep), args.reps, args.ncu)
    write(out, "io", "io", stamp(checks=checks), rows, markdown(rows, checks),
          ["setting", "variant", "model", "dtype", "direction", "B", "H", "N", "d", "read_bytes", "write_bytes",
           "total_bytes", "model_bytes", "compulsory_bytes", "kernels", "ms", "kernel_names"])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--target":
        target(sys.argv[2])
    else:
        sys.exit("run through `python -m bench io`")
