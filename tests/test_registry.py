"""Registry, capabilities and input validation: every rejection is a ValueError before any launch.

These run without a GPU: a request that got past validation would fail with RuntimeError (no
device), so a ValueError here proves the check happens before anything is launched.
"""
import numpy as np
import pytest

import sandbox
from sandbox.masks import BlockSparse


def qkv(B=1, Hq=2, Hkv=2, Nq=4, Nk=5, d=8, dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, Hq, Nq, d)).astype(dtype), rng.standard_normal((B, Hkv, Nk, d)).astype(dtype),
            rng.standard_normal((B, Hkv, Nk, d)).astype(dtype))


def test_registry_lists_variants_with_capabilities():
    rows = {r["name"]: r for r in sandbox.variants()}
    assert {"standard", "numba-rowwise"} <= set(rows)
    for r in rows.values():
        assert r["backend"] in ("cuda", "numba") and r["family"] and r["capabilities"]["dtypes"]
    assert rows["standard"]["params"]["philox_rounds"]["choices"] == [10, 7]


def test_get_variant_validates_parameters():
    assert sandbox.get_variant("standard", philox_rounds=7).params == {"philox_rounds": 7}
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        sandbox.get_variant("nope")
    with pytest.raises(ValueError, match="no parameter 'block_r'"):
        sandbox.get_variant("standard", block_r=64)
    with pytest.raises(ValueError, match="philox_rounds=8 is not allowed"):
        sandbox.get_variant("standard", philox_rounds=8)


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v: (q[0], k, v), "4-D"),
    (lambda q, k, v: (q, k, v[:, :, :3]), "same shape"),
    (lambda q, k, v: (q[..., :4], k, v), "does not match"),
    (lambda q, k, v: (q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)), "dtype float64 is not supported"),
    (lambda q, k, v: (q.astype(np.float16), k, v), "share a dtype"),
    (lambda q, k, v: (q[:, :2], k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1)), "multiple of Hkv"),
    (lambda q, k, v: (q[:, :, :0], k, v), ">= 1"),
    (lambda q, k, v: ([[1.0]], k, v), "4-D|shape"),
])
def test_bad_shapes_and_dtypes(mutate, match):
    with pytest.raises(ValueError, match=match):
        sandbox.forward(*mutate(*qkv()), variant="standard")


@pytest.mark.parametrize("kw,match", [
    ({"dropout_p": 1.0}, "dropout_p"), ({"dropout_p": -0.1}, "dropout_p"),
    ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"offset": 2**32}, "offset"),
    ({"window": (1,)}, "window"), ({"window": (1.5, None)}, "window"), ({"scale": float("inf")}, "scale"),
    ({"block_mask": np.ones((1, 4, 5), bool)}, "BlockSparse"),
    ({"block_mask": BlockSparse(np.ones((1, 3, 5), bool), (1, 1))}, "layout has shape"),
    ({"block_mask": BlockSparse(np.ones((3, 4, 5), bool), (1, 1))}, "layout has shape"),
])
def test_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        sandbox.forward(*qkv(), variant="standard", **kw)


def test_capabilities_are_checked_before_launch():
    q, k, v = qkv(dtype=np.float16)
    with pytest.raises(ValueError, match="'numba-rowwise'.*dtype float16"):
        sandbox.forward(q, k, v, variant="numba-rowwise")
    q, k, v = qkv(d=300)
    with pytest.raises(ValueError, match="'standard'.*head dim 300"):
        sandbox.forward(q, k, v, variant="standard")


def test_backward_input_checks():
    q, k, v = qkv()
    res = sandbox.forward(q, k, v, variant="numba-rowwise")
    with pytest.raises(ValueError, match="dout has shape"):
        sandbox.backward(q[:, :, :2], res)
    with pytest.raises(ValueError, match="dout has dtype"):
        sandbox.backward(q.astype(np.float16), res)
    with pytest.raises(ValueError, match="either the forward Result"):
        sandbox.backward(q, variant="numba-rowwise", q=q, k=k, v=v)
    with pytest.raises(ValueError, match="lse must be float32"):
        sandbox.backward(q, variant="numba-rowwise", q=q, k=k, v=v, out=q, lse=np.zeros((1, 2, 3), np.float32))



