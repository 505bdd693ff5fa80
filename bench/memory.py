"""Family `memory`: peak device memory against N for materialised attention and FlashAttention,
forward and backward (FA1 paper Sec. 3.2 / FA2 paper Sec. 4: memory linear in N instead of
quadratic), up to the largest N that fits; where the materialised one runs out is marked.

Series (bench/selection.py): the registered variants tagged baseline and flagship, in each of their
dtypes among fp32 and fp16, forward and (with a backward) forward + backward.

Setting: B = 1, H = 16, d = 128, N doubling from 1k to 128k. Measurement: a CuPy memory hook
counts the bytes the pool hands out and takes back during one call (forward, or forward +
backward), so the peak is what the call itself needs on top of its inputs (q, k, v, dout: listed
separately); cudaMalloc rounding to 512 bytes is included. PyTorch SDPA's flash and math backends
(fp16) are measured the same way through torch.cuda.max_memory_allocated. Before its first size,
each variant is checked against the oracle on a small problem. A variant stops growing N after
running out of memory or when the next size would take longer than --max-seconds (4x the
last call: time grows as N^2).

    python -m bench memory [--max-n 131072]
"""
from __future__ import annotations

import time
from pathlib import Path

from . import selection
from .common import Progress, stamp, write
from .harness import oracle_check

SETTING = dict(B=1, H=16, d=128)
DTYPES = ("float32", "float16")
# PyTorch's SDPA backends measured beside the variants (fp16)
SDPA_SERIES = (("sdpa-flash", "float16", "forward"), ("sdpa-flash", "float16", "both"), ("sdpa-math", "float16", "forward"))


def series() -> list[tuple[str, str, str]]:
    """(variant, dtype, direction) of the baseline and flagship variants, then SDPA's."""
    chosen = [v for v in selection.select(head_dim=SETTING["d"]) if "baseline" in v.tags or "flagship" in v.tags]
    return [(v.name, dt, dr) for dt in DTYPES for v in chosen if dt in v.caps.dtypes
            for dr in (("forward", "both") if v.caps.backward else ("forward",))] + list(SDPA_SERIES)


def plan() -> list[dict]:
    rows = {}
    for name, dtype, direction in series():
        if not name.startswith("sdpa-"):
            rows.setdefault((name, dtype), []).append(direction)
    return [selection.row("memory", n, dt, SETTING["d"], drs, "peak bytes of one call, B = 1, H = 16, N = 1k-128k")
            for (n, dt), drs in rows.items()]


class PeakHook:
    """A CuPy memory hook: bytes handed out by the pool that are still held, and their peak."""

    def __new__(cls):
        from cupy.cuda import memory_hook

        class _Hook(memory_hook.MemoryHook):
            name = "PeakHook"

            def __init__(self):
                self.current = self.peak = 0
                self.sizes = {}

            def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
                self.sizes[mem_ptr] = mem_size
                self.current += mem_size
                self.peak = max(self.peak, self.current)

            def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
                self.current -= self.sizes.pop(mem_ptr, mem_size)

        return _Hook()


def peak_sandbox(name, dtype, direction, N, B, H, d):
    """(peak bytes of one call beyond its inputs, input bytes, seconds)."""
    import cupy as cp
    import sandbox
    bound = sandbox.get_variant(name)
    gen = cp.random.default_rng(N)
    q, k, v, dout = (gen.standard_normal((B, H, N, d), dtype=cp.float32).astype(dtype) for _ in range(4))
    inputs = sum(x.nbytes for x in (q, k, v, dout))
    bound.check(sandbox.problem.make_problem(q, k, v), "forward" if direction == "forward" else "backward")
    cp.cuda.Device().synchronize()
    hook = PeakHook()
    t0 = time.perf_counter()
    with hook:
        res = sandbox.forward(q, k, v, variant=bound)
        if direction != "forward":
            sandbox.backward(dout, res)          # its gradients freed at once; the hook keeps the peak
        del res
    cp.cuda.Device().synchronize()
    return hook.peak, inputs, time.perf_counter() - t0


