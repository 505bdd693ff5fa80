"""Family `varlen` (issue 18): packed variable-length batches (flash-attn's varlen layout), the single
launch against one launch per sequence, the padded batch and PyTorch.

Variants (bench/selection.py): every registered CUDA variant with a packed-sequence kernel (its impl's
`varlen_forward`) that runs float16 at d = 128, without backward rungs. Problems: --mixes of
S:lo-hi, S sequences of random lengths uniform in [lo, hi] (seeded; Nq = Nk per sequence), packed
(total, H, d); H = 16, d = 128, fp16; causal and not (--causal).

Rows per (mix, causal), each through sandbox entry points on CuPy arrays:
- single:  sandbox.varlen.forward (one launch, the table uploaded from pinned memory on the stream);
- per-seq: sandbox.varlen.forward(single_launch=False), one launch per sequence (the reference rung);
- padded:  sandbox.forward on the padded batch (B = S, N = the longest length), the variant's plain
           kernel: what padding costs (it also attends to the padding keys: a cost reference, checked on
           equal lengths, where it is the same attention);
- torch:   torch.nn.attention.varlen.varlen_attn (flash-attn's varlen kernel in PyTorch) where PyTorch
           has it, else SDPA (flash backend) on the padded batch; a `skipped` row where neither runs.
FLOPs: 4 d sum(Nq_s Nk_s) per head (halved, less the diagonal's half, with causal), real tokens only,
for every row, padded ones included.

Training rows (--directions train): a training step's attention as a PyTorch user runs it, forward and backward
through autograd (sandbox.torch.varlen_attention, torch fp16 tensors, dout random), 3.5x the forward's FLOPs (the
backward counted as 2.5x, as in the FA2 paper):
- train-device: cu_seqlens one int32 CUDA tensor for queries and keys (transformers' padding-free batches): the
                one-launch forward reading the offsets on the device and the backward of packed self-attention
                under a document mask, neither waiting for the stream (sandbox/varlen.py);
- train-host:   the offsets as a host list: the same forward from host tables, one backward per sequence;
- train-torch:  torch.nn.attention.varlen.varlen_attn through autograd where PyTorch has it, else SDPA (flash
                backend) on the padded batch.
Their check: dq, dk, dv of each sequence against the float64 oracle's backward under the tolerance rule.

Check before timing (bench.harness.check_then_time): each row's call on a small packed batch (lengths
1, 37, 128, 300) against the float64 oracle per sequence
under the tolerance rule (the same-precision naive reference); the padded rows on 3 sequences of 200.
A failing row is not timed. Timing, two clocks:
- kernel (ms): sandbox.timing.time_fn, CUDA events around the call, warm-up, L2 flushed, a spin
  kernel ahead of each sample so that the host's enqueue time hides behind it: the device's time;
- host (host_ms): the median wall-clock of --reps calls, each synchronised after (CUDA idle before):
  the time a Python caller waits, the host's table building and launches included.

    python -m bench varlen [--mixes 64:64-2048,16:1024-8192] [--causal 0,1] [--directions forward,train] [--reps 10]
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

import sandbox
from sandbox import oracle, tolerance, varlen

from . import selection
from .common import UsageError, csv_of, stamp, write
from .harness import check_then_time, worst

H, D, DTYPE = 16, 128, "float16"
METHODS = ("single", "per-seq", "padded", "torch")
TRAIN_METHODS = ("train-device", "train-host", "train-torch")
TRAIN_FLOPS = 3.5                  # forward + backward over the forward's FLOPs (the backward as 2.5x)


def series() -> list[str]:
    return [v.name for v in selection.select(dtype=DTYPE, head_dim=D, backend="cuda", without=("backward-rung",),
                                             where=lambda v: getattr(v.impl, "varlen_forward", False))]


def plan() -> list[dict]:
    return [selection.row("varlen", n, DTYPE, D, "forward",
                          f"packed batches (64 x 64-2k, 16 x 1k-8k), H = {H}, causal and not: {', '.join(METHODS)} "
                          "(single launch, per sequence, padded, PyTorch varlen or padded SDPA); training steps: "
                          f"{', '.join(TRAIN_METHODS)}") for n in series()]


def parse_mix(text: str) -> tuple[int, int, int]:
    try:
        s, rng = text.split(":")
        lo, hi = rng.split("-")
        out = int(s), int(lo), int(hi)
    except ValueError:
        raise UsageError(f"mix {text!r}: expected S:lo-hi, e.g. 64:64-2048") from None
    if out[0] < 1 or not 1 <= out[1] <= out[2]:
        raise UsageError(f"mix {text!r}: S >= 1 and 1 <= lo <= hi")
    return out


def lengths(S: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed + S * 7919 + hi).integers(lo, hi + 1, S).tolist()


def flops(lens, causal: bool) -> float:
    n = np.asarray(lens, np.float64)
    pairs = n * (n + 1) / 2 if causal else n * n
    return float(4 * D * H * pairs.sum())


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _pack(lens, seed=0):
    import cupy as cp
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    g = cp.random.default_rng(seed)
    q, k, v = (g.standard_normal((int(cu[-1]), H, D), dtype=cp.float32).astype(cp.float16) for _ in range(3))
    return q, k, v, cu


def _padded(x, cu):
    """(S, H, Nmax, d) zero-padded copy of packed x."""
    import cupy as cp
    lens = np.diff(cu)
    out = cp.zeros((lens.size, H, int(lens.max()), D), dtype=x.dtype)
    for s, n in enumerate(lens):
        out[s, :, :n] = x[cu[s]:cu[s + 1]].transpose(1, 0, 2)
    return out


def _calls(name, method, q, k, v, cu, causal):
    """A zero-argument callable running `method` on the packed batch, or a ValueError saying why not."""
    torch = _torch()
    if method == "single":
        return lambda: varlen.forward(q, k, v, cu, cu, variant=name, causal=causal)
    if method == "per-seq":
        return lambda: varlen.forward(q, k, v, cu, cu, variant=name, causal=causal, single_launch=False)
    if method == "padded":
        qp, kp, vp = (_padded(x, cu) for x in (q, k, v))
        return lambda: sandbox.forward(qp, kp, vp, variant=name, causal=causal)
    if torch is None:
        raise ValueError("PyTorch with CUDA not available")
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    fn = _torch_varlen()
    if fn is not None:
        tcu = torch.as_tensor(cu, dtype=torch.int32, device="cuda")
        n = int(np.diff(cu).max())
        return lambda: fn(tq, tk, tv, tcu, tcu, n, n, window_size=(-1, 0) if causal else (-1, -1))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    pq, pk, pv = (torch.from_dlpack(_padded(x, cu)) for x in (q, k, v))

    def sdpa():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(pq, pk, pv, is_causal=causal)
    return sdpa


def _train_calls(name, method, q, k, v, cu, causal, dout):
    """A zero-argument callable running a training step's attention (forward + backward through autograd) with
    `method` on the packed batch, returning the packed (dq, dk, dv); a ValueError saying why not."""
    torch = _torch()
    if torch is None:
        raise ValueError("PyTorch with CUDA not available")
    import sandbox.torch as st
    tq, tk, tv, td = (torch.from_dlpack(x) for x in (q, k, v, dout))
    n = int(np.diff(cu).max())
    if method in ("train-device", "train-host"):
        offsets = torch.as_tensor(cu, dtype=torch.int32, device="cuda") if method == "train-device" else \
            [int(c) for c in cu]

        def step():
            qq, kk, vv = (x.detach().requires_grad_() for x in (tq, tk, tv))
            st.varlen_attention(qq, kk, vv, offsets, offsets, n, n, variant=name, causal=causal).backward(td)
            return qq.grad, kk.grad, vv.grad
        return step
    fn = _torch_varlen()
    if fn is not None:
        tcu = torch.as_tensor(cu, dtype=torch.int32, device="cuda")

        def varlen_step():
            qq, kk, vv = (x.detach().requires_grad_() for x in (tq, tk, tv))
            fn(qq, kk, vv, tcu, tcu, n, n, window_size=(-1, 0) if causal else (-1, -1)).backward(td)
            return qq.grad, kk.grad, vv.grad
        return varlen_step
    from torch.nn.attention import SDPBackend, sdpa_kernel
    pq, pk, pv, pd = (torch.from_dlpack(_padded(x, cu)) for x in (q, k, v, dout))
    lens = np.diff(cu)

    def sdpa_step():
        qq, kk, vv = (x.detach().requires_grad_() for x in (pq, pk, pv))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal).backward(pd)
        return tuple(torch.cat([g[s, :, :m].transpose(0, 1) for s, m in enumerate(lens)]) for g in
                     (qq.grad, kk.grad, vv.grad))
    return sdpa_step


def _check_train(name, method, causal):
    """(ok, worst verdict) of a training step's gradients on a small batch, per sequence against the oracle."""
    import cupy as cp
    padded = method == "train-torch" and _torch_varlen() is None
    lens = [200, 200, 200] if padded else [1, 37, 128, 300]
    q, k, v, cu = _pack(lens, seed=2)
    dout = cp.random.default_rng(3).standard_normal(q.shape, dtype=cp.float32).astype(cp.float16)
    grads = [cp.asnumpy(cp.from_dlpack(g.contiguous())).astype(np.float64)
             for g in _train_calls(name, method, q, k, v, cu, causal, dout)()]
    qn, kn, vn, dn = (x.get().astype(np.float64) for x in (q, k, v, dout))
    verdicts = []
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        args = [x[a:b].transpose(1, 0, 2)[None] for x in (dn, qn, kn, vn)]
        ref = oracle.backward(*args, causal=causal)
        naive = oracle.backward(*args, precision=DTYPE, causal=causal)
        for g, r, nv, nm in zip(grads, ref, naive, ("dq", "dk", "dv")):
            verdicts.append(tolerance.compare(f"{name} {method} {nm}[{s}]", g[a:b].transpose(1, 0, 2)[None], r, DTYPE,
                                              nv, role="grad"))
    v = worst(verdicts)
    return v.ok, v


