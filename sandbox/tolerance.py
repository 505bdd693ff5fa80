"""The tolerance rule (docs/ARCHITECTURE.md "Tolerances"), per dtype, against the float64 oracle.

exact tier (float32):      max|kernel - oracle64| <= EXACT_RTOL * max(1, max|oracle64|)
                                                     + TERMS_ULPS * eps32 * terms
                           terms = the magnitude of the terms behind the output
                           (oracle.term_bounds). Why: no float32 summation is closer than
                           eps * sum|terms|. Seen on the GPU and the simulator: large logits
                           (|s| ~ 100) put an error ~ eps * S_abs in every score, which softmax
                           carries into out (5.9e-5 > 4.1e-5 at logit scale 30, d = 128, both the
                           CUDA and Numba variants alike); dS = P * (dP - D) cancels, so dK was
                           1.3e-5 where the exact value is 0 (Nq = Nk = 1, q ~ 30). The design's
                           first rule is the terms = 0 case; for unit-scale inputs terms ~ sqrt(d).
tensor-core tier (16-bit): max|kernel - oracle64| <= k * max|naive - oracle64| + floor
                           k = 2 for out and lse, 3 for gradients; naive = the oracle in the
                           kernel's precision; floor = FLOOR_ULPS * eps(dtype) * max|oracle64|
                           (rounding noise of the dtype at the output's magnitude). FLOOR_ULPS is
                           1 for out and lse, 2 for gradients: a gradient is a sum of rounded
                           products, and on tiny problems the naive's error is a max over a
                           handful of elements, a poor estimate (seen: dK at Nk = 3, d = 1 off by
                           1.06x the 1-ulp rule while the naive happened to be nearly exact).
                           Gradients add OUT_ROUNDING_ULPS * eps(dtype) * the output-rounding
                           bound (oracle.output_rounding_bounds): D = rowsum(dO o O) is formed from
                           the stored 16-bit O, and where dS = P (dP - D) cancels to ~0 that
                           rounding is all that is left, while the max|oracle64| floor is ~0 (seen:
                           fa2-tc dK 1.1e-3 at Nq = Nk = 1, GQA, dropout, where the exact dK is 0
                           and the naive happened to be off by 3.3e-4).
Non-finite entries must match exactly (dead rows: lse = -inf); NaN never passes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .precision import EPS

EXACT_RTOL = 1e-5
TERMS_ULPS = 4.0        # float32 rounding units per unit of |terms| (seen: errors ~0.5 eps32 * terms)
TC_FACTOR = {"out": 2.0, "lse": 2.0, "grad": 3.0}
FLOOR_ULPS = {"out": 1.0, "lse": 1.0, "grad": 2.0}
OUT_ROUNDING_ULPS = 1.0     # per element of O: ~3.5 standard deviations of one round-to-nearest (ulp/sqrt 12)


@dataclass
class Verdict:
    name: str
    ok: bool
    err: float
    tol: float
    why: str = ""

    def __str__(self):
        status = "ok" if self.ok else "FAIL"
        return f"{self.name}: {status} err={self.err:.3g} tol={self.tol:.3g} {self.why}".rstrip()


def _finite_parts(got, ref, name):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        return None, None, f"shape {got.shape} != oracle {ref.shape}"
    if np.isnan(got).any():
        return None, None, f"{int(np.isnan(got).sum())} NaN"
    fin_ref, fin_got = np.isfinite(ref), np.isfinite(got)
    if not np.array_equal(fin_ref, fin_got) or not np.array_equal(got[~fin_got], ref[~fin_ref]):
        return None, None, f"{int((fin_ref != fin_got).sum())} non-finite mismatches"
    return got[fin_ref], ref[fin_ref], ""


def compare(name, got, ref, dtype, naive=None, role="out", terms=0.0, out_rounding=0.0) -> Verdict:
    g, r, why = _finite_parts(got, ref, name)
    if g is None:
        return Verdict(name, False, float("inf"), 0.0, why)
    if g.size == 0:
        return Verdict(name, True, 0.0, 0.0)
    err = float(np.max(np.abs(g - r)))
    mag = float(np.max(np.abs(r)))
    if dtype == "float32":
        tol = EXACT_RTOL * max(1.0, mag) + TERMS_ULPS * EPS["float32"] * terms
    else:
        if naive is None:
            raise ValueError("the tensor-core tier needs the same-precision naive reference")
        n = np.asarray(naive, np.float64)[np.isfinite(np.asarray(ref, np.float64))]
        tol = (TC_FACTOR[role] * float(np.max(np.abs(n - r))) + FLOOR_ULPS[role] * EPS[dtype] * mag
               + OUT_ROUNDING_ULPS * EPS[dtype] * out_rounding)
    return Verdict(name, err <= tol, err, tol)
