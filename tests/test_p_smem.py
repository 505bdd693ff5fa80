"""fa3's p_smem: the overlapped loop's P_j kept in shared memory (stmatrix into a [64][Bc] tile per consumer
warpgroup) and O += P_j V_j reading its A operand from there, instead of from 32 registers (kernels_cu/fa3_ws.cu
FA_P_SMEM, kernels_cu/hopper.cuh store_p / wg_gemm_pv_ss).

Without a GPU: the module switch, the shared memory it adds, the refusals, and the NVRTC builds (sm_90a): the
three-consumer builds at d = 64 spill-free without a score modifier and spilling less with the soft-cap than P in
registers does. With a GPU: against the oracle and bit for bit against p_smem=False (the same 16-bit P, the same
products).
"""

import numpy as np
import pytest

import sandbox
from sandbox import fuzz, loader, modifiers as M
from sandbox.problem import make_problem
from variants.fa2_tc import ModKernel

from mod_cases import compile_reports


def _problem(d, Nq=16, **options):
    q = np.zeros((1, 4, Nq, d), np.float16)
    k = np.zeros((1, 2, Nq, d), np.float16)
    return make_problem(q, k, k, **options)


def _resolved(p, **params):
    bound = sandbox.get_variant("fa3", **params)
    return bound.variant.impl._resolved(p, bound.config)


def test_p_smem_module_switch_and_shared_memory():
    """Off by default; on, the module carries -DFA_P_SMEM (named in its label), the kernel names are unchanged, and
    the block takes one [64][Bc] 16-bit P tile more per consumer warpgroup (48 KB more at d = 64's three consumers,
    32 KB at d = 128's two), within the 227 KB an sm_90 block may have, persistent included."""
    assert sandbox.get_variant("fa3").config.p_smem is False
    for d, consumers, extra in ((64, 3, 3 * 64 * 128 * 2), (128, 2, 2 * 64 * 128 * 2)):
        p = _problem(d, Nq=4096, causal=True)
        on, off = _resolved(p, p_smem=True), _resolved(p, p_smem=False)
        assert on.consumers == off.consumers == consumers and on.persistent == off.persistent
        u_on, u_off = on.unit("float16", d), off.unit("float16", d)
        assert "-DFA_P_SMEM" in u_on.options and "-DFA_P_SMEM" not in u_off.options and "p_smem" in u_on.label
        assert u_on.names == u_off.names
        assert on.forward_smem(d) - off.forward_smem(d) == extra
        assert on.envelope_errors(d) == []
        mk = ModKernel.of(_problem(d, causal=True, score_mod=M.softcap(30.0)))
        assert "-DFA_P_SMEM" in on.unit("float16", d, mk).options


def test_p_smem_refused_where_the_kernel_has_no_such_loop():
    """fa3-ws has no overlapped loop (no parameter); d > 128 and key tiles that are not whole 64-key panels are
    refused before any launch, naming p_smem."""
    with pytest.raises(ValueError, match="p_smem"):
        sandbox.get_variant("fa3-ws", p_smem=True)
    for d, params in ((192, {}), (256, {}), (64, {"block_c": 80}), (128, {"block_c": 112})):
        with pytest.raises(ValueError, match="p_smem"):
            sandbox.get_variant("fa3", p_smem=True, **params).check(_problem(d), "forward")
    from variants.fa3_ws import WsConfig
    errs = WsConfig(overlap=False, consumers=3, persistent=False, softmax_turns=False, p_smem=True).envelope_errors(64)
    assert len(errs) == 1 and "p_smem" in errs[0] and "no overlap" in errs[0]


def test_compile_units_leave_out_what_the_envelope_refuses():
    """p_smem with 80-key tiles is refused at every head dim (whole 64-key panels only), so the compile report builds no
    fa3_ws.cu forward for it, the D = 64 persistent unit included (built, it fails the kernel's static_assert)."""
    impl = sandbox.get_variant("fa3").variant.impl
    cfg = impl.configure(p_smem=True, block_c=80)
    assert all(cfg.for_head_dim(D).envelope_errors(D) for D in (64, 128))
    assert not [u for u in impl.compile_units(cfg) if u.source == "fa3_ws.cu"]
    assert [u for u in impl.compile_units(impl.configure(p_smem=True)) if u.source == "fa3_ws.cu"]


def test_p_smem_frees_the_registers_p_held():
    """NVRTC (sm_90a, fp16, d = 64, causal, three consumers at 160 registers a thread): without a score modifier the
    build stays spill-free; with the soft-cap it spills less than with P in registers (session 24: 44 against 412
    bytes stored on the persistent grid), and its cubin is another (the switch reaches the kernel)."""
    plain = _problem(64, Nq=4096, causal=True)
    capped = _problem(64, Nq=4096, causal=True, score_mod=M.softcap(30.0))
    mk = ModKernel.of(capped)
    units = {"plain": _resolved(plain, consumers=3, p_smem=True).unit("float16", 64),
             "on": _resolved(capped, consumers=3, persistent=True, p_smem=True).unit("float16", 64, mk),
             "off": _resolved(capped, consumers=3, persistent=True).unit("float16", 64, mk)}
    reports = compile_reports(list(units.values()), "sm_90")      # skips on a GPU machine
    assert all(r.spill_stores == 0 and r.spill_loads == 0 for r in reports[units["plain"]])
    (on,), (off,) = reports[units["on"]], reports[units["off"]]
    assert on.spill_stores < off.spill_stores and on.spill_loads < off.spill_loads, (on, off)
    b_on, b_off = loader.build(units["on"], "sm_90"), loader.build(units["off"], "sm_90")
    assert "serialized" not in b_on.log and b_on.cubin != b_off.cubin


