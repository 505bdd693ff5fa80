"""The disk cache of NVRTC builds (sandbox/kernel_cache.py) and the loader's builds through it.

CPU tests: NVRTC through cuda.bindings, no GPU; NVRTC runs are counted by wrapping
loader._nvrtc_build. One GPU test (`pytest -m gpu`): the run-time path in fresh processes, the
second served from the cache.
"""
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="pip install .[compile] for NVRTC through cuda.bindings")

from sandbox import kernel_cache, loader  # noqa: E402
from sandbox.device import has_gpu  # noqa: E402
from sandbox.launch import cuda_options  # noqa: E402

# small units: one template kernel (a mangled lowered name), and three extern "C" ones
ROWDOT = loader.CompileUnit("standard.cu", ("standard_rowdot<float>",), cuda_options(), label="rowdot")
ROWDOT_HALF = loader.CompileUnit("standard.cu", ("standard_rowdot<__half>",), cuda_options(), label="rowdot-half")
SOFTMAX = loader.CompileUnit("softmax.cu", ("softmax_naive", "softmax_safe", "softmax_online"), cuda_options(),
                             label="softmax")

# On the GPU image, NVRTC through cuda.bindings in a process where CuPy is loaded returned empty
# logs (tests/test_compile.py): the tests that read ptxas's report run where there is no GPU.
needs_log = pytest.mark.skipif(has_gpu(), reason="ptxas logs through cuda.bindings are checked without a GPU")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("SANDBOX_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def nvrtc_calls(monkeypatch):
    calls = []
    real = loader._nvrtc_build

    def counting(source, text, opts, names, arch):
        calls.append((source, tuple(names), arch))
        return real(source, text, opts, names, arch)

    monkeypatch.setattr(loader, "_nvrtc_build", counting)
    return calls


def entries(folder):
    return sorted(p.name for p in folder.iterdir() if p.is_file())


# ---- location and key

def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("SANDBOX_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_cache.cache_dir() == tmp_path / "home" / ".cache" / "fa-sandbox"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.cache_dir() == tmp_path / "xdg" / "fa-sandbox"
    monkeypatch.setenv("SANDBOX_CACHE_DIR", str(tmp_path / "mine"))
    assert kernel_cache.cache_dir() == tmp_path / "mine" and kernel_cache.enabled()
    for off in ("off", "OFF", "0"):
        monkeypatch.setenv("SANDBOX_CACHE_DIR", off)
        assert kernel_cache.cache_dir() is None and not kernel_cache.enabled()


def test_key_changes_with_every_input_and_not_with_name_order():
    base = ("src", ("-std=c++17",), ("a<1>", "b<2>"), "sm_90", "13.5")
    k = kernel_cache.key(*base)
    assert len(k) == 64 and k == kernel_cache.key(*base)
    assert k == kernel_cache.key("src", ("-std=c++17",), ("b<2>", "a<1>"), "sm_90", "13.5")
    changed = [("src2",) + base[1:], (base[0], ("-std=c++17", "-DX=1")) + base[2:],
               base[:2] + (("a<1>",),) + base[3:], base[:3] + ("sm_80",) + base[4:],
               base[:3] + ("sm_90a",) + base[4:], base[:4] + ("13.6",)]
    keys = {kernel_cache.key(*c) for c in changed}
    assert k not in keys and len(keys) == len(changed)


def test_build_options_carry_the_ptxas_report_and_the_include_dir():
    opts = loader.build_options(ROWDOT)
    assert opts[0] == "-std=c++17" and "-Xptxas=-v" in opts
    assert len([o for o in opts if o.startswith("-I")]) == len(set(o for o in opts if o.startswith("-I")))


# ---- builds through the cache

def test_build_is_a_cubin_with_lowered_names(cache, nvrtc_calls):
    b = loader.build(ROWDOT, "sm_90")
    assert b.cubin[:4] == b"\x7fELF" and not b.cached and b.arch == "sm_90"
    low = b.lowered["standard_rowdot<float>"]
    assert low.startswith("_Z") and low.encode() in b.cubin          # the mangled symbol the driver looks up
    s = loader.build(SOFTMAX, "sm_90")
    assert s.lowered == {n: n for n in SOFTMAX.names}                  # extern "C"
    assert len(nvrtc_calls) == 2
    assert b.path is not None and b.path.read_bytes() == b.cubin and b.path.parent == cache


def test_second_build_is_read_from_the_cache(cache, nvrtc_calls):
    first = loader.build(ROWDOT, "sm_90")
    start = time.perf_counter()
    second = loader.build(ROWDOT, "sm_90")
    assert time.perf_counter() - start < 0.5
    assert len(nvrtc_calls) == 1 and second.cached
    assert (second.cubin, second.lowered, second.log, second.key) == (first.cubin, first.lowered, first.log, first.key)
    # the same names in another order are the same module
    again = loader.build(loader.CompileUnit("softmax.cu", SOFTMAX.names[::-1], SOFTMAX.options), "sm_90")
    loader.build(SOFTMAX, "sm_90")
    assert len(nvrtc_calls) == 2 and not again.cached


@needs_log
def test_compile_report_of_an_unchanged_unit_comes_from_the_cache(cache, nvrtc_calls):
    first = loader.compile_only(SOFTMAX, "sm_90")
    second = loader.compile_only(SOFTMAX, "sm_90")
    assert first == second and len(nvrtc_calls) == 1
    assert [r.name for r in first] == list(SOFTMAX.names) and all(r.registers > 0 for r in first)
    meta = json.loads(next(cache.glob("*.json")).read_text())
    assert "Used" in meta["log"] and meta["arch"] == "sm_90"


def test_changed_inputs_are_new_entries(cache, nvrtc_calls):
    loader.build(ROWDOT, "sm_90")
    loader.build(ROWDOT, "sm_80")                                              # arch
    loader.build(ROWDOT_HALF, "sm_90")                                         # names
    loader.build(loader.CompileUnit("standard.cu", ROWDOT.names, ROWDOT.options + ("-DSANDBOX_TEST=1",)), "sm_90")
    assert len(nvrtc_calls) == 4
    assert len(list(cache.glob("*.cubin"))) == 4 and len(list(cache.glob("*.json"))) == 4
    for unit, arch in ((ROWDOT, "sm_90"), (ROWDOT, "sm_80"), (ROWDOT_HALF, "sm_90")):
        assert loader.build(unit, arch).cached
    assert len(nvrtc_calls) == 4


def test_source_change_is_a_new_entry(cache, nvrtc_calls, monkeypatch):
    loader.build(ROWDOT, "sm_90")
    text = loader.source_text("standard.cu")
    monkeypatch.setattr(loader, "source_text", lambda name: text + "\n// edited\n")
    b = loader.build(ROWDOT, "sm_90")
    assert len(nvrtc_calls) == 2 and not b.cached


def test_nvrtc_version_is_in_the_key(cache, nvrtc_calls, monkeypatch):
    loader.build(ROWDOT, "sm_90")
    monkeypatch.setattr(loader, "_nvrtc_version", lambda: "99.0")
    assert not loader.build(ROWDOT, "sm_90").cached and len(nvrtc_calls) == 2


def _corrupt(cache, how):
    (cubin,) = cache.glob("*.cubin")
    (meta,) = cache.glob("*.json")
    if how == "truncated cubin":
        cubin.write_bytes(cubin.read_bytes()[:100])
    elif how == "flipped cubin byte":
        data = bytearray(cubin.read_bytes())
        data[len(data) // 2] ^= 0xFF
        cubin.write_bytes(bytes(data))
    elif how == "missing cubin":
        cubin.unlink()
    elif how == "missing json":
        meta.unlink()
    elif how == "partial json":
        meta.write_text(meta.read_text()[:40])
    elif how == "empty json":
        meta.write_text("")
    elif how == "json of another key":
        m = json.loads(meta.read_text())
        m["key"] = "0" * 64
        meta.write_text(json.dumps(m))
    elif how == "json without lowered names":
        m = json.loads(meta.read_text())
        m["lowered"] = {}
        meta.write_text(json.dumps(m))
    elif how == "json not an object":
        meta.write_text("[1, 2]")


@pytest.mark.parametrize("how", ["truncated cubin", "flipped cubin byte", "missing cubin", "missing json",
                                 "partial json", "empty json", "json of another key", "json without lowered names",
                                 "json not an object"])
def test_corrupt_or_partial_entry_is_rebuilt(cache, nvrtc_calls, how):
    good = loader.build(ROWDOT, "sm_90")
    _corrupt(cache, how)
    assert kernel_cache.load(good.key, ROWDOT.names) is None
    rebuilt = loader.build(ROWDOT, "sm_90")
    assert len(nvrtc_calls) == 2 and not rebuilt.cached and rebuilt.lowered == good.lowered
    repaired = loader.build(ROWDOT, "sm_90")                       # the rebuild overwrote the entry
    assert repaired.cached and repaired.cubin == rebuilt.cubin and len(nvrtc_calls) == 2


@needs_log
def test_stored_log_without_the_ptxas_report_is_rebuilt_for_the_report(cache, nvrtc_calls):
    """A run-time build in a process where NVRTC returned an empty log stores that log: the compile
    report rebuilds the entry once instead of failing on it."""
    b = loader.build(SOFTMAX, "sm_90")
    kernel_cache.store(kernel_cache.Build(b.cubin, b.lowered, "", b.arch, b.nvrtc, b.key))
    reports = loader.compile_only(SOFTMAX, "sm_90")
    assert len(nvrtc_calls) == 2 and all(r.registers > 0 for r in reports)
    assert "Used" in kernel_cache.load(b.key, SOFTMAX.names).log


@pytest.mark.parametrize("off", ["off", "0"])
def test_disabled_cache_builds_every_time_and_writes_nothing(tmp_path, monkeypatch, nvrtc_calls, off):
    monkeypatch.setenv("SANDBOX_CACHE_DIR", off)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    a = loader.build(ROWDOT, "sm_90")
    b = loader.build(ROWDOT, "sm_90")
    assert len(nvrtc_calls) == 2 and not a.cached and not b.cached and a.path is None
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()


def test_unwritable_cache_warns_and_builds(tmp_path, monkeypatch, nvrtc_calls):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SANDBOX_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(kernel_cache, "_warned", False)
    with pytest.warns(RuntimeWarning, match="not written"):
        b = loader.build(ROWDOT, "sm_90")
    assert b.path is None and b.cubin[:4] == b"\x7fELF"


def test_writes_leave_no_temporary_files(cache, nvrtc_calls):
    loader.build(ROWDOT, "sm_90")
    loader.build(ROWDOT, "sm_90", refresh=True)
    assert len(nvrtc_calls) == 2
    names = entries(cache)
    assert len(names) == 2 and not [n for n in names if n.endswith(".tmp")]


@pytest.mark.skipif(kernel_cache.fcntl is None, reason="build locks need flock (POSIX)")
def test_concurrent_builds_of_one_entry_compile_once(cache, nvrtc_calls):
    """Four threads (as four processes would) ask for one missing entry: one compiles it under the
    entry's lock, the others wait and read it."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        builds = list(pool.map(lambda _: loader.build(ROWDOT, "sm_90"), range(4)))
    assert len(nvrtc_calls) == 1
    assert len({b.cubin for b in builds}) == 1 and sum(not b.cached for b in builds) == 1


def test_concurrent_writers_of_one_entry_leave_a_valid_entry(cache):
    b = loader.build(ROWDOT, "sm_90")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: kernel_cache.store(b), range(32)))
    again = kernel_cache.load(b.key, ROWDOT.names)
    assert again is not None and again.cubin == b.cubin


# ---- parallel builds

def test_prebuild_builds_identical_units_once_and_fills_the_cache(cache, nvrtc_calls):
    seen = []
    builds = loader.prebuild([ROWDOT, SOFTMAX, ROWDOT, ROWDOT_HALF], "sm_90", workers=2,
                             progress=lambda i, n, unit, arch, b, t: seen.append((i, n, unit.label, arch)))
    assert len(nvrtc_calls) == 3 and len(builds) == 4
    assert builds[0] is builds[2] and builds[1].lowered == {n: n for n in SOFTMAX.names}
    assert sorted(i for i, *_ in seen) == [1, 2, 3] and {n for _, n, *_ in seen} == {3}
    assert all(loader.build(u, "sm_90").cached for u in (ROWDOT, SOFTMAX, ROWDOT_HALF))
    assert len(nvrtc_calls) == 3


def test_build_many_runs_every_job_and_reports_failures_together(cache, nvrtc_calls):
    bad = loader.CompileUnit("standard.cu", ("standard_rowdot<no_such_type>",), cuda_options(), label="bad")
    with pytest.raises(RuntimeError, match=r"1 of 3 builds failed(.|\n)*bad for sm_90"):
        loader.build_many([(ROWDOT, "sm_90"), (bad, "sm_90"), (SOFTMAX, "sm_90")], workers=2)
    assert loader.build(ROWDOT, "sm_90").cached and loader.build(SOFTMAX, "sm_90").cached


# ---- run time without a GPU: the loader's module path against a stand-in for CuPy

class FakeDriverError(Exception):
    pass


class FakeKernel:
    def __init__(self, name, module):
        self.name, self.module, self.max_dynamic_shared_size_bytes = name, module, 48 * 1024


class FakeRawModule:
    made = []

    def __init__(self, *, code=None, path=None, options=(), name_expressions=None):
        self.code, self.path, self.options, self.names = code, path, options, name_expressions
        FakeRawModule.made.append(self)

    def get_function(self, name):
        if self.path is not None:
            data = open(self.path, "rb").read()
            if data[:4] != b"\x7fELF" or FakeRawModule.refuse:
                raise FakeDriverError("CUDA_ERROR_INVALID_IMAGE")
            assert name.encode() in data, name            # a lowered name of this CUBIN
        else:
            assert name in self.names
        return FakeKernel(name, self)


@pytest.fixture
def fake_cupy(monkeypatch):
    import types
    cupy = types.ModuleType("cupy")
    cupy.RawModule = FakeRawModule
    cupy.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
        Device=lambda i=0: types.SimpleNamespace(compute_capability="90"),
        driver=types.SimpleNamespace(CUDADriverError=FakeDriverError))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    FakeRawModule.made, FakeRawModule.refuse = [], False
    for f in (loader._cubin_module, loader._cupy_module, loader._device_arch):
        f.cache_clear()
    monkeypatch.setattr(loader, "_MODULES", {})
    monkeypatch.setattr(loader, "_warned_fallback", set())
    yield cupy
    for f in (loader._cubin_module, loader._cupy_module, loader._device_arch):
        f.cache_clear()


BIG = loader.CompileUnit("standard.cu", ("standard_rowdot<float>",), cuda_options(),
                         {"standard_rowdot<float>": 64 * 1024}, label="rowdot, 64 KB of dynamic smem")


def test_get_kernel_loads_the_cached_cubin_by_lowered_name(cache, nvrtc_calls, fake_cupy):
    kernel = loader.get_kernel(BIG, "standard_rowdot<float>")
    (module,) = FakeRawModule.made
    b = loader.build(BIG, "sm_90")
    assert module.path == str(b.path) and module.code is None and kernel.name == b.lowered["standard_rowdot<float>"]
    assert kernel.max_dynamic_shared_size_bytes == 64 * 1024            # raised above the 48 KB default
    assert loader.get_kernel(BIG, "standard_rowdot<float>") is kernel and len(nvrtc_calls) == 1
    # a new process (fresh in-memory caches) reads the disk cache: no NVRTC run
    for f in (loader._cubin_module, loader._device_arch):
        f.cache_clear()
    loader._MODULES.clear()
    loader.get_kernel(BIG, "standard_rowdot<float>")
    assert len(nvrtc_calls) == 1 and len(FakeRawModule.made) == 2


def test_get_kernel_builds_for_the_device_architecture(cache, nvrtc_calls, fake_cupy):
    fake_cupy.cuda.Device = lambda i=0: type("D", (), {"compute_capability": "80"})()
    loader.get_kernel(ROWDOT, "standard_rowdot<float>")
    assert nvrtc_calls == [("standard.cu", ROWDOT.names, "sm_80")]


@pytest.mark.parametrize("off", ["off", "0"])
def test_disabled_cache_is_cupys_own_build(monkeypatch, nvrtc_calls, fake_cupy, off):
    monkeypatch.setenv("SANDBOX_CACHE_DIR", off)
    kernel = loader.get_kernel(BIG, "standard_rowdot<float>")
    (module,) = FakeRawModule.made
    assert module.path is None and module.names == list(BIG.names) and "-std=c++17" in module.options
    assert module.code == loader.source_text("standard.cu") and not nvrtc_calls
    assert kernel.name == "standard_rowdot<float>" and kernel.max_dynamic_shared_size_bytes == 64 * 1024


def test_a_cubin_the_driver_refuses_falls_back_to_cupy_with_a_warning(cache, nvrtc_calls, fake_cupy):
    FakeRawModule.refuse = True
    with pytest.warns(RuntimeWarning, match="did not load"):
        kernel = loader.get_kernel(ROWDOT, "standard_rowdot<float>")
    assert kernel.module.path is None and kernel.module.code is not None


def test_a_failed_build_falls_back_to_cupy_with_a_warning(cache, fake_cupy):
    bad = loader.CompileUnit("standard.cu", ("standard_rowdot<no_such_type>",), cuda_options())
    with pytest.warns(RuntimeWarning, match="NVRTC through cuda.bindings failed"):
        kernel = loader.get_kernel(bad, "standard_rowdot<no_such_type>")
    assert kernel.module.code is not None                # CuPy's build (here a stand-in that accepts it)


# ---- run time, on a GPU: a fresh process reads the build of the one before

GPU_SCRIPT = r"""
import hashlib, json, time
import numpy as np
import cupy as cp
import sandbox
from sandbox import loader

rng = np.random.default_rng(0)
q, k, v = (cp.asarray(rng.standard_normal((1, 2, 200, 128)).astype(np.float16)) for _ in range(3))
cp.cuda.Device().synchronize()
bound = sandbox.get_variant("fa2-tc", block_c=64)             # d = 128, Bc = 64: 64 KB of dynamic smem
unit = bound.config.unit("float16", 128)
name = bound.config.forward_name("float16", 128, False)
start = time.perf_counter()
kernel = loader.get_kernel(unit, name)
seconds = time.perf_counter() - start
out = sandbox.attention(q, k, v, variant="fa2-tc", block_c=64, causal=True)
module = loader._module(unit.source, tuple(unit.options), tuple(unit.names))
print(json.dumps({"seconds": seconds, "nvrtc_builds": loader.NVRTC_BUILDS, "module": type(module).__name__,
                  "smem_attr": kernel.max_dynamic_shared_size_bytes, "smem_need": unit.dynamic_smem[name],
                  "out": hashlib.sha256(cp.asnumpy(out).tobytes()).hexdigest()}))
"""


def _gpu_run(cache_dir):
    env = {**os.environ, "SANDBOX_CACHE_DIR": cache_dir}
    proc = subprocess.run([sys.executable, "-c", GPU_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=str(Path(__file__).resolve().parents[1]))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_second_process_loads_the_cached_cubin(tmp_path):
    folder = str(tmp_path / "cache")
    cold = _gpu_run(folder)
    warm = _gpu_run(folder)
    cupy_path = _gpu_run("off")          # the fallback: CuPy's NVRTC, no disk cache of ours
    assert cold["module"] == warm["module"] == "_CubinModule" and cupy_path["module"] == "RawModule"
    assert cold["nvrtc_builds"] >= 1 and warm["nvrtc_builds"] == 0, (cold, warm)
    assert warm["seconds"] < 0.5, warm
    assert cold["out"] == warm["out"] == cupy_path["out"]
    for run in (cold, warm, cupy_path):
        assert run["smem_attr"] >= run["smem_need"] > 48 * 1024, run


def test_cuda_options_are_searched_once_per_environment(monkeypatch):
    """launch.cuda_options: the include-path search (a few dozen stats, ~0.5 ms) runs once per environment, not
    per call (the packed-sequence forward names its compile unit on every call)."""
    from sandbox import launch, loader
    launch._cuda_options.cache_clear()
    calls = []
    monkeypatch.setattr(loader, "cuda_include_dirs", lambda: calls.append(1) or ["/x"])
    try:
        assert launch.cuda_options() == ("-I/x",) and launch.cuda_options() == ("-I/x",)
        assert len(calls) == 1
        monkeypatch.setenv("CUDA_HOME", "/elsewhere")
        launch.cuda_options()
        assert len(calls) == 2
    finally:
        launch._cuda_options.cache_clear()
