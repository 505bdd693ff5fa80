#!/usr/bin/env bash
# One call on a GPU machine: the GPU test suite (Hypothesis over every variant),
# compute-sanitizer on a small case per CUDA variant, the benchmark, and a summary printed last.
# Logs and JSON go to $OUT (default ./out). Usage: COMMIT=<sha> [PARTS=tests|bench|tc|families] bash bench/gpu_session.sh
# (COMMIT from the development checkout: a device copy of the tree may carry a stale .git HEAD)
# (one device call holds 10 minutes: run PARTS=tests and PARTS=bench as two calls when both do not fit;
# SANITIZE=0 skips compute-sanitizer, GPU_SHARDS=k runs each fuzz pair as k tests).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
# Third-party pytest plugins on GPU images can break `import torch` inside pytest: load none.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD HYPOTHESIS_PROFILE=gpu PYTHONWARNINGS=ignore PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
export GPU_EXAMPLES=${GPU_EXAMPLES:-150}
PY=${PY:-python3}
PARTS=${PARTS:-tests,bench}
step() { echo "== $1 ($(date +%T))"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/device.txt"
$PY -c "import cupy, numba, numpy; print('cupy', cupy.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__)" | tee -a "$OUT/device.txt"

if [[ $PARTS == *tests* ]]; then
# The compile report (registers, spills, shared memory for sm_80 and sm_90) is CI's: NVRTC through
# cuda.bindings on this image returns empty ptxas logs (seen at 945516e and 1cd78c6).

if [[ ${SANITIZE:-1} == 1 ]]; then
step "compute-sanitizer memcheck + racecheck, one small case per CUDA variant, in the background"
sanitize() {   # tool variant [--backward] -> one verdict line
  compute-sanitizer --tool "$1" --error-exitcode 9 $PY -m sandbox run --variants "$2" --batch 1 --heads 2 \
    --seqlen 70 --headdim 40 --reps 1 --no-baselines --causal $3 > "/tmp/sanitizer-$1-$2.log" 2>&1
  echo "$1 $2 ${3:---forward} rc=$? $(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "/tmp/sanitizer-$1-$2.log")"
}
(
  # "name:--backward" for variants with a backward, "name:" for forward-only ones
  for vb in $($PY -c "import sandbox; print(' '.join(r['name'] + (':--backward' if r['capabilities']['backward'] else ':')
                                                   for r in sandbox.variants() if r['backend'] == 'cuda'))"); do
    sanitize memcheck "${vb%%:*}" "${vb#*:}" & sanitize racecheck "${vb%%:*}" "${vb#*:}" & wait
  done > "$OUT/sanitizer.txt"
  # template configs with their own code paths (split-K's shared-memory reductions)
  for spec in fa2-tc:split=k+block_r=32+block_c=64; do
    sanitize memcheck "$spec" "" & sanitize racecheck "$spec" "" & wait
  done >> "$OUT/sanitizer.txt"
  # the d = 128 backward tile (Bc = 128, two warps per dQ row group; the cases above run d = 40)
  spec=fa2-tc:bwd_block_c=128
  { sanitize memcheck "$spec" "--backward --headdim 128" & sanitize racecheck "$spec" "--backward --headdim 128" & wait
  } >> "$OUT/sanitizer.txt"
  cat /tmp/sanitizer-*.log > "$OUT/sanitizer.log"
) &
sanitizer_pid=$!
fi


# The CPU tests are CI's; here only `-m gpu`, spread over pytest-xdist workers (Numba JIT and the
# oracle are CPU-bound). Each worker writes its example counts to /tmp/fuzz/fuzz.json.<worker>.
step "GPU test suite: pytest -m gpu on ${WORKERS:-8} workers ($GPU_EXAMPLES examples per fuzz test)"
rm -rf /tmp/fuzz; mkdir -p /tmp/fuzz
FUZZ_REPORT=/tmp/fuzz/fuzz.json $PY -m pytest -q -p no:cacheprovider -p xdist -n "${WORKERS:-8}" -m gpu tests \
  ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/pytest.log" | tail -40
echo "pytest rc=${PIPESTATUS[0]}" | tee -a "$OUT/pytest.log"
$PY -c "
import glob, json, sys
counts = {}
for part in glob.glob('/tmp/fuzz/fuzz.json.*'):
    for key, n in json.load(open(part))['by_variant'].items():
        counts[key] = counts.get(key, 0) + n
json.dump({'total': sum(counts.values()), 'by_variant': counts}, open(sys.argv[1], 'w'), indent=1)
" "$OUT/fuzz.json"
[[ ${SANITIZE:-1} == 1 ]] && { wait $sanitizer_pid; cat "$OUT/sanitizer.txt"; }

fi

if [[ $PARTS == *bench* ]]; then
step "benchmark"
$PY -m sandbox run --json /tmp/run.json ${RUN_ARGS:-} 2>&1 | tee "$OUT/bench.md"
$PY -m sandbox run --causal --json /tmp/run_causal.json ${RUN_ARGS:-} 2>&1 | tee -a "$OUT/bench.md"
$PY -c "import json; json.dump([json.load(open(f)) for f in ('/tmp/run.json', '/tmp/run_causal.json')], open('$OUT/bench.json', 'w'), indent=1)"

