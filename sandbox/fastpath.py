"""The host-cost path for PyTorch callers: a repeated call is resolved once, then only launched.

A forward call's signature (variant and parameters, shapes, strides, dtypes, device, options) keys a
`Plan`: the bound variant, the validated Problem and, where the variant offers one, a pointer-level
`LaunchPlan` (sandbox/launch.py) with the kernel, grid, shared memory, tile table and typed scalars
already resolved. A repeated call costs a dict lookup, the allocation of its outputs through torch's
caching allocator, and the launch on torch's current stream; only `seed` and `offset`, which change
per call, are checked each time. Variants without a `forward_plan` (or problems a plan refuses, such
as block-sparse masks, whose layouts are not hashed per call) take the generic path in api.py.

Why: the generic path (variant resolution, validation, wrapping torch tensors as CuPy arrays,
DLPack back) cost a large fraction of a millisecond per call, several times SDPA's host time;
bench/host_cost.py measures both beside SDPA.

The key holds the option values and their types (`causal=1` must not hit a plan made for
`causal=True`, which validation would have refused), and the plan keeps no tensor alive.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import weakref
from collections import OrderedDict

from . import arrays, stream_counters
from .launch import COUNTERS

_PLANS: OrderedDict = OrderedDict()
_MAX_PLANS = 512
_TORCH_DTYPES = {}


def _torch_dtype(name: str):
    if not _TORCH_DTYPES:
        torch = sys.modules["torch"]
        _TORCH_DTYPES.update(float32=torch.float32, float16=torch.float16, bfloat16=torch.bfloat16, int32=torch.int32,
                              uint32=torch.int32)   # a counter's bits: torch's uint32 has few operations
    return _TORCH_DTYPES[name]


class Plan:
    """One forward problem resolved: the bound variant, its Problem, the forward LaunchPlan and the
    backward LaunchPlans made so far (keyed by the backward's variant and dout's strides). With score / mask
    modifiers, `problem` is kept without them and `mods` holds them weakly (`full_problem` puts them back): a
    plan in the cache must not keep a modifier, and the buffers it holds (a model's dense mask), alive."""

    __slots__ = ("bound", "problem", "forward", "backward", "device", "strides", "mods", "__weakref__")

    def __init__(self, bound, problem, forward, device, strides, mods=None):
        self.bound, self.problem, self.forward, self.device = bound, problem, forward, device
        self.strides = strides          # element strides of q, k, v, which the plan is keyed by
        self.backward = {}
        self.mods = mods                # (weakref or None, weakref or None): score_mod, mask_mod; None without


def variant_key(variant):
    """A hashable name for a variant argument: a name, or a bound variant's name and parameters."""
    if variant is None or isinstance(variant, str):
        return variant
    return (variant.name, tuple(sorted(variant.params.items())))


def forward_key(q, k, v, variant, params, causal, scale, dropout_p, window):
    return (variant_key(variant), tuple(sorted(params.items())) if params else (),
            q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            causal.__class__, causal, scale.__class__, scale, dropout_p.__class__, dropout_p,
            window.__class__, window)


def is_torch_cuda(*xs) -> bool:
    return all(type(x).__module__.startswith("torch") and getattr(x, "is_cuda", False) for x in xs)


def mods_key(key, score_mod, mask_mod, device):
    """A forward key extended by the modifiers' identities, or None where no plan may be kept. A mask modifier's
    tile table is computed on the caller's stream and read there (variants/mask_tiles.py), so its plans are per
    stream; while that stream is being captured into a CUDA graph none is made or used (the table a capture
    launches is filled only when the graph runs)."""
    stream = None
    if mask_mod is not None:
        s = _stream(device)
        if stream_counters.capturing(s):
            return None
        stream = s.ptr
    return key + (id(score_mod), id(mask_mod), stream)


def lookup(key, score_mod=None, mask_mod=None):
    plan = _PLANS.get(key)
    if plan is not None:
        if plan.mods is not None and not (_alive(plan.mods[0]) is score_mod and _alive(plan.mods[1]) is mask_mod):
            return None                 # an id of a modifier since freed, reused (its finalizer runs soon)
        _PLANS.move_to_end(key)
    return plan


def _alive(ref):
    return None if ref is None else ref()


def make_plan(key, bound, problem, q, k, v):
    """Resolve the forward once; a variant without `forward_plan` gets a plan without one (the caller
    then runs the generic path with the resolved variant and problem). A plan with modifiers goes when either
    modifier does (weakref.finalize), so that its buffers go with them."""
    _check_unit_stride(q=q, k=k, v=v)
    make = getattr(bound.variant.impl, "forward_plan", None)
    strides = {"q": tuple(q.stride()), "k": tuple(k.stride()), "v": tuple(v.stride())}
    launch = None
    if make is not None and problem.block_mask is None:
        with arrays.caller_stream(q):
            launch = make(problem, bound.config, strides)
    mods = None
    sm, mm = problem.score_mod, problem.mask_mod
    if sm is not None or mm is not None:
        mods = tuple(None if m is None else weakref.ref(m) for m in (sm, mm))
        problem = dataclasses.replace(problem, score_mod=None, mask_mod=None)
    plan = Plan(bound, problem, launch, q.device, strides, mods)
    _PLANS.pop(key, None)
    _PLANS[key] = plan
    ref = weakref.ref(plan)       # the finalizers hold the plan weakly: a long-lived score modifier (a cached
    for m in (sm, mm):            # soft-cap) must not keep every per-step mask's plan, and its buffers, alive
        if m is not None:
            weakref.finalize(m, _drop, key, ref)
    if len(_PLANS) > _MAX_PLANS:
        _PLANS.popitem(last=False)
    return plan


def _drop(key, ref):
    plan = ref()
    if plan is not None and _PLANS.get(key) is plan:
        del _PLANS[key]


def full_problem(plan):
    """The plan's Problem with its modifiers (which the plan holds weakly; alive while the caller holds them)."""
    p = plan.problem
    if plan.mods is None:
        return p
    return dataclasses.replace(p, score_mod=_alive(plan.mods[0]), mask_mod=_alive(plan.mods[1]))


def _check_unit_stride(**xs):
    for name, x in xs.items():
        if x.shape[-1] > 1 and x.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along d (last axis); got strides {tuple(x.stride())}")


def problem_for(plan, seed, offset):
    p = full_problem(plan)
    return p if (p.seed, p.offset) == (seed, offset) else dataclasses.replace(p, seed=seed, offset=offset)


def _stream(device):
    """CuPy stream object for torch's current stream on `device`, with CuPy's device set to it."""
    dev = device.index
    import cupy
    if cupy.cuda.runtime.getDevice() != dev:
        cupy.cuda.runtime.setDevice(dev)
    return arrays._external_stream(arrays.torch_stream_ptr(dev), dev)


def _run(launch, device, inputs: dict, seed, offset) -> dict:
    torch = sys.modules["torch"]
    stream = _stream(device)
    ptr = {name: x.data_ptr() for name, x in inputs.items()}
    bufs = {}
    if launch.scratch_bytes:          # the scratch buffers: one allocation (LaunchPlan.scratch)
        scratch = bufs[" scratch"] = torch.empty(launch.scratch_bytes, dtype=torch.uint8, device=device)
        base = scratch.data_ptr()
        for name, at in launch.scratch.items():
            ptr[name] = base + at
    for name, (shape, dt, zeroed) in launch.buffers.items():
        if name in launch.scratch:
            continue
        if zeroed == COUNTERS and not stream_counters.capturing(stream):
            ptr[name] = stream_counters.zeroed(sys.modules["cupy"], math.prod(shape), stream).data.ptr
            continue                  # kept per stream, not an output (a capture takes fresh zeros below)
        b = bufs[name] = (torch.zeros if zeroed else torch.empty)(shape, dtype=_torch_dtype(dt), device=device)
        ptr[name] = b.data_ptr()
    launch.run(ptr, seed, offset, stream)
    return bufs


def run_forward(plan, q, k, v, seed, offset):
    """(out, lse) as torch tensors, launched on torch's current stream."""
    bufs = _run(plan.forward, plan.device, {"q": q, "k": k, "v": v}, seed, offset)
    return bufs["out"], bufs["lse"]


def backward_launch(plan, bound, dout, out):
    """The backward LaunchPlan of `bound` for this forward plan and dout's strides, made once; None
    where the variant has none."""
    problem = full_problem(plan)
    stream = None
    if problem.mask_mod is not None:  # its tile table is made on, and read after, the caller's stream (mods_key)
        s = _stream(dout.device)
        if stream_counters.capturing(s):
            return None               # the generic path: a captured table is filled only when the graph runs
        stream = s.ptr
    key = (variant_key(bound), tuple(dout.stride()), tuple(out.stride()), stream)
    if key in plan.backward:
        return plan.backward[key]
    _check_unit_stride(dout=dout, out=out)
    bound.check(problem, "backward")
    make = getattr(bound.variant.impl, "backward_plan", None)
    launch = None
    if make is not None and problem.block_mask is None:
        strides = {**plan.strides, "out": tuple(out.stride()), "dout": tuple(dout.stride())}
        with arrays.caller_stream(dout):
            launch = make(problem, bound.config, strides)
    plan.backward[key] = launch
    return launch


def run_backward(launch, problem, dout, q, k, v, out, lse):
    """(dq, dk, dv) as torch tensors in q's dtype."""
    bufs = _run(launch, q.device, {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse},
                problem.seed, problem.offset)
    dq = bufs["dq"]
    if dq.dtype != q.dtype:
        dq = dq.to(q.dtype)
    return dq, bufs["dk"], bufs["dv"]