def torch_label() -> str:
    return "torch varlen_attn" if _torch_varlen() is not None else "SDPA flash, padded"


def _out_of(method, res, cu):
    """The packed (total, H, d) output of a call as float32 NumPy."""
    import cupy as cp
    if method in ("single", "per-seq"):
        out = res[0]
    elif method == "padded":
        out = cp.concatenate([res.out[s, :, :n].transpose(1, 0, 2) for s, n in enumerate(np.diff(cu))])
    else:
        t = res[0] if isinstance(res, tuple) else res
        if t.dim() == 4:                                        # padded SDPA: (S, H, Nmax, d)
            import torch
            t = torch.cat([t[s, :, :n].transpose(0, 1) for s, n in enumerate(np.diff(cu))])
        out = cp.from_dlpack(t.contiguous())
    return cp.asnumpy(out).astype(np.float32)


def _check(name, method, causal):
    """(ok, worst verdict) of `method` on a small batch, per sequence against the oracle."""
    lens = [200, 200, 200] if method == "padded" or (method == "torch" and _torch_varlen() is None) \
        else [1, 37, 128, 300]
    q, k, v, cu = _pack(lens, seed=1)
    out = _out_of(method, _calls(name, method, q, k, v, cu, causal)(), cu)
    qn, kn, vn = (x.get().astype(np.float32) for x in (q, k, v))
    verdicts = []
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        args = [x[a:b].transpose(1, 0, 2)[None] for x in (qn, kn, vn)]
        ref, _ = oracle.forward(*args, causal=causal)
        naive, _ = oracle.forward(*args, precision=DTYPE, causal=causal)
        verdicts.append(tolerance.compare(f"{name} {method} out[{s}]", out[a:b].transpose(1, 0, 2)[None], ref,
                                            DTYPE, naive, role="out"))
    v = worst(verdicts)
    return v.ok, v


