"""The variant contract: what a variant's implementation object (`Variant.impl`) provides.

A variant is a `sandbox.registry.Variant` (name, family, backend, description, impl, params, caps,
seed_ref, and for the benchmarks tags, bench_configs, bench_sweep; see sandbox/registry.py) passed
to `register(...)`. The sandbox reads the declaration for everything it decides before a launch,
and calls the impl for the rest:

    Variant.params   (Param: name, choices, default, doc, replay)
                     the parameters a caller may pass (`variant=..., block_r=64`); `bind` refuses a
                     name not listed or a value not in `choices`, fills in `default`s, and passes
                     the full set to `impl.configure`. `replay=True` marks a parameter that changes
                     the dropout stream (philox_rounds): a backward must use the forward's value.
    Variant.caps     (Capabilities: backward, causal, window, block_sparse, dropout, gqa, dtypes,
                     head_dims) what the variant supports; `BoundVariant.check` refuses the rest with
                     a ValueError naming the variant and every missing capability, before
                     `impl.check` runs and before any array moves.
    Variant.backend  "cuda" (kernels_cu/ through CuPy) or "numba"; a "cuda" impl is a CompiledImpl.
    Variant.family, description, seed_ref   for listings and reports (`sandbox list`, tables).
    Variant.tags, bench_configs, bench_sweep which bench families time the variant, with which
                     parameter sets (sandbox/registry.py module docstring; bench/selection.py).

Which members the sandbox uses, and where:

    member                               required        used by
    configure(**params) -> config        yes             registry.Variant.bind
    to_backend(x, name="array")          yes             api (every array), cli run
    forward(problem, q, k, v, config)    yes             api.forward
    backward(problem, dout, q, k, v,     if caps.backward api.backward
             out, lse, config[, saved=])
    check(problem, config, direction)    no              registry.BoundVariant.check
    config_caps(config, caps) -> caps    no              registry.BoundVariant.caps (the fuzzer draws
                                                         within them): a config that refuses part of
                                                         caps (e.g. a backward kernel without modifiers)
    compile_units(config)                backend "cuda"  compile_report (GPU-less NVRTC build)
    report_configs()                     no              compile_report (default: [{}])
    tuned(config, unit=None)             no              compile_report (default: every config)
    forward_plan(problem, config, st)    no (or None)    fastpath (torch callers)
    backward_plan(problem, config, st)   no (or None)    fastpath (torch callers)
    SIMULATOR_PARAMS                     no              tests/test_numba_simulator.py
    has_backward                         no              the fa2-tc family itself; the sandbox
                                                         reads caps.backward, never this

"Optional" means absent or None (the sandbox looks it up with getattr(impl, name, None)), or
callable. `contract_errors(variant)` checks a registered variant against this table;
tests/test_contract_module.py runs it over the registry.

Defaults live in one place: the Params. `impl.configure()` with no arguments must give the same
config as `Variant.bind()` with none (the Params' defaults), and configs must compare equal for
equal parameters (a frozen dataclass in every in-tree variant).
"""
from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

__all__ = ["VariantImpl", "BackwardImpl", "CompiledImpl", "PlannedImpl", "REQUIRED", "OPTIONAL",
           "contract_errors"]


@runtime_checkable
class VariantImpl(Protocol):
    """What every variant's impl provides."""

    def configure(self, **params) -> Any:
        """Validated compile-time / launch parameters -> a config object.

        Called by `Variant.bind` with every Param by name (defaults filled in; values already
        checked against `choices`), once per bind. Raise ValueError for combinations that no
        problem could run (checks that depend on the problem belong in `check`). The config is
        opaque to the sandbox: it is handed back to every other method, compared with `==`, and
        shown in error messages."""

    def to_backend(self, x, name: str = "array") -> Any:
        """The caller's array `x` (NumPy, CuPy, torch or any DLPack / __cuda_array_interface__
        array) as an array of this backend: a CuPy view for "cuda" (sandbox.arrays.to_device:
        zero-copy for device arrays, a copy for NumPy), a device or simulator array for "numba"
        (sandbox.numba_support.to_backend). Runs inside `arrays.caller_stream`. `name` ("q",
        "dout", "lse", ...) names the array in a ValueError (e.g. a strided last axis)."""

    def forward(self, problem, q, k, v, config) -> tuple:
        """Launch the forward on the current stream -> (out, lse) or (out, lse, saved).

        problem: the validated sandbox.problem.Problem (shapes, dtype, scale, band, dropout, seed
        and offset), already checked against caps and `check`. q, k, v: backend arrays from
        `to_backend`, any strides with unit stride along d. out: [B, Hq, Nq, d] in q's dtype;
        lse: float32 [B, Hq, Nq], natural log, -inf on rows that see no key (out 0 there).
        saved: an optional dict the backward receives back as `saved=` (fa1 / fa2 keep the
        bit-packed dropout mask under dropout_store="packed"); an empty dict when nothing is kept.
        Never synchronise the device."""


