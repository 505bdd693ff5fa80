"""Fuzz a variant against the oracle: Hypothesis strategies for problems a variant claims to
support, and the check of one case under the tolerance rule (docs/ARCHITECTURE.md "Tolerances").

Awkward inputs on purpose: length 1, lengths that are not tile multiples, Nq != Nk, rows that see
no key (causal with Nq > Nk, narrow windows, sparse layouts), large logits and a non-zero mean.
Used by tests/ (CPU simulator and GPU suites) and by `python -m sandbox fuzz`.

Score and mask modifiers (sandbox/modifiers.py) are drawn for variants whose capabilities list them:
the built-ins with random parameters (SCORE_MODS, MASK_MODS), or the factories a caller passes (a
user's modifier). The kernel runs the modifier's scalar form, the oracle its NumPy form, so a
mismatch between the two shows as a failed comparison; check_case also compares the two forms
directly (and the derivative with a finite difference) as the "score_mod" / "mask_mod" verdicts.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from . import api, modifiers, oracle, tolerance
from .masks import BlockSparse
from .precision import numpy_dtype
from .registry import BoundVariant

EXAMPLES = Counter()          # examples checked, per "variant/dtype/direction" (for the reports)
FEATURES = Counter()          # examples checked, per "variant/feature" (features(case))


def features(case: "Case") -> list[str]:
    """The features a case exercises, as the reports count them: causal, window, block_sparse,
    dropout, gqa, scale (not 1/sqrt(d)), head_dim>128, score_mod:<name> (sinks counted as their
    own), mask_mod:<name>."""
    o = case.options
    out = [name for name, on in (("causal", o.get("causal")), ("window", o.get("window") is not None),
                                 ("block_sparse", o.get("block_mask") is not None),
                                 ("dropout", o.get("dropout_p", 0.0) > 0.0), ("gqa", case.Hq != case.Hkv),
                                 ("scale", o.get("scale") is not None), ("head_dim>128", case.d > 128)) if on]
    score, mask = o.get("score_mod"), o.get("mask_mod")
    if score is not None:
        out.append(f"score_mod:{score.name.removesuffix('+sinks')}")
        if score.sink is not None:
            out.append("score_mod:sinks")
    if mask is not None:
        out.append(f"mask_mod:{mask.name}")
    return out


@dataclass(frozen=True)
class Limits:
    """Size envelope of generated problems."""

    max_n: int = 300
    max_batch_heads: int = 6
    dims: tuple = (1, 3, 8, 16, 32, 40, 64, 96, 128)

    @classmethod
    def simulator(cls):
        return cls(max_n=6, max_batch_heads=2, dims=(1, 2, 4))


@dataclass
class Case:
    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    d: int
    dtype: str
    options: dict
    data_seed: int
    logit_scale: float = 1.0
    mean: float = 0.0

    def inputs(self):
        """q, k, v, dout as NumPy arrays of the case's dtype (deterministic in data_seed)."""
        rng = np.random.default_rng(self.data_seed)
        npdt = numpy_dtype(self.dtype)
        q = rng.standard_normal((self.B, self.Hq, self.Nq, self.d)) * self.logit_scale + self.mean
        k = rng.standard_normal((self.B, self.Hkv, self.Nk, self.d)) + self.mean
        v = rng.standard_normal((self.B, self.Hkv, self.Nk, self.d)) + self.mean
        dout = rng.standard_normal((self.B, self.Hq, self.Nq, self.d))
        return tuple(x.astype(npdt) for x in (q, k, v, dout))


# Modifier factories: (rng, B, Hq, Nq, Nk) -> a modifier that fits the problem.
def _heads(rng, Hq):
    return int(rng.choice([1, Hq]))


def _relative_bias(rng, B, Hq, Nq, Nk):
    dist = int(rng.integers(0, 4))
    return modifiers.relative_bias(rng.standard_normal((_heads(rng, Hq), 2 * dist + 1)), dist)


# The built-in score modifiers by name (the feature names of `features`), then in the order the
# fuzzer draws them; "sinks" draws sinks alone or with a soft-cap.
SCORE_MOD_FACTORIES = {
    "softcap": lambda rng, B, Hq, Nq, Nk: modifiers.softcap(float(rng.choice([0.5, 2.0, 20.0, 50.0]))),
    "alibi": lambda rng, B, Hq, Nq, Nk: modifiers.alibi(rng.uniform(-1.0, 0.5, _heads(rng, Hq))),
    "relative_bias": _relative_bias,
    "sinks": lambda rng, B, Hq, Nq, Nk: modifiers.sinks(rng.normal(0.0, 2.0, _heads(rng, Hq))),
    "softcap+sinks": lambda rng, B, Hq, Nq, Nk: modifiers.softcap(3.0).with_sinks(rng.normal(0.0, 2.0, _heads(rng, Hq))),
}
SCORE_MODS = tuple(SCORE_MOD_FACTORIES.values())


