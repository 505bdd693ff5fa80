"""The API's edges that used to give a wrong answer silently (issue 15): the backward's replay of
the forward's dropout stream and options, and array interop without a GPU. Runs on the CPU (the
Numba variants under the simulator)."""
import numpy as np
import pytest

import sandbox
from sandbox import arrays

VARIANT = "numba-rowwise"


@pytest.fixture(scope="module")
def dropout_forward():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 6, 8)).astype(np.float32) for _ in range(3))
    return (q, k, v), sandbox.forward(q, k, v, variant=VARIANT, dropout_p=0.3, seed=11, offset=2)


def test_backward_refuses_another_philox_stream(dropout_forward):
    (q, _, _), res = dropout_forward
    with pytest.raises(ValueError, match="different dropout stream"):
        sandbox.backward(np.ones_like(q), res, philox_rounds=7)
    sandbox.backward(np.ones_like(q), res, philox_rounds=10)          # the forward's value is fine


def test_explicit_backward_with_dropout_needs_rng(dropout_forward):
    (q, k, v), res = dropout_forward
    kw = dict(q=q, k=k, v=v, out=res.out, lse=res.lse, variant=VARIANT, dropout_p=0.3)
    with pytest.raises(ValueError, match="needs rng"):
        sandbox.backward(np.ones_like(q), **kw)
    got = sandbox.backward(np.ones_like(q), rng=res.rng, **kw)
    want = sandbox.backward(np.ones_like(q), res)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("option", [{"causal": True}, {"dropout_p": 0.1}, {"window": (1, 1)}, {"scale": 2.0}])
def test_backward_options_must_match_the_forward(dropout_forward, option):
    (q, _, _), res = dropout_forward
    with pytest.raises(ValueError, match="differs from the forward"):
        sandbox.backward(np.ones_like(q), res, **option)


def test_backward_accepts_the_forwards_options_again(dropout_forward):
    (q, _, _), res = dropout_forward
    sandbox.backward(np.ones_like(q), res, causal=False, dropout_p=0.3, rng=res.rng)


def test_backward_refuses_an_rng_other_than_the_forwards(dropout_forward):
    (q, _, _), res = dropout_forward
    with pytest.raises(ValueError, match="differs from the forward"):
        sandbox.backward(np.ones_like(q), res, rng=(12, 2))


def test_backward_result_and_arrays_are_exclusive(dropout_forward):
    (q, _, _), res = dropout_forward
    with pytest.raises(ValueError, match="one or the other"):
        sandbox.backward(np.ones_like(q), res, q=q)


def test_seed_type_is_checked_on_every_call():
    q = np.zeros((1, 1, 2, 8), np.float32)
    with pytest.raises(TypeError, match="seed"):
        sandbox.api.check_rng(1.5, 0)
    with pytest.raises(TypeError, match="offset"):
        sandbox.api.check_rng(0, True)
    with pytest.raises(ValueError, match="offset"):
        sandbox.api.check_rng(0, 2**32)
    with pytest.raises(TypeError, match="seed"):
        sandbox.forward(q, q, q, variant=VARIANT, seed=1.5)


def test_default_variant_follows_the_dtype():
    assert sandbox.api._resolve(None, {}, np.zeros(1, np.float32)).name == "fa2"
    assert sandbox.api._resolve(None, {}, np.zeros(1, np.float16)).name == "fa2-tc"


def test_torch_tensors_are_a_kind_even_when_they_require_grad():
    torch = pytest.importorskip("torch")
    t = torch.zeros(2, 3, requires_grad=True)
    assert arrays.kind_of(t) == "torch"                    # torch's interface raises; no hasattr probe
    assert arrays.to_host(t.to(torch.bfloat16)).dtype.name == "bfloat16"


def test_a_grid_past_cudas_limits_is_a_value_error_before_the_launch():
    """batch x heads goes on grid y or z in the kernels: past 65535 blocks the launch would fail with the
    driver's 'invalid argument'; it is a ValueError naming the axis and the way out instead."""
    from sandbox import loader
    loader.check_grid("k", (2**31 - 1, 65535, 65535))
    for grid, axis in (((1, 65536, 1), "y"), ((1, 1, 70000), "z"), ((2**31, 1, 1), "x")):
        with pytest.raises(ValueError, match=f"grid {axis}.*split the batch"):
            loader.check_grid("k", grid)


def test_default_variant_by_dtype_device_and_head_dim(monkeypatch):
    """variant=None: fa2 for fp32, fa2-tc for fp16 / bf16, fa3 for fp16 / bf16 device arrays on an sm_90 GPU
    with a head dim fa3 takes (past 128 too); packed batches keep fa2-tc up to d = 128 (one launch)."""
    torch = pytest.importorskip("torch")
    from sandbox import api, device, varlen
    x = lambda d, dt=torch.float16: torch.zeros(1, 2, 3, d, dtype=dt)   # noqa: E731
    assert api.default_variant(x(64)) == "fa2-tc" and api.default_variant(x(64, torch.float32)) == "fa2"
    assert api.default_variant(None) == api.DEFAULT_VARIANT
    monkeypatch.setattr(api, "_device_index", lambda like: 0)            # as if x lived on GPU 0
    for cc, d, dt, want in (((9, 0), 64, torch.float16, "fa3"), ((9, 0), 256, torch.bfloat16, "fa3"),
                            ((9, 0), 59, torch.float16, "fa2-tc"), ((9, 0), 64, torch.float32, "fa2"),
                            ((8, 0), 64, torch.float16, "fa2-tc"), ((10, 0), 128, torch.float16, "fa2-tc")):
        monkeypatch.setattr(device, "compute_capability", lambda index=None, cc=cc: cc)
        assert api.default_variant(x(d, dt)) == want, (cc, d, dt)
    monkeypatch.setattr(device, "compute_capability", lambda index=None: (9, 0))
    assert api.default_variant(x(64), {"block_r": 64}) == "fa2-tc"        # fa2-tc's parameters: its config
    assert varlen.default_variant(torch.zeros(5, 2, 64, dtype=torch.float16)) == "fa2-tc"
    assert varlen.default_variant(torch.zeros(5, 2, 256, dtype=torch.float16)) == "fa3"


def test_packed_launches_check_their_grid_before_anything_else():
    """PackedLaunch refuses a grid past CUDA's limits at construction (before it reads the kernel), and lets an
    empty one (skipped at launch) through whatever its other axes."""
    from sandbox import loader
    with pytest.raises(ValueError, match="grid y"):
        loader.PackedLaunch(object(), (1, 70000), (128,), 0, ())
    with pytest.raises(AttributeError):           # past the check: an object() has no .ptr
        loader.PackedLaunch(object(), (0, 70000), (128,), 0, ())
