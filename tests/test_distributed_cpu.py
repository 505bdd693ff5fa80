"""sandbox.distributed on the CPU: 2 and 3 ranks on gloo (spawned processes) running the Numba
variants under the CUDA simulator, against the float64 oracle on the full sequence; and, in this
process, the log-sum-exp merge, the layouts, the zig-zag block classification, the block-gradient
identity the ring backward relies on, and the argument checks. Skipped without PyTorch.

The spawned worlds run all their cases in one process group each (module-scoped fixtures), so the
process start-up (importing torch, numba) is paid twice, not once per case."""
import itertools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sd = pytest.importorskip("sandbox.distributed")

import distributed_worker as dw  # noqa: E402

import sandbox  # noqa: E402
from sandbox import oracle, tolerance  # noqa: E402

pytestmark = pytest.mark.simulator

ROWWISE = {"variant": "numba-rowwise", "params": {}}
FA2 = {"variant": "numba-fa2", "params": {"block_r": 8, "block_c": 8, "threads": 32}}   # SIMULATOR_PARAMS


def _case(name, method, Hq, Hkv, N, causal, layout, kernel=ROWWISE, **extra):
    return dict(name=name, method=method, B=1, Hq=Hq, Hkv=Hkv, N=N, d=8, causal=causal, layout=layout,
                dtype="float32", seed=sum(map(ord, name)), **kernel, **extra)


CASES_2 = [
    _case("ring-contiguous", "ring", 2, 2, 24, False, "contiguous"),
    _case("ring-contiguous-causal", "ring", 2, 2, 24, True, "contiguous"),
    _case("ring-zigzag-causal-gqa", "ring", 4, 2, 24, True, "zigzag"),
    _case("ring-zigzag-gqa", "ring", 4, 2, 24, False, "zigzag"),
    _case("ring-zigzag-causal-fa2", "ring", 2, 1, 16, True, "zigzag", kernel=FA2),
    _case("ulysses-causal-gqa", "ulysses", 4, 2, 24, True, "contiguous"),
    _case("ulysses-zigzag-causal", "ulysses", 2, 2, 24, True, "zigzag"),
    _case("ulysses", "ulysses", 2, 2, 24, False, "contiguous"),
]
CASES_3 = [
    _case("ring-zigzag-causal-gqa", "ring", 4, 2, 36, True, "zigzag"),
    _case("ring-contiguous-causal", "ring", 2, 2, 36, True, "contiguous"),
    _case("ring-contiguous-gqa", "ring", 4, 2, 36, False, "contiguous"),
    _case("ulysses-causal-gqa", "ulysses", 6, 3, 36, True, "contiguous"),
]
# errors that need the world size; each is expected on every rank, before any communication (the
# cases after them would see stray messages otherwise)
ERRORS_2 = [
    _case("zigzag-odd-length", "ring", 2, 2, 24, True, "zigzag", local_n=3, error="ValueError",
          match="divisible by 2 \\* world = 4"),
    _case("ulysses-query-heads", "ulysses", 3, 3, 24, False, "contiguous", error="ValueError",
          match="query heads"),
    _case("ulysses-kv-heads", "ulysses", 4, 1, 24, True, "contiguous", error="ValueError", match="K/V heads"),
    _case("ulysses-zigzag-odd-length", "ulysses", 2, 2, 24, True, "zigzag", local_n=5, error="ValueError",
          match="divisible by 2 \\* world"),
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return dw.run_world(2, ERRORS_2 + CASES_2, tmp_path_factory.mktemp("world2"))


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    return dw.run_world(3, CASES_3, tmp_path_factory.mktemp("world3"))


def _assert_matches_oracle(case, results):
    bad = [str(v) for v in dw.verdicts(case, dw.gather(case, results)) if not v.ok]
    assert not bad, f"{case['name']} on {len(results)} ranks: " + "; ".join(bad)


@pytest.mark.parametrize("case", CASES_2, ids=lambda c: c["name"])
def test_two_ranks_match_the_oracle(world2, case):
    _assert_matches_oracle(case, world2)


@pytest.mark.parametrize("case", CASES_3, ids=lambda c: c["name"])
def test_three_ranks_match_the_oracle(world3, case):
    _assert_matches_oracle(case, world3)


@pytest.mark.parametrize("case", ERRORS_2, ids=lambda c: c["name"])
def test_world_size_errors_on_every_rank(world2, case):
    import re
    for rank, res in enumerate(world2):
        got = res[case["name"]]
        assert got["error"] == case["error"] and re.search(case["match"], got["message"]), (rank, got)


# ---- the log-sum-exp merge

def test_merge_of_key_splits_is_the_oracle():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 2, 5, 4)), rng.standard_normal((1, 2, 9, 4)), rng.standard_normal((1, 2, 9, 4))
    parts = [oracle.forward(q, k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 2), (2, 7), (7, 9))]
    out, lse = sd.merge_partials([torch.from_numpy(o) for o, _ in parts], [torch.from_numpy(s) for _, s in parts])
    ref_out, ref_lse = oracle.forward(q, k, v)
    assert out.dtype == torch.float64
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=0, atol=1e-12)


