"""The public entry points: attention, forward, backward (DESIGN.md "Public API").

Flow of a call: resolve the variant and its parameters -> validate the problem (shapes, dtype,
options) -> check the variant's capabilities -> move arrays to the backend (zero-copy where
possible) -> launch -> hand results back as the caller's array type. Every rejection happens
before anything is launched.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import arrays
from .precision import dtype_name
from .problem import Problem, make_problem
from .registry import BoundVariant, get_variant

DEFAULT_VARIANT = "fa2"


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

    def __iter__(self):
        return iter((self.out, self.lse, self.rng))


def _resolve(variant, params) -> BoundVariant:
    return get_variant(variant if variant is not None else DEFAULT_VARIANT, **params)


def _backend_arrays(bound: BoundVariant, xs, names):
    impl = bound.variant.impl
    return [impl.to_backend(x, name) for x, name in zip(xs, names)]


def forward(q, k, v, variant=None, causal=False, scale=None, dropout_p=0.0, seed=0, offset=0,
            window=None, block_mask=None, **params) -> Result:
    bound = _resolve(variant, params)
    problem = make_problem(q, k, v, causal, scale, dropout_p, seed, offset, window, block_mask)
    bound.check(problem, "forward")
    kind = arrays.kind_of(q)
    qb, kb, vb = _backend_arrays(bound, (q, k, v), ("q", "k", "v"))
    out, lse, *saved = bound.variant.impl.forward(problem, qb, kb, vb, bound.config)
    saved = saved[0] if saved else {}     # what a variant keeps for its backward (a stored dropout mask)
    return Result(arrays.like(out, kind), arrays.like(lse, kind), (problem.seed, problem.offset),
                  problem, bound, (qb, kb, vb, out, lse), saved)


def attention(q, k, v, variant=None, causal=False, scale=None, dropout_p=0.0, seed=0, offset=0,
              window=None, block_mask=None, **params):
    """softmax(mask(scale * q k^T)) (with dropout) @ v; returns out only."""
    return forward(q, k, v, variant, causal, scale, dropout_p, seed, offset, window, block_mask,
                   **params).out


def backward(dout, res: Result | None = None, variant=None, *, q=None, k=None, v=None, out=None,
             lse=None, rng=None, causal=False, scale=None, dropout_p=0.0, window=None,
             block_mask=None, **params):
    """(dq, dk, dv) for loss = sum(out * dout); the dropout mask is replayed from rng = (seed, offset).

    Either pass the forward's Result (its options are reused), or q, k, v, out, lse, rng and the
    same options as the forward.
    """
    saved = {}
    if res is not None:
        problem, saved = res.problem, res.saved
        bound = res.variant if variant is None and not params else _resolve(
            variant if variant is not None else res.variant.name, params)
        qb, kb, vb, ob, lb = res.inputs
    else:
        if any(x is None for x in (q, k, v, out, lse)):
            raise ValueError("backward needs either the forward Result or q, k, v, out and lse")
        seed, offset = rng if rng is not None else (0, 0)
        bound = _resolve(variant, params)
        problem = make_problem(q, k, v, causal, scale, dropout_p, seed, offset, window, block_mask)
        bound.check(problem, "backward")          # before any array moves to the device
        qb, kb, vb, ob = _backend_arrays(bound, (q, k, v, out), ("q", "k", "v", "out"))
        lb = bound.variant.impl.to_backend(lse, "lse")
        if tuple(ob.shape) != (problem.B, problem.Hq, problem.Nq, problem.d):
            raise ValueError(f"out has shape {tuple(ob.shape)}, expected q's shape")
        if tuple(lb.shape) != (problem.B, problem.Hq, problem.Nq) or str(lb.dtype) != "float32":
            raise ValueError(f"lse must be float32 of shape {(problem.B, problem.Hq, problem.Nq)}")
    if res is not None:
        bound.check(problem, "backward")
    kind = arrays.kind_of(dout)
    (db,) = _backend_arrays(bound, (dout,), ("dout",))
    if tuple(db.shape) != (problem.B, problem.Hq, problem.Nq, problem.d):
        raise ValueError(f"dout has shape {tuple(db.shape)}, expected {(problem.B, problem.Hq, problem.Nq, problem.d)}")
    if dtype_name(db) != problem.dtype:
        raise ValueError(f"dout has dtype {dtype_name(db)}, expected {problem.dtype} like q")
    extra = {"saved": saved} if saved or bound.params.get("dropout_store") == "packed" else {}
    grads = bound.variant.impl.backward(problem, db, qb, kb, vb, ob, lb, bound.config, **extra)
    return tuple(arrays.like(g, kind) for g in grads)
