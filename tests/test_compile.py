"""Compile-only build of every registered CUDA variant (no GPU needed).

What is built (sandbox/compile_report.py): every CUDA variant's default config and each config of
its `report_configs()` that its `tuned` accepts (SANDBOX_COMPILE_FULL=1: every one), every unit of
`compile_units(config)`, each distinct kernel instantiation once (configs and variants that share a
kernel share its build), in a thread pool, through the disk cache of sandbox/kernel_cache.py (CI
starts with an empty one). The tests below also hold every key of every TUNED table to be a
configuration of its variant that this build covers.

Fails on a compile error, on register spills in any config marked tuned, or on shared memory above
the architecture's per-block limit.

Architectures: by default sm_90 only, the H100 / H200 target (223 distinct kernels on 2026-11-23,
about 2-2.5 s of NVRTC each: 4-5 minutes of both cores of a 2-core machine with an empty cache,
beside the rest of the suite; a few seconds with a warm one). SANDBOX_COMPILE_FULL=1 builds every report config for every architecture
of compile_report.ARCHS (sm_80 as well), as `python -m sandbox compile-report` does.
"""
import copy
import dataclasses
import os

import pytest

from sandbox import compile_report
from sandbox.device import has_gpu
from sandbox.problem import Problem
from sandbox.registry import all_variants

pytest.importorskip("cuda.bindings.nvrtc", reason="pip install .[compile] for the NVRTC compile check")
if has_gpu():
    # On the GPU image, NVRTC called from a process that pytest started returned an empty log (no
    # ptxas report), while the same command run directly worked: there, run
    # `python -m sandbox compile-report --gate` (which fails on spills in tuned configs) as a command of
    # its own. This check is CI's (no GPU).
    pytest.skip("compile-only check runs in CI; on a GPU machine run `python -m sandbox compile-report --gate`",
                allow_module_level=True)

FULL = os.environ.get("SANDBOX_COMPILE_FULL") == "1"
ARCHS = compile_report.ARCHS if FULL else ("sm_90",)
GATE = not FULL          # the defaults and tuned tables (compile_report.configs); FULL: every report config

# The build starts when pytest imports this module (collection), in its own process at a lower CPU
# priority: a single-process pytest run uses one core, and the build takes the other while the
# tests collected before these run. A session that runs none of these tests kills it at exit.
# Under pytest-xdist each worker would import this module: there the build starts on first use.
REPORT = None if os.environ.get("PYTEST_XDIST_WORKER") else compile_report.ReportProcess(ARCHS, nice=10, gate=GATE)


def rows():
    global REPORT
    if REPORT is None:
        REPORT = compile_report.ReportProcess(ARCHS, gate=GATE)
    return REPORT.rows()


def cuda_variants():
    return [v for v in all_variants().values() if v.backend == "cuda"]


def test_every_cuda_variant_compiles_for_every_arch():
    names = {r["variant"] for r in rows()}
    expected = {name for name, _, _ in compile_report.units(GATE)}
    assert expected and names == expected
    assert {r["arch"] for r in rows()} == set(ARCHS)


def test_every_listed_config_is_built():
    """Default and report_configs() of every CUDA variant: each unit of each, every kernel of each unit."""
    built = {(r["config"], r["unit"], r["kernel"], r["arch"]) for r in rows()}
    expected = {(repr(bound), unit.label, name, arch)
                for name_, bound, unit in compile_report.units(GATE) if bound is not None
                for name in unit.names for arch in ARCHS}
    assert expected and expected <= built
    for v in cuda_variants():
        assert repr(v.bind()) in {r["config"] for r in rows()}, f"{v.name}: default config not built"


def test_no_spills_in_tuned_configs():
    spills = [r for r in rows() if r["tuned"] and (r["spill_stores"] or r["spill_loads"])]
    assert not spills, compile_report.markdown(spills)


