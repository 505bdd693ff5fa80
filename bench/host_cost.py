"""Family `host`: what a PyTorch caller pays per call, beside SDPA, and speed as a PyTorch user sees it.

Variants (bench/selection.py): every registered flagship CUDA variant with a tensor-core dtype (fp16),
checked against the oracle first (forward and, with one, backward; bench.harness): a variant that
fails is not timed.

Two measurements, both with torch tensors on torch's current stream:
- host time per call: the GPU is kept busy (a long torch.cuda._sleep queued first), so that N calls
  only enqueue work; wall time / N is the Python + launch cost of one call. Entry points: SDPA
  (flash backend), `sandbox.attention` (the plain API: plan path), `sandbox.torch.attention`
  (eager autograd.Function), the custom op `torch.ops.sandbox.attention_fwd` directly, and the
  training forward (inputs requiring grad) of sandbox.torch against SDPA's.
- speed from torch: CUDA events around back-to-back calls with the GPU not kept busy, as a user
  times a loop: host cost shows wherever it exceeds the kernel's time. Reported beside the
  kernel-only figure (sandbox.timing.time_fn: the host hidden behind a spin kernel), each as a
  ratio to SDPA flash measured the same way.

    python -m bench host --out DIR [--quick] [--skip-speed]
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from . import selection
from .common import UsageError, stamp, write
from .harness import oracle_check


def series() -> list[str]:
    """The flagship CUDA variants with fp16."""
    return [v.name for v in selection.select("flagship", backend="cuda", dtype="float16", head_dim=64)]


def plan() -> list[dict]:
    return [selection.row("host", n, "float16", "64,128", "forward,both",
                          "host us per call from torch (plain API, sandbox.torch, custom op) and TFLOP/s "
                          "from torch, beside SDPA flash / cuDNN") for n in series()]


def _torch():
    import torch
    return torch


def host_us(fn, calls=200, trials=5):
    """Host microseconds per call with the GPU busy (calls only enqueue): the median of `trials`."""
    torch = _torch()
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(trials):
        torch.cuda._sleep(int(3e8))        # ~0.15 s of GPU time: every call below only enqueues
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(per_call)[trials // 2]


def loop_ms(fn, calls=30, reps=5):
    """Milliseconds per call of back-to-back calls timed with CUDA events (host cost included)."""
    torch = _torch()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        best.append(a.elapsed_time(b) / calls)
    return sorted(best)[len(best) // 2]


def _sdpa(backend):
    torch = _torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    F = torch.nn.functional

    def call(q, k, v, causal):
        with sdpa_kernel([be]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


ENTRIES = ("sandbox.attention (plain API)", "sandbox.torch.attention (eager)", "torch.ops.sandbox.attention_fwd")


def host_table(name, quick=False):
    torch = _torch()
    import sandbox
    import sandbox.torch as st
    sdpa = _sdpa("flash")
    rows = []
    shapes = [(b, n) for b in (1, 2, 4, 8) for n in (128, 512, 2048)] if not quick else [(1, 128), (8, 2048)]
    for B, N in shapes:
        H, d = 16, 64
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16) for _ in range(3))
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
        scale = 1.0 / math.sqrt(d)
        ref = host_us(lambda: sdpa(q, k, v, False))
        entries = dict(zip(ENTRIES, (
            host_us(lambda: sandbox.attention(q, k, v, variant=name)),
            host_us(lambda: st.attention(q, k, v, variant=name)),
            host_us(lambda: torch.ops.sandbox.attention_fwd(
                q, k, v, None, name, "", False, scale, 0.0, False, None, None, None, 0, 0)))))
        ref_train = host_us(lambda: sdpa(qg, kg, vg, False))
        train = host_us(lambda: st.attention(qg, kg, vg, variant=name))
        # a training step's attention: forward and backward through autograd (the engine runs the backward
        # on its device thread; the call returns once the backward's kernels are queued). Fewer calls per
        # trial: each queues several kernels, and a full launch queue would make the host wait.
        go = torch.randn_like(q)
        ref_step = host_us(lambda: sdpa(qg, kg, vg, False).backward(go), calls=60)
        step = (host_us(lambda: st.attention(qg, kg, vg, variant=name).backward(go), calls=60)
                if bound_has_backward(name) else float("nan"))
        row = {"variant": name, "B": B, "N": N, "H": H, "d": d, "sdpa_flash_us": ref, "sdpa_flash_train_us": ref_train,
               "sandbox_torch_train_us": train, "sdpa_flash_step_us": ref_step, "sandbox_torch_step_us": step}
        row.update({f"{entry} us": us for entry, us in entries.items()})
        rows.append(row)
        print(f"  host {name} B={B} N={N}: sdpa {ref:.1f} us, plain {entries[ENTRIES[0]]:.1f}, "
              f"torch eager {entries[ENTRIES[1]]:.1f}, op {entries[ENTRIES[2]]:.1f}; "
              f"train fwd sdpa {ref_train:.1f}, sandbox {train:.1f}; fwd+bwd sdpa {ref_step:.1f}, sandbox {step:.1f}",
              file=sys.stderr, flush=True)
    return rows


def speed_table(name, quick=False):
    """FA2 grid (B N = 16k, hidden 2048): kernel-only and from-torch TFLOP/s, the variant and SDPA.
    Row keys name the variant as "ours" (the row's `variant` says which)."""
    torch = _torch()
    import cupy as cp
    import sandbox
    import sandbox.torch as st
    from sandbox.timing import time_fn, tflops
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for N in ((512, 2048, 8192, 16384) if not quick else (2048,)):
                B, H = 16384 // N, 2048 // d
                q, k, v, dout = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16) for _ in range(4))
                flops = 4.0 * B * H * N * N * d * (0.5 if causal else 1.0)
                qc, kc, vc = (cp.asarray(x) for x in (q, k, v))
                row = {"variant": name, "d": d, "causal": causal, "N": N, "B": B, "H": H}
                kern = time_fn(lambda: sandbox.attention(qc, kc, vc, variant=name, causal=causal), reps=10)
                row["ours kernel TFLOP/s"] = tflops(flops, kern.median_ms)
                for be in ("flash", "cudnn"):
                    fn = _sdpa(be)
                    try:
                        t = time_fn(lambda: fn(q, k, v, causal), reps=10)
                        row[f"sdpa-{be} kernel TFLOP/s"] = tflops(flops, t.median_ms)
                        row[f"sdpa-{be} torch TFLOP/s"] = tflops(flops, loop_ms(lambda: fn(q, k, v, causal)))
                    except RuntimeError as e:          # a backend that refuses the shape
                        print(f"  sdpa {be} skipped: {e}", file=sys.stderr)
                row["ours torch TFLOP/s"] = tflops(flops, loop_ms(
                    lambda: st.attention(q, k, v, variant=name, causal=causal)))
                qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))

                def ours_both():
                    out = st.attention(qg, kg, vg, variant=name, causal=causal)
                    torch.autograd.grad(out, (qg, kg, vg), dout)

                def sdpa_both(be):
                    out = _sdpa(be)(qg, kg, vg, causal)
                    torch.autograd.grad(out, (qg, kg, vg), dout)
                row["ours torch both TFLOP/s"] = tflops(3.5 * flops, loop_ms(ours_both, calls=10, reps=3))
                for be in ("flash", "cudnn"):
                    try:
                        row[f"sdpa-{be} torch both TFLOP/s"] = tflops(
                            3.5 * flops, loop_ms(lambda: sdpa_both(be), calls=10, reps=3))
                    except RuntimeError as e:          # a backend that refuses the shape
                        print(f"  sdpa {be} backward skipped: {e}", file=sys.stderr)
                rows.append(row)
                print(f"  speed {name} d={d} causal={causal} N={N}: " + ", ".join(
                    f"{k_}={v_:.0f}" for k_, v_ in row.items() if "TFLOP" in k_), file=sys.stderr, flush=True)
    return rows


