"""GPU: a batch x heads past CUDA's 65535 blocks per grid axis (y, z) is a ValueError before any wrong
launch, or a right answer (a kernel whose grid does not grow with it, such as a persistent one): never
the driver's 'invalid argument' or an unchecked result."""
import numpy as np
import pytest

import sandbox
from sandbox import oracle

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def _variants():
    if not cp.cuda.is_available():
        return []
    major = cp.cuda.Device().compute_capability[0]
    return ["fa2-tc"] + (["fa3", "fa3-ws"] if int(major) >= 9 else [])


@pytest.mark.parametrize("variant", _variants())
def test_many_batch_heads_is_refused_or_right(variant):
    B, H, N, d = 65536 + 8, 1, 16, 64
    g = cp.random.default_rng(0)
    q, k, v, do = (g.standard_normal((B, H, N, d), dtype=cp.float32).astype(cp.float16) for _ in range(4))
    pick = [0, 65535, B - 1]                   # the last block row of y, and past it
    inputs = {b: [cp.asnumpy(x[b:b + 1]).astype(np.float64) for x in (q, k, v, do)] for b in pick}
    try:
        res = sandbox.forward(q, k, v, variant=variant, causal=True)
    except ValueError as e:
        assert "split the batch" in str(e)
        return
    for b in pick:                             # the forward ran (a grid that does not grow with B x H): right?
        qb, kb, vb, _ = inputs[b]
        ref, _ = oracle.forward(qb, kb, vb, causal=True)
        np.testing.assert_allclose(cp.asnumpy(res.out[b:b + 1]).astype(np.float64), ref, rtol=2e-2, atol=2e-2)
    try:
        grads = sandbox.backward(do, res)
    except ValueError as e:
        assert "split the batch" in str(e)
        return
    for b in pick:
        dq, dk, dv = oracle.backward(inputs[b][3], *inputs[b][:3], causal=True)
        for mine, theirs in zip(grads, (dq, dk, dv)):
            np.testing.assert_allclose(cp.asnumpy(mine[b:b + 1]).astype(np.float64), theirs, rtol=5e-2, atol=5e-2)