def test_shared_memory_within_the_device_limit():
    """Every kernel fits sm_90 (the H100/H200 target); larger configs are marked as not fitting sm_80."""
    over = [r for r in rows() if r["arch"] == "sm_90" and not r["fits"]]
    assert not over, compile_report.markdown(over)
    assert all(r["fits"] == (r["static_smem"] + r["dynamic_smem"] <= r["smem_limit"]) for r in rows())


def test_report_renders():
    text = compile_report.markdown(rows())
    assert "standard_gemm" in text and text.count("\n") == len(rows()) + 1


# ---- TUNED tables (no compilation of their own: the configs they name are among the report's)

def _tuned_variants():
    return [v for v in cuda_variants() if getattr(v.impl, "TUNED", None)]


def _covering(v, key):
    """The report configs of `v` that `impl.tuned` accepts when TUNED holds `key` alone: the configs
    the key describes, as the variant's own comparison reads it."""
    probe = copy.copy(v.impl)
    probe.TUNED = {key}
    return [b for b in compile_report.configs(v, GATE) if probe.tuned(b.config)]


def _launchable(v, bound) -> list[int]:
    """Head dims (64, 128) at which the config passes the variant's checks before a launch."""
    dims = []
    for d in (64, 128):
        try:
            bound.check(Problem(1, 1, 1, 128, 128, d, v.caps.dtypes[0]))
        except ValueError:
            continue
        dims.append(d)
    return dims


def test_tuned_keys_are_configuration_keys():
    """Every item of a TUNED key is a value the variant's configs take (a choice of one of its
    Params, or a field its configure() fixes, such as fa1-tc's split="q"), and the key describes a
    config the variant's `tuned` recognises (a key of the wrong shape, such as 4 items where
    `tuned` compares 5-tuples, describes none), one that passes its checks at some head dim."""
    assert _tuned_variants()
    for v in _tuned_variants():
        default = v.bind().config
        values = [p.choices for p in v.params] + [(getattr(default, f.name),) for f in dataclasses.fields(default)]
        for key in v.impl.TUNED:
            bad = [item for item in key if not any(item in c for c in values)]
            assert not bad, f"{v.name}: TUNED key {key}: {bad} neither a Param choice nor a fixed config field"
            covering = _covering(v, key)
            assert covering, (f"{v.name}: TUNED key {key} describes none of its report configs "
                              f"(compile_report.configs); add the config to report_configs(), or fix the key "
                              f"to the tuple impl.tuned compares")
            for bound in covering:
                assert _launchable(v, bound), f"{v.name}: {bound!r} (TUNED {key}) fails its checks at d = 64 and 128"


def test_every_tuned_config_is_compiled_and_held_to_the_gate():
    """The config each TUNED key describes is built by the report, every one of its units, with its
    rows marked tuned (so the spill check covers it)."""
    by_config = {}
    for r in rows():
        by_config.setdefault(r["config"], []).append(r)
    for v in _tuned_variants():
        for key in v.impl.TUNED:
            for bound in _covering(v, key):
                got = by_config.get(repr(bound), [])
                units = v.impl.compile_units(bound.config)
                assert units and {u.label for u in units} <= {r["unit"] for r in got}, \
                    f"{v.name}: {bound!r} (TUNED {key}) not compiled"
                forward = [r for r in got if r["tuned"]]
                assert forward, f"{v.name}: {bound!r} (TUNED {key}) compiled but not marked tuned"


def test_tuned_keys_of_the_tensor_core_ladder_are_five_tuples():
    """fa2-tc-naive and fa1-tc inherit fa2-tc's `tuned`, which compares (block_r, block_c, warps,
    min_blocks, split): their defaults are their tuned configs."""
    variants = all_variants()
    for name in ("fa2-tc-naive", "fa1-tc"):
        v = variants[name]
        assert all(len(k) == 5 for k in v.impl.TUNED)
        assert v.impl.tuned(v.bind().config), f"{name}: default config not tuned"
