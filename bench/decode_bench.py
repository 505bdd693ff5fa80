"""Family `decode` (issue 18): split-KV decoding kernels against a KV cache, in bytes moved per second
against the device's copy bandwidth and PyTorch SDPA's flash backend.

Variants (bench/selection.py): every registered variant tagged `decode` that runs float16 at
d = 128. Problem: one new query row (Nq = 1) per sequence, Hq = 32 query heads on Hkv = 8 K/V heads
(GQA 4), d = 128, fp16, B in {1, 8, 64}, key lengths 4k..256k (a problem whose cache needs more
than a third of the free memory is a `skipped` row). Layouts: `contiguous` is the variant through
sandbox.forward on the cache viewed as (B, Hkv, N, d); `paged` is sandbox.decode.forward (its
kernel path) over the same bytes viewed as pages of --page-size keys, (pages, Hkv, page, d), with
a shuffled block table: the cache is one (B, N, Hkv, d) buffer, flash-attn's layout, so both views
and SDPA read the same memory without copies.

Check before timing (bench.harness.check_then_time): each layout on a small ragged problem (B = 3,
lengths 1, 700, 1500, 2 query rows, causal) against the float64 oracle under the tolerance rule
(sandbox.decode.oracle_verdicts: the same-precision naive reference, as for every 16-bit variant); a
failing layout is not timed. Timing: sandbox.timing.time_fn (CUDA events, warm-up, L2 flushed,
median of --reps). Bytes moved: K and V of every sequence (2 B Hkv N d x 2 bytes) plus q and out.
Ceiling: a CuPy copy of the K half of the cache onto the V half, the same number of bytes read and
written (`copy GB/s` = bytes / time), measured per problem; `% copy` = decode GB/s / copy GB/s.
Baseline: SDPA's flash backend (enable_gqa) on the contiguous view, where PyTorch with CUDA is
importable and the backend takes the problem (else the cell says why).

The kernel path follows sandbox.decode's switches: SANDBOX_DECODE_FUSED=0 times the two-launch form
(split kernel + decode_merge) instead of the one-launch default, SANDBOX_DECODE_PIPE=0 the register
load path, SANDBOX_DECODE_L2=first the K/V stream with the evict-first L2 hint (normal priority is the
default since 2026-11-26: 1-3% faster on the H100), SANDBOX_DECODE_ORDER=heads the grid with the K/V heads
of one split on its x axis; the table's
header and the JSON meta say which ran, and S is the split count of each row.

    python -m bench decode [--batches 1,8,64] [--seqlens 4096,16384,65536,262144] [--page-size 64]
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

import sandbox
from sandbox import decode

from . import selection
from .common import csv_of, stamp, write
from .harness import check_then_time

HQ, HKV, D, DTYPE = 32, 8, 128, "float16"
LAYOUTS = ("contiguous", "paged")


def series() -> list[str]:
    return [v.name for v in selection.select("decode", dtype=DTYPE, head_dim=D)]


def plan() -> list[dict]:
    return [selection.row("decode", n, DTYPE, D, "forward",
                          f"Nq = 1, Hq = {HQ} / Hkv = {HKV}, B 1-64, N 4k-256k, {' and '.join(LAYOUTS)} (sandbox.decode) "
                          "vs device copy and SDPA flash") for n in series()]


def _torch_or_why():
    try:
        import torch
    except ImportError:
        return None, "PyTorch not installed"
    if not torch.cuda.is_available():
        return None, "PyTorch without CUDA"
    return torch, None


def _small_check(name: str, layout: str, page_size: int):
    """(ok, verdict): a ragged causal decoding step through the layout's entry point against the oracle."""
    import cupy as cp
    rng = np.random.default_rng(5)
    B, nq, lens, room = 3, 2, [1, 700, 1500], 1536
    f = lambda *s: rng.standard_normal(s).astype(np.float16)  # noqa: E731
    q, kk, vv = f(B, HQ, nq, D), f(B, HKV, room, D), f(B, HKV, room, D)
    worst = None
    if layout == "contiguous":
        res = sandbox.forward(cp.asarray(q), cp.asarray(kk), cp.asarray(vv), variant=name, causal=True)
        pairs = [(res.out.get(), res.lse.get(), q, kk, vv, True)]
    else:
        pages = rng.permutation(B * room // page_size).reshape(B, room // page_size)
        kc = np.zeros((B * room // page_size, HKV, page_size, D), np.float16)
        vc = kc.copy()
        for b in range(B):
            for p in range(room // page_size):
                kc[pages[b, p]] = kk[b, :, p * page_size:(p + 1) * page_size]
                vc[pages[b, p]] = vv[b, :, p * page_size:(p + 1) * page_size]
        out, lse = decode.forward(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), lens, block_table=pages, causal=True)
        pairs = [(out.get()[b:b + 1], lse.get()[b:b + 1], q[b:b + 1], kk[b:b + 1, :, :n], vv[b:b + 1, :, :n], True)
                 for b, n in enumerate(lens)]
    for o, l_, qq, k_, v_, causal in pairs:
        for v in decode.oracle_verdicts(o, l_, qq, k_, v_, DTYPE, causal):     # with the same-precision naive
            if worst is None or (not v.ok and worst.ok):
                worst = v
    return worst.ok, worst


def run(name: str, batches, seqlens, page_size: int, reps: int) -> list[dict]:
    import cupy as cp
    torch, why_not = _torch_or_why()
    done = {}

    def checks(lay):
        """The layout's small check, once per run; a refusal (ValueError) is re-raised for every row
        (check_then_time makes it a `skipped` row) instead of ending the family."""
        if lay not in done:
            try:
                done[lay] = _small_check(name, lay, page_size)
            except ValueError as e:
                done[lay] = e
        if isinstance(done[lay], Exception):
            raise done[lay]
        return done[lay]
    rows = []
    for B in batches:
        for N in seqlens:
            base = {"variant": name, "dtype": DTYPE, "B": B, "N": N, "Hq": HQ, "Hkv": HKV, "d": D,
                    "page_size": page_size}
            kv_bytes = 2 * B * N * HKV * D * 2
            if N % page_size or kv_bytes > cp.cuda.Device().mem_info[0] / 3:
                rows += [{**base, "layout": lay, "status": "skipped: cache does not fit (or N not a page multiple)"}
                         for lay in LAYOUTS]
                continue
            rows += _one(name, base, kv_bytes, page_size, reps, checks, torch, why_not)
            cp.get_default_memory_pool().free_all_blocks()
    return rows


def _one(name, base, kv_bytes, page_size, reps, checks, torch, why_not) -> list[dict]:
    """The rows of one (B, N): the cache allocated, copied (the ceiling), filled and timed; freed on return."""
    import cupy as cp
    from sandbox.timing import time_fn
    B, N = base["B"], base["N"]
    rows = []
    cache = cp.empty((2, B, N, HKV, D), dtype=cp.float16)        # flash-attn's (B, N, Hkv, d), K then V
    copy_ms = time_fn(lambda: cp.copyto(cache[1], cache[0]), reps=reps).median_ms
    gen = cp.random.default_rng(N + B)
    for b in range(B):
        cache[:, b] = gen.standard_normal((2, N, HKV, D), dtype=cp.float32).astype(cp.float16)
    k, v = cache[0].transpose(0, 2, 1, 3), cache[1].transpose(0, 2, 1, 3)     # (B, Hkv, N, d) views
    npages = B * N // page_size
    kp = cache[0].reshape(npages, page_size, HKV, D).transpose(0, 2, 1, 3)   # (pages, Hkv, page, d)
    vp = cache[1].reshape(npages, page_size, HKV, D).transpose(0, 2, 1, 3)
    table = np.random.default_rng(B).permutation(npages).reshape(B, N // page_size).astype(np.int32)
    q = gen.standard_normal((B, HQ, 1, D), dtype=cp.float32).astype(cp.float16)
    moved = kv_bytes + 2 * q.nbytes
    calls = {"contiguous": lambda: sandbox.forward(q, k, v, variant=name),
             "paged": lambda: decode.forward(q, kp, vp, [N] * B, block_table=table)}
    splits = decode.launch_plan(B, HQ, HKV, 1, D, DTYPE, N)[2]      # the kernel's split count (both layouts)
    for lay in LAYOUTS:
        t = check_then_time(lambda lay=lay: checks(lay), lambda lay=lay: calls[lay], reps)
        row = {**base, "layout": lay, "status": t["status"], "bytes": moved, "copy_ms": copy_ms,
               "copy_GBps": kv_bytes / copy_ms / 1e6, "splits": splits}
        if "ms" in t:
            row.update(ms=t["ms"], p10_ms=t["p10_ms"], p90_ms=t["p90_ms"], GBps=moved / t["ms"] / 1e6)
            row["pct_copy"] = 100.0 * row["GBps"] / row["copy_GBps"]
        rows.append(row)
    sdpa = _sdpa_row(torch, why_not, q, k, v, reps)
    for row in rows[-len(LAYOUTS):]:
        row.update(sdpa)
        if "ms" in row and "sdpa_ms" in sdpa:
            row["speedup_vs_sdpa"] = sdpa["sdpa_ms"] / row["ms"]
        print(f"  {name} {row['layout']:10s} B={B:3d} N={N:7d} S={splits:3d} " + (
            f"{row['ms']:8.3f} ms {row['GBps']:7.0f} GB/s {row['pct_copy']:5.1f}% copy" if "ms" in row
            else row["status"]) + (f"  sdpa {sdpa['sdpa_ms']:.3f} ms" if "sdpa_ms" in sdpa else ""), flush=True)
    return rows


def _sdpa_row(torch, why_not, q, k, v, reps) -> dict:
    """SDPA's flash backend on the contiguous view (same bytes, zero-copy), or why not."""
    if torch is None:
        return {"sdpa": f"skipped: {why_not}"}
    from sandbox.timing import time_fn
    from torch.nn.attention import SDPBackend, sdpa_kernel
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    F = torch.nn.functional

    def call():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
    try:
        call()
        torch.cuda.synchronize()
        t = time_fn(call, reps=reps)
    except (RuntimeError, TypeError) as e:
        return {"sdpa": f"skipped: {str(e).splitlines()[0][:80]}"}
    return {"sdpa": "ok", "sdpa_ms": t.median_ms}


def markdown(rows, page_size: int) -> str:
    out = [f"Decoding (Nq = 1, Hq = {HQ}, Hkv = {HKV}, d = {D}, fp16; paged: pages of {page_size} keys, shuffled; "
           f"kernel path pipe={decode.DEFAULT_PIPE} fused={decode.DEFAULT_FUSED} l2={decode.DEFAULT_L2} "
           f"order={decode.DEFAULT_ORDER}): bytes moved "
           "/ time against a device copy of the same bytes and SDPA flash (contiguous); S = the kernel's splits", "",
           "| variant | layout | B | N | S | ms | GB/s | copy GB/s | % copy | SDPA flash ms | speedup vs SDPA |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ms" not in r:
            out.append(f"| {r['variant']} | {r['layout']} | {r['B']} | {r['N']} | | {r['status'][:70]} | | | | | |")
            continue
        sd = f"{r['sdpa_ms']:.4f}" if "sdpa_ms" in r else r.get("sdpa", "")[:50]
        sp = f"{r['speedup_vs_sdpa']:.2f}x" if "speedup_vs_sdpa" in r else ""
        out.append(f"| {r['variant']} | {r['layout']} | {r['B']} | {r['N']} | {r.get('splits', '')} | {r['ms']:.4f} | "
                   f"{r['GBps']:.0f} | {r['copy_GBps']:.0f} | {r['pct_copy']:.1f}% | {sd} | {sp} |")
    return "\n".join(out)


def plot(data, path) -> None:
    """GB/s against N, one line per (variant, layout, B), the copy bandwidth dashed."""
    from .plots import _figure, _finish
    plt, fig, (ax,) = _figure()
    rows = [r for r in data["rows"] if "GBps" in r]
    for key in dict.fromkeys((r["variant"], r["layout"], r["B"]) for r in rows):
        pts = sorted((r["N"], r["GBps"]) for r in rows if (r["variant"], r["layout"], r["B"]) == key)
        ax.plot(*zip(*pts), marker="o", label=f"{key[0]} {key[1]} B={key[2]}")
    copy = sorted({(r["N"], r["copy_GBps"]) for r in rows if r["layout"] == LAYOUTS[0] and r["B"] == rows[0]["B"]})
    if copy:
        ax.plot(*zip(*copy), "k--", label="device copy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("keys per sequence N")
    ax.set_ylabel("GB/s (K + V + q + out)")
    ax.legend(fontsize=7)
    _finish(plt, fig, data["meta"], "Split-KV decoding: bytes moved per second", path)


def add_arguments(ap):
    ap.add_argument("--batches", type=csv_of(kind=int, low=1), default=(1, 8, 64))
    ap.add_argument("--seqlens", type=csv_of(kind=int, low=256), default=(4096, 16384, 65536, 262144))
    ap.add_argument("--page-size", type=int, default=64, choices=(16, 32, 64, 128, 256))


def main(args, out: Path):
    rows = [r for name in series() for r in run(name, list(args.batches), list(args.seqlens), args.page_size,
                                                args.reps)]
    meta = stamp(variants=series(), page_size=args.page_size, pipe=decode.DEFAULT_PIPE, fused=decode.DEFAULT_FUSED,
                 l2=decode.DEFAULT_L2, order=decode.DEFAULT_ORDER)
    write(out, "decode", "decode", meta, rows, markdown(rows, args.page_size))
    try:
        plot({"meta": meta, "rows": rows}, out / "decode.png")
    except ImportError:
        print("matplotlib not installed: no decode.png", flush=True)
