"""The exact attention oracle: NumPy, float64, written for clarity (docs/ARCHITECTURE.md "The oracle").

It is the definition of every feature's semantics. Forward: materialise S = scale * Q K^T, apply the
mask (causal / window / block-sparse, bottom-right aligned), softmax, dropout (the
`sandbox.dropout_mask` RNG contract), O = P V. Backward by the textbook equations:

    dV = P_drop^T dO,  dP_drop = dO V^T,  dP = dP_drop * Z / (1 - p),
    D = rowsum(dO * O),  dS = P * (dP - D),  dQ = scale * dS K,  dK = scale * dS^T Q

GQA/MQA: query head h reads K/V head h // (Hq // Hkv); dK and dV sum over the group.
A row that sees no key has out = 0, lse = -inf and zero gradients.

NaN inputs propagate, as in PyTorch (issue 15); a NaN is not a masked key. The mask is applied
first (masked scores are -inf before the row max), so a NaN at a masked position is dropped, and a
masked key adds no term to P V (not a 0 * NaN one):
- a NaN in q[b, h, i, :] makes row i's out and lse NaN, if row i sees at least one key (a row that
  sees none stays dead: out 0, lse -inf);
- a NaN in k[b, hk, j, :] makes out and lse NaN in every row that sees key j; a NaN in v[b, hk, j, c]
  makes out[..., c] NaN in those rows (lse untouched); rows that do not see key j are unaffected;
- only a row with no visible key (row max -inf, sum exactly 0) is dead; a NaN row max or sum is not.
The backward is the textbook equations above in IEEE arithmetic, with P = 0 at masked entries:
0 * NaN = NaN, so a NaN row's dS (D_i is NaN) is NaN across the row, and dQ = scale dS K, dK =
scale dS^T Q pick up NaN from any NaN row of K or Q of the head (e.g. a NaN q_i makes dK NaN for
every key of its K/V head). For NaN in q and k that is the most NaN a kernel may produce: one that
skips masked tiles (or entries) leaves finite some entries the oracle has NaN, never the reverse.
Known gap in the kernels: the tiled ones form P V over whole tiles (standard over every key), so a
NaN in v[j] also reaches, as 0 * NaN, rows that do not see key j (those in its tile; for standard,
all); only numba-rowwise skips masked keys. tests/test_gpu_nan.py puts NaN in q and k only.
Infinite inputs are out of scope.

Score and mask modifiers (sandbox/modifiers.py, issue 18): `score_mod` maps the scaled score
s = scale * q.k (what flex attention's score_mod sees) to the logit the softmax uses, and may add a
per-head sink logit to the softmax denominator; `mask_mod` is ANDed with causal, window and
block_mask. With them the forward is
    S_ij = mod(scale * q_i . k_j, b, h, i, j)  where visible (causal, window, block_mask, mask_mod)
    lse_i = log(sum_j exp(S_ij) + exp(sink_h)),  P_ij = exp(S_ij - lse_i)   (sink_h = -inf without sinks)
and the backward multiplies dS by mod'(s) at the visible entries before forming dQ and dK
(dS_raw = dS_mod * mod'(s)). A row with no visible key keeps out = 0; its lse is sink_h (-inf without
sinks).

`precision="float16"` (or "bfloat16", "float32") is the same-precision mode used by the
tensor-core tolerance rule: inputs and the materialised intermediates (S, P, O; dP, dS and the
gradients) are rounded to that dtype, as a naive kernel in that precision would store them.
"""
from __future__ import annotations

import numpy as np

from .masks import element_mask
from .modifiers import index_grids
from .philox import dropout_mask
from .precision import round_to


def _prepare(q, k, v, scale):
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("oracle expects q (B, Hq, Nq, d), k and v (B, Hkv, Nk, d)")
    B, Hq, Nq, d = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    g = Hq // Hkv
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    return q, np.repeat(k, g, axis=1), np.repeat(v, g, axis=1), scale, g


def _visible(B, H, Nq, Nk, causal, window, block_mask, mask_mod):
    """bool [Bm, Hm, Nq, Nk]: causal AND window AND block_mask AND mask_mod."""
    vis = element_mask(H, Nq, Nk, causal, window, block_mask)[None]
    if mask_mod is not None:
        vis = vis & mask_mod.visible(B, H, np.arange(Nq), Nk)
    return vis


