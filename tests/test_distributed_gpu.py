"""sandbox.distributed on two GPUs (NCCL): ring attention (zig-zag and contiguous) and Ulysses with
fa2-tc and fa3 in float16 and bfloat16, causal and not, GQA, forward and backward, against the float64
oracle under the tensor-core tier (sandbox/tolerance.py), beside the single-GPU result on the full
sequence, which must pass the same check.

    python -m pytest -m gpu tests/test_distributed_gpu.py      # needs >= 2 CUDA GPUs

The ranks are spawned processes (tests/distributed_worker.py, start method spawn), one per GPU.
"""
import pytest

torch = pytest.importorskip("torch")
sd = pytest.importorskip("sandbox.distributed")

import distributed_worker as dw  # noqa: E402

import sandbox  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs")]

WORLD = 2


def _case(name, method, dtype, Hq, Hkv, causal, layout, N=512, d=64, variant="fa2-tc"):
    return dict(name=f"{name}-{dtype}", method=method, B=1, Hq=Hq, Hkv=Hkv, N=N, d=d, causal=causal,
                layout=layout, dtype=dtype, seed=sum(map(ord, name + dtype)), variant=variant, params={})


CASES = [c for dtype in ("float16", "bfloat16") for c in (
    _case("ring-zigzag-causal-gqa", "ring", dtype, 4, 2, True, "zigzag"),
    _case("ring-contiguous-causal", "ring", dtype, 4, 4, True, "contiguous"),
    _case("ring-contiguous-gqa", "ring", dtype, 4, 2, False, "contiguous"),
    _case("ring-zigzag-d128", "ring", dtype, 2, 2, False, "zigzag", N=256, d=128),
    _case("ulysses-causal-gqa", "ulysses", dtype, 4, 2, True, "contiguous"),
    _case("ulysses-zigzag", "ulysses", dtype, 4, 4, False, "zigzag"),
    # fa3 (the default on sm_90 elsewhere): each ring step's causal block of q against a k / v chunk, lse merged
    _case("fa3-ring-zigzag-causal-gqa", "ring", dtype, 4, 2, True, "zigzag", variant="fa3"),
    _case("fa3-ring-contiguous-d128", "ring", dtype, 2, 2, True, "contiguous", N=384, d=128, variant="fa3"),
    _case("fa3-ulysses-causal-gqa", "ulysses", dtype, 4, 2, True, "contiguous", variant="fa3"),
)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return dw.run_world(WORLD, CASES, tmp_path_factory.mktemp("nccl"), backend="nccl", device="cuda")


def _single_gpu(case) -> dict:
    """out and gradients of the case on one GPU over the full sequence (the plain sandbox API)."""
    dt = getattr(torch, case["dtype"])
    q, k, v, dout = (torch.from_numpy(x).to("cuda:0", dt) for x in dw.inputs(case))
    res = sandbox.forward(q, k, v, variant=case["variant"], causal=case["causal"])
    grads = sandbox.backward(dout, res)
    return {name: x.double().cpu().numpy() for name, x in zip(("out", "dq", "dk", "dv"), (res.out, *grads))}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_two_gpus_match_the_oracle_as_one_gpu_does(world, case):
    got = dw.gather(case, world)
    one = _single_gpu(case)
    bad = [f"{WORLD} GPUs {v}" for v in dw.verdicts(case, got) if not v.ok]
    bad += [f"1 GPU {v}" for v in dw.verdicts(case, one) if not v.ok]
    gap = {name: float(abs(got[name] - one[name]).max()) for name in got}
    assert not bad, f"{case['name']}: " + "; ".join(bad) + f" (max |2 GPUs - 1 GPU|: {gap})"
