"""Build CUDA sources from kernels_cu/ with NVRTC, cache the builds on disk, load them with CuPy.

- Sources are read as package data and their local `#include "x.cuh"` lines are inlined, so the
  text that is compiled (and that the disk cache is keyed by) is the whole program.
- Templates are instantiated through name expressions: a variant's config object produces the
  exact names (e.g. "standard_softmax<__half>"); `get_kernel` takes them, the lowered (mangled)
  names stay inside this module.
- `build(unit, arch)`: one NVRTC compilation through cuda.bindings (no GPU needed) to a CUBIN, with
  ptxas's register / spill / shared-memory report in its log, stored in the disk cache
  (sandbox/kernel_cache.py: $SANDBOX_CACHE_DIR, else ~/.cache/fa-sandbox). `prebuild` / `build_many`
  build many in threads; `compile_only` reports from a build (the compile report's path).
- Run time: one module per (source, options, name expressions) and device, built for the device's
  architecture by `build` (read from the cache when any process built it before) and loaded from
  its CUBIN with cupy.RawModule(path=...). SANDBOX_CACHE_DIR=off goes back to
  cupy.RawModule(code=..., name_expressions=...) (CuPy's NVRTC, no disk cache of ours), as does a
  machine without NVRTC through cuda.bindings.
- Dynamic shared memory above 48 KB is enabled per kernel before its first launch.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from . import kernel_cache

BASE_OPTIONS = ("-std=c++17",)
STATIC_SMEM_LIMIT = 48 * 1024
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.M)


@dataclass(frozen=True)
class CompileUnit:
    """What one variant config compiles: a source, its template names, options and dynamic smem."""

    source: str                      # file name under kernels_cu/
    names: tuple                     # name expressions
    options: tuple = ()
    dynamic_smem: dict = field(default_factory=dict, hash=False, compare=False)   # name -> bytes
    label: str = ""
    archs: tuple = ()                # the only real architectures it builds for ("sm_90a"); () any

    def target(self, arch: str) -> str | None:
        """What to build for on a GPU of (or a report for) `arch`, e.g. "sm_90": `arch` itself for a
        unit that names no architecture; its architecture-specific form ("sm_90a": wgmma, setmaxnreg)
        where the unit names one; None where the unit cannot run there (an sm_90a kernel on sm_80 or on
        sm_100: architecture-specific code runs on that architecture only)."""
        if not self.archs:
            return arch
        return next((a for a in self.archs if a == arch or a.rstrip("a") == arch), None)


def kernel_dir() -> Path:
    return Path(str(resources.files("kernels_cu")))


@functools.lru_cache(maxsize=None)
def source_text(name: str) -> str:
    """The source with local includes inlined (each header once)."""
    seen: set[str] = set()

    def expand(fname: str) -> str:
        text = (kernel_dir() / fname).read_text()

        def sub(m):
            inc = m.group(1)
            if inc in seen:
                return f"// (already included: {inc})"
            seen.add(inc)
            return f"// ---- begin {inc}\n{expand(inc)}\n// ---- end {inc}"

        return _INCLUDE.sub(sub, text)

    return expand(name)


# ---- run time: NVRTC (cuda.bindings) to a CUBIN for the device, cached on disk, loaded by CuPy

_MODULES: dict = {}
_warned_fallback: set = set()


def _module(source: str, options: tuple, names: tuple, archs: tuple = ()):
    """The module holding `names` on the current device: with the disk cache on (the default), built
    by `build` for the device's architecture (or read from the cache) and loaded from its CUBIN;
    with SANDBOX_CACHE_DIR=off, or where NVRTC cannot be loaded through cuda.bindings, a
    cupy.RawModule compiled by CuPy's NVRTC (the previous path). Either way `.get_function(name)`
    takes a name expression."""
    import cupy
    # an architecture-specific unit (archs, e.g. sm_90a) always takes the CUBIN path: CuPy compiles for
    # the plain architecture, where wgmma does not assemble (with the disk cache off, built unstored)
    mode = "cubin" if (kernel_cache.enabled() or archs) and _nvrtc_usable() else "cupy"
    key = (source, options, names, archs, mode, cupy.cuda.runtime.getDevice() if mode == "cubin" else None)
    module = _MODULES.get(key)
    if module is None:
        if mode == "cubin":
            device_arch = _device_arch(key[-1])
            arch = CompileUnit(source, names, options, archs=archs).target(device_arch)
            if arch is None:
                raise ValueError(f"{source} runs on {' or '.join(archs)} only; this GPU is {device_arch}")
            module = _cubin_module(source, options, names, arch)
        elif archs:
            raise RuntimeError(f"{source} needs NVRTC through cuda.bindings to build for {' or '.join(archs)} "
                               "(pip install .[compile])")
        else:
            module = _cupy_module(source, options, names)
        _MODULES[key] = module
    return module


def module_globals(source: str, option: str, name: str) -> list:
    """The device global `name` (a cupy MemoryPointer) of every module of `source` loaded on the current device
    whose build options include `option`: how a debugging switch's buffer is read back (fa3_ws.cu's -DFA_TRACE,
    variants/fa3_ws.py read_trace)."""
    import cupy
    device = cupy.cuda.runtime.getDevice()
    return [getattr(module, "raw", module).get_global(name) for key, module in _MODULES.items()
            if key[0] == source and option in key[1] and key[5] in (None, device)]


@functools.lru_cache(maxsize=None)
def _cupy_module(source: str, options: tuple, names: tuple):
    import cupy
    return cupy.RawModule(code=source_text(source), options=BASE_OPTIONS + options,
                          name_expressions=list(names))


@functools.lru_cache(maxsize=None)
def _device_arch(device: int) -> str:
    """'sm_90' for compute capability 9.0. A kernel that needs the architecture-specific features of
    sm_90a would build for "sm_90a": `build` takes the architecture string as given."""
    import cupy
    return f"sm_{cupy.cuda.Device(device).compute_capability}"


class _CubinModule:
    """A CUBIN built by `build`, loaded through cupy.RawModule(path=...): kernels by name expression
    (looked up by their lowered names), each RawKernel made once."""

    def __init__(self, raw, lowered: dict, path: str):
        self.raw, self.lowered, self.path, self.kernels = raw, lowered, path, {}

    def get_function(self, name: str):
        kernel = self.kernels.get(name)
        if kernel is None:
            kernel = self.kernels[name] = self.raw.get_function(self.lowered[name])
        return kernel


@functools.lru_cache(maxsize=None)
def _cubin_module(source: str, options: tuple, names: tuple, arch: str):
    """The CUBIN path, or CuPy's where it fails: a build that NVRTC through cuda.bindings refuses
    (a genuine compile error then fails again, in CuPy's words) or a CUBIN the driver refuses to
    load. Either way with a warning, once per source: the kernels are the same."""
    import cupy
    try:
        b = build(CompileUnit(source, names, options), arch)
    except RuntimeError as e:
        return _fall_back(source, options, names, f"NVRTC through cuda.bindings failed for {arch}: {e}")
    path = str(b.path) if b.path is not None else _temp_cubin(b.cubin)
    module = _CubinModule(cupy.RawModule(path=path), b.lowered, path)
    try:
        for name in names:               # load now: a CUBIN the driver refuses shows here, not at a launch
            module.get_function(name)
    except cupy.cuda.driver.CUDADriverError as e:
        return _fall_back(source, options, names, f"the CUDA driver did not load the NVRTC {b.nvrtc} CUBIN "
                                                  f"for {arch} ({e})")
    return module


def _fall_back(source: str, options: tuple, names: tuple, why: str):
    if source not in _warned_fallback:
        _warned_fallback.add(source)
        warnings.warn(f"{source}: {why[:2000]}; compiling it with CuPy's NVRTC instead (SANDBOX_CACHE_DIR=off "
                      "always does)", RuntimeWarning, stacklevel=4)
    return _cupy_module(source, options, names)


def _temp_cubin(cubin: bytes) -> str:
    """A CUBIN that the cache could not store, in a temporary file for cuModuleLoad (removed at exit)."""
    import atexit
    fd, path = tempfile.mkstemp(suffix=".cubin", prefix="fa-sandbox-")
    with os.fdopen(fd, "wb") as f:
        f.write(cubin)
    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    return path


@functools.lru_cache(maxsize=None)
def _nvrtc_usable() -> bool:
    """NVRTC through cuda.bindings loads (the `compile` extra, or a CUDA toolkit it finds); else the
    run-time path falls back to CuPy's NVRTC, with a warning."""
    try:
        _nvrtc_version()
        return True
    except Exception as e:            # ImportError, or the library not found / not loadable
        warnings.warn(f"NVRTC through cuda.bindings is not usable ({type(e).__name__}: {e}); kernels are "
                      "compiled by CuPy without the sandbox's disk cache (pip install .[compile] for it)",
                      RuntimeWarning, stacklevel=3)
        return False


def get_kernel(unit: CompileUnit, name: str):
    """The compiled kernel `name` of `unit`, with its dynamic shared-memory limit raised if needed."""
    kernel = _module(unit.source, tuple(unit.options), tuple(unit.names), tuple(unit.archs)).get_function(name)
    smem = int(unit.dynamic_smem.get(name, 0))
    if smem > STATIC_SMEM_LIMIT and kernel.max_dynamic_shared_size_bytes < smem:
        kernel.max_dynamic_shared_size_bytes = smem
    return kernel


GRID_LIMITS = (2**31 - 1, 65535, 65535)      # CUDA's blocks per grid axis (x, y, z)


def check_grid(name: str, grid) -> None:
    """ValueError (before the launch, instead of the driver's 'invalid argument') for a grid past CUDA's
    limits: the kernels put batch x heads (or batch) on y or z, so a batch of many heads can reach 65535."""
    for axis, n, limit in zip("xyz", grid, GRID_LIMITS):
        if n > limit:
            raise ValueError(f"{name}: the launch needs {n} blocks along grid {axis}, past CUDA's {limit} (the "
                             "kernels put batch x heads on y or z): split the batch into smaller calls")


def launch(unit: CompileUnit, name: str, grid, block, args, shared_mem: int = 0):
    """Launch with every scalar already typed (np.int32 / np.float32 / np.uint64 ...)."""
    for a in args:
        if isinstance(a, (bool, int, float)):
            raise TypeError(f"untyped Python scalar {a!r} passed to {name}: type it explicitly "
                            "(CuPy would pass it as long long / double)")
    grid = tuple(int(g) for g in grid)
    if min(grid) == 0:
        return
    check_grid(name, grid)
    get_kernel(unit, name)(grid, tuple(int(b) for b in block), tuple(args), shared_mem=int(shared_mem))


class Slot:
    """A kernel argument filled in per call (a device pointer or a per-call scalar), by name."""

    __slots__ = ("name", "ctype")

    def __init__(self, name: str, ctype: str = "u64"):
        self.name, self.ctype = name, ctype


_CTYPES = {"int32": "c_int32", "int64": "c_int64", "uint32": "c_uint32", "uint64": "c_uint64", "float32": "c_float",
           "u64": "c_uint64", "u32": "c_uint32"}


class PackedLaunch:
    """One kernel launch with its argument list packed once into a C parameter array.

    CuPy re-packs every argument on each launch (a few tenths of a microsecond each, about 10 us
    for the 30 arguments of fa2_tc_forward); here the fixed arguments are packed when the plan is
    made and a call rewrites only its `Slot`s (device pointers, seed, offset) before one
    cuLaunchKernel on the given stream. Arguments: typed NumPy scalars, CuPy arrays (their device
    pointer), Slots, or by-value structs: a `tma.Opaque` (its bytes copied in once) or a Slot of
    ctype "map" (128 bytes copied per call from the address given for it: a tensor map, sandbox/tma.py).
    SANDBOX_LAUNCH=cupy uses CuPy's launch instead (the reference path), except for kernels that take
    structs by value, which CuPy cannot pack.
    """

    def __init__(self, kernel, grid, block, shared_mem: int, args):
        self.kernel, self.args = kernel, tuple(args)
        self.grid = tuple(int(g) for g in (tuple(grid) + (1, 1))[:3])
        if min(self.grid) > 0:            # an empty launch is skipped (__call__), whatever its other axes
            check_grid("a packed kernel launch", self.grid)
        self.block = tuple(int(b) for b in (tuple(block) + (1, 1))[:3])
        self.shared_mem = int(shared_mem)
        self.cupy_path = os.environ.get("SANDBOX_LAUNCH") == "cupy"
        self.holders, self.slots = [], []
        for i, a in enumerate(self.args):
            if isinstance(a, Slot) and a.ctype == "map":             # a CUtensorMap refilled per call
                h = (ctypes.c_uint8 * 128)()
                self.slots.append((a.name, h))
                self.cupy_path = False                              # CuPy packs no opaque structs
            elif isinstance(a, Slot):
                h = getattr(ctypes, _CTYPES[a.ctype])(0)
                self.slots.append((a.name, h))
            elif hasattr(a, "address") and hasattr(a, "nbytes"):      # tma.Opaque: a struct by value
                h = (ctypes.c_uint8 * a.nbytes)()
                ctypes.memmove(h, a.address, a.nbytes)
                self.cupy_path = False                              # CuPy packs no opaque structs
            elif hasattr(a, "data") and hasattr(a.data, "ptr"):        # a CuPy array
                h = ctypes.c_uint64(a.data.ptr)
            elif isinstance(a, np.generic):
                h = getattr(ctypes, _CTYPES[a.dtype.name])(a.item())
            else:
                raise TypeError(f"argument {i} ({a!r}) of {kernel}: type it (np.int32, ...) or pass a Slot")
            self.holders.append(h)
        self.params = (ctypes.c_void_p * len(self.holders))(*[ctypes.addressof(h) for h in self.holders])
        self.params_addr = ctypes.addressof(self.params)
        self.function = int(kernel.ptr)
        if not self.cupy_path:
            from cuda.bindings import driver
            self.launch, self.success = driver.cuLaunchKernel, driver.CUresult.CUDA_SUCCESS

    def __call__(self, values: dict, stream) -> None:
        if min(self.grid) == 0:
            return
        for name, h in self.slots:
            if isinstance(h, ctypes.Array):
                ctypes.memmove(h, values[name], 128)             # the map's address
            else:
                h.value = values[name]
        if self.cupy_path:
            args = tuple(np.uint64(h.value) if isinstance(a, Slot) and a.ctype == "u64" else
                         (np.uint32(h.value) if isinstance(a, Slot) else a)
                         for a, h in zip(self.args, self.holders))
            self.kernel(self.grid, self.block, args, shared_mem=self.shared_mem, stream=stream)
            return
        (err,) = self.launch(self.function, *self.grid, *self.block, self.shared_mem, stream.ptr, self.params_addr, 0)
        if err != self.success:
            raise RuntimeError(f"cuLaunchKernel failed: {err}")


# ---- NVRTC builds through cuda.bindings (no GPU needed): CUBIN, lowered names, ptxas log

def cuda_include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h and friends, for NVRTC without CuPy."""
    dirs = []
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            dirs.append(os.path.join(os.environ[env], "include"))
    for entry in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include"):
            dirs.append(os.path.join(entry, sub))
    dirs.append("/usr/local/cuda/include")
    return [d for d in dict.fromkeys(dirs) if os.path.exists(os.path.join(d, "cuda_fp16.h"))][:1]


@dataclass
class KernelReport:
    label: str
    name: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    static_smem: int
    dynamic_smem: int

    @property
    def smem(self) -> int:
        return self.static_smem + self.dynamic_smem


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def build_options(unit: CompileUnit) -> list[str]:
    """NVRTC options of a build (the architecture apart): the unit's, `-Xptxas=-v` for the
    register / spill / shared-memory report (no effect on the code), and the CUDA include folder."""
    opts = [*BASE_OPTIONS, *unit.options, "-Xptxas=-v"]
    return opts + [inc for inc in (f"-I{d}" for d in cuda_include_dirs()) if inc not in opts]


_count_lock = threading.Lock()
NVRTC_BUILDS = 0          # NVRTC compilations run by this process (the tests count cache hits by it)


def build(unit: CompileUnit, arch: str = "sm_90", *, refresh: bool = False) -> kernel_cache.Build:
    """`unit` compiled by NVRTC for `arch`, a real architecture ("sm_90", "sm_90a", ...): the CUBIN,
    name expression -> lowered name, and the log with ptxas's report. Read from the disk cache
    (sandbox/kernel_cache.py) where it holds this build, else compiled and stored there;
    `refresh` compiles even on a hit. No GPU or driver is needed. An architecture-specific unit
    builds for its form of `arch` (CompileUnit.target: "sm_90" -> "sm_90a"); ValueError where it has none."""
    arch = _target(unit, arch)
    text, opts, names, version, k = _build_key(unit, arch)
    if not refresh:
        hit = kernel_cache.load(k, names)
        if hit is not None:
            return hit
    with kernel_cache.building(k):
        if not refresh:
            hit = kernel_cache.load(k, names)        # built by another process while this one waited
            if hit is not None:
                return hit
        cubin, lowered, log = _nvrtc_build(unit.source, text, opts, names, arch)
        return kernel_cache.store(kernel_cache.Build(cubin, lowered, log, arch, version, k))


def cached_build(unit: CompileUnit, arch: str = "sm_90") -> kernel_cache.Build | None:
    """The stored build of `unit` for `arch`, or None (nothing is compiled)."""
    _, _, names, _, k = _build_key(unit, _target(unit, arch))
    return kernel_cache.load(k, names)


def _target(unit: CompileUnit, arch: str) -> str:
    target = unit.target(arch)
    if target is None:
        raise ValueError(f"{unit.label or unit.source} builds for {' or '.join(unit.archs)} only, not {arch}")
    return target


def _build_key(unit: CompileUnit, arch: str) -> tuple:
    text = source_text(unit.source)
    opts = build_options(unit)
    names = tuple(unit.names)
    version = _nvrtc_version()
    return text, opts, names, version, kernel_cache.key(text, opts, names, arch, version)


def _nvrtc_build(source: str, text: str, opts: list, names: tuple, arch: str) -> tuple[bytes, dict, str]:
    """One NVRTC compilation (it releases the GIL: builds in threads run in parallel)."""
    global NVRTC_BUILDS
    from cuda.bindings import nvrtc

    def check(result, what):
        err = result[0]
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what} ({source}, {arch}): {err}")
        return result[1:] if len(result) > 1 else None

    with _count_lock:
        NVRTC_BUILDS += 1
    (prog,) = check(nvrtc.nvrtcCreateProgram(text.encode(), source.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        for name in names:
            check(nvrtc.nvrtcAddNameExpression(prog, name.encode()), "nvrtcAddNameExpression")
        full = [*opts, f"-arch={arch}"]
        result = nvrtc.nvrtcCompileProgram(prog, len(full), [o.encode() for o in full])
        (size,) = check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        # mutable buffers: NVRTC writes into them (writing into a bytes object mutates an immutable
        # value, and for sizes 0 and 1 CPython's shared singletons)
        buf = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = bytes(buf).rstrip(b"\0").decode(errors="replace")
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC failed to compile {source} for {arch}:\n{log}")
        lowered = {}
        for name in names:
            (low,) = check(nvrtc.nvrtcGetLoweredName(prog, name.encode()), "lowered name")
            lowered[name] = low.decode()
        (size,) = check(nvrtc.nvrtcGetCUBINSize(prog), "CUBIN size")
        cubin = bytearray(size)
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "CUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return bytes(cubin), lowered, log


def build_many(jobs, workers: int | None = None, progress=None) -> list[kernel_cache.Build]:
    """Build (unit, arch) jobs in a thread pool (`workers`, default one per CPU core) and fill the
    cache; identical jobs (source, options, names, arch) build once. One Build per job, in order.
    progress(i, n, unit, arch, build, seconds since the start) is called as each distinct job ends
    (build None where it failed). Every job runs; failures are raised together at the end."""
    jobs = [(u, a) for u, a in jobs]
    distinct: dict = {}
    for u, a in jobs:
        distinct.setdefault(_identity(u, a), (u, a))
    n, start, done = len(distinct), time.perf_counter(), 0
    results, errors = {}, []

    def finished(ident, b):
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, n, *distinct[ident], b, time.perf_counter() - start)

    for ident, (u, a) in distinct.items():          # the cache's answers first, without the pool
        b = cached_build(u, a)
        if b is not None:
            results[ident] = b
            finished(ident, b)
    missing = [ident for ident in distinct if ident not in results]
    if missing:
        workers = max(1, min(workers or os.cpu_count() or 1, len(missing)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(build, *distinct[ident]): ident for ident in missing}
            for future in as_completed(futures):
                ident = futures[future]
                try:
                    results[ident] = future.result()
                except Exception as e:          # noqa: BLE001 (collected, raised below)
                    u, a = distinct[ident]
                    errors.append(f"{u.label or u.source} for {a}: {e}")
                finished(ident, results.get(ident))
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} builds failed:\n" + "\n\n".join(errors))
    return [results[_identity(u, a)] for u, a in jobs]


def prebuild(units, arch: str = "sm_90", workers: int | None = None, progress=None) -> list[kernel_cache.Build]:
    """Build independent units for `arch` in parallel (see build_many) and fill the disk cache, so
    that later get_kernel / compile_only calls read it. One Build per unit that can run on `arch`
    (CompileUnit.target), in order."""
    return build_many([(u, arch) for u in units if u.target(arch) is not None], workers, progress)


def _identity(unit: CompileUnit, arch: str) -> tuple:
    return unit.source, tuple(unit.options), tuple(sorted(unit.names)), unit.target(arch) or arch


def compile_only(unit: CompileUnit, arch: str = "sm_90") -> list[KernelReport]:
    """Compile `unit` for `arch` with NVRTC (no driver needed), through the disk cache; one report
    per name expression."""
    return reports(unit, build(unit, arch))


def reports(unit: CompileUnit, b: kernel_cache.Build) -> list[KernelReport]:
    """ptxas's report of each name of `unit` from its build's log. A cached build whose log lacks it
    (stored by a run-time build in a process where NVRTC returned an empty log) is rebuilt once."""
    try:
        return _parse_ptxas(b.log, {b.lowered[n]: n for n in unit.names}, unit, b.arch)
    except RuntimeError:
        if not b.cached:
            raise
    b = build(unit, b.arch, refresh=True)
    return _parse_ptxas(b.log, {b.lowered[n]: n for n in unit.names}, unit, b.arch)


@functools.lru_cache(maxsize=None)
def _nvrtc_version() -> str:
    from cuda.bindings import nvrtc
    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcVersion: {err}")
    return f"{major}.{minor}"


def _parse_ptxas(log: str, lowered: dict, unit: CompileUnit, arch: str) -> list[KernelReport]:
    """Per entry: the 'Compiling entry function' / 'Function properties' line names it, the next
    stack-frame and 'Used N registers' lines belong to it (the order of the two varies)."""
    info: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            current = info.setdefault(m.group(1), {})
        elif m := re.search(r"Function properties for (\w+)", line):
            current = info.setdefault(m.group(1), {})
        elif current is not None and (m := _PTXAS_FRAME.search(line)):
            current.update(stack=int(m.group(1)), stores=int(m.group(2)), loads=int(m.group(3)))
        elif current is not None and (m := _PTXAS_USED.search(line)):
            current.update(regs=int(m.group(1)), smem=int(m.group(2) or 0))
    reports = []
    for mangled, name in lowered.items():
        r = info.get(mangled, {})
        if "regs" not in r:
            raise RuntimeError(f"no ptxas report for {name} ({mangled}) in {unit.source} for {arch} "
                               f"(NVRTC {_nvrtc_version()}); NVRTC log:\n{log[-3000:] or '(empty)'}")
        reports.append(KernelReport(unit.label or unit.source, name, arch, r["regs"], r.get("stores", 0),
                                    r.get("loads", 0), r.get("stack", 0), r["smem"],
                                    int(unit.dynamic_smem.get(name, 0))))
    return reports

