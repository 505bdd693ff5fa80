"""Hypothesis profiles, the gpu marker, and the example counts printed at the end of a run.

Profiles (HYPOTHESIS_PROFILE; without it `gpu` where GPU_EXAMPLES is set, `ci` under CI=true, else `dev`):
    ci        small and derandomised: the same examples every run, fast on 2 cores
    dev       a little more, random
    gpu       the GPU suite: GPU_EXAMPLES examples per test (150 unless set)
    thorough  long fuzzing sessions
deadline=None everywhere: the first call of a kernel compiles it.
"""
import json
import os

import pytest

from sandbox.device import cupy_or_none

if cupy_or_none() is not None:
    # On the GPU image, importing torch after Hypothesis failed inside pytest (torch's custom-op
    # schema parser saw "annotate(strtag)"); importing it first avoids that.
    try:
        import torch  # noqa: F401
    except ImportError:
        pass

from hypothesis import HealthCheck, settings  # noqa: E402

from sandbox import fuzz  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=25, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=50, **_common)
settings.register_profile("gpu", max_examples=int(os.environ.get("GPU_EXAMPLES", "150")), print_blob=True, **_common)
settings.register_profile("thorough", max_examples=2000, **_common)


def hypothesis_profile(env) -> str:
    """The profile a run loads: HYPOTHESIS_PROFILE where set; else `gpu` where GPU_EXAMPLES is set (the count
    is that profile's, and alone it used to leave the `dev` profile's 50 examples in force, silently: session 19
    found GPU runs that asked for 150 or 1,000 examples a test and ran 50); else `ci` under CI, else `dev`."""
    if env.get("HYPOTHESIS_PROFILE"):
        return env["HYPOTHESIS_PROFILE"]
    if env.get("GPU_EXAMPLES"):
        return "gpu"
    return "ci" if env.get("CI") else "dev"


settings.load_profile(hypothesis_profile(os.environ))


def pytest_collection_modifyitems(config, items):
    # the compile report starts in the background when test_compile.py is collected: its tests last,
    # so the NVRTC builds overlap the whole suite (stable sort: the order is otherwise unchanged)
    items.sort(key=lambda item: item.path.name == "test_compile.py")
    if cupy_or_none() is not None:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _write_fuzz_report():
    """With FUZZ_REPORT set, each process (pytest-xdist workers included) writes its own counts to
    FUZZ_REPORT.<worker>; bench/session.py adds them up. Written after every test, not only at the
    end, so that a run stopped by a time limit still reports the examples of its finished tests."""
    path = os.environ.get("FUZZ_REPORT")
    if path and fuzz.EXAMPLES:
        report = f"{path}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
        with open(report + ".tmp", "w") as f:          # then renamed: a reader never sees half a file
            json.dump({"total": sum(fuzz.EXAMPLES.values()), "by_variant": dict(fuzz.EXAMPLES),
                       "by_feature": dict(fuzz.FEATURES)}, f, indent=1)
        os.replace(report + ".tmp", report)


def pytest_runtest_logfinish(nodeid, location):
    _write_fuzz_report()


def pytest_sessionfinish(session):
    _write_fuzz_report()


def pytest_terminal_summary(terminalreporter):
    if not fuzz.EXAMPLES:
        return
    total = sum(fuzz.EXAMPLES.values())
    terminalreporter.write_sep("-", f"oracle-checked examples: {total}")
    for key, n in sorted(fuzz.EXAMPLES.items()):
        terminalreporter.write_line(f"  {key:45s} {n}")
