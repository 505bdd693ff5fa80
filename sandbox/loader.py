"""Build CUDA sources from kernels_cu/: at run time through cupy.RawModule (NVRTC), or compile-only
through cuda.bindings.nvrtc (no GPU needed) with a register / spill / shared-memory report.

- Sources are read as package data and their local `#include "x.cuh"` lines are inlined, so the
  text that is compiled (and that CuPy's on-disk cache is keyed by) is the whole program.
- Templates are instantiated through `name_expressions`: a variant's config object produces the
  exact names (e.g. "standard_softmax<__half>").
- One module per (source, options, name expressions), built lazily and cached.
- Dynamic shared memory above 48 KB is enabled per kernel before its first launch.
"""
from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

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


# ---- run time (CuPy)

@functools.lru_cache(maxsize=None)
def _module(source: str, options: tuple, names: tuple):
    import cupy
    return cupy.RawModule(code=source_text(source), options=BASE_OPTIONS + options,
                          name_expressions=list(names))


def get_kernel(unit: CompileUnit, name: str):
    """The compiled kernel `name` of `unit`, with its dynamic shared-memory limit raised if needed."""
    kernel = _module(unit.source, tuple(unit.options), tuple(unit.names)).get_function(name)
    smem = int(unit.dynamic_smem.get(name, 0))
    if smem > STATIC_SMEM_LIMIT and kernel.max_dynamic_shared_size_bytes < smem:
        kernel.max_dynamic_shared_size_bytes = smem
    return kernel


def launch(unit: CompileUnit, name: str, grid, block, args, shared_mem: int = 0):
    """Launch with every scalar already typed (np.int32 / np.float32 / np.uint64 ...)."""
    for a in args:
        if isinstance(a, (bool, int, float)):
            raise TypeError(f"untyped Python scalar {a!r} passed to {name}: type it explicitly "
                            "(CuPy would pass it as long long / double)")
    grid = tuple(int(g) for g in grid)
    if min(grid) == 0:
        return
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
    pointer) or Slots. SANDBOX_LAUNCH=cupy uses CuPy's launch instead (the reference path).
    """

    def __init__(self, kernel, grid, block, shared_mem: int, args):
        import ctypes
        self.kernel, self.args = kernel, tuple(args)
        self.grid = tuple(int(g) for g in (tuple(grid) + (1, 1))[:3])
        self.block = tuple(int(b) for b in (tuple(block) + (1, 1))[:3])
        self.shared_mem = int(shared_mem)
        self.cupy_path = os.environ.get("SANDBOX_LAUNCH") == "cupy"
        self.holders, self.slots = [], []
        for i, a in enumerate(self.args):
            if isinstance(a, Slot):
                h = getattr(ctypes, _CTYPES[a.ctype])(0)
                self.slots.append((a.name, h))
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


# ---- compile only (no GPU): NVRTC through cuda.bindings

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


def compile_only(unit: CompileUnit, arch: str = "sm_90") -> list[KernelReport]:
    """Compile `unit` for `arch` with NVRTC (no driver needed); one report per name expression."""
    from cuda.bindings import nvrtc

    def check(result, what):
        err = result[0]
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what}: {err}")
        return result[1:] if len(result) > 1 else None

    (prog,) = check(nvrtc.nvrtcCreateProgram(source_text(unit.source).encode(), unit.source.encode(), 0, [], []),
                    "nvrtcCreateProgram")
    try:
        for name in unit.names:
            check(nvrtc.nvrtcAddNameExpression(prog, name.encode()), "nvrtcAddNameExpression")
        opts = [*BASE_OPTIONS, *unit.options, f"-arch={arch}", "-Xptxas=-v"]
        opts += [f"-I{d}" for d in cuda_include_dirs()]
        result = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        (size,) = check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        # a mutable buffer: NVRTC writes into it (writing into a bytes object, as before, mutates an
        # immutable value, and for sizes 0 and 1 CPython's shared singletons)
        buf = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = bytes(buf).rstrip(b"\0").decode(errors="replace")
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC failed to compile {unit.source} for {arch}:\n{log}")
        lowered = {}
        for name in unit.names:
            (low,) = check(nvrtc.nvrtcGetLoweredName(prog, name.encode()), "lowered name")
            lowered[low.decode()] = name
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return _parse_ptxas(log, lowered, unit, arch)


def _nvrtc_version() -> str:
    from cuda.bindings import nvrtc
    _, major, minor = nvrtc.nvrtcVersion()
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


def as_scalar(value, ctype):
    """Typed kernel scalar (name the C type: 'int', 'float', 'u64', 'u32')."""
    return {"int": np.int32, "float": np.float32, "u64": np.uint64, "u32": np.uint32}[ctype](value)
