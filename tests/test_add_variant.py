"""'Add a variant' end to end (README): a throwaway variant module outside the project, found
through the `sandbox.variants` entry-point group with no edit anywhere in the repository, shows up
in `sandbox list`, `sandbox fuzz` (the Numba one, under the simulator), the compile report's units
and `bench plan`. Each tool runs in a subprocess that sees the module only through PYTHONPATH."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODULE = textwrap.dedent('''
    from sandbox.registry import Capabilities, Variant, philox_rounds_param, register
    from variants.numba_rowwise import Rowwise
    from variants.standard import Standard

    register(Variant(name="throwaway-rowwise", family="fa2", backend="numba",
                     description="test: one thread per row, registered from outside the project",
                     impl=Rowwise(), params=(philox_rounds_param(),), caps=Capabilities(dtypes=("float32",)),
                     seed_ref="test", tags=("exact-ladder",)))
    register(Variant(name="throwaway-standard", family="standard", backend="cuda",
                     description="test: standard attention, registered from outside the project",
                     impl=Standard(), params=(philox_rounds_param(),),
                     caps=Capabilities(dtypes=("float32", "float16")), seed_ref="test", tags=("baseline",)))
''')


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugin")
    (d / "throwaway_variants.py").write_text(MODULE)
    info = d / "throwaway_variants-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: throwaway-variants\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[sandbox.variants]\nthrowaway = throwaway_variants\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(d), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return env, d


def _run(env, *args, timeout=300):
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return r.stdout


def test_listed(plugin_env):
    out = _run(plugin_env[0], "-m", "sandbox", "list")
    assert "throwaway-rowwise" in out and "throwaway-standard" in out


def test_fuzzed(plugin_env):
    out = _run(plugin_env[0], "-m", "sandbox", "fuzz", "--variants", "throwaway-rowwise", "--examples", "3",
               "--direction", "forward", "--derandomize")
    assert "examples checked: 3" in out


def test_in_the_compile_report(plugin_env):
    out = _run(plugin_env[0], "-c", "from sandbox import compile_report; "
               "print(sorted({name for name, _, _ in compile_report.units()}))")
    assert "throwaway-standard" in out


def test_in_the_bench_plan(plugin_env):
    env, d = plugin_env
    _run(env, "-m", "bench", "plan", "--json", str(d / "plan.json"))
    text = (d / "plan.json").read_text()
    json.loads(text)
    assert "throwaway-rowwise" in text and "throwaway-standard" in text
