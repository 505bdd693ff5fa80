"""GPU suite: every registered variant against the oracle (Hypothesis), explicit awkward cases,
dropout masks extracted bit for bit, and array interop. Run with `pytest -m gpu` on a GPU machine."""
import os

import numpy as np
import pytest
from hypothesis import example, given

import sandbox
from sandbox import fuzz, get_variant
from sandbox.masks import BlockSparse
from sandbox.precision import numpy_dtype
from sandbox.registry import all_variants

pytestmark = pytest.mark.gpu

PAIRS = [(n, dt, direction) for n, v in sorted(all_variants().items()) for dt in v.caps.dtypes
         for direction in (("forward", "backward") if v.caps.backward else ("forward",))]
# GPU_SHARDS=k runs each pair as k independent tests (GPU_EXAMPLES random examples each), so that
# pytest-xdist keeps every core busy when the pairs are fewer than the workers
SHARDS = range(int(os.environ.get("GPU_SHARDS", "1")))


def awkward(dtype, d):
    """Hand-picked edge cases: length 1, dead rows, Nq != Nk, non-multiples of tiles, large logits."""
    return [
        fuzz.Case(1, 1, 1, 1, 1, d, dtype, {}, 0),
        fuzz.Case(1, 2, 1, 7, 3, d, dtype, {"causal": True}, 1),                     # rows 0-3 dead, GQA
        fuzz.Case(2, 3, 3, 65, 130, d, dtype, {"window": (5, 0)}, 2, logit_scale=30.0 if dtype == "float32" else 4.0),
        fuzz.Case(1, 2, 2, 129, 77, d, dtype, {"causal": True, "dropout_p": 0.5, "seed": 2**40 + 3, "offset": 9}, 3),
        fuzz.Case(1, 2, 2, 33, 50, d, dtype, {"block_mask": BlockSparse(np.eye(4, 5, dtype=bool)[None], (9, 10))}, 4,
                  mean=0.5),
        fuzz.Case(1, 2, 1, 40, 70, d, dtype, {"scale": -0.4, "causal": True}, 5),     # raw-score max needs K negated
        fuzz.Case(1, 1, 1, 17, 33, d, dtype, {"scale": 0.0, "window": (3, 2)}, 6),    # uniform rows
    ]


@pytest.mark.parametrize("shard", SHARDS)
@pytest.mark.parametrize("name,dtype,direction", PAIRS)
def test_variant_matches_oracle(name, dtype, direction, shard):
    bound = get_variant(name)
    d = 64 if 64 in bound.variant.caps.head_dims else bound.variant.caps.head_dims[-1]

    @given(fuzz.cases(bound, dtype))
    def check(case):
        fuzz.assert_case(bound, case, direction)

    for case in awkward(dtype, d):
        if not _supported(bound, case, direction):
            continue
        check = example(case)(check)
    check()


def _supported(bound, case, direction="forward"):
    try:
        q, k, v, _ = case.inputs()
        bound.check(sandbox.problem.make_problem(q, k, v, **case.options), direction)
        return True
    except ValueError:
        return False


DROPOUT = [(n, dt) for n, v in sorted(all_variants().items()) if v.caps.dropout and 64 in v.caps.head_dims
           for dt in v.caps.dtypes]


def _choices(name, param):
    return [c for prm in get_variant(name).variant.params if prm.name == param for c in prm.choices]


