"""Compile every registered CUDA variant without a GPU (NVRTC via cuda.bindings) and report
registers, spills, stack and shared memory per kernel and architecture."""
from __future__ import annotations

from . import loader
from .registry import all_variants

ARCHS = ("sm_80", "sm_90")
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}   # max shared memory per block (opt-in)


def units():
    """(variant name, params, CompileUnit) for every CUDA variant and every config it lists, then
    the kernels that are not attention variants (the lecture's softmax algorithms)."""
    from . import softmax
    for v in all_variants().values():
        if v.backend != "cuda":
            continue
        for params in getattr(v.impl, "report_configs", lambda: [{}])():
            bound = v.bind(**params)
            for unit in v.impl.compile_units(bound.config):
                yield v.name, bound, unit
    yield "softmax", None, softmax.unit()


def report(archs=ARCHS):
    rows = []
    for name, bound, unit in units():
        for arch in archs:
            for r in loader.compile_only(unit, arch):
                tuned = bound is None or _tuned(bound, unit)
                rows.append({"variant": name, "config": repr(bound) if bound else name, "unit": unit.label, "kernel": r.name,
                             "arch": arch, "registers": r.registers, "spill_stores": r.spill_stores,
                             "spill_loads": r.spill_loads, "stack": r.stack, "static_smem": r.static_smem,
                             "dynamic_smem": r.dynamic_smem, "smem_limit": SMEM_LIMIT[arch], "tuned": tuned,
                             "fits": r.static_smem + r.dynamic_smem <= SMEM_LIMIT[arch]})
    return rows


def _tuned(bound, unit) -> bool:
    """The variant's verdict on one unit of a config (`impl.tuned(config, unit)`); impls without
    `tuned` count every config as tuned."""
    tuned = getattr(bound.variant.impl, "tuned", None)
    return True if tuned is None else tuned(bound.config, unit)


def report_in_subprocess(archs=ARCHS):
    """report() in a fresh interpreter: once CuPy has loaded its own libnvrtc into a process, NVRTC
    called through cuda.bindings there returned an empty log (seen on the GPU image), so the
    compile-only check keeps its own process."""
    import json
    import subprocess
    import sys
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        proc = subprocess.run([sys.executable, "-m", "sandbox", "compile-report", "--arch", ",".join(archs),
                               "--json", f.name], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"compile report failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return json.load(open(f.name))


def markdown(rows) -> str:
    head = ("| variant | kernel | arch | regs | spill st/ld | stack | smem (static+dyn) | tuned |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        fits = "" if r.get("fits", True) else f" (> {r['smem_limit']}: not on {r['arch']})"
        lines.append(f"| {r['variant']} | `{r['kernel']}` | {r['arch']} | {r['registers']} | "
                     f"{r['spill_stores']}/{r['spill_loads']} | {r['stack']} | {r['static_smem']}+{r['dynamic_smem']}{fits} | "
                     f"{'yes' if r['tuned'] else 'no'} |")
    return "\n".join(lines)