def peak_sdpa(backend, direction, N, B, H, d):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[backend]
    g = torch.Generator(device="cuda").manual_seed(0)
    need = direction != "forward"
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g, requires_grad=need)
               for _ in range(3))
    dout = torch.randn_like(q)
    inputs = 4 * q.numel() * 2
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with sdpa_kernel([be]):
        if need:
            torch.nn.functional.scaled_dot_product_attention(q, k, v).backward(dout)
        else:
            with torch.no_grad():
                torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, inputs, time.perf_counter() - t0


def run(max_n=131072, max_seconds=40.0, start=1024):
    import cupy as cp
    import sandbox
    Ns = []
    n = start
    while n <= max_n:
        Ns.append(n)
        n *= 2
    rows, checks = [], []
    todo = series()
    progress = Progress(len(todo) * len(Ns), "memory")
    for name, dtype, direction in todo:
        sdpa = name.startswith("sdpa-")
        if not sdpa:
            ok, verdict = oracle_check(sandbox.get_variant(name), dtype, SETTING["d"], direction, n=200, seed=3)
            checks.append(f"{name} {dtype} {direction}: {'ok' if ok else f'FAIL {verdict}'}")
            if not ok:
                continue
        stopped = None
        for N in Ns:
            progress(f"{name} {dtype} {direction} N={N}")
            row = {"variant": name, "dtype": dtype, "direction": direction, "N": N, **SETTING}
            if stopped:
                rows.append({**row, "status": stopped}); continue
            try:
                peak, inputs, secs = (peak_sdpa(name[5:], direction, N, **SETTING) if sdpa
                                      else peak_sandbox(name, dtype, direction, N, **SETTING))
                rows.append({**row, "status": "ok", "peak_bytes": peak, "input_bytes": inputs, "seconds": secs})
                if 4 * secs > max_seconds:     # time grows as N^2: the next size would take about 4x
                    stopped = f"not run: N={N} took {secs:.0f} s"
            except Exception as e:      # noqa: BLE001 -- CuPy and PyTorch out-of-memory errors differ
                if "out of memory" not in str(e).lower() and "OutOfMemory" not in type(e).__name__:
                    raise
                rows.append({**row, "status": "out of memory"})
                stopped = "out of memory at a smaller N"
            cp.get_default_memory_pool().free_all_blocks()
            if sdpa:
                import torch
                torch.cuda.empty_cache()
    return rows, checks


def markdown(rows, checks) -> str:
    Ns = sorted({r["N"] for r in rows})
    out = [f"Peak device memory of one call beyond its inputs, GB (B = {SETTING['B']}, H = {SETTING['H']}, "
           f"d = {SETTING['d']}); OOM = out of memory on this GPU", "",
           "| variant | dtype | direction | " + " | ".join(f"N={n // 1024}k" for n in Ns) + " |",
           "|---|---|---|" + "---|" * len(Ns)]
    for key in dict.fromkeys((r["variant"], r["dtype"], r["direction"]) for r in rows):
        cells = []
        for n in Ns:
            r = next((r for r in rows if (r["variant"], r["dtype"], r["direction"], r["N"]) == (*key, n)), None)
            cells.append("-" if r is None else f"{r['peak_bytes'] / 1e9:.3g}" if r["status"] == "ok"
                         else "**OOM**" if r["status"] == "out of memory" else "·")
        out.append("| " + " | ".join(key) + " | " + " | ".join(cells) + " |")
    out += ["", "· = not run (an earlier N ran out of memory or took longer than the limit). Oracle checks: "
            + "; ".join(checks)]
    return "\n".join(out)


def add_arguments(ap):
    ap.add_argument("--max-n", type=int, default=131072)
    ap.add_argument("--max-seconds", type=float, default=40.0)


def main(args, out: Path):
    rows, checks = run(args.max_n, args.max_seconds)
    write(out, "memory", "memory", stamp(checks=checks, **SETTING), rows, markdown(rows, checks))