@pytest.mark.parametrize("name,dtype", DROPOUT)
@pytest.mark.parametrize("rounds", [10, 7])
@pytest.mark.parametrize("store", ["replay", "packed"])
def test_dropout_mask_is_bit_exact(name, dtype, rounds, store):
    """q = k = 0 makes P uniform; v = I makes out[i, j] = P_drop[i, j]: the keep mask, read back exactly.
    With dropout_store="packed" the stored bits are compared too, and the backward reads them."""
    if rounds not in _choices(name, "philox_rounds"):
        pytest.skip("variant has one Philox setting")
    if store not in _choices(name, "dropout_store") + ["replay"]:
        pytest.skip("variant only replays the mask")
    params = {"philox_rounds": rounds, **({"dropout_store": store} if store == "packed" else {})}
    B, H, Nq, N = 2, 3, 37, 64
    npdt = numpy_dtype(dtype)
    q = np.zeros((B, H, Nq, N), npdt); k = np.zeros((B, H, N, N), npdt)
    v = np.broadcast_to(np.eye(N, dtype=npdt), (B, H, N, N)).copy()
    seed, offset, p = 2**35 + 17, 5, 0.3
    res = sandbox.forward(q, k, v, variant=get_variant(name, **params), dropout_p=p, seed=seed, offset=offset)
    kept = np.asarray(res.out) != 0
    want = sandbox.philox.dropout_mask((B, H, Nq, N), p, seed, offset, rounds)
    assert np.array_equal(kept, want)
    if store == "packed":
        bits = np.asarray(sandbox.arrays.to_host(res.saved["dropout_bits"]))
        unpacked = np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[..., :N].astype(bool)
        assert np.array_equal(unpacked, want)
    if not get_variant(name).variant.caps.backward:
        return
    # the backward replays the same mask: dV = P_drop^T dO with dO = e_i picks row i of P_drop
    dout = np.zeros_like(q); dout[:, :, :, 0] = 1
    _, _, dv = sandbox.backward(dout, res)
    kept_cols = np.asarray(dv)[..., 0] != 0                      # dv[j, 0] = sum_i P_drop[i, j]
    assert np.array_equal(kept_cols, kept.any(axis=2))


@pytest.mark.parametrize("name", sorted(n for n, v in all_variants().items() if v.backend == "cuda"))
def test_array_types_and_strides(name):
    import cupy as cp
    bound = get_variant(name)
    caps = bound.variant.caps
    dtype = caps.dtypes[0]
    # 16-bit: |out| < 4 here, where an fp16 ulp is <= 2**-9; P is rounded to fp16 before P V
    atol = 1e-5 if dtype == "float32" else 1e-2
    d = 32 if 32 in caps.head_dims else min(caps.head_dims)              # within the variant's envelope
    nq = 40 if caps.max_query_rows is None else min(40, caps.max_query_rows)   # the last nq rows query
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 40, 3, 3 * d)).astype(numpy_dtype(dtype))   # (B, N, H, 3 d): a packed QKV layout
    q, k, v = (np.transpose(x[:, 40 - nq:, :, :d] if i == 0 else x[..., i * d:(i + 1) * d], (0, 2, 1, 3))
               for i in range(3))
    ref, _ = sandbox.oracle.forward(q, k, v, causal=True)
    xc = cp.asarray(x)
    qc, kc, vc = (cp.transpose(xc[:, 40 - nq:, :, :d] if i == 0 else xc[..., i * d:(i + 1) * d], (0, 2, 1, 3))
                  for i in range(3))
    out = sandbox.attention(qc, kc, vc, variant=bound, causal=True)            # strided views, no copies
    assert isinstance(out, cp.ndarray)
    np.testing.assert_allclose(out.get().astype(np.float64), ref, atol=atol)
    torch = pytest.importorskip("torch")
    qt, kt, vt = (torch.as_tensor(np.ascontiguousarray(a), device="cuda") for a in (q, k, v))
    out_t = sandbox.attention(qt, kt, vt, variant=bound, causal=True)
    assert isinstance(out_t, torch.Tensor) and out_t.is_cuda
    np.testing.assert_allclose(out_t.cpu().numpy().astype(np.float64), ref, atol=atol)