def test_merge_in_float32_meets_the_exact_tier():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 3, 6, 8)) * 3 for _ in range(3))
    parts = [oracle.forward(q, k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 3), (3, 6))]
    out, lse = sd.merge_partials([torch.from_numpy(o).float() for o, _ in parts],
                                 [torch.from_numpy(s).float() for _, s in parts])
    ref_out, ref_lse = oracle.forward(q, k, v)
    terms = oracle.term_bounds(np.ones_like(q), q, k, v)
    for name, got, ref in (("out", out, ref_out), ("lse", lse, ref_lse)):
        verdict = tolerance.compare(name, got.numpy(), ref, "float32", terms=terms[name])
        assert verdict.ok, str(verdict)


def test_merge_with_a_part_that_sees_no_key():
    out1, lse1 = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3)
    dead_out, dead_lse = torch.zeros(1, 1, 3, 4), torch.full((1, 1, 3), -math.inf)
    out, lse = sd.merge_partials([dead_out, out1, dead_out], [dead_lse, lse1, dead_lse])
    assert torch.equal(out, out1) and torch.equal(lse, lse1)
    out, lse = sd.merge_partials([dead_out, dead_out], [dead_lse, dead_lse])    # a dead row stays dead
    assert torch.equal(out, dead_out) and torch.equal(lse, dead_lse)


# ---- layouts

@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_unshard_round_trip(world, layout):
    x = torch.arange(2 * 24 * world * 3).reshape(2, 1, 24 * world, 3)
    shards = [sd.shard(x, r, world, layout=layout) for r in range(world)]
    assert all(s.shape == (2, 1, 24, 3) for s in shards)
    assert torch.equal(sd.unshard(shards, layout=layout), x)
    assert torch.equal(torch.sort(torch.cat(shards, 2).flatten()).values, torch.sort(x.flatten()).values)


def test_zigzag_rank_holds_chunks_r_and_2w_minus_1_minus_r():
    x = torch.arange(12)
    assert sd.shard(x, 0, 3, causal=True, dim=0).tolist() == [0, 1, 10, 11]
    assert sd.shard(x, 1, 3, causal=True, dim=0).tolist() == [2, 3, 8, 9]
    assert sd.shard(x, 2, 3, causal=True, dim=0).tolist() == [4, 5, 6, 7]
    assert sd.shard(x, 1, 3, causal=False, dim=0).tolist() == [4, 5, 6, 7]       # contiguous when not causal


def test_shard_rejects_a_length_that_does_not_split():
    with pytest.raises(ValueError, match="sequence length 10 is not divisible by 4"):
        sd.shard(torch.zeros(1, 1, 10, 2), 0, 2, causal=True)
    with pytest.raises(ValueError, match="layout"):
        sd.shard(torch.zeros(1, 1, 8, 2), 0, 2, layout="zig")


# ---- which blocks each ring step computes

def test_pair_classification():
    assert sd.classify(3, 1) == "full" and sd.classify(2, 2) == "causal" and sd.classify(1, 3) == "skip"


