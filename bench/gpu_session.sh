#!/usr/bin/env bash
# One call on a GPU machine: compile report, the GPU test suite (Hypothesis over every variant),
# compute-sanitizer on a small case per CUDA variant, the benchmark, and a summary printed last.
# Logs and JSON go to $OUT (default ./out). Usage: COMMIT=<sha> bash bench/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
# Third-party pytest plugins on GPU images can break `import torch` inside pytest: load none.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD HYPOTHESIS_PROFILE=gpu PYTHONWARNINGS=ignore PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
export GPU_EXAMPLES=${GPU_EXAMPLES:-150}
PY=${PY:-python3}
step() { echo "== $1 ($(date +%T))"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/device.txt"
$PY -c "import cupy, numba, numpy; print('cupy', cupy.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__)" | tee -a "$OUT/device.txt"

step "compile report (NVRTC, sm_80 + sm_90)"
$PY -m sandbox compile-report --arch sm_80,sm_90 > "$OUT/compile.md" 2>&1; echo "rc=$?" | tee -a "$OUT/compile.md"
tail -2 "$OUT/compile.md"

step "test suite: CPU tests + pytest -m gpu ($GPU_EXAMPLES examples per fuzz test)"
FUZZ_REPORT="$OUT/fuzz.json" $PY -m pytest -q -p no:cacheprovider tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -40
echo "pytest rc=${PIPESTATUS[0]}" | tee -a "$OUT/pytest.log"

step "compute-sanitizer memcheck + racecheck, one small case per CUDA variant"
for tool in memcheck racecheck; do
  for v in $($PY -c "import sandbox; print(' '.join(r['name'] for r in sandbox.variants() if r['backend']=='cuda'))"); do
    compute-sanitizer --tool $tool --error-exitcode 9 $PY -m sandbox run --variants "$v" --batch 1 --heads 2 \
      --seqlen 70 --headdim 40 --reps 1 --no-baselines --causal --backward > /tmp/sanitizer.log 2>&1
    rc=$?
    cat /tmp/sanitizer.log >> "$OUT/sanitizer.log"
    echo "$tool $v rc=$rc $(grep -m1 'ERROR SUMMARY' /tmp/sanitizer.log)" | tee -a "$OUT/sanitizer.txt"
  done
done

step "benchmark"
$PY -m sandbox run --json /tmp/run.json ${RUN_ARGS:-} 2>&1 | tee "$OUT/bench.md"
$PY -m sandbox run --causal --json /tmp/run_causal.json ${RUN_ARGS:-} 2>&1 | tee -a "$OUT/bench.md"
$PY -c "import json; json.dump([json.load(open(f)) for f in ('/tmp/run.json', '/tmp/run_causal.json')], open('$OUT/bench.json', 'w'), indent=1)"

step "summary"
COMMIT=${COMMIT:-unknown} $PY bench/gpu_summary.py "$OUT" > "$OUT/summary.md"
cat "$OUT/sanitizer.txt" >> "$OUT/sanitizer.log"; rm -f "$OUT/sanitizer.txt"
cat "$OUT/summary.md"
