"""Every registered variant satisfies the variant contract (sandbox/contract.py), on the CPU.

Also pins "defaults live in one place": an impl's configure() with no arguments gives the config
that Variant.bind() builds from the Params' defaults."""
import pytest

from sandbox import contract
from sandbox.registry import Capabilities, Param, Variant, all_variants

VARIANTS = sorted(all_variants().items())


@pytest.mark.parametrize("name,variant", VARIANTS, ids=[n for n, _ in VARIANTS])
def test_impl_satisfies_the_contract(name, variant):
    impl = variant.impl
    assert isinstance(impl, contract.VariantImpl)
    for member in ("configure", "to_backend", "forward"):
        assert callable(getattr(impl, member, None)), f"{name}: {member} is required"
    if variant.caps.backward:
        assert isinstance(impl, contract.BackwardImpl), f"{name} declares a backward but has none"
    if variant.backend == "cuda":
        assert isinstance(impl, contract.CompiledImpl), f"{name} (cuda) has no compile_units"
    for member in contract.OPTIONAL:
        value = getattr(impl, member, None)
        assert value is None or callable(value), f"{name}: {member} must be absent, None or callable"
    assert contract.contract_errors(variant) == []


@pytest.mark.parametrize("name,variant", VARIANTS, ids=[n for n, _ in VARIANTS])
def test_configure_defaults_are_the_param_defaults(name, variant):
    assert variant.impl.configure() == variant.bind().config
    assert variant.bind().params == {p.name: p.default for p in variant.params}
    for p in variant.params:
        assert p.default in p.choices, f"{name}: {p.name} default {p.default!r} is not among its choices"


class _Config:
    def __init__(self, block=64):
        self.block = block

    def __eq__(self, other):
        return isinstance(other, _Config) and other.block == self.block


class _Impl:
    """A minimal impl: the three required methods and a backward."""

    def configure(self, block=64):
        return _Config(block)

    def to_backend(self, x, name="array"):
        return x

    def forward(self, problem, q, k, v, config):
        return q, None

    def backward(self, problem, dout, q, k, v, out, lse, config):
        return q, k, v


def _variant(impl, backend="numba", default=64, **caps):
    return Variant("toy", "fa2", backend, "a toy", impl, (Param("block", (32, 64), default),),
                   Capabilities(**caps))


def test_contract_errors_find_what_is_missing():
    assert contract.contract_errors(_variant(_Impl())) == []
    assert isinstance(_Impl(), contract.BackwardImpl) and not isinstance(_Impl(), contract.CompiledImpl)
    # a default that differs from configure()'s own
    assert any("defaults" in e for e in contract.contract_errors(_variant(_Impl(), default=32)))
    # a cuda variant needs compile_units
    assert any("compile_units" in e for e in contract.contract_errors(_variant(_Impl(), backend="cuda")))

    class NoBackward(_Impl):
        backward = None
        has_backward = False      # caps.backward is True here
        check = "not callable"
        SIMULATOR_PARAMS = {"block": 8}

    errs = contract.contract_errors(_variant(NoBackward()))
    assert any(e.startswith("backward is missing") for e in errs)
    assert any(e.startswith("check") for e in errs)
    assert any("has_backward" in e for e in errs)
    assert any("SIMULATOR_PARAMS" in e for e in errs)
    # without caps.backward, no backward is fine
    assert contract.contract_errors(_variant(type("Fwd", (_Impl,), {"backward": None})(), backward=False)) == []

    class BadForward(_Impl):
        def forward(self, problem, q, k, v):
            return q, None

    assert any("forward does not take 5" in e for e in contract.contract_errors(_variant(BadForward())))
