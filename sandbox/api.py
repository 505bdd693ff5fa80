"""The public entry points: attention, forward, backward (docs/ARCHITECTURE.md "Public API").

Flow of a call: resolve the variant and its parameters -> validate the problem (shapes, dtype,
options) -> check the variant's capabilities -> move arrays to the backend (zero-copy where
possible) -> launch on the caller's stream -> hand results back as the caller's array type. Every
rejection happens before anything is launched.

PyTorch CUDA tensors take the plan path (sandbox/fastpath.py) where the variant offers pointer-level
plans: the first call of a signature runs the full resolution and validation, later calls only
launch. Everything else takes the generic path below.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import arrays, device, fastpath
from .precision import dtype_name
from .philox import check_offset, check_seed
from .problem import OptionTypeError, Problem, make_problem
from .registry import BoundVariant, get_variant

# variant=None: the fastest exact variant for fp32, the tensor-core one for fp16 / bf16 (default_variant:
# on an sm_90 GPU the Hopper rung fa3 instead, for every head dim it takes)
DEFAULT_VARIANTS = {"float32": "fa2", "float16": "fa2-tc", "bfloat16": "fa2-tc"}
DEFAULT_VARIANT = DEFAULT_VARIANTS["float32"]
HOPPER_DEFAULT = "fa3"
HOPPER_DEFAULT_DIMS = range(8, 257, 8)          # fa3's head dims (its capabilities)


def _device_index(x) -> int | None:
    """The GPU a CuPy or torch CUDA array lives on; None for host arrays."""
    kind = arrays.kind_of(x)
    if kind == "cupy":
        return int(x.device.id)
    if kind == "torch" and x.device.type == "cuda":
        return int(x.device.index if x.device.index is not None else 0)
    return None


def default_variant(like=None, params=None) -> str:
    """The variant that variant=None means for an input like `like`: DEFAULT_VARIANTS by dtype (fa2 for fp32,
    fa2-tc for fp16 / bf16), except fp16 / bf16 device arrays on an sm_90 GPU (H100, H200) whose head dim
    fa3 takes (8..256, step 8) and no variant parameters given (those name the default's config, fa2-tc's as
    before): fa3, the fastest rung there and the one that takes head dims past 128."""
    if like is None:
        return DEFAULT_VARIANT
    dtype = dtype_name(like)
    name = DEFAULT_VARIANTS.get(dtype, DEFAULT_VARIANT)
    if dtype in ("float16", "bfloat16") and not params and like.shape[-1] in HOPPER_DEFAULT_DIMS:
        index = _device_index(like)
        if index is not None and device.compute_capability(index) == (9, 0):
            return HOPPER_DEFAULT
    return name


@dataclass
class Result:
    """Forward result: out [B,Hq,Nq,d], lse [B,Hq,Nq] float32, rng = (seed, offset) for the replay."""

    out: object
    lse: object
    rng: tuple
    problem: Problem = field(repr=False, default=None)
    variant: BoundVariant = field(repr=False, default=None)
    inputs: tuple = field(repr=False, default=())
    saved: dict = field(repr=False, default_factory=dict)
    plan: object = field(repr=False, default=None)     # fastpath.Plan of a torch call, or None

    def __iter__(self):
        return iter((self.out, self.lse, self.rng))


def _resolve(variant, params, like=None) -> BoundVariant:
    return get_variant(default_variant(like, params) if variant is None else variant, **params)


def _backend_arrays(bound: BoundVariant, xs, names):
    impl = bound.variant.impl
    return [impl.to_backend(x, name) for x, name in zip(xs, names)]


def _plan_for(q, k, v, variant, params, causal, scale, dropout_p, window, seed, offset, score_mod=None,
              mask_mod=None):
    """The fastpath.Plan of a torch call's signature (and modifiers: fastpath.mods_key), resolved and validated on
    first use; None where an option is unhashable (the generic path then validates it) or no plan may be kept."""
    try:
        key = fastpath.forward_key(q, k, v, variant, params, causal, scale, dropout_p, window)
        if score_mod is not None or mask_mod is not None:
            key = fastpath.mods_key(key, score_mod, mask_mod, q.device)
            if key is None:
                return None
        plan = fastpath.lookup(key, score_mod, mask_mod)
    except TypeError:
        return None
    if plan is None:
        bound = _resolve(variant, params, q)
        problem = make_problem(q, k, v, causal, scale, dropout_p, seed, offset, window, None, score_mod, mask_mod)
        bound.check(problem, "forward")
        plan = fastpath.make_plan(key, bound, problem, q, k, v)
    return plan


def forward(q, k, v, variant=None, causal=False, scale=None, dropout_p=0.0, seed=0, offset=0,
            window=None, block_mask=None, score_mod=None, mask_mod=None, **params) -> Result:
    """Result(out, lse, rng). score_mod / mask_mod: sandbox.modifiers.ScoreMod / MaskMod (issue 18),
    for variants whose capabilities list them (a torch call's plan path takes them too: fastpath.mods_key)."""
    if block_mask is None and fastpath.is_torch_cuda(q, k, v):
        plan = _plan_for(q, k, v, variant, params, causal, scale, dropout_p, window, seed, offset, score_mod,
                         mask_mod)
        if plan is not None and plan.forward is not None:
            check_rng(seed, offset)
            out, lse = fastpath.run_forward(plan, q, k, v, seed, offset)
            return Result(out, lse, (seed, offset), fastpath.problem_for(plan, seed, offset), plan.bound,
                          (q, k, v, out, lse), {}, plan)
    bound = _resolve(variant, params, q)
    problem = make_problem(q, k, v, causal, scale, dropout_p, seed, offset, window, block_mask,
                           score_mod, mask_mod)
    bound.check(problem, "forward")
    kind = arrays.kind_of(q)
    with arrays.caller_stream(q):
        qb, kb, vb = _backend_arrays(bound, (q, k, v), ("q", "k", "v"))
        out, lse, *saved = bound.variant.impl.forward(problem, qb, kb, vb, bound.config)
        saved = saved[0] if saved else {}     # what a variant keeps for its backward (a stored dropout mask)
        return Result(arrays.like(out, kind), arrays.like(lse, kind), (problem.seed, problem.offset),
                      problem, bound, (qb, kb, vb, out, lse), saved)


def forward_checks(q, k, v, variant=None, causal=False, scale=None, dropout_p=0.0, seed=0, offset=0, window=None,
                   block_mask=None, score_mod=None, mask_mod=None, **params) -> BoundVariant:
    """Every rejection `forward` would raise for these arguments, without launching anything; the
    bound variant. For layers that must refuse before they change state (sandbox/decode.py writes
    new keys into the caller's cache)."""
    bound = _resolve(variant, params, q)
    bound.check(make_problem(q, k, v, causal, scale, dropout_p, seed, offset, window, block_mask, score_mod,
                             mask_mod), "forward")
    return bound


def attention(q, k, v, variant=None, causal=False, scale=None, dropout_p=0.0, seed=0, offset=0,
              window=None, block_mask=None, score_mod=None, mask_mod=None, **params):
    """softmax(mask(score_mod(scale * q k^T))) (with dropout) @ v; returns out only."""
    return forward(q, k, v, variant, causal, scale, dropout_p, seed, offset, window, block_mask,
                   score_mod, mask_mod, **params).out


class _Unset:
    def __repr__(self):
        return "<unset>"


_UNSET = _Unset()


def backward(dout, res: Result | None = None, variant=None, *, q=None, k=None, v=None, out=None,
             lse=None, rng=None, causal=_UNSET, scale=_UNSET, dropout_p=_UNSET, window=_UNSET,
             block_mask=_UNSET, score_mod=_UNSET, mask_mod=_UNSET, **params):
    """(dq, dk, dv) for loss = sum(out * dout); the dropout mask is replayed from rng = (seed, offset).

    Either pass the forward's Result (its options are reused; an option passed again must equal the
    forward's, and a parameter that changes the dropout stream, such as `philox_rounds`, must match
    the forward's), or q, k, v, out, lse and the same options as the forward, with `rng` whenever
    dropout_p > 0.
    """
    options = {"causal": causal, "scale": scale, "dropout_p": dropout_p, "window": window, "block_mask": block_mask,
               "score_mod": score_mod, "mask_mod": mask_mod}
    if res is not None:
        return _backward_from_result(dout, res, variant, options, params, q, k, v, out, lse, rng)
    if any(x is None for x in (q, k, v, out, lse)):
        raise ValueError("backward needs either the forward Result or q, k, v, out and lse")
    opts = {name: (None if value is _UNSET else value) for name, value in options.items()}
    opts["causal"] = False if causal is _UNSET else causal
    opts["dropout_p"] = 0.0 if dropout_p is _UNSET else dropout_p
    if rng is None:
        if isinstance(opts["dropout_p"], (int, float)) and opts["dropout_p"] > 0:
            raise ValueError("backward with dropout_p > 0 needs rng=(seed, offset), the forward's Result.rng: "
                             "without it the dropout mask cannot be replayed")
        rng = (0, 0)
    seed, offset = _rng_pair(rng)
    if opts["block_mask"] is None and fastpath.is_torch_cuda(dout, q, k, v, out, lse):
        plan = _plan_for(q, k, v, variant, params, opts["causal"], opts["scale"], opts["dropout_p"],
                         opts["window"], seed, offset, opts["score_mod"], opts["mask_mod"])
        if plan is not None and plan.forward is not None:
            problem = fastpath.problem_for(plan, seed, offset)
            _check_out_lse(out, lse, problem)
            launch = fastpath.backward_launch(plan, plan.bound, dout, out)
            if launch is not None:
                _check_dout(dout, problem)
                return fastpath.run_backward(launch, problem, dout, q, k, v, out, lse.contiguous())
    bound = _resolve(variant, params, q)
    problem = make_problem(q, k, v, opts["causal"], opts["scale"], opts["dropout_p"], seed, offset,
                           opts["window"], opts["block_mask"], opts["score_mod"], opts["mask_mod"])
    bound.check(problem, "backward")          # before any array moves to the device
    _check_out_lse(out, lse, problem)
    with arrays.caller_stream(dout):
        qb, kb, vb, ob = _backend_arrays(bound, (q, k, v, out), ("q", "k", "v", "out"))
        lb = bound.variant.impl.to_backend(lse, "lse")
        if hasattr(lb, "flags") and not lb.flags.c_contiguous:     # the kernels index lse densely
            lb = lb.copy()
        return _run_backward(bound, problem, dout, (qb, kb, vb, ob, lb), {})


def _check_out_lse(out, lse, problem):
    """out like q; lse float32 [B, Hq, Nq] (the forward's)."""
    p = problem
    if tuple(out.shape) != (p.B, p.Hq, p.Nq, p.d) or dtype_name(out) != p.dtype:
        raise ValueError(f"out must be the forward's output, {p.dtype} of shape {(p.B, p.Hq, p.Nq, p.d)}; got "
                         f"{dtype_name(out)} {tuple(out.shape)}")
    if tuple(lse.shape) != (p.B, p.Hq, p.Nq) or dtype_name(lse) != "float32":
        raise ValueError(f"lse must be float32 of shape (the forward's) {(p.B, p.Hq, p.Nq)}; got "
                         f"{dtype_name(lse)} {tuple(lse.shape)}")


def check_rng(seed, offset):
    """seed an int in [0, 2**64), offset an int in [0, 2**32) (bool and float refused): checked on
    every call, the plan path included, since they change per call (plain ints pass at once)."""
    if type(seed) is int and type(offset) is int and 0 <= seed < 2**64 and 0 <= offset < 2**32:
        return
    check_seed(seed)
    check_offset(offset)


def _rng_pair(rng):
    try:
        seed, offset = rng
    except (TypeError, ValueError):
        raise ValueError(f"rng must be (seed, offset), the forward's Result.rng; got {rng!r}") from None
    check_rng(seed, offset)
    return int(seed), int(offset)


def _backward_from_result(dout, res, variant, options, params, q, k, v, out, lse, rng):
    if not isinstance(res, Result):
        raise OptionTypeError(f"res must be the forward's sandbox.Result, got {type(res).__name__}")
    given = [n for n, x in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)) if x is not None]
    if given:
        raise ValueError(f"backward got a Result and {', '.join(given)}: pass one or the other")
    problem = res.problem
    if rng is not None and _rng_pair(rng) != (problem.seed, problem.offset):
        raise ValueError(f"rng={rng!r} differs from the forward's {res.rng}: the dropout mask would not be "
                         "the forward's")
    for name, value in options.items():
        if value is _UNSET:
            continue
        fwd = getattr(problem, name)
        if name == "scale" and value is not None:
            same = float(value) == fwd
        elif name == "window" and value is not None:
            same = tuple(value) == fwd
        else:       # masks and modifiers: the forward's own object
            same = value is fwd if name in ("block_mask", "score_mod", "mask_mod") else value == fwd
        if not same:
            raise ValueError(f"backward: {name}={value!r} differs from the forward's {name}={fwd!r}; "
                             "the backward reuses the forward's options (omit it)")
    bound = res.variant if variant is None and not params else _resolve(
        variant if variant is not None else res.variant.name, params)
    if problem.dropout_p > 0 and bound.replay_params() != res.variant.replay_params():
        raise ValueError(f"backward with {bound!r} would replay a different dropout stream than the forward's "
                         f"{res.variant!r} ({bound.replay_params()} vs {res.variant.replay_params()})")
    bound.check(problem, "backward")
    if res.plan is not None and fastpath.is_torch_cuda(dout) and not res.saved:
        launch = fastpath.backward_launch(res.plan, bound, dout, res.inputs[3])
        if launch is not None:
            _check_dout(dout, problem)
            return fastpath.run_backward(launch, problem, dout, *res.inputs)
    with arrays.caller_stream(dout):
        inputs = res.inputs
        if res.plan is not None:          # torch tensors kept by the plan path: wrap them for the backend
            inputs = _backend_arrays(bound, inputs, ("q", "k", "v", "out", "lse"))
        return _run_backward(bound, problem, dout, inputs, res.saved)


def _check_dout(dout, problem):
    if tuple(dout.shape) != (problem.B, problem.Hq, problem.Nq, problem.d):
        raise ValueError(f"dout has shape {tuple(dout.shape)}, expected {(problem.B, problem.Hq, problem.Nq, problem.d)}")
    if dtype_name(dout) != problem.dtype:
        raise ValueError(f"dout has dtype {dtype_name(dout)}, expected {problem.dtype} like q")


def _run_backward(bound, problem, dout, inputs, saved):
    """The variant's backward on backend arrays; gradients as dout's array type."""
    qb, kb, vb, ob, lb = inputs
    kind = arrays.kind_of(dout)
    _check_dout(dout, problem)
    (db,) = _backend_arrays(bound, (dout,), ("dout",))
    extra = {"saved": saved} if saved or bound.wants_saved() else {}
    grads = bound.variant.impl.backward(problem, db, qb, kb, vb, ob, lb, bound.config, **extra)
    return tuple(arrays.like(g, kind) for g in grads)
