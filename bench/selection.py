"""Which variants, in which configurations, each bench family times: read from the registry, never
named in bench/ (tests/test_bench_registry.py holds every bench module to that).

A variant's registration says it (sandbox/registry.py, module docstring): its `tags` (exact-ladder,
tc-ladder, backward-rung, flagship, baseline, io:<model>), its capabilities (dtypes, head dims,
backward, block_sparse, dropout), its `bench_configs` (parameter sets timed besides its defaults: a
set of only `bwd_*` parameters is a backward rung, any other a forward rung) and its `bench_sweep`
(the axes the `variants` table crosses). Each family module has `plan() -> rows` built from these;
`python -m bench plan` prints them.
"""
from __future__ import annotations

from sandbox.registry import TIER_OF_DTYPE, Variant, all_variants

LADDER_OF_TIER = {"exact": "exact-ladder", "tensor-core": "tc-ladder"}
DIRECTIONS = ("forward", "backward", "both")
PLAN_KEYS = ("family", "variant", "dtype", "d", "directions", "setting")


def spec(name: str, params: dict | None = None) -> str:
    """(name, {split: k, block_r: 16}) -> 'name:split=k+block_r=16' (the form parse_spec reads)."""
    return name + (":" + "+".join(f"{k}={v}" for k, v in params.items()) if params else "")


def _order(v: Variant):
    """Baselines first, then CUDA before Numba, then by name: the tables' row order."""
    return ("baseline" not in v.tags, v.backend != "cuda", v.name)


def select(tag: str | None = None, *, backend: str | None = None, dtype: str | None = None,
           head_dim: int | None = None, backward: bool | None = None, block_sparse: bool | None = None,
           dropout: bool | None = None, without: tuple = (), where=None) -> list[Variant]:
    """Registered variants with `tag` (any tag when None) whose capabilities allow the request,
    without the tags in `without`, passing `where(variant)`; in table order."""
    out = []
    for v in all_variants().values():
        c = v.caps
        if tag is not None and tag not in v.tags or any(t in v.tags for t in without):
            continue
        if backend is not None and v.backend != backend or dtype is not None and dtype not in c.dtypes:
            continue
        if head_dim is not None and head_dim not in c.head_dims or backward and not c.backward:
            continue
        if block_sparse and not c.block_sparse or dropout and not c.dropout:
            continue
        if where is not None and not where(v):
            continue
        out.append(v)
    return sorted(out, key=_order)


def is_backward_config(params: dict) -> bool:
    """A bench config of only backward parameters (bwd_*): timed where a backward is, not forward."""
    return bool(params) and all(k.startswith("bwd_") for k in params)


def rungs(v: Variant, direction: str) -> list[dict]:
    """The parameter sets of `v` timed in `direction`: its defaults ({}), then its bench_configs that
    change that direction (forward: any with a forward parameter; backward, both: any with a bwd_ one)."""
    if direction == "forward":
        extra = [c for c in v.bench_configs if not is_backward_config(c)]
    else:
        extra = [c for c in v.bench_configs if any(k.startswith("bwd_") for k in c)]
    return [{}] + [dict(c) for c in extra]


def ladder(dtype: str, head_dim: int, direction: str) -> list[str]:
    """Specs of the ladder of `dtype`'s tier timed in `direction` at `head_dim`: every variant tagged
    with the tier's ladder that runs the request (a backward-rung only where a backward is timed)."""
    tag = LADDER_OF_TIER[TIER_OF_DTYPE[dtype]]
    forward = direction == "forward"
    chosen = select(tag, dtype=dtype, head_dim=head_dim, backward=not forward,
                    without=("backward-rung",) if forward else ())
    return [spec(v.name, p) for v in chosen for p in rungs(v, direction)]


def io_model(v: Variant) -> str | None:
    """The io family's byte model of a variant (its io:<model> tag), or None: not profiled."""
    return next((t[3:] for t in v.tags if t.startswith("io:")), None)


def tensor_core_dtypes(v: Variant) -> list[str]:
    return [d for d in v.caps.dtypes if TIER_OF_DTYPE[d] == "tensor-core"]


def unplanned(rows: list[dict]) -> list[str]:
    """CUDA and Numba variants that no family's plan times (each should be under at least one)."""
    planned = {r["variant"].partition(":")[0] for r in rows}
    return sorted(n for n, v in all_variants().items() if v.backend in ("cuda", "numba") and n not in planned)


def row(family: str, variant: str, dtype: str, d, directions, setting: str) -> dict:
    """One plan row; d and directions as comma-joined text."""
    join = lambda x: x if isinstance(x, str) else str(x) if isinstance(x, int) else ",".join(map(str, x))  # noqa: E731
    return {"family": family, "variant": variant, "dtype": dtype, "d": join(d), "directions": join(directions),
            "setting": setting}


def table(rows: list[dict]) -> str:
    """The plan as a markdown table."""
    out = ["| " + " | ".join(PLAN_KEYS) + " |", "|" + "---|" * len(PLAN_KEYS)]
    out += ["| " + " | ".join(str(r[k]) for k in PLAN_KEYS) + " |" for r in rows]
    return "\n".join(out)