step "exact-tier grid (fp32, d = 64, FA2 paper protocol)"
$PY -m bench grid --dtype float32 --headdim 64 --out /tmp/grid --reps ${GRID_REPS:-10} 2>&1 | grep -v '^\[' | tail -14
cp /tmp/grid/grid_float32_d64.md "$OUT/tables.md"

step "softmax: naive / safe / online (CUDA C and Numba), fp32, 4000 vectors"
$PY -m bench softmax --out /tmp/softmax --reps ${GRID_REPS:-10} 2>&1 | tail -8
{ echo; cat /tmp/softmax/softmax.md; } >> "$OUT/tables.md"

step "dropout axis: replay vs packed mask (fa2, fp32)"
$PY -m bench dropout --out /tmp/dropout --reps 5 2>&1 | tail -8
{ echo; cat /tmp/dropout/dropout.md; } >> "$OUT/tables.md"
$PY - "$OUT/bench.json" <<'EOF'
import json, os, sys
b = json.load(open(sys.argv[1]))
for name, path in (("grid_float32_d64", "/tmp/grid/grid_float32_d64.json"), ("softmax", "/tmp/softmax/softmax.json"),
                   ("dropout", "/tmp/dropout/dropout.json")):
    if os.path.exists(path):
        b.append({name: json.load(open(path))})
json.dump(b, open(sys.argv[1], "w"), indent=1)
EOF

fi

if [[ $PARTS == *tc* ]]; then
# TC_DIRECTIONS: forward (default) or e.g. backward,both (the backward rungs: atomic and deterministic dQ)
TCDIR=${TC_DIRECTIONS:-forward}; TCSTEM=$([[ $TCDIR == forward ]] && echo "" || echo "_${TCDIR//,/_}")
step "tensor-core grid (fp16, d = 64 and 128, $TCDIR, FA2 paper protocol) with the fp16 GEMM ceiling"
$PY -c "
from sandbox import baselines; from sandbox.timing import time_fn, tflops
fn, flops = baselines.gemm_fp16(8192); t = time_fn(fn, reps=20)
print(f'fp16 GEMM (cuBLAS via CuPy, 8192^3): {tflops(flops, t.median_ms):.1f} TFLOP/s')" 2>&1 | tee "$OUT/tc_tables.md"
for d in ${TC_DIMS:-64 128}; do
  $PY -m bench grid --dtype float16 --headdim $d --seqlens ${TC_SEQLENS:-512,1024,2048,4096,8192,16384} \
    --directions $TCDIR --variants "${TC_VARIANTS:-fa2-tc-naive,fa2-tc:block_r=64+block_c=64+min_blocks=auto,fa2-tc:warps=8+block_c=64+min_blocks=2,fa2-tc:split=k+block_r=64+block_c=64,fa2-tc:split=k+block_r=32+block_c=64,fa2-tc,fa2-tc:block_c=64,fa2-tc:block_c=128}" \
    --baselines ${TC_BASELINES:-flash,cudnn,math} --out /tmp/tc --reps ${GRID_REPS:-10} 2>&1 | grep -v '^\[' | tail -30
  { echo; cat /tmp/tc/grid_float16_d$d$TCSTEM.md; } >> "$OUT/tc_tables.md"
done
$PY -c "
import json, os; json.dump([{f'grid_float16_d{d}$TCSTEM': json.load(open(f'/tmp/tc/grid_float16_d{d}$TCSTEM.json'))} for d in (64, 128)
                            if os.path.exists(f'/tmp/tc/grid_float16_d{d}$TCSTEM.json')],
                       open('$OUT/tc.json', 'w'), indent=1)"
tar -czf "$OUT/tc.tgz" -C /tmp/tc .        # the family files (md, csv, json) for bench/results/<gpu>/
fi

if [[ $PARTS == *families* ]]; then
# the table families of `python -m bench` (issue 5); results travel back as one archive (a call
# returns at most 8 files), unpacked under bench/results/<gpu>/ on the development machine
step "bench families: ${FAMILIES:-io,memory,blocksparse,variants}"
mkdir -p /tmp/families
$PY -m bench all --families "${FAMILIES:-io,memory,blocksparse,variants}" --out /tmp/families --reps ${GRID_REPS:-10} \
  2>&1 | grep -v '^\[' | tee "$OUT/families.log" | tail -60
[ -f /tmp/io_ncu_raw.txt ] && cp /tmp/io_ncu_raw.txt /tmp/families/
tar -czf "$OUT/families.tgz" -C /tmp/families .
fi

step "summary"
COMMIT=${COMMIT:-unknown} $PY bench/gpu_summary.py "$OUT" > "$OUT/summary.md"
[ -f "$OUT/sanitizer.txt" ] && { cat "$OUT/sanitizer.txt" >> "$OUT/sanitizer.log"; rm -f "$OUT/sanitizer.txt"; }
rm -f "$OUT/device.txt"
cat "$OUT/summary.md"