def _covered(q_chunks, kv_chunks, causal, chunk=2):
    """How often each (query, key) element pair is computed by step_blocks's calls, in global positions."""
    n = chunk * (max(q_chunks + kv_chunks) + 1)
    count = np.zeros((n, n), int)
    rows = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in q_chunks])
    cols = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in kv_chunks])
    for blk in sd.step_blocks(q_chunks, kv_chunks, causal):
        r, c = rows[blk.row_slice(chunk)], cols[blk.col_slice(chunk)]
        seen = np.tril(np.ones((len(r), len(c)), bool)) if blk.causal else np.ones((len(r), len(c)), bool)
        np.add.at(count, (r[:, None].repeat(len(c), 1)[seen], c[None, :].repeat(len(r), 0)[seen]), 1)
    return count, rows, cols


@pytest.mark.parametrize("causal", [True, False])
def test_step_blocks_compute_each_visible_pair_once(causal):
    """For any chunk assignment (the fallback path included), the calls cover exactly the visible
    (query, key) pairs of the held chunks, each once."""
    for q_chunks in itertools.permutations(range(4), 2):
        for kv_chunks in [*itertools.permutations(range(4), 2), (0,), (3,), (1, 2, 3)]:
            count, rows, cols = _covered(q_chunks, kv_chunks, causal)
            i, j = np.meshgrid(np.arange(len(count)), np.arange(len(count)), indexing="ij")
            held = np.isin(i, rows) & np.isin(j, cols)
            want = held & ((j <= i) if causal else True)
            assert np.array_equal(count, want.astype(int)), (q_chunks, kv_chunks)


def test_step_blocks_fuse_the_zigzag_steps_into_one_call():
    assert sd.step_blocks((1, 4), (1, 4), True) == (sd.Block((0, 2), (0, 2), True),)      # own shard
    assert sd.step_blocks((1, 4), (0, 5), True) == (sd.Block((0, 2), (0, 1), False),)     # from a lower rank
    assert sd.step_blocks((1, 4), (2, 3), True) == (sd.Block((1, 2), (0, 2), False),)     # from a higher rank
    assert sd.step_blocks((2, 1), (1, 2), True) == (sd.Block((0, 1), (0, 1), False), sd.Block((0, 1), (1, 2), True),
                                                    sd.Block((1, 2), (0, 1), True))    # the per-pair fallback


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_balances_causal_work_and_contiguous_does_not(world):
    def work(rank, layout):
        mine = sd.chunk_ids(rank, world, layout)
        return sum(((b.rows[1] - b.rows[0]) * (b.cols[1] - b.cols[0])) * (0.5 if b.causal else 1.0)
                   for step in range(world)
                   for b in sd.step_blocks(mine, sd.chunk_ids((rank - step) % world, world, layout), True))
    zigzag = {work(r, "zigzag") for r in range(world)}
    assert zigzag == {2.0 * world}                  # (2W)^2 / 2 chunk pairs over W ranks, equal
    contiguous = [work(r, "contiguous") for r in range(world)]
    assert contiguous == [r + 0.5 for r in range(world)]


# ---- the identity the ring backward relies on

@pytest.mark.parametrize("kernel", [ROWWISE, FA2], ids=lambda k: k["variant"])
def test_block_gradients_from_the_global_out_and_lse_sum_to_the_full_gradient(kernel):
    """Split the keys in two chunks and the queries likewise: each block's backward, given the full
    problem's out and lse, is an exact piece of the full gradient; their sums are the gradient."""
    rng = np.random.default_rng(2)
    q, dout = (rng.standard_normal((1, 4, 8, 8)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 8, 8)).astype(np.float32) for _ in range(2))
    name, params = kernel["variant"], kernel["params"]
    res = sandbox.forward(q, k, v, variant=name, causal=True, **params)
    full = sandbox.backward(dout, res)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    blocks = (sd.Block((0, 1), (0, 1), True), sd.Block((1, 2), (0, 1), False), sd.Block((1, 2), (1, 2), True))
    for blk in blocks:
        r, c = blk.row_slice(4), blk.col_slice(4)
        g = sandbox.backward(dout[:, :, r], q=q[:, :, r], k=k[:, :, c], v=v[:, :, c], out=res.out[:, :, r],
                             lse=res.lse[:, :, r], causal=blk.causal, variant=name, **params)
        dq[:, :, r] += g[0]
        dk[:, :, c] += g[1]
        dv[:, :, c] += g[2]
    refs = oracle.backward(dout, q, k, v, causal=True)
    terms = oracle.term_bounds(dout, q, k, v, causal=True)
    for label, got, whole, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), full, refs):
        assert tolerance.compare(label, got, ref, "float32", terms=terms[label]).ok, label
        np.testing.assert_allclose(got, whole, rtol=0, atol=1e-5, err_msg=label)