def _ids(rng, rows, n):
    """Sorted document ids in 0..2 (packed sequences), shape (rows, n)."""
    return np.sort(rng.integers(0, 3, (rows, n)), axis=1)


def _document(rng, B, Hq, Nq, Nk):
    rows = int(rng.choice([1, B]))
    return modifiers.document(_ids(rng, rows, Nq), _ids(rng, rows, Nk))


MASK_MOD_FACTORIES = {
    "document": _document,
    "prefix_lm": lambda rng, B, Hq, Nq, Nk: modifiers.prefix_lm(rng.integers(0, Nk + 1, int(rng.choice([1, B])))),
    "dense": lambda rng, B, Hq, Nq, Nk: modifiers.dense(_padding_mask(rng, B, Nq, Nk)),
}


def _padding_mask(rng, B, Nq, Nk):
    """A model's mask: causal (bottom-right aligned) or not, keys left-padded per batch entry, and in about a third
    of the cases random holes (a packed or irregular mask), (B, 1, Nq, Nk) bool."""
    i, j = np.arange(Nq)[:, None] + (Nk - Nq), np.arange(Nk)[None, :]
    base = (j <= i) if rng.random() < 0.5 else np.ones((Nq, Nk), bool)
    pad = rng.integers(0, max(1, Nk // 2) + 1, B)
    out = base[None, None] & (j[None, None] >= pad[:, None, None, None])
    if rng.random() < 0.3:
        out &= rng.random(out.shape) < 0.7
    return out
MASK_MODS = tuple(MASK_MOD_FACTORIES.values())


def cases(bound: BoundVariant, dtype: str, limits: Limits = Limits(), score_mods=None, mask_mods=None):
    """Hypothesis strategy of Cases within `bound`'s capabilities and `limits` (Nq at most
    caps.max_query_rows where the variant has one).

    score_mods / mask_mods: modifier factories (rng, B, Hq, Nq, Nk) -> modifier. None: the built-ins
    (SCORE_MODS, MASK_MODS), drawn in about half the cases where the variant has the capability;
    given: one of them in every case (the caller asks for its modifier to be tested)."""
    from hypothesis import strategies as st

    caps = bound.caps                  # as the config has them (registry.BoundVariant.caps)
    dims = [d for d in limits.dims if d in caps.head_dims] or [caps.head_dims[0]]
    # 16-bit inputs: keep fp16 scores finite; fp32 gets genuinely large logits.
    big = 30.0 if dtype == "float32" else 4.0

    # query rows within the variant's envelope (decoding kernels: caps.max_query_rows), keys any length
    max_q = limits.max_n if caps.max_query_rows is None else max(1, min(limits.max_n, caps.max_query_rows))

    def lengths(top):
        return st.one_of(st.integers(1, min(8, top)), st.integers(1, top))

    @st.composite
    def build(draw):
        Nq, Nk, d = draw(lengths(max_q)), draw(lengths(limits.max_n)), draw(st.sampled_from(dims))
        heads = draw(st.sampled_from([1, 2, 3, 4]))
        group = draw(st.sampled_from([1, 2, heads])) if caps.gqa else 1
        Hkv = max(1, heads // group) if heads % group == 0 else heads
        Hq = Hkv * (heads // Hkv)
        B = draw(st.integers(1, max(1, limits.max_batch_heads // Hq)))
        opts = {}
        if caps.causal and draw(st.booleans()):
            opts["causal"] = True
        if caps.window and draw(st.integers(0, 3)) == 0:
            side = st.one_of(st.none(), st.integers(0, max(Nq, Nk)))
            opts["window"] = (draw(side), draw(side))
        if caps.block_sparse and draw(st.integers(0, 3)) == 0:
            bq, bk = draw(st.integers(1, max(1, Nq))), draw(st.integers(1, max(1, Nk)))
            hm = draw(st.sampled_from([1, Hq]))
            shape = (hm, -(-Nq // bq), -(-Nk // bk))
            density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
            layout = np.random.default_rng(draw(st.integers(0, 2**31))).random(shape) < density
            opts["block_mask"] = BlockSparse(layout, (bq, bk))
        if caps.dropout and draw(st.integers(0, 2)) == 0:
            opts["dropout_p"] = draw(st.sampled_from([0.1, 0.5, 0.9]))
            opts["seed"] = draw(st.integers(0, 2**64 - 1))
            opts["offset"] = draw(st.integers(0, 2**32 - 1))
        if draw(st.integers(0, 4)) == 0:
            opts["scale"] = draw(st.sampled_from([0.05, 1.0, 2.5, -0.7]))
        for key, given, default, able in (("score_mod", score_mods, SCORE_MODS, caps.score_mod),
                                          ("mask_mod", mask_mods, MASK_MODS, caps.mask_mod)):
            if given is not None or (able and draw(st.booleans())):
                factory = draw(st.sampled_from(list(given if given is not None else default)))
                rng = np.random.default_rng(draw(st.integers(0, 2**31)))
                opts[key] = factory(rng, B, Hq, Nq, Nk)
        logit_scale = draw(st.sampled_from([1.0, 1.0, big]))
        mean = draw(st.sampled_from([0.0, 0.0, 0.5]))
        return Case(B, Hq, Hkv, Nq, Nk, d, dtype, opts, draw(st.integers(0, 2**31)), logit_scale, mean)

    return build()


def check_case(bound: BoundVariant, case: Case, direction: str = "forward",
               references: dict | None = None) -> list[tolerance.Verdict]:
    """Run the variant on the case and compare with the oracle; one Verdict per output.

    references: a dict the caller keeps while it checks several variants on the same Case object
    (`sandbox run` checks every variant of a dtype on one case): the inputs and the oracle's answers
    are then computed once per case object and direction instead of once per variant."""
    memo = {} if references is None else references
    rounds = bound.params.get("philox_rounds", 10)
    kw = dict(case.options)

    def once(what, compute):
        key = (id(case), rounds, what)
        if key not in memo:
            memo[key] = (case, compute())      # the case is held so that its id is not reused
        return memo[key][1]

    q, k, v, dout = once("inputs", case.inputs)
    res = api.forward(q, k, v, variant=bound, **kw)

    def forward_refs():
        ref = oracle.forward(q, k, v, philox_rounds=rounds, **kw)
        if case.dtype == "float32":
            return ref, {}, oracle.term_bounds(dout, q, k, v, philox_rounds=rounds, **kw)
        return ref, dict(zip(("out", "lse"), oracle.forward(q, k, v, precision=case.dtype,
                                                            philox_rounds=rounds, **kw))), {}

    (ref_out, ref_lse), naive, terms = once("forward", forward_refs)
    verdicts = [tolerance.compare(name, _host(got), ref, case.dtype, naive.get(name), name, terms.get(name, 0.0))
                for name, got, ref in (("out", res.out, ref_out), ("lse", res.lse, ref_lse))]
    if direction == "backward":
        grads = api.backward(dout, res)

        def backward_refs():
            refs = oracle.backward(dout, q, k, v, philox_rounds=rounds, **kw)
            if case.dtype == "float32":
                return refs, (None,) * 3, {}
            return (refs, oracle.backward(dout, q, k, v, precision=case.dtype, philox_rounds=rounds, **kw),
                    oracle.output_rounding_bounds(dout, q, k, v, philox_rounds=rounds, **kw))

        refs, naives, rounding = once("backward", backward_refs)
        for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
            verdicts.append(tolerance.compare(name, _host(g), r, case.dtype, n, "grad", terms.get(name, 0.0),
                                              rounding.get(name, 0.0)))
    verdicts += _twin_verdicts(case)
    EXAMPLES[f"{bound.name}/{case.dtype}/{direction}"] += 1
    FEATURES.update(f"{bound.name}/{f}" for f in features(case))
    return verdicts


def _twin_verdicts(case) -> list[tolerance.Verdict]:
    """The case's modifiers: scalar form against NumPy form (and the derivative against a finite
    difference), on a problem of the case's shape (sandbox.modifiers.twin_errors)."""
    out = []
    for key in ("score_mod", "mask_mod"):
        mod = case.options.get(key)
        if mod is not None:
            # at most 8 x 8 positions: the scalar form runs in a Python loop
            errs = modifiers.twin_errors(mod, case.B, case.Hq, min(case.Nq, 8), min(case.Nk, 8), seed=case.data_seed)
            out.append(tolerance.Verdict(key, not errs, float(len(errs)), 0.0, "; ".join(errs)))
    return out


def assert_case(bound, case, direction="forward"):
    verdicts = check_case(bound, case, direction)
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, f"{bound!r} {direction} on {case}: " + "; ".join(bad)


def _host(x):
    from .arrays import to_host
    return to_host(x)
