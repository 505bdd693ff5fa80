"""The variant registry: what each variant is, what it accepts, and the checks that run before a launch.

What the benchmarks do with a variant comes from its registration, never from its name (bench/ names
no variant: tests/test_bench_registry.py): `tags` say which bench families time it, `caps` what it can
run there, `bench_configs` which parameter sets it is timed with besides its defaults, `bench_sweep`
the axes the `variants` table crosses. Tag vocabulary (TAGS; `python -m bench plan` shows the result):
    exact-ladder    a rung of the exact (fp32) ladder: the grid family at float32 times its defaults
                    and each of its bench_configs
    tc-ladder       a rung of the tensor-core ladder: the grid family at float16 / bfloat16
    backward-rung   a ladder rung only where a backward is timed (its forward is another rung's)
    flagship        the fastest variant of its tier: the series of the memory, blocksparse (with
                    block_sparse), dropout (with a dropout_store parameter) and host (tensor-core
                    dtypes: the variant compared with PyTorch SDPA from torch) families
    baseline        materialised attention (S, P in HBM): the reference series of the memory family
    decode          a split-KV decoding kernel (Nq <= 16 rows against a long KV cache): the decode
                    family's series, contiguous and through sandbox.decode's paged cache
    io:<model>      profiled by the io family (Nsight Compute bytes) against the byte model <model>
                    of its loop order: materialised, kv-outer (FA1), q-outer (FA2), with the tile
                    sizes of the variant's own config
A variant without tags is fuzzed and compile-checked but not benchmarked; every CUDA and Numba
variant in the tree carries at least one.

A variant registers itself (`register(Variant(...))` at import of its module under variants/, or
from another package through the `sandbox.variants` entry-point group). The sandbox discovers
variant modules by walking those places; it never imports one by name.

What a variant's implementation object (`Variant.impl`) provides, which members are optional and
who calls them: sandbox/contract.py (the variant contract), checked over the registry by
tests/test_contract_module.py.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from dataclasses import dataclass, field
from importlib.metadata import entry_points

from .problem import Problem

TIER_OF_DTYPE = {"float32": "exact", "float16": "tensor-core", "bfloat16": "tensor-core"}


@dataclass(frozen=True)
class Param:
    name: str
    choices: tuple
    default: object
    doc: str = ""
    replay: bool = False   # changes the dropout stream: a backward must use the forward's value


def philox_rounds_param() -> Param:
    """The Philox round count of the dropout RNG (10, the contract's; 7, a faster stream)."""
    return Param("philox_rounds", (10, 7), 10, "Philox rounds of the dropout RNG", replay=True)


@dataclass(frozen=True)
class Capabilities:
    backward: bool = True
    causal: bool = True
    window: bool = True
    block_sparse: bool = True
    dropout: bool = True
    gqa: bool = True
    dtypes: tuple = ("float32",)
    head_dims: tuple = tuple(range(1, 257))
    score_mod: bool = False    # score modifiers, sinks included (sandbox/modifiers.py), forward and backward
    mask_mod: bool = False     # mask modifiers (predicates of b, h, i, j), fully masked tiles skipped
    max_query_rows: int | None = None   # most query rows Nq per problem (decoding kernels); None: any

    def summary(self) -> dict:
        dims = self.head_dims
        contiguous = list(dims) == list(range(dims[0], dims[-1] + 1))
        return {"backward": self.backward, "causal": self.causal, "window": self.window,
                "block_sparse": self.block_sparse, "dropout": self.dropout, "gqa": self.gqa,
                "score_mod": self.score_mod, "mask_mod": self.mask_mod,
                "dtypes": list(self.dtypes),
                "head_dims": f"{dims[0]}..{dims[-1]}" if contiguous else list(dims),
                "max_query_rows": self.max_query_rows}


TAGS = {
    "exact-ladder": "rung of the exact (fp32) ladder: grid family at float32",
    "tc-ladder": "rung of the tensor-core ladder: grid family at float16 / bfloat16",
    "backward-rung": "ladder rung only in the backward directions (its forward is another rung's)",
    "flagship": "fastest of its tier: memory, blocksparse, dropout, host families",
    "baseline": "materialised attention: the memory family's reference series",
    "decode": "split-KV decoding kernel (a few query rows, long KV cache): the decode family",
}
IO_MODELS = ("materialised", "kv-outer", "q-outer")     # the io family's byte models: tag io:<model>


def tag_errors(tags) -> list[str]:
    """Tags outside the vocabulary (TAGS, io:<model> with a model of IO_MODELS)."""
    return [f"unknown tag {t!r}" for t in tags
            if t not in TAGS and not (t.startswith("io:") and t[3:] in IO_MODELS)]


@dataclass(frozen=True)
class Variant:
    name: str
    family: str            # standard | fa1 | fa2 | ...
    backend: str           # cuda | numba
    description: str
    impl: object = field(repr=False, compare=False)
    params: tuple = ()
    caps: Capabilities = Capabilities()
    seed_ref: str = ""     # the seed algorithm it implements
    tags: tuple = ()       # what the bench families do with it (TAGS, module docstring)
    bench_configs: tuple = field(default=(), compare=False)   # parameter dicts timed besides the defaults
    bench_sweep: dict = field(default_factory=dict, compare=False)  # param -> values: the variants table

    def __post_init__(self):
        """Tags from the vocabulary, bench configs and sweep axes that bind: a typo in a registration
        fails at import, not in a benchmark run on the GPU."""
        errs = tag_errors(self.tags)
        known = {p.name: p for p in self.params}
        for cfg in self.bench_configs:
            errs += [f"bench_configs {cfg}: {k}={v!r} is not a parameter value" for k, v in cfg.items()
                     if k not in known or v not in known[k].choices]
        errs += [f"bench_sweep {k}: {list(vs)} are not all parameter values" for k, vs in self.bench_sweep.items()
                 if k not in known or any(v not in known[k].choices for v in vs)]
        if errs:
            raise ValueError(f"variant {self.name!r}: " + "; ".join(errs))

    def bind(self, **params) -> "BoundVariant":
        known = {p.name: p for p in self.params}
        for key, value in params.items():
            if key not in known:
                raise ValueError(f"variant {self.name!r} has no parameter {key!r}; "
                                 f"it takes {sorted(known) or 'none'}")
            if value not in known[key].choices:
                raise ValueError(f"variant {self.name!r}: {key}={value!r} is not allowed; "
                                 f"choose from {list(known[key].choices)}")
        full = {p.name: params.get(p.name, p.default) for p in self.params}
        return BoundVariant(self, full, self.impl.configure(**full))

    def tiers(self) -> list[str]:
        return sorted({TIER_OF_DTYPE[d] for d in self.caps.dtypes})


@dataclass(frozen=True)
class BoundVariant:
    variant: Variant
    params: dict
    config: object

    @property
    def name(self) -> str:
        return self.variant.name

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.variant.name}({args})"

    @property
    def caps(self) -> "Capabilities":
        """The variant's capabilities as this config has them: `impl.config_caps(config, caps)` where the
        impl narrows them per config (e.g. a backward kernel that takes no modifiers), else caps."""
        narrow = getattr(self.variant.impl, "config_caps", None)
        return narrow(self.config, self.variant.caps) if narrow is not None else self.variant.caps

    def replay_params(self) -> dict:
        """The parameters that decide the dropout stream, with their values."""
        return {p.name: self.params[p.name] for p in self.variant.params if p.replay}

    def wants_saved(self) -> bool:
        """Whether the variant's backward takes what its forward saved (`saved=`, e.g. a stored mask)."""
        return _takes_saved(self.variant.impl)

    def check(self, problem: Problem, direction: str = "forward") -> None:
        """Raise ValueError naming the variant and every capability the problem needs but it lacks."""
        v, caps = self.variant, self.variant.caps
        missing = []
        if direction in ("backward", "both") and not caps.backward:
            missing.append("backward pass")
        if problem.dtype not in caps.dtypes:
            missing.append(f"dtype {problem.dtype} (supports {', '.join(caps.dtypes)})")
        if problem.d not in caps.head_dims:
            missing.append(f"head dim {problem.d} (supports {Capabilities(head_dims=caps.head_dims).summary()['head_dims']})")
        if problem.causal and not caps.causal:
            missing.append("causal masking")
        if problem.window is not None and not caps.window:
            missing.append("sliding-window masking")
        if problem.block_mask is not None and not caps.block_sparse:
            missing.append("block-sparse masking")
        if problem.dropout_p > 0 and not caps.dropout:
            missing.append("dropout")
        if problem.Hq != problem.Hkv and not caps.gqa:
            missing.append("GQA/MQA (Hq != Hkv)")
        if caps.max_query_rows is not None and problem.Nq > caps.max_query_rows:
            missing.append(f"Nq={problem.Nq} query rows (max_query_rows={caps.max_query_rows})")
        if problem.score_mod is not None and not caps.score_mod:
            missing.append("score modifiers (score_mod)")
        if problem.mask_mod is not None and not caps.mask_mod:
            missing.append("mask modifiers (mask_mod)")
        if direction in ("backward", "both") and problem.score_mod is not None and not problem.score_mod.has_grad:
            missing.append(f"a backward through score_mod {problem.score_mod.name!r}, which has no derivative")
        if missing:
            raise ValueError(f"variant {v.name!r} ({self!r}) does not support: " + "; ".join(missing))
        extra = getattr(v.impl, "check", None)
        if extra is not None:
            extra(problem, self.config, direction)


