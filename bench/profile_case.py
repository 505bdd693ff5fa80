"""One forward + backward of a variant on the FA2 grid's shape, for a profiler to look at:

    ncu -k regex:fa2_tc_bwd --section SpeedOfLight ... python bench/profile_case.py fa2-tc:bwd_block_r=32 --d 64

Runs the case once untimed (compiles the kernels) and once more, so that `ncu --launch-skip` or a
kernel filter can pick the warm launch."""
import argparse

import cupy as cp
import numpy as np

import sandbox
from sandbox.registry import parse_spec

ap = argparse.ArgumentParser()
ap.add_argument("spec", help="variant or variant:key=value+...")
ap.add_argument("--n", type=int, default=4096)
ap.add_argument("--d", type=int, default=64)
ap.add_argument("--causal", action="store_true")
args = ap.parse_args()
name, params = parse_spec(args.spec)
B, H = 16384 // args.n, 2048 // args.d        # the FA2 paper's grid: 16k tokens, hidden 2048
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((B, H, args.n, args.d)).astype(np.float16) for _ in range(4))
q, k, v, do = (cp.asarray(x) for x in (q, k, v, do))
for _ in range(2):
    res = sandbox.forward(q, k, v, variant=name, causal=args.causal, **params)
    sandbox.backward(do, res)
cp.cuda.Device().synchronize()
print("done", args.spec, B, H, args.n, args.d)