def _host_ms(fn, reps: int) -> float:
    import cupy as cp
    samples = []
    for _ in range(reps):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(samples))


def run(name: str, mixes, causals, reps: int, directions=("forward",)) -> list[dict]:
    import cupy as cp
    rows, checked = [], {}
    methods = [m for d, ms in (("forward", METHODS), ("train", TRAIN_METHODS)) if d in directions for m in ms]
    for S, lo, hi in mixes:
        lens = lengths(S, lo, hi)
        q, k, v, cu = _pack(lens)
        dout = cp.random.default_rng(5).standard_normal(q.shape, dtype=cp.float32).astype(cp.float16)
        for causal in causals:
            for method in methods:
                train = method in TRAIN_METHODS
                fl = flops(lens, causal) * (TRAIN_FLOPS if train else 1.0)
                key = (method, causal)
                base = {"variant": name, "method": method, "direction": "train" if train else "forward",
                        "mix": f"{S}:{lo}-{hi}", "S": S, "tokens": int(cu[-1]), "max_len": max(lens), "H": H, "d": D,
                        "dtype": DTYPE, "causal": causal, "flops": fl,
                        "baseline": torch_label() if method in ("torch", "train-torch") else ""}

                def check(key=key):
                    if key not in checked:
                        checked[key] = (_check_train if key[0] in TRAIN_METHODS else _check)(name, key[0], key[1])
                    return checked[key]

                def calls(m=method):
                    return _train_calls(name, m, q, k, v, cu, causal, dout) if m in TRAIN_METHODS else \
                        _calls(name, m, q, k, v, cu, causal)
                t = check_then_time(check, calls, reps, rejects=(ValueError, RuntimeError, TypeError))
                row = {**base, "status": t["status"]}
                if "ms" in t:
                    fn = calls()
                    row.update(ms=t["ms"], p10_ms=t["p10_ms"], p90_ms=t["p90_ms"], TFLOPs=fl / t["ms"] / 1e9,
                               host_ms=_host_ms(fn, reps))
                    row["host_TFLOPs"] = fl / row["host_ms"] / 1e9
                rows.append(row)
                print(f"  {name} {row['mix']:14s} causal={int(causal)} {method:8s} " + (
                    f"kernel {row['ms']:8.3f} ms {row['TFLOPs']:6.1f} TFLOP/s  host {row['host_ms']:8.3f} ms"
                    if "ms" in row else row["status"]), flush=True)
            relative_times(rows[-len(methods):])
        q = k = v = dout = None
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def relative_times(rows) -> None:
    """Each timed row's kernel and host time over its group's reference row, in place (single_speedup,
    single_host_speedup): the forward rows over `single`'s, the training rows over `train-device`'s."""
    for ref_method, group in (("single", METHODS), ("train-device", TRAIN_METHODS)):
        mine = [r for r in rows if r["method"] in group]
        ref = next((r for r in mine if r["method"] == ref_method and "ms" in r), None)
        for r in mine:
            if ref is not None and "ms" in r:
                r["single_speedup"] = r["ms"] / ref["ms"]
                r["single_host_speedup"] = r["host_ms"] / ref["host_ms"]