def test_numba_variants_take_any_strides():
    q, k, v = qkv()
    q_t = np.ascontiguousarray(q.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)   # same values, d-stride != 1
    out = sandbox.attention(q_t, k, v, variant="numba-rowwise")
    np.testing.assert_allclose(out, sandbox.oracle.forward(q, k, v)[0], atol=1e-5)


# fa2-tc (tensor-core tier): its envelope is checked before launch, so these run without a GPU.
@pytest.mark.parametrize("d,params,match", [
    (40, {}, None),                                                    # d = 40: zero-filled to 64
    (36, {}, "head dim 36"),                                          # cp.async moves 16-byte chunks
    (136, {}, "head dim 136"),                                         # above 128
    (64, {"block_r": 64, "warps": 8}, "multiple of 16"),              # 8 rows per warp
])
def test_fa2_tc_envelope(d, params, match):
    q, k, v = qkv(d=d, dtype=np.float16)
    bound = sandbox.get_variant("fa2-tc", **params)
    check = lambda: bound.check(sandbox.problem.make_problem(q, k, v))  # noqa: E731
    if match is None:
        check()
    else:
        with pytest.raises(ValueError, match=match):
            check()


@pytest.mark.parametrize("name", ["fa2-tc", "fa2-tc-naive", "fa1-tc"])
def test_tensor_core_rungs_reject_fp32_and_backward_before_launch(name):
    with pytest.raises(ValueError, match=f"{name}.*dtype float32"):
        sandbox.forward(*qkv(d=64), variant=name)
    q, k, v = qkv(d=64, dtype=np.float16)
    if not sandbox.get_variant(name).variant.caps.backward:
        with pytest.raises(ValueError, match=f"{name}.*backward pass"):
            sandbox.backward(q, q=q, k=k, v=v, out=q, lse=np.zeros(q.shape[:3], np.float32), variant=name)
    with pytest.raises(ValueError, match=f"{name}.*head dim 36"):
        sandbox.get_variant(name).check(sandbox.problem.make_problem(*qkv(d=36, dtype=np.float16)))


def test_tensor_core_rungs_name_their_kernels():
    from variants.fa1_tc import FA1TCConfig
    from variants.fa2_tc_naive import NaiveConfig
    assert NaiveConfig().forward_name("float16", 128, True) == "fa2_tc_naive_forward<__half, 128, 64, 64, 4, 10, true>"
    assert FA1TCConfig(128, 64, 8).forward_name("float16", 64, False) == "fa1_tc_forward<__half, 64, 128, 64, 8, 10, false>"
    assert sandbox.get_variant("fa1-tc").params == {"block_r": 128, "block_c": 64, "warps": 8, "philox_rounds": 10}


def test_fa2_tc_occupancy_auto_follows_the_accumulators():
    from variants.fa2_tc import TCConfig
    assert TCConfig(64, 64, 4, "auto").blocks_per_sm(64) == 3            # 32 + 32 + 96 registers
    assert TCConfig(64, 64, 4, "auto").blocks_per_sm(128) == 2           # 64 + 32 + 96
    assert TCConfig(128, 64, 4, "auto").blocks_per_sm(128) == 1          # 128 + 64 + 96
    assert TCConfig(128, 64, 8, min_blocks=2).blocks_per_sm(128) == 2
    assert "fa2_tc_forward<__half, 64, 64, 64, 4, true, 2, 3, 10, false>" == TCConfig(64, 64, 4, "auto").forward_name(
        "float16", 64, False)