def markdown(host, speed) -> str:
    lines = ["## Host time per call from torch (GPU kept busy), fp16, H = 16, d = 64", "",
             "| variant | B | N | SDPA flash us | plain API us | x | sandbox.torch us | x | custom op us | x | "
             "train fwd: SDPA us | sandbox.torch us | x | fwd+bwd: SDPA us | sandbox.torch us | x |", "|" + "---|" * 16]
    for r in host:
        if "status" in r:
            lines.append(f"| {r['variant']} | {r['status'][:80]} |" + " |" * 14)
            continue
        s = r["sdpa_flash_us"]
        p, e, o = (r[f"{n} us"] for n in ENTRIES)
        lines.append(f"| {r.get('variant', '-')} | {r['B']} | {r['N']} | {s:.1f} | {p:.1f} | {p / s:.2f} | {e:.1f} | {e / s:.2f} | {o:.1f} | "
                     f"{o / s:.2f} | {r['sdpa_flash_train_us']:.1f} | {r['sandbox_torch_train_us']:.1f} | "
                     f"{r['sandbox_torch_train_us'] / r['sdpa_flash_train_us']:.2f} | {r['sdpa_flash_step_us']:.1f} | "
                     f"{r['sandbox_torch_step_us']:.1f} | {r['sandbox_torch_step_us'] / r['sdpa_flash_step_us']:.2f} |")
    lines += ["", "## Speed: kernel only and from torch (FA2 grid, fp16, B N = 16k, hidden 2048)", "",
              "| variant | d | causal | N | kernel TFLOP/s | x SDPA flash (kernel) | x SDPA cuDNN (kernel) | "
              "from torch TFLOP/s | x SDPA flash (torch) | x SDPA cuDNN (torch) | fwd+bwd from torch | "
              "x SDPA flash | x SDPA cuDNN |", "|" + "---|" * 13]
    for r in speed:
        def ratio(a, b):
            return f"{r[a] / r[b]:.2f}" if a in r and b in r else "-"
        lines.append(f"| {r.get('variant', '-')} | {r['d']} | {r['causal']} | {r['N']} | {r['ours kernel TFLOP/s']:.0f} | "
                     f"{ratio('ours kernel TFLOP/s', 'sdpa-flash kernel TFLOP/s')} | "
                     f"{ratio('ours kernel TFLOP/s', 'sdpa-cudnn kernel TFLOP/s')} | {r['ours torch TFLOP/s']:.0f} | "
                     f"{ratio('ours torch TFLOP/s', 'sdpa-flash torch TFLOP/s')} | "
                     f"{ratio('ours torch TFLOP/s', 'sdpa-cudnn torch TFLOP/s')} | "
                     f"{r['ours torch both TFLOP/s']:.0f} | {ratio('ours torch both TFLOP/s', 'sdpa-flash torch both TFLOP/s')} | "
                     f"{ratio('ours torch both TFLOP/s', 'sdpa-cudnn torch both TFLOP/s')} |")
    return "\n".join(lines) + "\n"


