"""GPU: a NaN in the inputs propagates as the oracle says (issue 15), for every registered variant.

One NaN query row and one NaN key under a causal mask (so that some rows do not see the key), and a
NaN in a row that sees no key (which stays dead: out 0, lse -inf). The forward's out and lse are
NaN exactly where the oracle's are and match it elsewhere under the tier's tolerance
(sandbox/tolerance.py, as tests/test_gpu_variants.py compares). The backward's gradients have no NaN
where the oracle has none and match it there; the oracle's backward is the textbook equations in
IEEE arithmetic, the most NaN a kernel may produce (sandbox/oracle.py), so where it has NaN a
kernel may have either; dQ of a NaN query row that sees a key must be NaN, not 0.
Run with `pytest -m gpu` on a GPU machine; skipped without one (tests/conftest.py).
"""
import numpy as np
import pytest

import sandbox
from sandbox import get_variant, oracle, tolerance
from sandbox.arrays import to_host
from sandbox.precision import numpy_dtype
from sandbox.registry import all_variants

pytestmark = pytest.mark.gpu

# (head, row or key, column) of each NaN; two heads, so head 1 is the untouched control in the first two
CASES = {
    # row 37 sees keys 0..37 (not key 64); key 64 is seen by rows 64..149, alone in its tile for Bc <= 64
    # (a tile whose only visible score is NaN: its max is -inf under fmaxf)
    "q-and-k": dict(Nq=150, Nk=150, nan_q=[(0, 37, 5)], nan_k=[(0, 64, 3)], nan_rows=[(0, 37)]),
    "q-only": dict(Nq=150, Nk=150, nan_q=[(0, 37, 5)], nan_k=[], nan_rows=[(0, 37)]),
    # causal with Nq > Nk (bottom-right aligned): rows 0..29 see no key; row 10's NaN is masked away
    "dead-rows": dict(Nq=150, Nk=120, nan_q=[(0, 10, 5), (1, 80, 0)], nan_k=[], nan_rows=[(1, 80)]),
}


def _configs(variant):
    """The default parameters and, for variants with a warp partitioning axis, its other choices; for the
    fa3 rungs, the softmax exp2 on the FMA pipe in every third column block (key 64 of "q-and-k" is in n8
    block 8, one of them: its fmaxf clamp once turned a NaN score into 0, found in review)."""
    out = [{}]
    for p in variant.params:
        if p.name == "split":
            out += [{"split": c} for c in p.choices if c != p.default]
        if p.name == "exp2_fma":
            out.append({"exp2_fma": 3})
    return out


def _spec(name, params):
    return name + "".join(f"+{k}={v}" for k, v in params.items()).replace("+", ":", 1)


PARAMS = [(n, dt, params) for n, v in sorted(all_variants().items()) for dt in v.caps.dtypes for params in _configs(v)]


def _bind(name, params, problem, direction):
    """The bound variant, or None where it rejects the problem; a split choice the default tile
    rejects is retried with the smallest block_r and the largest block_c (split-K needs those)."""
    variant = all_variants()[name]
    tries = [params]
    if params:
        small = {p.name: min(c for c in p.choices if isinstance(c, int)) for p in variant.params if p.name == "block_r"}
        large = {p.name: max(c for c in p.choices if isinstance(c, int)) for p in variant.params if p.name == "block_c"}
        tries.append({**params, **small, **large})
    for prm in tries:
        try:
            bound = get_variant(name, **prm)
            bound.check(problem, direction)
            return bound
        except ValueError:
            continue
    return None


def _inputs(dtype, case, d, seed=15):
    rng = np.random.default_rng(seed)
    npdt = numpy_dtype(dtype)
    q = rng.standard_normal((1, 2, case["Nq"], d))
    k, v = (rng.standard_normal((1, 2, case["Nk"], d)) for _ in range(2))
    dout = rng.standard_normal((1, 2, case["Nq"], d))
    clean = [x.astype(npdt) for x in (q, k, v, dout)]
    q, k, v, dout = (x.copy() for x in clean)
    for h, i, c in case["nan_q"]:
        q[0, h, i, c] = np.nan
    for h, j, c in case["nan_k"]:
        k[0, h, j, c] = np.nan
    return clean, (q, k, v, dout)


def _f64(x):
    return np.asarray(to_host(x)).astype(np.float64)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name,dtype,params", PARAMS)
def test_nan_inputs_propagate_like_the_oracle(name, dtype, params, case):
    variant = all_variants()[name]
    d = 64 if 64 in variant.caps.head_dims else variant.caps.head_dims[-1]
    spec = CASES[case]
    (qc, kc, vc, doc), (q, k, v, dout) = _inputs(dtype, spec, d)
    problem = sandbox.problem.make_problem(q, k, v, causal=True)
    bound = _bind(name, params, problem, "forward")
    if bound is None:
        pytest.skip(f"{_spec(name, params)} rejects the problem")
    where = f"{bound!r} {dtype} {case}"
    exact = dtype == "float32"

    res = sandbox.forward(q, k, v, variant=bound, causal=True)
    refs = oracle.forward(q, k, v, causal=True)
    # tolerance inputs from the NaN-free problem (the rows the NaN does not reach are the same there)
    terms = oracle.term_bounds(doc, qc, kc, vc, causal=True) if exact else {}
    naives = (None, None) if exact else oracle.forward(q, k, v, causal=True, precision=dtype)
    for name_, got, ref, naive in zip(("out", "lse"), (res.out, res.lse), refs, naives):
        got = _f64(got)
        assert np.array_equal(np.isnan(got), np.isnan(ref)), \
            f"{where}: {name_} NaN at {np.argwhere(np.isnan(got) != np.isnan(ref))[:5].tolist()} ... differs from the oracle"
        sel = ~np.isnan(ref)
        verdict = tolerance.compare(name_, got[sel], ref[sel], dtype, None if naive is None else naive[sel], name_,
                                    terms.get(name_, 0.0))
        assert verdict.ok, f"{where}: {verdict}"

    if not variant.caps.backward or _bind(name, bound.params, problem, "backward") is None:
        return
    grads = sandbox.backward(dout, res)
    refs = oracle.backward(dout, q, k, v, causal=True)
    naives = (None,) * 3 if exact else oracle.backward(dout, q, k, v, causal=True, precision=dtype)
    rounding = {} if exact else oracle.output_rounding_bounds(doc, qc, kc, vc, causal=True)
    for name_, got, ref, naive in zip(("dq", "dk", "dv"), grads, refs, naives):
        got = _f64(got)
        sel = ~np.isnan(ref)
        extra = np.isnan(got) & sel
        assert not extra.any(), f"{where}: {name_} has {int(extra.sum())} NaN where the oracle has none, " \
                                f"e.g. {np.argwhere(extra)[:5].tolist()}"
        verdict = tolerance.compare(name_, got[sel], ref[sel], dtype, None if naive is None else naive[sel], "grad",
                                    terms.get(name_, 0.0), rounding.get(name_, 0.0))
        assert verdict.ok, f"{where}: {verdict}"
        if name_ == "dq":
            for h, i in spec["nan_rows"]:
                assert np.isnan(got[0, h, i]).all(), f"{where}: dQ of NaN row {i} (head {h}) is not NaN"
