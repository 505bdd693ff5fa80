"""Compile every registered CUDA variant without a GPU (NVRTC via cuda.bindings) and report
registers, spills, stack and shared memory per kernel and architecture.

What is built: for every CUDA variant its default config and each config of `report_configs()`
(`configs`), every unit of `compile_units(config)`, then the softmax kernels (`units`). Each distinct
kernel instantiation (source, options, name expression, architecture) is compiled once, alone in its
program, however many configs and variants share it (`kernel_jobs`): ptxas allocates registers per
kernel, so its report is the one the kernel gets in the full module (the unit the loader builds).
The builds run in a thread pool (NVRTC releases the GIL) through the loader's disk cache
(sandbox/kernel_cache.py): an unchanged kernel's report is read from its stored ptxas log.
Progress goes to stderr, `[i/n] label kernel arch (elapsed)`.
"""
from __future__ import annotations

import os
import sys

from . import loader
from .device import DEFAULT_ARCHS, SMEM_PER_BLOCK_OPTIN, smem_per_block_optin
from .registry import all_variants

ARCHS = DEFAULT_ARCHS                                        # sm_80, sm_90
SMEM_LIMIT = {a: SMEM_PER_BLOCK_OPTIN[a] for a in ARCHS}    # max shared memory per block (opt-in)


def configs(variant, gate: bool = False) -> list:
    """The bound configs the report builds for a CUDA variant: its default, then every entry of
    `report_configs()` (default [{}]), each once. `gate`: the default and the configs its `tuned`
    accepts only (the registry's defaults and tuned tables: what the CI gate must cover; the rest of
    report_configs() compiles in the full report)."""
    seen, out = set(), []
    tuned = getattr(variant.impl, "tuned", None)
    for params in [{}, *getattr(variant.impl, "report_configs", lambda: [{}])()]:
        bound = variant.bind(**params)
        key = tuple(sorted(bound.params.items(), key=lambda kv: kv[0]))
        if key in seen or (gate and params and tuned is not None and not tuned(bound.config)):
            continue
        seen.add(key)
        out.append(bound)
    return out


def units(gate: bool = False):
    """(variant name, bound config, CompileUnit) for every CUDA variant and every config it lists
    (`gate`: see configs), then the kernels that are not attention variants (the lecture's softmax
    algorithms, the packed backward's row preparation)."""
    from . import softmax, varlen
    for v in all_variants().values():
        if v.backend != "cuda":
            continue
        for bound in configs(v, gate):
            for unit in v.impl.compile_units(bound.config):
                yield v.name, bound, unit
    yield "softmax", None, softmax.unit()
    yield "varlen_rows", None, varlen.rows_unit()


def kernel_key(unit, name: str, arch: str) -> tuple:
    return unit.source, tuple(unit.options), name, arch


def kernel_jobs(entries, archs) -> dict:
    """kernel_key -> a one-name CompileUnit, for every distinct kernel of `entries` ((variant, bound,
    unit) triples) and architecture."""
    jobs = {}
    for _, _, unit in entries:
        for arch in archs:
            if unit.target(arch) is None:        # an sm_90a unit has no sm_80 build
                continue
            for name in unit.names:
                jobs.setdefault(kernel_key(unit, name, arch),
                                loader.CompileUnit(unit.source, (name,), tuple(unit.options),
                                                   {name: unit.dynamic_smem.get(name, 0)}, unit.label,
                                                   tuple(unit.archs)))
    return jobs