def add_arguments(ap):
    ap.add_argument("--quick", action="store_true", help="two host shapes and one grid size")
    ap.add_argument("--skip-speed", action="store_true", help="only the host-time table")
    ap.add_argument("--variants", default=None,
                    help="comma-separated registered names; default: the flagship CUDA variants (python -m bench plan host)")


def bound_has_backward(name) -> bool:
    return bool(sandbox_variant(name).variant.caps.backward)


def sandbox_variant(name):
    import sandbox
    return sandbox.get_variant(name)


def main(args, out: Path):
    try:
        torch = _torch()
    except ImportError:
        raise UsageError("the host family needs PyTorch (pip install torch)") from None
    if not torch.cuda.is_available():
        raise UsageError("the host family needs a CUDA GPU visible to PyTorch")
    host, speed = [], []
    for name in (args.variants.split(",") if getattr(args, "variants", None) else series()):
        bound = sandbox_variant(name)
        ok, verdict = oracle_check(bound, "float16", 64, "backward" if bound.variant.caps.backward else "forward")
        if not ok:           # a variant that fails its check is not timed
            host.append({"variant": name, "status": f"FAIL {verdict}"})
            continue
        host += host_table(name, args.quick)
        speed += [] if args.skip_speed else speed_table(name, args.quick)
    rows = [{"table": "host", **r} for r in host] + [{"table": "speed", **r} for r in speed]
    write(Path(out), "host", "host", stamp(), rows, markdown(host, speed))
