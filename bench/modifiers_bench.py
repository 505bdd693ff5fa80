"""Family `modifiers` (issue 18): what a score or mask modifier compiled into a tensor-core kernel costs
over plain causal attention, beside PyTorch's FlexAttention running the same modifier.

Variants (bench/selection.py): every registered variant with the score_mod capability on the
tensor-core tier (fp16), in its defaults (--variant names one instead). Cases, all causal: plain, softcap
(cap 30), ALiBi (the paper's slopes), a relative-position bias (a learned table, max distance 128), a
document mask (4 equal packed documents: a mask modifier, so three quarters of the causal tiles are
empty and skipped) and attention sinks (one logit per head). Shapes: FA2's grid, B*N = 16k tokens,
hidden 2048 (H = 2048 / d), N in {1k, 4k, 8k}, d in {64, 128}.
Check before timing (bench.harness): each (variant, case, d) against the float64 oracle on a
(1, 2, 256, d) problem with the same modifier, forward and backward; a failing one is not timed.
Timing: sandbox.timing.time_fn (CUDA events, warm-up with the NVRTC build outside, L2 flushed,
median) of the forward and of the backward; `overhead` is the time over plain causal of the same
variant and shape.
FlexAttention (torch.nn.attention.flex_attention, torch.compile'd, the mask as a BlockMask from
create_block_mask, built outside the timed region): the same score_mod / mask_mod written in torch.
Per case: torch._dynamo.reset(), a fresh compiled callable, the recompile limit raised (and
fail_on_recompile_limit_hit where PyTorch has it), a warm-up that must compile its two graphs
(inference; autograd forward + backward), or the row fails with "ran eager"; then the first 256 rows
of that warm-up's output checked against the oracle (causal: they see keys < 256 only), then
forward (and backward through autograd) timed the same way. Sinks have no flex_attention form (a denominator term without a key): that cell says so.
Where PyTorch has no flex_attention or no CUDA, the flex rows are skipped with the reason.

    python -m bench modifiers [--seqlens 1024,4096,8192] [--headdims 64,128 (or 192, 256)] [--variant NAME] [--no-flex]
                              [--cases softcap,alibi]
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import numpy as np

import sandbox
from sandbox import modifiers

from . import selection
from .common import UsageError, csv_of, parse_variant, stamp, write
from .harness import check_then_time, oracle_check

DTYPE = "float16"
TOKENS, HIDDEN = 16384, 2048
CASES = ("causal", "softcap", "alibi", "relative_bias", "document", "sinks")
CAP, MAX_DISTANCE, DOCUMENTS = 30.0, 128, 4
CHECK_N, CHECK_HEADS = 256, 2


def _capable(v) -> bool:
    return v.caps.score_mod and DTYPE in selection.tensor_core_dtypes(v)


def series() -> list[str]:
    """The variants timed: score modifiers on the tensor-core tier, fp16."""
    return [v.name for v in selection.select(dtype=DTYPE, where=_capable)]


def plan() -> list[dict]:
    return [selection.row("modifiers", n, DTYPE, (64, 128), "forward,backward",
                          "causal vs " + ", ".join(CASES[1:]) + " (compiled modifiers), N = 1k-8k, "
                          "beside FlexAttention") for n in series()]


def modifier_options(case: str, H: int, N: int) -> dict:
    """The forward's options for a case at H heads and length N (deterministic parameters)."""
    rng = np.random.default_rng(0)
    if case == "causal":
        return {"causal": True}
    if case == "softcap":
        return {"causal": True, "score_mod": modifiers.softcap(CAP)}
    if case == "alibi":
        return {"causal": True, "score_mod": modifiers.alibi(modifiers.alibi_slopes(H))}
    if case == "relative_bias":
        table = rng.standard_normal((H, 2 * MAX_DISTANCE + 1)) * 0.5
        return {"causal": True, "score_mod": modifiers.relative_bias(table, MAX_DISTANCE)}
    if case == "document":
        return {"causal": True, "mask_mod": modifiers.document(np.arange(N) * DOCUMENTS // N)}
    if case == "sinks":
        return {"causal": True, "score_mod": modifiers.sinks(rng.normal(0.0, 1.0, H))}
    raise ValueError(f"unknown case {case!r}")


# ---- FlexAttention: the same modifiers written in torch

def flex_unavailable() -> str | None:
    """Why FlexAttention cannot run here, or None."""
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed"
    import torch
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError as e:
        return f"PyTorch {torch.__version__} without flex_attention ({e})"
    if not torch.cuda.is_available():
        return "PyTorch without CUDA"
    return None


def _flex_fn():
    """A fresh torch.compile of flex_attention (the caller resets dynamo first: see run_flex)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _dynamo_limits():
    """torch._dynamo.config patched for the bench: a recompile limit no case reaches and, where this
    PyTorch has it, an error instead of the silent eager fallback past the limit. Each case compiles
    two entries (inference forward; forward with requires_grad plus its backward): the old single
    compiled callable shared flex_attention's code object across cases, so the limit (8) was hit
    ("tensor 'key' requires_grad mismatch") and flex ran eager (39 ms at d = 128)."""
    import torch._dynamo.config as cfg
    patch = {k: 64 for k in ("recompile_limit", "cache_size_limit") if hasattr(cfg, k)}
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        patch["fail_on_recompile_limit_hit"] = True
    return cfg.patch(patch)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def flex_args(case: str, opts: dict, B: int, H: int, N: int):
    """(score_mod, block_mask) for flex_attention, or a reason string where it has no form."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    if case == "sinks":
        return "sinks: flex_attention has no denominator term without a key"
    dev = "cuda"

    def softcap(score, b, h, q, kv):
        return CAP * torch.tanh(score / CAP)

    def alibi(score, b, h, q, kv):
        return score + slopes[h] * (kv - q)

    def relative_bias(score, b, h, q, kv):
        return score + table[h, torch.clamp(kv - q, -MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE]

    if case == "alibi":
        slopes = torch.tensor(opts["score_mod"].buffers["slopes"], dtype=torch.float32, device=dev)
    if case == "relative_bias":
        table = torch.tensor(opts["score_mod"].buffers["table"], dtype=torch.float32, device=dev)
    score_mod = {"softcap": softcap, "alibi": alibi, "relative_bias": relative_bias}.get(case)
    if case == "document":
        ids = torch.tensor(opts["mask_mod"].buffers["q_ids"][0], dtype=torch.int32, device=dev)

        def mask_mod(b, h, q, kv):
            return (kv <= q) & (ids[q] == ids[kv])
        block_mask = create_block_mask(mask_mod, 1, 1, N, N, device=dev)
    else:
        def mask_mod(b, h, q, kv):
            return kv <= q
        block_mask = create_block_mask(mask_mod, 1, 1, N, N, device=dev)
    return score_mod, block_mask


def flex_check(case: str, out, q, k, v, H: int, N: int):
    """(ok, message): the first CHECK_N rows of batch entry 0 of flex_attention's output on the timed
    inputs against the float64 oracle run on those rows and keys (every case is causal, so row i sees
    keys <= i only; the document ids of the first CHECK_N positions), fp16 tolerance. No extra compile:
    the output is the timed call's."""
    from sandbox import oracle
    opts = modifier_options(case, H, N)
    if case == "document":
        opts["mask_mod"] = modifiers.document(np.arange(N)[:CHECK_N] * DOCUMENTS // N)
    n = min(CHECK_N, N)
    qs, ks, vs = (x[:1, :, :n].float().cpu().numpy() for x in (q, k, v))
    ref, _ = oracle.forward(qs, ks, vs, **opts)
    err = float(np.abs(out[:1, :, :n].float().cpu().numpy() - ref).max())
    return err < 2e-2, f"flex_attention max |err| {err:.3g} against the oracle"


# ---- the run

def run(spec: str, seqlens, dims, reps, cases=CASES) -> list[dict]:
    import cupy as cp
    bound = parse_variant(spec)[1]
    rows = []
    for d in dims:
        checks = {case: oracle_check(bound, DTYPE, d, "backward", n=CHECK_N, heads=CHECK_HEADS,
                                     options=modifier_options(case, CHECK_HEADS, CHECK_N)) for case in cases}
        for n in seqlens:
            B, H = max(1, TOKENS // n), HIDDEN // d
            rng = cp.random.default_rng(n)
            q, k, v, do = (rng.standard_normal((B, H, n, d), dtype=cp.float32).astype(DTYPE) for _ in range(4))
            base = {}
            for case in cases:
                opts = modifier_options(case, H, n)
                tf = check_then_time(lambda: checks[case], lambda: (lambda: sandbox.forward(q, k, v, variant=bound, **opts)),
                                     reps)
                tb = check_then_time(lambda: checks[case], lambda: _backward_call(bound, q, k, v, do, opts), reps)
                row = {"impl": spec, "case": case, "dtype": DTYPE, "N": n, "B": B, "H": H, "d": d,
                       "status": tf["status"] if tf["status"] != "ok" else tb["status"]}
                if "ms" in tf and "ms" in tb:
                    row.update(fwd_ms=tf["ms"], bwd_ms=tb["ms"])
                    if case == "causal":
                        base = row
                    elif "fwd_ms" in base:
                        row.update(fwd_overhead=tf["ms"] / base["fwd_ms"] - 1, bwd_overhead=tb["ms"] / base["bwd_ms"] - 1)
                    print(f"  {spec} d={d} N={n:5d} {case:14s} fwd {tf['ms']:7.3f} ms  bwd {tb['ms']:7.3f} ms", flush=True)
                rows.append(row)
    return rows


def _backward_call(bound, q, k, v, do, opts):
    """The backward to time, after its forward (outside the timed region)."""
    res = sandbox.forward(q, k, v, variant=bound, **opts)
    return lambda: sandbox.backward(do, res)


def run_flex(q, k, v, do, d, n, B, H, reps, cases=CASES) -> list[dict]:
    """Per case: dynamo reset, a fresh compiled flex_attention, the block mask built once (outside the
    timed region), a warm-up call that must compile a graph (else the row fails: flex ran eager), the
    oracle check on that call's output, then forward and backward timed."""
    import torch
    rows = []
    tq, tk, tv, tdo = (torch.as_tensor(x, device="cuda") for x in (q, k, v, do))
    base = {}
    for case in cases:
        row = {"impl": "flex_attention", "case": case, "dtype": DTYPE, "N": n, "B": B, "H": H, "d": d}
        opts = modifier_options(case, H, n)
        args = flex_args(case, opts, B, H, n)
        if isinstance(args, str):
            rows.append({**row, "status": f"skipped: {args}"})
            continue
        torch._dynamo.reset()
        with _dynamo_limits():
            row.update(_time_flex(case, args, tq, tk, tv, tdo, H, n, reps))
        if "fwd_ms" in row:
            if case == "causal":
                base = row
            elif "fwd_ms" in base:
                row.update(fwd_overhead=row["fwd_ms"] / base["fwd_ms"] - 1, bwd_overhead=row["bwd_ms"] / base["bwd_ms"] - 1)
            print(f"  flex_attention d={d} N={n:5d} {case:14s} fwd {row['fwd_ms']:7.3f} ms  bwd {row['bwd_ms']:7.3f} ms",
                  flush=True)
        rows.append(row)
    return rows


def _time_flex(case, args, tq, tk, tv, tdo, H, n, reps) -> dict:
    """The status and times of one flex case (run_flex)."""
    import torch
    fn = _flex_fn()
    score_mod, block_mask = args
    gq, gk, gv = (x.detach().requires_grad_() for x in (tq, tk, tv))
    try:
        before = _compiled_graphs()
        out = fn(tq, tk, tv, score_mod=score_mod, block_mask=block_mask)       # compiles (inference)
        gout = fn(gq, gk, gv, score_mod=score_mod, block_mask=block_mask)      # compiles (autograd)
        torch.autograd.grad(gout, (gq, gk, gv), tdo, retain_graph=True)
        torch.cuda.synchronize()
        if _compiled_graphs() < before + 2:
            return {"status": f"FAIL flex_attention ran eager: dynamo compiled {_compiled_graphs() - before} of 2 "
                              "graphs (recompile limit or graph break)"}
        ok, verdict = flex_check(case, out, tq, tk, tv, H, n)
    except (ValueError, RuntimeError, AssertionError) as e:
        return {"status": f"rejected: {type(e).__name__}: {str(e)[:80]}"}
    if not ok:
        return {"status": f"FAIL {verdict}"}
    tf = check_then_time(lambda: (True, verdict), lambda: (lambda: fn(tq, tk, tv, score_mod=score_mod,
                                                                      block_mask=block_mask)),
                         reps, rejects=(ValueError, RuntimeError))
    tb = check_then_time(lambda: (True, verdict),
                         lambda: (lambda: torch.autograd.grad(gout, (gq, gk, gv), tdo, retain_graph=True)),
                         reps, rejects=(ValueError, RuntimeError))
    res = {"status": tf["status"] if tf["status"] != "ok" else tb["status"]}
    if "ms" in tf and "ms" in tb:
        res.update(fwd_ms=tf["ms"], bwd_ms=tb["ms"])
    return res


def markdown(rows, flex_note: str | None = None) -> str:
    out = [f"Modifiers on the tensor-core tier ({DTYPE.replace('float', 'fp')}, causal, B*N = 16k tokens, hidden "
           f"{HIDDEN}): ms and cost over plain causal of the same implementation", "",
           "| impl | d | N | case | fwd ms | fwd over causal | bwd ms | bwd over causal |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "fwd_ms" not in r:
            out.append(f"| {r['impl']} | {r['d']} | {r['N']} | {r['case']} | {r['status'][:90]} | | | |")
            continue
        fo = f"{100 * r['fwd_overhead']:+.0f}%" if "fwd_overhead" in r else "-"
        bo = f"{100 * r['bwd_overhead']:+.0f}%" if "bwd_overhead" in r else "-"
        out.append(f"| {r['impl']} | {r['d']} | {r['N']} | {r['case']} | {r['fwd_ms']:.3f} | {fo} | {r['bwd_ms']:.3f} | {bo} |")
    if flex_note:
        out += ["", f"FlexAttention not run: {flex_note}."]
    return "\n".join(out)


def add_arguments(ap):
    ap.add_argument("--seqlens", type=csv_of(kind=int, low=1), default=(1024, 4096, 8192))
    ap.add_argument("--headdims", type=csv_of(allowed=(64, 128, 192, 256), kind=int), default=(64, 128))
    ap.add_argument("--variant", default=None,
                    help="a variant spec with the score_mod capability; default: the registry's (python -m bench plan modifiers)")
    ap.add_argument("--no-flex", dest="flex", action="store_false", help="skip the FlexAttention rows")
    ap.add_argument("--cases", type=csv_of(allowed=CASES), default=CASES,
                    help="a subset of the cases (plain causal, the base of the overheads, is always timed first)")


def main(args, out: Path):
    if args.variant is not None:
        bound = parse_variant(args.variant)[1]
        if not _capable(bound.variant):
            raise UsageError(f"variant {bound.name!r} has no score_mod capability on the tensor-core tier")
        todo = [args.variant]
    else:
        todo = series()
    note = flex_unavailable() if args.flex else "--no-flex"
    cases = ("causal",) + tuple(c for c in CASES if c in args.cases and c != "causal")
    rows = [r for spec in todo for r in run(spec, list(args.seqlens), list(args.headdims), args.reps, cases)]
    if note is None:
        rows += _flex_rows(list(args.seqlens), list(args.headdims), args.reps, cases)
    write(out, "modifiers", "modifiers", stamp(variants=todo, flex=note or "torch.compile(flex_attention)"), rows,
          markdown(rows, note))


def _flex_rows(seqlens, dims, reps, cases=CASES) -> list[dict]:
    import cupy as cp
    rows = []
    for d in dims:
        for n in seqlens:
            B, H = max(1, TOKENS // n), HIDDEN // d
            rng = cp.random.default_rng(n)
            q, k, v, do = (rng.standard_normal((B, H, n, d), dtype=cp.float32).astype(DTYPE) for _ in range(4))
            rows += run_flex(q, k, v, do, d, n, B, H, reps, cases)
    return rows


TARGET_PCT = 10     # the soft-cap's and ALiBi's cost over plain causal that issue 18 asks for, drawn on the plots


def plot(data, path):
    """Forward and backward cost over plain causal per case, against N; one panel per direction, a line
    per (implementation, d, case); with a single N, grouped bars (case x implementation and d) instead."""
    from .plots import _figure, _finish
    rows = [r for r in data["rows"] if "fwd_overhead" in r]
    if len({r["N"] for r in rows}) == 1:
        return _bars(data, rows, path)
    plt, fig, axes = _figure(ncols=2)
    dims = sorted({r["d"] for r in rows})           # a marker per head dim, the smallest drawn solid
    for ax, key, title in zip(axes, ("fwd_overhead", "bwd_overhead"), ("forward", "backward")):
        for i, (impl, d, case) in enumerate(dict.fromkeys((r["impl"], r["d"], r["case"]) for r in rows)):
            pts = sorted((r["N"], 100 * r[key]) for r in rows if (r["impl"], r["d"], r["case"]) == (impl, d, case))
            ax.plot(*zip(*pts), marker="os^D"[dims.index(d) % 4], color=f"C{CASES.index(case)}",
                    ls="--" if impl == "flex_attention" else "-", alpha=1.0 if d == dims[0] else 0.6,
                    label=f"{impl} d={d} {case}")
        ax.axhline(0, color="k", lw=0.5)
        ax.axhline(TARGET_PCT, color="gray", lw=0.8, ls=":", label=f"{TARGET_PCT}% (issue 18's target)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N")
        ax.set_ylabel(f"{title} time over plain causal (%)")
        ax.legend(fontsize=5)
        ax.grid(True, alpha=0.3)
    _finish(plt, fig, data["meta"], "Score and mask modifiers: cost over plain causal", path)


def _bars(data, rows, path):
    """One N: per direction, a group of bars per case, one bar per (implementation, d); missing cells empty."""
    from .plots import _figure, _finish
    plt, fig, axes = _figure(ncols=2)
    cases = [c for c in CASES if any(r["case"] == c for r in rows)]
    series = list(dict.fromkeys((r["impl"], r["d"]) for r in rows))
    width = 0.8 / max(1, len(series))
    for ax, key, title in zip(axes, ("fwd_overhead", "bwd_overhead"), ("forward", "backward")):
        for s_i, (impl, d) in enumerate(series):
            vals = {r["case"]: 100 * r[key] for r in rows if (r["impl"], r["d"]) == (impl, d)}
            xs = [c_i + (s_i - (len(series) - 1) / 2) * width for c_i, c in enumerate(cases) if c in vals]
            ax.bar(xs, [vals[c] for c in cases if c in vals], width, label=f"{impl} d={d}",
                   color=f"C{s_i}", hatch="//" if impl == "flex_attention" else None)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xticks(range(len(cases)), cases)
        ax.set_ylabel(f"{title} time over plain causal (%)")
        ax.set_title(f"{title}, N = {rows[0]['N']}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    _finish(plt, fig, data["meta"], "Score and mask modifiers: cost over plain causal", path)