def report(archs=ARCHS, workers: int | None = None, progress: bool = True, gate: bool = False) -> list[dict]:
    """One row per (variant, config, unit, kernel, arch), the kernels built by `kernel_jobs`; `gate`:
    the defaults and tuned configs only (configs)."""
    limit = {arch: smem_per_block_optin(arch) for arch in archs}     # ValueError for an unknown arch
    entries = list(units(gate))
    jobs = kernel_jobs(entries, archs)
    keys = list(jobs)
    builds = loader.build_many([(jobs[k], k[3]) for k in keys], workers,
                               _print_progress if progress else None)
    kernel = {}
    for k, b in zip(keys, builds):
        (kernel[k],) = loader.reports(jobs[k], b)
    rows = []
    for name, bound, unit in entries:
        for arch in archs:
            if unit.target(arch) is None:
                continue
            tuned = bound is None or _tuned(bound, unit)
            for kname in unit.names:
                r = kernel[kernel_key(unit, kname, arch)]
                dynamic = int(unit.dynamic_smem.get(kname, 0))
                rows.append({"variant": name, "config": repr(bound) if bound else name, "unit": unit.label,
                             "kernel": kname, "arch": arch, "target": unit.target(arch), "registers": r.registers,
                             "spill_stores": r.spill_stores, "spill_loads": r.spill_loads, "stack": r.stack,
                             "static_smem": r.static_smem, "dynamic_smem": dynamic, "smem_limit": limit[arch],
                             "tuned": tuned, "fits": r.static_smem + dynamic <= limit[arch]})
    return rows


def _print_progress(i, n, unit, arch, build, elapsed):
    state = "failed" if build is None else ("cached" if build.cached else "built")
    print(f"[{i}/{n}] {unit.label or unit.source} {unit.names[0]} {arch} {state} ({elapsed:.1f} s)",
          file=sys.stderr, flush=True)


def _tuned(bound, unit) -> bool:
    """The variant's verdict on one unit of a config (`impl.tuned(config, unit)`); impls without
    `tuned` count every config as tuned."""
    tuned = getattr(bound.variant.impl, "tuned", None)
    return True if tuned is None else tuned(bound.config, unit)


def report_in_subprocess(archs=ARCHS, gate: bool = False):
    """report() in a fresh interpreter: once CuPy has loaded its own libnvrtc into a process, NVRTC
    called through cuda.bindings there returned an empty log (seen on the GPU image), so the
    compile-only check keeps its own process."""
    return ReportProcess(archs, gate=gate).rows()


class ReportProcess:
    """`python -m sandbox compile-report` started now in a child process, its rows read by rows().

    nice: the child's CPU priority increment (POSIX), so that a build started ahead of time takes
    the cores the caller leaves idle rather than time from the caller. A child still running when
    this process exits is killed. The rows come back also when the command fails on spills in
    tuned configs (its exit status 1), so that the caller's checks name them."""

    def __init__(self, archs=ARCHS, nice: int = 0, gate: bool = False):
        import atexit
        import subprocess
        import tempfile
        self._tmp = tempfile.TemporaryDirectory(prefix="fa-sandbox-report-")
        self.out = os.path.join(self._tmp.name, "report.json")
        cmd = [sys.executable, "-m", "sandbox", "compile-report", "--arch", ",".join(archs), "--json", self.out,
               *(["--gate"] if gate else [])]
        renice = (lambda: os.nice(nice)) if nice and hasattr(os, "nice") else None
        # output to files, not pipes: nobody reads a pipe while the child runs ahead of time
        self._log = open(os.path.join(self._tmp.name, "output.txt"), "w+")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=renice)
        self._rows, self._error = None, None
        atexit.register(self._kill)

    def rows(self) -> list[dict]:
        import json
        if self._rows is None and self._error is None:
            self.proc.wait()
            try:
                with open(self.out) as f:
                    self._rows = json.load(f)
            except (OSError, ValueError):
                self._log.seek(0)
                self._error = f"compile report failed (exit {self.proc.returncode}):\n{self._log.read()[-6000:]}"
            finally:
                self._log.close()
                self._tmp.cleanup()
        if self._error is not None:
            raise RuntimeError(self._error)
        return self._rows

    def _kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def markdown(rows) -> str:
    head = ("| variant | kernel | arch | regs | spill st/ld | stack | smem (static+dyn) | tuned |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        fits = "" if r.get("fits", True) else f" (> {r['smem_limit']}: not on {r['arch']})"
        lines.append(f"| {r['variant']} | `{r['kernel']}` | {r.get('target') or r['arch']} | {r['registers']} | "
                     f"{r['spill_stores']}/{r['spill_loads']} | {r['stack']} | {r['static_smem']}+{r['dynamic_smem']}{fits} | "
                     f"{'yes' if r['tuned'] else 'no'} |")
    return "\n".join(lines)
