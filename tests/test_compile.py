"""Compile-only build of every registered CUDA variant for sm_80 and sm_90 (no GPU needed).

Fails on a compile error, on register spills in any config marked tuned, or on shared memory above
the architecture's per-block limit."""
import pytest

from sandbox import compile_report
from sandbox.device import has_gpu

pytest.importorskip("cuda.bindings.nvrtc", reason="pip install .[compile] for the NVRTC compile check")
if has_gpu():
    # On the GPU image, NVRTC called from a process that pytest started returned an empty log (no
    # ptxas report), while the same command run directly worked: bench/gpu_session.sh runs the
    # report directly there and fails on spills in tuned configs. This check is CI's (no GPU).
    pytest.skip("compile-only check runs in CI; on GPU machines bench/gpu_session.sh runs it", allow_module_level=True)

ROWS = None


def rows():
    global ROWS
    if ROWS is None:
        ROWS = compile_report.report_in_subprocess()
    return ROWS


def test_every_cuda_variant_compiles_for_every_arch():
    names = {r["variant"] for r in rows()}
    expected = {name for name, _, _ in compile_report.units()}
    assert expected and names == expected
    assert {r["arch"] for r in rows()} == set(compile_report.ARCHS)


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