def test_fa2_tc_auto_block_c_follows_head_dim_and_dropout():
    """The default config: Br=128, 4 warps, Bc per (D, dropout) from TCConfig.AUTO_BC, and the tile
    table and shared memory follow the resolved Bc."""
    from variants.fa2_tc import TCConfig
    c = TCConfig()
    assert c.forward_name("float16", 64, False) == "fa2_tc_forward<__half, 64, 128, 64, 4, true, 2, 1, 10, false>"
    assert c.forward_name("float16", 128, True) == "fa2_tc_forward<__half, 128, 128, 32, 4, true, 2, 1, 10, true>"
    assert c.forward_smem(64) == 2 * 64 * (128 + 128) and c.forward_smem(128, True) == 2 * 128 * (128 + 64)
    wide = TCConfig(128, 128, 4, 1)
    assert wide.bc(64, True) == 128 and wide.unit("float16", 64).dynamic_smem == {
        wide.forward_name("float16", 64, drop): 2 * 64 * (128 + 256) for drop in (False, True)}
    assert sandbox.get_variant("fa2-tc").params["block_c"] == "auto"


def test_fa2_tc_split_k_geometry():
    """split='k': each warp owns all Br rows and Bc / warps keys; auto Bc gives each warp 16 keys, the
    accumulator budget bounds Br by d, and shared memory holds the partial sums and row maxima."""
    from variants.fa2_tc import TCConfig
    k = TCConfig(32, "auto", 4, split="k")
    assert k.bc(128) == 64 and k.warp_tile(128) == (32, 16)
    assert k.forward_name("float16", 128, False) == "fa2_tc_forward<__half, 128, 32, 64, 4, false, 2, 1, 10, false>"
    assert k.forward_smem(128) == max(2 * 128 * (32 + 128), 4 * 32 * (128 + 12)) + 4 * 4 * 32
    assert TCConfig(64, 64, 4, split="k").envelope_errors(64) == []
    assert "lower block_r" in TCConfig(64, 64, 4, split="k").envelope_errors(128)[0]
    assert "multiple of 16" in TCConfig(32, 32, 4, split="k").envelope_errors(64)[0]     # 8 keys per warp
    assert "'q' or 'k'" in TCConfig(split="x").envelope_errors(64)[0]
    q, k_, v = qkv(d=128, dtype=np.float16)
    with pytest.raises(ValueError, match="lower block_r"):
        sandbox.get_variant("fa2-tc", split="k", block_r=64).check(sandbox.problem.make_problem(q, k_, v))


def test_fa2_tc_stages_is_a_template_axis_outside_the_tuned_set():
    """stages=1 (copies waited for before the GEMMs) names its own kernel and is a measured rung, not
    a tuned config; the default pipeline (2) of a tuned config stays tuned."""
    from variants.fa2_tc import FA2TensorCore, TCConfig
    one = TCConfig(stages=1)
    assert one.forward_name("float16", 64, False) == "fa2_tc_forward<__half, 64, 128, 64, 4, true, 1, 1, 10, false>"
    assert not FA2TensorCore().tuned(one) and FA2TensorCore().tuned(TCConfig())


def test_fa2_tc_deterministic_backward_names_its_kernels():
    """fa2-tc-deterministic: the column kernel without atomics plus the row-parallel dQ kernel, in one
    module; fa2-tc's module holds the atomic column kernel only. Both hold the D = rowsum(dO o O) kernel."""
    atomic = sandbox.get_variant("fa2-tc").config.backward_unit("float16", 64)
    det = sandbox.get_variant("fa2-tc-deterministic").config.backward_unit("bfloat16", 128)
    assert atomic.names == ("fa2_tc_bwd<__half, 64, 64, 64, 4, 1, 3, 10, false, true>",
                            "fa2_tc_bwd<__half, 64, 64, 64, 4, 1, 3, 10, true, true>",
                            "fa2_tc_bwd_rowdot<__half>")
    assert det.names == ("fa2_tc_bwd<__nv_bfloat16, 128, 64, 64, 4, 1, 1, 10, false, false>",
                         "fa2_tc_bwd<__nv_bfloat16, 128, 64, 64, 4, 1, 1, 10, true, false>",
                         "fa2_tc_bwd_rowdot<__nv_bfloat16>",
                         "fa2_tc_bwd_dq<__nv_bfloat16, 128, 64, 64, 4, 10, false>",
                         "fa2_tc_bwd_dq<__nv_bfloat16, 128, 64, 64, 4, 10, true>")
    assert det.dynamic_smem[det.names[3]] == 2 * 128 * (2 * 64 + 4 * 64)


