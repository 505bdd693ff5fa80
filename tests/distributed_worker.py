"""Ranks for the sandbox.distributed tests: spawn a process group, run cases, check against the oracle.

`run_world(world, cases, folder)` starts `world` processes (torch.multiprocessing, start method
spawn), each joining one process group (gloo on CPU, NCCL on GPUs; a file:// store in `folder`).
Every rank builds the same full inputs from the case's seed, takes its shard (sandbox.distributed
.shard), runs ring_attention or ulysses_attention forward and backward, and saves its output and
gradient shards; an error case records the exception instead. The parent then puts the shards
back together (`gather`) and compares them with the float64 oracle under sandbox/tolerance.py
(`verdicts`). A case is a dict:

    name, method ("ring" | "ulysses"), B, Hq, Hkv, N (the whole sequence), d, causal, layout,
    variant, params, dtype ("float32" | "float16" | "bfloat16"), seed,
    kwargs (extra keyword arguments), error (for an error case: the exception class name
    expected), local_n (error cases: the shard length, the shards then random of that length)
"""
from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path

import numpy as np

TIMEOUT_S = 240.0          # a hung ring (a bug) fails the test instead of hanging CI


def inputs(case) -> tuple:
    """Full q, k, v, dout as float64 NumPy arrays, the same on every rank (seeded)."""
    rng = np.random.default_rng(case["seed"])
    B, Hq, Hkv, N, d = (case[x] for x in ("B", "Hq", "Hkv", "N", "d"))
    return (rng.standard_normal((B, Hq, N, d)), rng.standard_normal((B, Hkv, N, d)),
            rng.standard_normal((B, Hkv, N, d)), rng.standard_normal((B, Hq, N, d)))


def rounded(case) -> tuple:
    """inputs(case) rounded to the case's dtype (what every rank feeds in), as float64."""
    import torch
    dt = getattr(torch, case["dtype"])
    return tuple(torch.from_numpy(x).to(dt).double().numpy() for x in inputs(case))


def run_world(world: int, cases: list, folder, backend: str = "gloo", device: str = "cpu") -> list:
    """Run the cases on `world` spawned ranks; returns each rank's results, {name: dict}."""
    import torch.multiprocessing as mp
    folder = Path(folder)
    for old in folder.glob("rank*.pt"):
        old.unlink()
    ctx = mp.start_processes(_rank_main, args=(world, backend, device, str(folder), cases), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{world} ranks did not finish in {TIMEOUT_S:.0f} s")
    import torch
    return [torch.load(folder / f"rank{r}.pt") for r in range(world)]


def _rank_main(rank: int, world: int, backend: str, device: str, folder: str, cases: list) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)           # the ranks share the machine's cores
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S / 2))
    try:
        results = {case["name"]: _run_case(case, rank, world, device) for case in cases}
        torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _local_tensors(case, rank: int, world: int, device: str) -> list:
    """This rank's q, k, v, dout shards in the case's dtype (random of length local_n for error cases)."""
    import torch
    import sandbox.distributed as sd
    dt = getattr(torch, case["dtype"])
    full = [torch.from_numpy(x).to(dt) for x in inputs(case)]
    if "local_n" in case:
        n = case["local_n"]
        return [x[:, :, :n].to(device).contiguous() for x in full]
    return [sd.shard(x, rank, world, case["causal"], case["layout"]).to(device).contiguous() for x in full]


def _run_case(case, rank: int, world: int, device: str) -> dict:
    import sandbox.distributed as sd
    fn = sd.ring_attention if case["method"] == "ring" else sd.ulysses_attention
    q, k, v, dout = _local_tensors(case, rank, world, device)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    kwargs = dict(causal=case["causal"], layout=case["layout"], variant=case["variant"], **case.get("params", {}),
                  **case.get("kwargs", {}))
    if "error" in case:
        try:
            fn(q, k, v, **kwargs)
        except Exception as e:        # recorded for the parent, which checks class and message
            return {"error": type(e).__name__, "message": str(e)}
        return {"error": None, "message": "no exception"}
    try:
        out = fn(q, k, v, **kwargs)
        out.backward(dout)
    except Exception:
        return {"error": "unexpected", "message": traceback.format_exc()}
    return {"out": out.detach().cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(), "dv": v.grad.cpu()}


def gather(case, results: list) -> dict:
    """The full out, dq, dk, dv (float64 NumPy) from every rank's shards of a case."""
    import sandbox.distributed as sd
    for r, res in enumerate(results):
        got = res[case["name"]]
        if "out" not in got:
            raise AssertionError(f"rank {r} failed on {case['name']}: {got['message']}")
    return {name: sd.unshard([res[case["name"]][name] for res in results], case["causal"], case["layout"])
            .double().numpy() for name in ("out", "dq", "dk", "dv")}


def verdicts(case, got: dict) -> list:
    """out, dq, dk, dv against the float64 oracle under the project's tolerance rule (exact tier
    for float32 with the term bounds; the tensor-core tier, with the naive, for 16-bit)."""
    from sandbox import oracle, tolerance
    q, k, v, dout = rounded(case)
    kw = dict(causal=case["causal"])
    ref_out, _ = oracle.forward(q, k, v, **kw)
    refs = dict(zip(("dq", "dk", "dv"), oracle.backward(dout, q, k, v, **kw)), out=ref_out)
    dtype = case["dtype"]
    terms, naive, rounding = {}, {}, {}
    if dtype == "float32":
        terms = oracle.term_bounds(dout, q, k, v, **kw)
    else:
        naive["out"], _ = oracle.forward(q, k, v, precision=dtype, **kw)
        naive.update(zip(("dq", "dk", "dv"), oracle.backward(dout, q, k, v, precision=dtype, **kw)))
        rounding = oracle.output_rounding_bounds(dout, q, k, v, **kw)
    return [tolerance.compare(name, got[name], refs[name], dtype, naive.get(name),
                              "out" if name == "out" else "grad", terms.get(name, 0.0), rounding.get(name, 0.0))
            for name in ("out", "dq", "dk", "dv")]
