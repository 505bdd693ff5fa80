"""GPU suite, one feature at a time: Hypothesis cases that all carry one feature of issue 18 (a
built-in score or mask modifier, or a head dim past 128), for every GPU variant that claims it,
against the oracle. The general fuzz (test_gpu_variants.py) draws each modifier in a few percent of
its cases; here every case has it, so the per-feature counts the reports quote (fuzz.FEATURES, in
the session's fuzz.json) reach their targets in one device call.

Each test keeps its modules few (one modifier, head dims of at most two padded sizes): every distinct
(modifier text, dtype, head-dim bucket, dropout) is one NVRTC build per pytest worker that meets it
first. GPU_EXAMPLES examples per test (profile gpu), GPU_SHARDS tests per (variant, feature, dtype,
direction)."""
import os

import pytest
from hypothesis import given

from sandbox import fuzz, get_variant
from sandbox.registry import all_variants

SHARDS = range(int(os.environ.get("GPU_SHARDS", "1")))
NO_MOD = (lambda rng, B, Hq, Nq, Nk: None,)
MOD_DIMS = (16, 40, 64, 96, 128)          # two padded sizes on the tensor-core rungs (64, 128)
WIDE_DIMS = (136, 160, 192, 200, 256)     # the head dims past 128 (padded to 192 and 256 there)


def _gpu_variants():
    return [v for _, v in sorted(all_variants().items()) if v.backend in ("cuda", "numba")]


def _features(v):
    out = []
    if v.caps.score_mod:
        out += [f"score_mod:{name}" for name in fuzz.SCORE_MOD_FACTORIES]
    if v.caps.mask_mod:
        out += [f"mask_mod:{name}" for name in fuzz.MASK_MOD_FACTORIES]
    if any(d > 128 for d in v.caps.head_dims) and v.backend == "cuda":
        out.append("head_dim>128")
    return out


CASES = [(v.name, feature, dtype, direction) for v in _gpu_variants() for feature in _features(v)
         for dtype in v.caps.dtypes
         for direction in (("forward", "backward") if v.caps.backward else ("forward",))]


def _strategy(bound, dtype, feature):
    kind, _, name = feature.partition(":")
    if kind == "score_mod":
        return fuzz.cases(bound, dtype, fuzz.Limits(dims=MOD_DIMS),
                          score_mods=(fuzz.SCORE_MOD_FACTORIES[name],), mask_mods=NO_MOD)
    if kind == "mask_mod":
        return fuzz.cases(bound, dtype, fuzz.Limits(dims=MOD_DIMS), score_mods=NO_MOD,
                          mask_mods=(fuzz.MASK_MOD_FACTORIES[name],))
    dims = tuple(d for d in WIDE_DIMS if d in bound.variant.caps.head_dims)
    return fuzz.cases(bound, dtype, fuzz.Limits(max_n=200, dims=dims), score_mods=NO_MOD, mask_mods=NO_MOD)


def test_every_feature_has_a_variant():
    """Each built-in modifier and the wide head dims are fuzzed on some GPU variant."""
    covered = {feature for _, feature, _, _ in CASES}
    assert {f"score_mod:{n}" for n in fuzz.SCORE_MOD_FACTORIES} <= covered
    assert {f"mask_mod:{n}" for n in fuzz.MASK_MOD_FACTORIES} <= covered
    assert "head_dim>128" in covered


@pytest.mark.gpu
@pytest.mark.parametrize("shard", SHARDS)
@pytest.mark.parametrize("name,feature,dtype,direction", CASES)
def test_feature_matches_oracle(name, feature, dtype, direction, shard):
    bound = get_variant(name)
    want = feature.replace("softcap+sinks", "sinks")

    @given(_strategy(bound, dtype, feature))
    def check(case):
        assert want in fuzz.features(case), (feature, case)
        fuzz.assert_case(bound, case, direction)

    check()
