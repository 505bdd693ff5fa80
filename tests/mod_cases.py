"""Shared fixtures of the compiled-modifier tests (tests/test_modifiers_tc.py for fa2-tc,
tests/test_modifiers_hopper.py for the Hopper rungs): one problem shape, the built-in modifiers
drawn the same way, and the C parameter types MOD_PARAMS declares (kernels_cu/tc_mods.cuh) once a
module's -D options are substituted, to hold the host's argument packing to them."""
import re

import numpy as np
import pytest

from sandbox import loader, modifiers as M
from sandbox.device import has_gpu
from sandbox.problem import make_problem

B, HQ, HKV, NQ, NK = 2, 4, 2, 70, 90


def score_mods():
    rng = np.random.default_rng(0)
    return {"softcap": M.softcap(2.0), "alibi": M.alibi(M.alibi_slopes(HQ)),
            "relative_bias": M.relative_bias(rng.standard_normal((HQ, 7)), 3),
            "sinks": M.sinks(rng.normal(size=HQ)), "softcap+sinks": M.softcap(3.0).with_sinks([0.5])}


def twice_softcap(c: float) -> M.ScoreMod:
    """2 c tanh(s / c): the soft-cap's factored texts (core fa_tanh(s), derivative fa_sech2(s), so FA_TANH_CORE too)
    with post pre = 2 instead of 1, so that a backward that drops or doubles the factor (fa3_bwd2.cu ds_scale,
    fa3_backward.dq_scale) fails the oracle."""
    cap = (c, 1.0 / c)             # the soft-cap's buffer layout, for its NumPy and scalar forms (sandbox/modifiers.py)
    return M.ScoreMod("twice_softcap", lambda s, b, h, i, j: 2 * M._softcap_np(s, b, h, i, j, cap),
                      lambda s, b, h, i, j: 2 * M._softcap_scalar(s, b, h, i, j, cap),
                      f"{2 * c:.1f}f * fa_tanh(s * {1 / c:.9e}f)",
                      lambda s, b, h, i, j: 2 * M._softcap_grad_np(s, b, h, i, j, cap),
                      lambda s, b, h, i, j: 2 * M._softcap_grad_scalar(s, b, h, i, j, cap),
                      f"2.0f * fa_sech2(s * {1 / c:.9e}f)", params={"c": c},
                      cuda_factored=("fa_tanh(s)", 1 / c, 2 * c), cuda_factored_grad="fa_sech2(s)", monotone=True)


def mask_mods():
    ids = np.sort(np.random.default_rng(1).integers(0, 3, (B, NQ)), axis=1)
    kv = np.sort(np.random.default_rng(2).integers(0, 3, (B, NK)), axis=1)
    pad = np.arange(NK)[None, None, None, :] >= np.array([0, 30])[:, None, None, None]     # key padding per entry
    return {"document": M.document(ids, kv), "prefix_lm": M.prefix_lm([5, 40]),
            "dense": M.dense(pad & np.ones((1, 1, NQ, NK), bool))}


def problem(score_mod=None, mask_mod=None, dtype=np.float16, d=64, **kw):
    q = np.zeros((B, HQ, NQ, d), dtype)
    k = np.zeros((B, HKV, NK, d), dtype)
    return make_problem(q, k, k, score_mod=score_mod, mask_mod=mask_mod, **kw)


def declared_params(options) -> list[str]:
    """The C types of MOD_PARAMS (kernels_cu/tc_mods.cuh) once the -D options are substituted, then those of
    FACTORED_PARAMS where the options compile a factored core (the backward kernels list both)."""
    header = loader.source_text("tc_mods.cuh")
    body = re.search(r"#define MOD_PARAMS (.*)", header).group(1)
    if "-DFA_SCORE_FACTORED=1" in options:
        body += re.search(r"#define FACTORED_PARAMS (.*)", header).group(1)
    macros = dict(o[2:].split("=", 1) for o in options if o.startswith("-D") and "=" in o)
    for name in ("FA_SM_PARAMS", "FA_MM_PARAMS"):
        body = body.replace(name, macros.get(name, ""))
    decls = [x.strip() for x in body.split(",") if x.strip()]
    return [re.sub(r"\s*(__restrict__\s*)?\w+$", "", x).strip() for x in decls]


C_OF = {np.dtype(np.int32): "int", np.dtype(np.float32): "float"}
PTR_OF = {np.dtype(np.float32): "const float*", np.dtype(np.int32): "const int*",
          np.dtype(np.uint8): "const unsigned char*", np.dtype(np.int8): "const signed char*"}


def compile_reports(units, arch: str) -> dict:
    """unit -> its ptxas reports, the units built in parallel through the disk cache (NVRTC on the CPU);
    skipped without cuda.bindings and on a GPU machine (NVRTC logs are empty under pytest on the GPU
    image: tests/test_compile.py)."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="pip install .[compile] for NVRTC builds")
    if has_gpu():
        pytest.skip("compile-only check (NVRTC logs are empty under pytest on the GPU image: tests/test_compile.py)")
    loader.prebuild(units, arch)
    return {u: loader.compile_only(u, arch) for u in units}