@runtime_checkable
class BackwardImpl(VariantImpl, Protocol):
    """An impl whose Variant declares `caps.backward`."""

    def backward(self, problem, dout, q, k, v, out, lse, config, saved=None) -> tuple:
        """Launch the backward on the current stream -> (dq, dk, dv) shaped like q, k, v.

        Same problem and config as the forward (api.backward refuses differing options and
        replay parameters); dout, out: backend arrays like q; lse: float32 [B, Hq, Nq], contiguous.
        Dropout: regenerate the mask from (problem.seed, problem.offset) under the RNG contract,
        or read it from `saved`. A backward that declares a `saved` parameter always receives it
        (`saved={}` when the forward kept nothing); one that does not never does, and then its
        forward must return no saved dict, or an empty one."""


@runtime_checkable
class CompiledImpl(VariantImpl, Protocol):
    """An impl of backend "cuda": its kernels can be built without a GPU (sandbox/compile_report.py).

    Optional beside compile_units:
        report_configs() -> [dict]       parameter sets to build and report (default [{}]: the
                                         defaults); each is passed to Variant.bind
        tuned(config, unit=None) -> bool whether a config (and one of its units) is held to "no
                                         register spills" by the CI check (default: every one)
    """

    def compile_units(self, config) -> list:
        """The sandbox.loader.CompileUnits that `config` launches (source, template name
        expressions, options, dynamic shared memory per kernel), for the compile-only report."""


@runtime_checkable
class PlannedImpl(VariantImpl, Protocol):
    """An impl with pointer-level launch plans for PyTorch callers (sandbox/fastpath.py).

    Either method may be None (or absent): that direction takes the generic path. Both run once
    per signature (shapes, strides, dtype, options) inside `arrays.caller_stream`, never for a
    block-sparse problem, and return a sandbox.launch.LaunchPlan or None (the generic path runs).
    """

    def forward_plan(self, problem, config, strides: dict):
        """strides: element strides of "q", "k", "v". The plan's buffers must name "out" and "lse";
        its run(pointers, seed, offset, stream) gets every input and buffer by name."""

    def backward_plan(self, problem, config, strides: dict):
        """strides: those of "q", "k", "v", "out", "dout". Buffers must name "dq", "dk", "dv"
        (dq may be float32: it is cast to q's dtype after the run); run gets q, k, v, out, dout,
        lse and the buffers by name."""


# member -> when it is required: "always", "backward" (caps.backward), "cuda" (backend), or
# "optional" (absent, None or callable)
REQUIRED = {"configure": "always", "to_backend": "always", "forward": "always", "backward": "backward",
            "compile_units": "cuda"}
OPTIONAL = ("check", "config_caps", "report_configs", "tuned", "forward_plan", "backward_plan")
_ARITY = {"configure": 0, "to_backend": 1, "forward": 5, "backward": 8, "check": 3, "config_caps": 2, "compile_units": 1,
          "report_configs": 0, "tuned": 2, "forward_plan": 3, "backward_plan": 3}


def _needed(when: str, variant) -> bool:
    return when == "always" or (when == "backward" and variant.caps.backward) or \
        (when == "cuda" and variant.backend == "cuda")


def _takes(fn, n: int) -> bool:
    try:
        inspect.signature(fn).bind(*([None] * n))
        return True
    except TypeError:
        return False
    except ValueError:           # no signature to read (a builtin): do not guess
        return True


def contract_errors(variant) -> list[str]:
    """What a registered Variant's impl lacks under this contract (empty: nothing)."""
    impl, errs = variant.impl, []
    for name, when in REQUIRED.items():
        member = getattr(impl, name, None)
        if member is None:
            if _needed(when, variant):
                errs.append(f"{name} is missing (required: {when})")
            continue
        if not callable(member):
            errs.append(f"{name} is not callable")
        elif not _takes(member, _ARITY[name]):
            errs.append(f"{name} does not take {_ARITY[name]} positional arguments")
    for name in OPTIONAL:
        member = getattr(impl, name, None)
        if member is not None and not callable(member):
            errs.append(f"{name} is neither None nor callable")
        elif member is not None and not _takes(member, _ARITY[name]):
            errs.append(f"{name} does not take {_ARITY[name]} positional arguments")
    has_backward = getattr(impl, "has_backward", None)
    if has_backward is not None and bool(has_backward) != variant.caps.backward:
        errs.append(f"has_backward={has_backward!r} disagrees with caps.backward={variant.caps.backward}")
    sim = getattr(impl, "SIMULATOR_PARAMS", None)
    if sim is not None:
        try:
            variant.bind(**sim)
        except (TypeError, ValueError) as e:
            errs.append(f"SIMULATOR_PARAMS {sim!r} do not bind: {e}")
    if callable(getattr(impl, "configure", None)):
        try:
            if impl.configure() != variant.bind().config:
                errs.append("configure() differs from the Params' defaults (Variant.bind())")
        except (TypeError, ValueError) as e:
            errs.append(f"configure() or bind() failed: {e}")
    return errs