def markdown(rows) -> str:
    out = [f"Packed variable-length batches (H = {H}, d = {D}, fp16; TFLOP/s of the real tokens' work): the "
           "single launch against one launch per sequence, the padded batch and PyTorch; train rows: forward + "
           f"backward through autograd ({TRAIN_FLOPS}x the forward's FLOPs). kernel: CUDA events "
           "(device time); host: wall clock of a synchronised call. `x single`: the row's time over the single "
           "launch's, or over train-device's for train rows (above 1: that row is slower)", "",
           "| variant | mix | causal | method | kernel ms | TFLOP/s | host ms | host TFLOP/s | x single (kernel) | "
           "x single (host) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = r["method"] + (f" ({r['baseline']})" if r.get("baseline") else "")
        if "ms" not in r:
            out.append(f"| {r['variant']} | {r['mix']} | {int(r['causal'])} | {label} | {r['status'][:70]} "
                       "| | | | | |")
            continue
        sp = lambda x: f"{x:.2f}x" if x is not None else ""  # noqa: E731
        out.append(f"| {r['variant']} | {r['mix']} | {int(r['causal'])} | {label} | {r['ms']:.3f} | "
                   f"{r['TFLOPs']:.1f} | {r['host_ms']:.3f} | {r['host_TFLOPs']:.1f} | "
                   f"{sp(r.get('single_speedup'))} | {sp(r.get('single_host_speedup'))} |")
    return "\n".join(out)


def plot(data, path) -> None:
    """TFLOP/s (kernel, solid; host, hatched) per (mix, causal), one bar group per method."""
    from .plots import _figure, _finish
    plt, fig, (ax,) = _figure()
    rows = [r for r in data["rows"] if "ms" in r]
    group_of = lambda r: (r["mix"], r["causal"], r.get("direction", "forward"))   # noqa: E731
    groups = list(dict.fromkeys(group_of(r) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / max(1, 2 * len(methods))
    for m_i, m in enumerate(methods):
        for c_i, (key, hatch) in enumerate((("TFLOPs", None), ("host_TFLOPs", "//"))):
            ys = [next((r[key] for r in rows if group_of(r) == g and r["method"] == m), 0) for g in groups]
            xs = [i + (2 * m_i + c_i) * width for i in range(len(groups))]
            ax.bar(xs, ys, width, hatch=hatch, color=f"C{m_i}", label=f"{m} {'kernel' if c_i == 0 else 'host'}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{g[0]}\n{'causal' if g[1] else 'full'}\n{g[2]}" for g in groups], fontsize=7)
    ax.set_ylabel("TFLOP/s (real tokens)")
    ax.legend(fontsize=6)
    _finish(plt, fig, data["meta"], "Packed variable-length batches", path)


def add_arguments(ap):
    ap.add_argument("--mixes", type=csv_of(), default=("64:64-2048", "16:1024-8192"))
    ap.add_argument("--causal", type=csv_of(kind=int, allowed=(0, 1)), default=(0, 1))
    ap.add_argument("--directions", type=csv_of(allowed=("forward", "train")), default=("forward", "train"),
                    help="forward rows, and training-step rows (forward + backward through autograd)")


def main(args, out: Path):
    mixes = [parse_mix(m) for m in args.mixes]
    causals = [bool(c) for c in args.causal]
    rows = [r for name in series() for r in run(name, mixes, causals, args.reps, args.directions)]
    meta = stamp(variants=series(), H=H, d=D, torch_baseline=torch_label())
    write(out, "varlen", "varlen", meta, rows, markdown(rows))
    try:
        plot({"meta": meta, "rows": rows}, out / "varlen.png")
    except ImportError:
        print("matplotlib not installed: no varlen.png", flush=True)
