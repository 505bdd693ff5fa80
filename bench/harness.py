"""The one check-then-time step every table family runs on a variant: check against the float64
oracle, then time; a variant that fails its check is not timed, one the request is outside of
(capability, envelope, out of memory) is a row that says why.

    row.update(check_then_time(check, timed, reps))
        check() -> (ok, verdict)   runs the variant and compares with the oracle
        timed() -> fn              the zero-argument callable to time (built after the check passed)
    -> {"status": "ok", "ms", "p10_ms", "p90_ms"} | {"status": "FAIL <verdict>"} | {"status": "skipped: why"}

Timing: sandbox.timing.time_fn (CUDA events, warm-up, L2 flushed between repetitions, median).
Checks: `oracle_check` (a small problem through sandbox.fuzz.check_case, forward or forward +
backward) where the timed problem is too large for the oracle; the grid and variants families also
check a row slice of the very problem they time (grid.check_slice).
"""
from __future__ import annotations


def out_of_memory_errors() -> tuple:
    """CuPy's out-of-memory error where CuPy is importable (a table cell, not a crash)."""
    from sandbox.device import cupy_or_none
    cp = cupy_or_none()
    return (cp.cuda.memory.OutOfMemoryError,) if cp is not None else ()


def worst(verdicts):
    """The verdict that decides: a failing one first, else the closest to its tolerance."""
    return max(verdicts, key=lambda v: (not v.ok, v.err / max(v.tol, 1e-30)))


def oracle_check(bound, dtype: str, d: int, direction: str = "forward", *, n: int = 256, heads: int = 2,
                 options: dict | None = None, seed: int = 0):
    """(ok, worst verdict) of a (1, heads, n, d) problem against the oracle; direction "backward"
    checks the gradients too. Options (causal, dropout_p, seed, ...) go to the forward as given."""
    from sandbox.fuzz import Case, check_case
    case = Case(1, heads, heads, n, n, d, dtype, dict(options or {}), seed)
    v = worst(check_case(bound, case, "backward" if direction in ("backward", "both") else "forward"))
    return v.ok, v


def check_then_time(check, timed, reps: int = 10, *, rejects: tuple = (ValueError,), rejected: str = "skipped",
                    reason=lambda e: str(e)[:80]) -> dict:
    """Check, then (only if the check passed) time; an exception of `rejects` (and CuPy's out of
    memory) at either step is a `rejected: reason` row. Returns the row's status and timing fields."""
    from sandbox.timing import time_fn
    rejects = tuple(rejects) + out_of_memory_errors()
    try:
        ok, verdict = check()
        if not ok:
            return {"status": f"FAIL {verdict}"}
        t = time_fn(timed(), reps=reps)
    except rejects as e:
        return {"status": f"{rejected}: {reason(e)}"}
    return {"status": "ok", "ms": t.median_ms, "p10_ms": t.p10_ms, "p90_ms": t.p90_ms}