def test_fa2_tc_backward_geometry():
    """bwd_block_r=32: 2 warps of 32 keys (MK = 2) at d <= 64; d = 128 is rejected before launch."""
    from variants.fa2_tc import TCConfig
    c = TCConfig(bwd_block_r=32, bwd_min_blocks=1)
    assert c.bwd_geometry(64) == (32, 64, 2, 2) and c.backward_errors(64) == []
    assert c.backward_name("float16", 64, True) == "fa2_tc_bwd<__half, 64, 32, 64, 2, 2, 1, 10, true, true>"
    assert TCConfig().bwd_blocks_per_sm(64) == 3 and TCConfig().bwd_blocks_per_sm(128) == 1
    assert c.backward_smem(64) == 2 * (2 * 64 * 64 + 4 * 32 * 64 + 64 * 32) + 4 * 4 * 32
    assert "d <= 64" in c.backward_errors(128)[0]
    wide = TCConfig(bwd_block_r=128)       # 8 warps x 16 keys, one block per SM unless asked
    assert wide.bwd_geometry(64) == (128, 128, 8, 1) and wide.backward_errors(64) == []
    assert wide.backward_name("float16", 64, False) == "fa2_tc_bwd<__half, 64, 128, 128, 8, 1, 1, 10, false, true>"
    assert "d <= 64" in wide.backward_errors(128)[0]
    q, k, v = qkv(d=128, dtype=np.float16)
    bound = sandbox.get_variant("fa2-tc", bwd_block_r=32)
    bound.check(sandbox.problem.make_problem(q, k, v), "forward")
    with pytest.raises(ValueError, match="d <= 64"):
        bound.check(sandbox.problem.make_problem(q, k, v), "backward")


def test_fa2_tc_rejects_rows_cp_async_cannot_copy():
    """16-byte cp.async chunks: a row stride off a multiple of 8 elements, or a base address off
    16 bytes, is a ValueError naming the fix (checked on NumPy views; the launch checks CuPy ones)."""
    from variants.fa2_tc import check_alignment
    check_alignment(np.zeros((1, 2, 4, 64), np.float16), "q")
    padded = np.zeros((1, 2, 4, 68), np.float16)[..., :64]                 # row stride 68 elements
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        check_alignment(padded, "q")
    buf = np.zeros(2 * 4 * 64 + 8, np.float16)
    shifted = buf[1:1 + 2 * 4 * 64].reshape(1, 2, 4, 64)                   # base 2 bytes off
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        check_alignment(shifted, "k")


def test_fa2_tc_backward_tiles_and_preprocessing():
    """bwd_block_c: Bc = 128 runs 8 warps (Br = 64: two warps per 16-row dQ group); pairs outside
    BWD_GEOMETRY and tiles whose accumulators cannot fit are rejected before launch, as is a bad bwd_pre."""
    from variants.fa2_tc import TCConfig
    wide = TCConfig(bwd_block_c=128)
    assert wide.bwd_geometry(128) == (64, 128, 8, 1) and wide.backward_errors(128) == []
    assert TCConfig().bwd_geometry(128) == (64, 128, 8, 1)                      # auto: the atomic d = 128 tile
    assert TCConfig(deterministic=True).bwd_geometry(128) == (64, 64, 4, 1)   # its column kernel: Bc = 64
    assert wide.backward_name("float16", 128, False) == "fa2_tc_bwd<__half, 128, 64, 128, 8, 1, 1, 10, false, true>"
    assert wide.backward_smem(128) == 2 * (2 * 128 * 128 + 4 * 64 * 128 + 128 * 64) + 4 * 4 * 64
    assert "one of" in TCConfig(bwd_block_r=128, bwd_block_c=64).backward_errors(64)[0]
    assert "one of" in TCConfig(bwd_block_r=32, bwd_block_c=128).backward_errors(64)[0]
    assert TCConfig(bwd_block_r=64).bwd_blocks_per_sm(64) == 3 and wide.bwd_blocks_per_sm(64) == 1
    assert TCConfig(bwd_pre="numpy").backward_errors(64) and TCConfig(bwd_pre="cupy").backward_errors(128) == []