# ---- argument checks, all before any communication (no process group here: they come first)

def _qkv(Hq=2, Hkv=2, n=4, d=8, **kw):
    return (torch.zeros(1, Hq, n, d, **kw), torch.zeros(1, Hkv, n, d, **kw), torch.zeros(1, Hkv, n, d, **kw))


@pytest.mark.parametrize("fn", [sd.ring_attention, sd.ulysses_attention], ids=["ring", "ulysses"])
@pytest.mark.parametrize("change,err,match", [
    ({"dropout_p": 0.1}, ValueError, "dropout_p=0.1: dropout is not supported.*global row and column"),
    ({"dropout_p": "0.1"}, TypeError, "dropout_p"),
    ({"causal": "yes"}, TypeError, "causal"),
    ({"layout": "zig"}, ValueError, "layout"),
    ({"variant": "no-such-variant"}, ValueError, "unknown variant"),
    ({"variant": "numba-rowwise", "block_r": 8}, ValueError, "block_r"),
    ({"variant": "fa2-tc-naive"}, ValueError, "backward pass"),
    ({"k": torch.zeros(1, 2, 6, 8), "v": torch.zeros(1, 2, 6, 8)}, ValueError, "same sequence length"),
    ({"k": torch.zeros(1, 2, 4, 4)}, ValueError, "k and v must have the same shape"),
    ({"q": np.zeros((1, 2, 4, 8), np.float32)}, TypeError, "q must be a torch.Tensor"),
])
def test_argument_errors_come_first(fn, change, err, match):
    q, k, v = _qkv(requires_grad=True)
    args = {"q": q, "k": k, "v": v, "variant": "numba-rowwise", "causal": True}
    args.update(change)
    with pytest.raises(err, match=match):
        fn(**args)


def test_without_a_process_group_the_error_says_so():
    with pytest.raises(RuntimeError, match="not initialized"):
        sd.ring_attention(*_qkv(), variant="numba-rowwise")


# ---- the two-GPU benchmark's command line (it runs on GPUs; here only what needs none)

def test_benchmark_help_and_the_torchrun_hint(monkeypatch):
    import subprocess
    import sys
    from bench import context_parallel
    helped = subprocess.run([sys.executable, "-m", "bench.context_parallel", "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "--seqlens" in helped.stdout and "hidden" in helped.stdout, helped.stderr
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match="run under torchrun"):
        context_parallel.main(["--out", "unused"])


class _NoHops:
    """A one-rank ring that fails if asked to transfer: with one rank nothing may be sent."""

    world, rank = 1, 0

    def shift(self, tensor, tag):
        raise AssertionError("a one-rank ring sent a message")


@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_ring_is_plain_attention_without_messages(causal):
    rng = np.random.default_rng(3)
    q, dout = (rng.standard_normal((1, 4, 6, 8)) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 6, 8)) for _ in range(2))
    t = [torch.from_numpy(x).float() for x in (q, k, v, dout)]
    cfg = sd._Config(None, 1, 0, sandbox.get_variant("numba-rowwise"), causal, 1 / math.sqrt(8),
                     "zigzag" if causal else "contiguous")
    out, lse = sd._ring_forward(*t[:3], cfg, _NoHops())
    grads = sd._ring_backward(t[3], *t[:3], out, lse, cfg, _NoHops())
    terms = oracle.term_bounds(dout, q, k, v, causal=causal)
    refs = (oracle.forward(q, k, v, causal=causal)[0], *oracle.backward(dout, q, k, v, causal=causal))
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), refs):
        verdict = tolerance.compare(name, got.numpy(), ref, "float32", terms=terms[name])
        assert verdict.ok, str(verdict)