@pytest.fixture
def launched(monkeypatch):
    """The options of every fa3_ws.cu unit a launch (or a plan) asks for, in order: p_smem is bit-equal to P in
    registers by design, so only the module tells whether the switch reached the launch."""
    import variants.fa3_ws as ws
    seen, get = [], ws.get_kernel

    def recording(unit, name):
        seen.append(unit.options)
        return get(unit, name)
    monkeypatch.setattr(ws, "get_kernel", recording)
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_p_smem_matches_oracle_and_p_in_registers(dtype, launched):
    """p_smem=True against the oracle and bit for bit against p_smem=False: d = 64 with three consumers (persistent
    and per-tile grid) and two, d = 128 with softmax turns and with ping-pong, causal and ragged lengths, GQA, the
    soft-cap, ALiBi, a document mask, dropout with a window, q_prescale, Bc = 64; the launched module carries the switch
    (or not). A P tile rewritten before the GEMM that reads it is done, or read before its warp stored it, can show as
    a mismatch (a race shows only where the timing lets it)."""
    sc = M.softcap(30.0)
    docs = M.document(np.repeat([0, 1, 2], [300, 400, 300])[None])
    cases = [({"consumers": 3, "persistent": True}, fuzz.Case(1, 4, 2, 700, 700, 64, dtype,
                                                               {"causal": True, "score_mod": sc}, 1)),
             ({"consumers": 3, "persistent": False}, fuzz.Case(2, 2, 2, 333, 517, 64, dtype,
                                                                {"causal": True, "score_mod": M.softcap(5.0)}, 2,
                                                                logit_scale=4.0)),
             ({"consumers": 3}, fuzz.Case(1, 4, 4, 400, 1000, 48, dtype, {"window": (100, 37), "dropout_p": 0.2,
                                                                           "seed": 3, "score_mod": sc}, 3)),
             ({"consumers": 3, "persistent": True}, fuzz.Case(1, 2, 2, 640, 640, 64, dtype,
                                                               {"score_mod": M.alibi(M.alibi_slopes(2))}, 4)),
             ({}, fuzz.Case(1, 2, 2, 1000, 1000, 64, dtype, {"causal": True, "mask_mod": docs}, 5)),
             ({"consumers": 2, "block_c": 64}, fuzz.Case(1, 4, 2, 500, 500, 64, dtype, {"causal": True}, 6)),
             ({}, fuzz.Case(1, 4, 2, 700, 700, 128, dtype, {"causal": True, "score_mod": sc}, 7)),
             ({"pingpong": True}, fuzz.Case(1, 2, 2, 300, 450, 96, dtype, {"dropout_p": 0.1, "seed": 9}, 8)),
             ({"q_prescale": True, "consumers": 3}, fuzz.Case(1, 4, 2, 700, 700, 64, dtype,
                                                               {"causal": True, "score_mod": sc}, 9))]
    for params, case in cases:
        fuzz.assert_case(sandbox.get_variant("fa3", p_smem=True, **params), case, "forward")
        q, k, v = case.inputs()[:3]
        launched.clear()
        a = sandbox.forward(q, k, v, variant="fa3", p_smem=True, **params, **case.options)
        assert launched and all("-DFA_P_SMEM" in o for o in launched), (params, case)
        launched.clear()
        b = sandbox.forward(q, k, v, variant="fa3", **params, **case.options)
        assert launched and not any("-DFA_P_SMEM" in o for o in launched), (params, case)
        assert np.array_equal(np.asarray(a.out), np.asarray(b.out), equal_nan=True), (params, case)
        assert np.array_equal(np.asarray(a.lse), np.asarray(b.lse), equal_nan=True), (params, case)


@pytest.mark.gpu
def test_p_smem_from_torch_takes_the_plan_path(launched):
    """From PyTorch (the plan path: fastpath), on the caller's stream, the module with the switch, the same result
    as the generic path."""
    torch = pytest.importorskip("torch")
    from sandbox import fastpath
    fastpath._PLANS.clear()                         # the plan is made (and its module asked for) in this call
    case = fuzz.Case(1, 4, 4, 512, 512, 64, "float16", {"causal": True, "score_mod": M.softcap(30.0)}, 11)
    q, k, v = case.inputs()[:3]
    a = sandbox.forward(q, k, v, variant="fa3", p_smem=True, consumers=3, **case.options)
    stream = torch.cuda.Stream()
    launched.clear()
    with torch.cuda.stream(stream):
        t = sandbox.forward(*(torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in (q, k, v)), variant="fa3",
                            p_smem=True, consumers=3, **case.options)
    stream.synchronize()
    assert t.plan is not None and launched and all("-DFA_P_SMEM" in o for o in launched)
    assert np.array_equal(t.out.cpu().numpy(), np.asarray(a.out)) and np.array_equal(t.lse.cpu().numpy(),
                                                                                      np.asarray(a.lse))