@pytest.mark.parametrize("name", sorted(n for n, v in all_variants().items() if v.backend == "cuda"))
def test_device_arrays_strided_along_d_are_rejected(name):
    import cupy as cp
    caps = get_variant(name).variant.caps
    d = 8 if 8 in caps.head_dims else min(caps.head_dims)                # within the variant's envelope
    q = cp.zeros((1, 1, 4, d), numpy_dtype(caps.dtypes[0]))
    q_t = cp.ascontiguousarray(q.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    with pytest.raises(ValueError, match="unit stride along d"):
        sandbox.attention(q_t, q, q, variant=name)


def _param_grid(variant):
    """Every combination of a variant's research parameters (Philox rounds left at the default)."""
    import itertools
    axes = [p for p in variant.params if p.name != "philox_rounds"]
    return [dict(zip([p.name for p in axes], combo)) for combo in itertools.product(*[p.choices for p in axes])]


# CUDA template configs; the Numba variants compile one kernel per (head dim, tiles) and are fuzzed
# at their defaults (a sweep there would spend the run in the Numba compiler)
SWEPT = sorted(n for n, v in all_variants().items() if len(_param_grid(v)) > 1 and v.backend == "cuda")


@pytest.mark.parametrize("name", SWEPT)
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_parameter_sweep_matches_oracle(name, direction):
    """split x Br x Bc x warps (x dtype): every combination the variant accepts is fuzzed."""
    from hypothesis import assume, strategies as st
    variant = all_variants()[name]
    if direction == "backward" and not variant.caps.backward:
        pytest.skip("forward-only variant")

    limits = fuzz.Limits(dims=(33, 40, 64))     # one padded head dim (64): one module per config

    @given(st.sampled_from(_param_grid(variant)), st.sampled_from(variant.caps.dtypes), st.data())
    def check(params, dtype, data):
        bound = get_variant(name, **params)
        case = data.draw(fuzz.cases(bound, dtype, limits))
        assume(_supported(bound, case, direction))
        fuzz.assert_case(bound, case, direction)

    check()


@pytest.mark.parametrize("spec,direction", [("fa2-tc:split=k+block_r=32+block_c=64", "forward"),
                                            ("fa2-tc:split=k+block_r=32+block_c=128", "forward"),
                                            ("fa2-tc:bwd_block_c=128", "backward"),
                                            ("fa2-tc-deterministic:bwd_block_c=128", "backward")])
def test_head_dim_128_configs_match_oracle(spec, direction):
    """The sweep runs at d <= 64; configs whose d = 128 kernels differ here: split-K's (Br = 32: 128
    accumulators per lane) and the 8-warp backward tile (Br = 64, Bc = 128: two warps per dQ row group)."""
    from hypothesis import strategies as st
    from sandbox.registry import parse_spec
    name, params = parse_spec(spec)
    bound = get_variant(name, **params)

    @given(st.sampled_from(bound.variant.caps.dtypes), st.data())
    def check(dtype, data):
        case = data.draw(fuzz.cases(bound, dtype, fuzz.Limits(dims=(72, 128))))
        fuzz.assert_case(bound, case, direction)

    check()


# fa1: one block per (batch, K/V head) walks every tile in a fixed order (no atomics).
@pytest.mark.parametrize("name", sorted(n for n in all_variants() if "deterministic" in n or n == "fa1"))
def test_deterministic_backward_is_bitwise_reproducible(name):
    rng = np.random.default_rng(0)
    dt = numpy_dtype(all_variants()[name].caps.dtypes[0])
    q, k, v, dout = (rng.standard_normal(s).astype(dt) for s in
                     ((2, 4, 300, 64), (2, 2, 280, 64), (2, 2, 280, 64), (2, 4, 300, 64)))
    res = sandbox.forward(q, k, v, variant=name, causal=True, dropout_p=0.2, seed=3)
    first = [np.asarray(g) for g in sandbox.backward(dout, res)]
    for _ in range(19):
        again = sandbox.backward(dout, res)
        assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(first, again))


@pytest.mark.parametrize("name", sorted(n for n, v in all_variants().items()
                                        if any(p.name == "dropout_store" for p in v.params)))
def test_packed_dropout_backward_needs_the_forward_result(name):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 40, 32)).astype(np.float32) for _ in range(3))
    res = sandbox.forward(q, k, v, variant=name, dropout_store="packed", dropout_p=0.2, seed=4)
    with pytest.raises(ValueError, match="packed"):
        sandbox.backward(q, q=q, k=k, v=v, out=res.out, lse=res.lse, rng=res.rng, variant=name,
                         dropout_store="packed", dropout_p=0.2)
    ref = sandbox.backward(q, res)                       # the stored mask, read back: same as replay
    rep = sandbox.backward(q, sandbox.forward(q, k, v, variant=name, dropout_p=0.2, seed=4))
    for a, b in zip(ref, rep):
        np.testing.assert_array_equal(np.asarray(a) != 0, np.asarray(b) != 0)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