def _raw_scores(q, k, scale, rnd):
    return rnd(np.einsum("bhid,bhjd->bhij", q, k) * scale)   # one rounding, as a GEMM epilogue does


def _modified(s, score_mod, rnd):
    """mod(s) on every entry (masked ones are replaced by -inf afterwards), rounded like s."""
    if score_mod is None:
        return s
    return rnd(score_mod.apply(s, *index_grids(*s.shape[:2], np.arange(s.shape[2]), s.shape[3])))


def _mod_derivative(s, score_mod):
    """mod'(s) [B, H, Nq, Nk] (the NumPy derivative), 1 without a modifier."""
    if score_mod is None:
        return 1.0
    return score_mod.derivative(s, *index_grids(*s.shape[:2], np.arange(s.shape[2]), s.shape[3]))


def _mod_curvature(s, score_mod):
    """|mod''(s)| by a central difference of the NumPy derivative (float64; a bound's ingredient, so
    a relative step of 1e-5 is plenty)."""
    h = 1e-5 * (1.0 + np.abs(s))
    return np.abs(_mod_derivative(s + h, score_mod) - _mod_derivative(s - h, score_mod)) / (2.0 * h)


def _probabilities(q, k, scale, causal, window, block_mask, rnd, score_mod=None, mask_mod=None):
    """(P [B,H,Nq,Nk], lse [B,H,Nq], visible [Bm,Hm,Nq,Nk]) in float64 with dead rows as zeros."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    s = _modified(_raw_scores(q, k, scale, rnd), score_mod, rnd)
    vis = _visible(B, H, Nq, Nk, causal, window, block_mask, mask_mod)
    sink = -np.inf if score_mod is None else score_mod.sink_logits(H)      # [1, H, 1, 1] or -inf
    s = np.where(vis, s, -np.inf)               # before the max: a NaN at a masked position is dropped
    m = np.maximum(s.max(axis=-1, keepdims=True), sink)   # NaN where a visible score is NaN (max propagates it)
    alive = m != -np.inf                        # NaN is not a dead row: only a row with no visible key is
    m_safe = np.where(alive, m, 0.0)
    with np.errstate(invalid="ignore"):
        e = np.where(vis, np.exp(s - m_safe), 0.0)   # masked entries 0, also in a NaN row (exp(-inf - NaN))
        l = e.sum(axis=-1, keepdims=True) + np.exp(sink - m_safe)   # the sink joins the denominator only
    p = rnd(np.where(alive & vis, e / np.where(alive, l, 1.0), 0.0))
    with np.errstate(divide="ignore"):
        lse = np.where(alive, m_safe + np.log(np.where(alive, l, 1.0)), -np.inf)[..., 0]
    return p, lse, vis


def _pv(pd, v, vis):
    """O = P V over the visible keys only: a masked key adds no term, not a 0 * NaN one (a NaN in v
    reaches the rows that see its key). The same einsum as before where v has no NaN."""
    bad = np.isnan(v)
    if not bad.any():
        return np.einsum("bhij,bhjd->bhid", pd, v)
    out = np.einsum("bhij,bhjd->bhid", pd, np.where(bad, 0.0, v))
    hit = np.einsum("bhij,bhjd->bhid", np.broadcast_to(vis, pd.shape).astype(np.float64), bad.astype(np.float64))
    return np.where(hit > 0, np.nan, out)


def _dropout(shape, dropout_p, seed, offset, rounds):
    if dropout_p == 0.0:
        return None
    return dropout_mask(shape, dropout_p, seed, offset, rounds) / (1.0 - dropout_p)


def forward(q, k, v, causal=False, scale=None, dropout_p=0.0, seed=0, offset=0, window=None,
            block_mask=None, precision="float64", philox_rounds=10, score_mod=None, mask_mod=None):
    """-> (out [B,Hq,Nq,d] float64, lse [B,Hq,Nq] float64)."""
    rnd = lambda x: round_to(x, precision)  # noqa: E731  identity for float64
    q, k, v = (rnd(x) for x in (q, k, v))
    q, k, v, scale, _ = _prepare(q, k, v, scale)
    p, lse, vis = _probabilities(q, k, scale, causal, window, block_mask, rnd, score_mod, mask_mod)
    z = _dropout(p.shape, dropout_p, seed, offset, philox_rounds)
    pd = p if z is None else rnd(p * z)
    out = rnd(_pv(pd, v, vis))
    return out, lse


def backward(dout, q, k, v, causal=False, scale=None, dropout_p=0.0, seed=0, offset=0, window=None,
             block_mask=None, precision="float64", philox_rounds=10, score_mod=None, mask_mod=None):
    """-> (dq, dk, dv) in float64, shaped like q, k, v."""
    rnd = lambda x: round_to(x, precision)  # noqa: E731
    Hkv = np.shape(k)[1]
    q, k, v, dout = (rnd(x) for x in (q, k, v, dout))
    q, kr, vr, scale, g = _prepare(q, k, v, scale)
    dout = np.asarray(dout, dtype=np.float64)
    p, _, vis = _probabilities(q, kr, scale, causal, window, block_mask, rnd, score_mod, mask_mod)
    z = _dropout(p.shape, dropout_p, seed, offset, philox_rounds)
    pd = p if z is None else rnd(p * z)
    out = rnd(_pv(pd, vr, vis))                 # the forward's output (D reads it)
    dv = np.einsum("bhij,bhid->bhjd", pd, dout)
    dpd = rnd(np.einsum("bhid,bhjd->bhij", dout, vr))
    dp = dpd if z is None else dpd * z
    D = np.sum(dout * out, axis=-1, keepdims=True)
    ds = rnd(p * (dp - D))
    if score_mod is not None:                   # dS_raw = dS_mod * mod'(s), at the visible entries only
        ds = rnd(np.where(vis, ds * _mod_derivative(_raw_scores(q, kr, scale, rnd), score_mod), ds))
    dq = scale * np.einsum("bhij,bhjd->bhid", ds, kr)
    dk = scale * np.einsum("bhij,bhid->bhjd", ds, q)
    B, _, Nk, d = kr.shape
    dk = dk.reshape(B, Hkv, g, Nk, d).sum(axis=2)
    dv = dv.reshape(B, Hkv, g, Nk, d).sum(axis=2)
    return rnd(dq), rnd(dk), rnd(dv)



def output_rounding_bounds(dout, q, k, v, causal=False, scale=None, dropout_p=0.0, seed=0, offset=0,
                           window=None, block_mask=None, philox_rounds=10, score_mod=None, mask_mod=None) -> dict:
    """What rounding `out` to a 16-bit dtype moves the gradients by, per unit of relative rounding.

    Every FlashAttention backward forms D = rowsum(dO o O) from the stored (rounded) output, and
    dS = P * (dP - D) cancels: where the exact gradient is ~0 (e.g. Nq = Nk = 1, where dP = D), what
    is left is O's rounding carried through D. O's elements round independently, so D_i moves by
    about u * rms_i, rms_i = sqrt(sum_c (dO_ic O_ic)^2), for a relative rounding u; then
    dQ_i moves by scale * rms_i * sum_j P_ij |k_j| and dK_j by scale * sum_i P_ij rms_i |q_i|.
    With a score modifier, P is weighted by |mod'(s)| (dS is multiplied by it).
    Returns {"dq", "dk", "dv"} -> the largest element of each, per unit of u (dv does not see D)."""
    Hkv = np.shape(k)[1]
    q, kr, vr, scale, g = _prepare(q, k, v, scale)
    dout = np.asarray(dout, dtype=np.float64)
    p, _, _ = _probabilities(q, kr, scale, causal, window, block_mask, lambda x: x, score_mod, mask_mod)
    z = _dropout(p.shape, dropout_p, seed, offset, philox_rounds)
    out = np.einsum("bhij,bhjd->bhid", p if z is None else p * z, vr)
    rms = np.sqrt(np.sum((dout * out) ** 2, axis=-1, keepdims=True))          # [B, H, Nq, 1]
    pg = p if score_mod is None else p * np.abs(_mod_derivative(_raw_scores(q, kr, scale, lambda x: x), score_mod))
    dq = abs(scale) * rms * np.einsum("bhij,bhjd->bhid", pg, np.abs(kr))
    B, _, Nk, d = kr.shape
    dk = abs(scale) * np.einsum("bhij,bhid->bhjd", pg, rms * np.abs(q)).reshape(B, Hkv, g, Nk, d).sum(2)
    return {"dq": float(dq.max()) if dq.size else 0.0, "dk": float(dk.max()) if dk.size else 0.0, "dv": 0.0}


def term_bounds(dout, q, k, v, causal=False, scale=None, dropout_p=0.0, seed=0, offset=0,
                window=None, block_mask=None, philox_rounds=10, score_mod=None, mask_mod=None) -> dict:
    """Magnitudes of the terms behind each output, for the exact-tier tolerance (sandbox/tolerance.py).

    A float32 kernel's rounding error in a sum is bounded by eps * sum|terms|, not eps * |sum|:
    - scores: s = scale * q.k carries an error ~ eps * S_abs, S_abs = max scale * sum_c |q_c k_c|;
      softmax turns it into a relative error of P, so out is off by ~ (1 + S_abs) * max|v| * eps
      and lse by ~ (1 + S_abs) * eps (large logits);
    - gradients: dS = P * (dP - D) cancels, so a gradient near 0 can be built from large terms;
      its bound is the sum of |terms| times (1 + S_abs) for the score error carried into P.
    With a score modifier the score error is carried through it and the modifier adds its own:
    S_abs = max |mod'(s)| * scale * sum_c |q_c k_c| + |mod(s)| (+ |sink|), and dS's terms are
    weighted by |mod'(s)|. The backward also evaluates mod' at the erring score: dS moves by
    P |dP - D| |mod''(s)| eps scale sum_c |q_c k_c| (the exact dP - D), with mod'' by a central
    difference of the NumPy derivative (seen on the GPU: numba-fa2, soft-cap 0.5, logits ~ 30 x
    sqrt(d), dK 1.3e-4 against a tolerance of 3.7e-5 without this term; mod'' reaches 0.77 / cap).
    Returns {"out", "lse", "dq", "dk", "dv"} -> float.
    """
    Hkv = np.shape(k)[1]
    q, kr, vr, scale, g = _prepare(q, k, v, scale)
    dout = np.asarray(dout, dtype=np.float64)
    p, _, vis = _probabilities(q, kr, scale, causal, window, block_mask, lambda x: x, score_mod, mask_mod)
    s_abs_all = abs(scale) * np.einsum("bhid,bhjd->bhij", np.abs(q), np.abs(kr))
    grad_abs, curv = 1.0, 0.0
    if score_mod is not None:
        s = _raw_scores(q, kr, scale, lambda x: x)
        grad_abs = np.abs(_mod_derivative(s, score_mod)) if score_mod.has_grad else 1.0
        curv = _mod_curvature(s, score_mod) * s_abs_all if score_mod.has_grad else 0.0
        sink = score_mod.sink_logits(q.shape[1])
        sink_abs = np.where(np.isfinite(sink), np.abs(sink), 0.0)
        s_abs_all = grad_abs * s_abs_all + np.abs(_modified(s, score_mod, lambda x: x)) + sink_abs
    s_abs = float(np.where(vis, s_abs_all, 0.0).max()) if s_abs_all.size else 0.0
    z = _dropout(p.shape, dropout_p, seed, offset, philox_rounds)
    zz = 1.0 if z is None else z
    pd = p * zz
    out = np.einsum("bhij,bhjd->bhid", pd, vr)
    dp_abs = np.einsum("bhid,bhjd->bhij", np.abs(dout), np.abs(vr)) * zz
    D_abs = np.sum(np.abs(dout * out), axis=-1, keepdims=True)
    amplify = 1.0 + s_abs
    # the curvature term multiplies the exact dP - D: its factor is the error of mod', not a sum that cancels
    dp = np.einsum("bhid,bhjd->bhij", dout, vr) * zz
    D = np.sum(dout * out, axis=-1, keepdims=True)
    ds_abs = p * ((dp_abs + D_abs) * grad_abs * amplify + np.abs(dp - D) * curv)
    B, _, Nk, d = kr.shape
    dq = abs(scale) * np.einsum("bhij,bhjd->bhid", ds_abs, np.abs(kr))
    dk = (abs(scale) * np.einsum("bhij,bhid->bhjd", ds_abs, np.abs(q))).reshape(B, Hkv, g, Nk, d).sum(2)
    dv = amplify * np.einsum("bhij,bhid->bhjd", pd, np.abs(dout)).reshape(B, Hkv, g, Nk, d).sum(2)
    vmax = float(np.abs(vr).max()) * (float(np.max(zz)) if z is not None else 1.0)
    grads = {n: (float(x.max()) if x.size else 0.0) for n, x in (("dq", dq), ("dk", dk), ("dv", dv))}
    return {"out": amplify * vmax, "lse": amplify, **grads}