@functools.lru_cache(maxsize=None)
def _takes_saved(impl) -> bool:
    backward = getattr(impl, "backward", None)
    return backward is not None and "saved" in inspect.signature(backward).parameters


_REGISTRY: dict[str, Variant] = {}
_discovered = False


def register(variant: Variant) -> Variant:
    if variant.name in _REGISTRY and _REGISTRY[variant.name] is not variant:
        raise ValueError(f"variant {variant.name!r} is already registered")
    _REGISTRY[variant.name] = variant
    return variant


def _discover() -> None:
    """Import every module of the in-tree `variants` package and every entry point plugin."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    package = importlib.import_module("variants")
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
    for ep in entry_points(group="sandbox.variants"):
        ep.load()


def all_variants() -> dict[str, Variant]:
    _discover()
    return dict(_REGISTRY)


def get_variant(name, **params) -> BoundVariant:
    if isinstance(name, BoundVariant):
        return name if not params else name.variant.bind(**{**name.params, **params})
    _discover()
    if name not in _REGISTRY:
        raise ValueError(f"unknown variant {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name].bind(**params)


def parse_spec(spec: str) -> tuple[str, dict]:
    """'fa2-tc:split=k+block_r=32' -> ('fa2-tc', {'split': 'k', 'block_r': 32}) ('fa3:pingpong=true' gives
    True): a variant and its
    parameters in one token (the CLI's --variants and the benchmark tables take these)."""
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split("+")):
        key, _, value = item.partition("=")
        params[key] = _spec_value(value)
    return name, params


def _spec_value(text: str):
    """A parameter value written in a spec: an int, a bool (True / False, any case), else the text."""
    if text.isdigit():
        return int(text)
    return {"true": True, "false": False}.get(text.lower(), text)


def variants() -> list[dict]:
    """Registered variants with family, backend, tiers, parameters, capabilities and bench tags."""
    rows = []
    for v in all_variants().values():
        rows.append({"name": v.name, "family": v.family, "backend": v.backend, "tiers": v.tiers(),
                     "params": {p.name: {"choices": list(p.choices), "default": p.default} for p in v.params},
                     "capabilities": v.caps.summary(), "seed": v.seed_ref, "description": v.description,
                     "tags": list(v.tags), "bench_configs": [dict(c) for c in v.bench_configs],
                     "bench_sweep": {k: list(vs) for k, vs in v.bench_sweep.items()}})
    return rows
