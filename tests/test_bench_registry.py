"""Bench families select their variants from the registry (issue 16): tags, capabilities, bench
configs; `python -m bench plan` shows the selection without a GPU; no bench module names a variant;
the check-then-time harness; `python -m bench session` on a machine without a GPU, its dry run and
its summary. All on CPU."""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from bench import FAMILIES, grid, harness, selection, session
from bench.gpu_summary import parse_ncu_details, summarize
from sandbox import registry
from sandbox.device import has_gpu
from sandbox.problem import make_problem
from sandbox.registry import Capabilities, Param, Variant

from cli_helpers import ROOT, one_error_line
from cli_helpers import cli as run_cli
GPU_BACKENDS = ("cuda", "numba")


def cli(*args, cwd=ROOT):
    return run_cli(*args, module="bench", cwd=cwd, timeout=300)


# --- bench/*.py names no variant -----------------------------------------------------------------

def string_literals(path: Path):
    """(line, text) of every string constant of a module: docstrings, f-string parts, plain literals."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_no_registered_variant_name_in_bench_sources():
    """A variant name as a whole word (a token of name characters: fa2-tc is not fa2, but fa2:split=k
    is) in any string literal of bench/*.py is a hard-coded selection: the registry says what to time."""
    names = set(registry.all_variants())
    found = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for line, text in string_literals(path):
            hits = set(re.findall(r"[A-Za-z0-9_-]+", text)) & names
            found += [f"{path.name}:{line}: {sorted(hits)} in {text[:60]!r}" for _ in [0] if hits]
    assert not found, "\n".join(found)


def test_the_name_check_would_catch_a_spec():
    names = {"fa2", "fa2-tc"}
    assert set(re.findall(r"[A-Za-z0-9_-]+", "x fa2:split=k y")) & names == {"fa2"}
    assert set(re.findall(r"[A-Za-z0-9_-]+", "cupy-fa2-tcx, fa2_tc.py")) & names == set()


# --- tags, the plan --------------------------------------------------------------------------------

def test_every_gpu_variant_is_tagged_from_the_vocabulary():
    for v in registry.all_variants().values():
        assert not registry.tag_errors(v.tags), v.name
        if v.backend in GPU_BACKENDS:
            assert v.tags, f"{v.name} has no bench tag: it would never be timed"
    rows = {r["name"]: r for r in registry.variants()}
    assert all(isinstance(r["tags"], list) and isinstance(r["bench_configs"], list) for r in rows.values())
    json.dumps(registry.variants())          # `python -m sandbox list --json` writes these rows


@pytest.mark.parametrize("kw,match", [
    ({"tags": ("ladder",)}, "unknown tag 'ladder'"), ({"tags": ("io:kv-inner",)}, "unknown tag"),
    ({"bench_configs": ({"block_q": 1},)}, "block_q=1 is not a parameter value"),
    ({"bench_configs": ({"block_r": 48},)}, "block_r=48"), ({"bench_sweep": {"block_r": (16, 48)}}, "bench_sweep block_r"),
])
def test_registration_rejects_bad_bench_fields(kw, match):
    with pytest.raises(ValueError, match=match):
        Variant("zz-bad", "fa2", "cuda", "bad", impl=None, params=(Param("block_r", (16, 32), 16),), **kw)


def test_plan_lists_every_cuda_and_numba_variant(tmp_path):
    r = cli("plan", "--json", str(tmp_path / "plan.json"))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "plan.json").read_text())
    assert set(data["families"]) == set(FAMILIES) and data["unplanned"] == []
    planned = {row["variant"].partition(":")[0] for rows in data["families"].values() for row in rows}
    gpu = {n for n, v in registry.all_variants().items() if v.backend in GPU_BACKENDS}
    assert gpu <= planned
    for name in gpu:
        assert re.search(rf"^\| \w+ \| {re.escape(name)}(:\S*)? \|", r.stdout, re.M), name
    assert "no family times: none" in r.stdout


def test_plan_of_one_family_and_its_errors(tmp_path):
    r = cli("plan", "io")
    assert r.returncode == 0 and all(line.startswith("| io |") for line in r.stdout.strip().splitlines()[2:])
    assert "unknown family 'nope'" in one_error_line(cli("plan", "nope"))
    assert "cannot write --json" in one_error_line(cli("plan", "--json", str(tmp_path / "no" / "p.json")))


def test_ladders_put_backward_rungs_and_configs_where_a_backward_is_timed():
    every = registry.all_variants()
    for dtype in ("float32", "float16"):
        fwd = dict(grid.selection_for(dtype, 64, ("forward",)))
        both = dict(grid.selection_for(dtype, 64, ("forward", "backward")))
        tag = selection.LADDER_OF_TIER[registry.TIER_OF_DTYPE[dtype]]
        ladder = {n for n, v in every.items() if tag in v.tags and dtype in v.caps.dtypes}
        assert {s.partition(":")[0] for s in both} == ladder
        for s in fwd:
            v = every[s.partition(":")[0]]
            assert "backward-rung" not in v.tags and not selection.is_backward_config(registry.parse_spec(s)[1])
        for s, drs in both.items():
            v, params = every[s.partition(":")[0]], registry.parse_spec(s)[1]
            assert ("backward" in drs) == (v.caps.backward and (not params or any(k.startswith("bwd_") for k in params)))
            assert ("forward" in drs) == (s in fwd)
        # every bench config of every rung is timed somewhere
        for n in ladder:
            for cfg in every[n].bench_configs:
                assert selection.spec(n, cfg) in both


class DummyImpl:
    def configure(self, **params):
        return SimpleNamespace(**params)


@pytest.fixture
def throwaway():
    """A tensor-core flagship ladder rung with a sweep, registered for the test and removed after."""
    v = Variant("zz-throwaway", "fa2", "cuda", "test variant", impl=DummyImpl(),
                params=(Param("block_r", (16, 32), 16), Param("bwd_block_c", (32, 64), 32)),
                caps=Capabilities(dropout=False, dtypes=("float16",), head_dims=(64, 128)),
                tags=("tc-ladder", "flagship"), bench_configs=({"block_r": 32}, {"bwd_block_c": 64}),
                bench_sweep={"block_r": (16, 32)})
    registry.all_variants()
    registry.register(v)
    try:
        yield v
    finally:
        registry._REGISTRY.pop(v.name, None)


def test_a_throwaway_variant_is_planned_where_its_tags_and_caps_select(throwaway, tmp_path, capsys):
    from bench.__main__ import main
    main(["plan", "--json", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "plan.json").read_text())
    where = {fam: [r for r in rows if r["variant"].partition(":")[0] == "zz-throwaway"]
             for fam, rows in data["families"].items()}
    assert {f for f, rows in where.items() if rows} == {"grid", "variants", "memory", "blocksparse", "host"}
    # grid: the tensor-core run only; defaults everywhere, the forward config forward, the bwd_ one backward
    grid_rows = {r["variant"]: r for r in where["grid"]}
    assert set(grid_rows) == {"zz-throwaway", "zz-throwaway:block_r=32", "zz-throwaway:bwd_block_c=64"}
    assert {r["dtype"] for r in grid_rows.values()} == {"float16"}
    assert grid_rows["zz-throwaway"]["directions"] == "forward,backward,both"
    assert grid_rows["zz-throwaway:block_r=32"]["directions"] == "forward"
    assert grid_rows["zz-throwaway:bwd_block_c=64"]["directions"] == "backward,both"
    assert where["variants"][0]["d"] == "64,128" and "2 configs" in where["variants"][0]["setting"]
    assert {r["dtype"] for r in where["memory"]} == {"float16"}
    assert "| grid | zz-throwaway:block_r=32 |" in out and "| host | zz-throwaway |" in out
    # not in io (no io:<model> tag), not in dropout (no dropout), not in the fp32 ladder (no fp32)
    assert data["unplanned"] == []
    assert all(grid.selection_for("float32", 64, ("forward",))) and \
        "zz-throwaway" not in {s for s, _ in grid.selection_for("float32", 64, ("forward",))}
    # the session sanitizes it (defaults and both configs) and would profile the first fp16 flagship
    cases = [c for c in session.sanitizer_cases() if c[0].startswith("zz-throwaway")]
    assert ("zz-throwaway", 128, True) in cases and ("zz-throwaway:block_r=32", 64, False) in cases
    assert ("zz-throwaway:bwd_block_c=64", 128, True) in cases


def test_the_throwaway_variant_is_gone_after_the_test():
    assert "zz-throwaway" not in registry.all_variants()


# --- the harness ---------------------------------------------------------------------------------

def test_check_then_time_does_not_time_a_failure(monkeypatch):
    import sandbox.timing
    timed = []
    monkeypatch.setattr(sandbox.timing, "time_fn", lambda fn, reps: SimpleNamespace(median_ms=2.0, p10_ms=1.0, p90_ms=3.0))

    def factory():
        timed.append(1)
        return lambda: None
    assert harness.check_then_time(lambda: (False, "err 3 > tol 1"), factory) == {"status": "FAIL err 3 > tol 1"}
    assert not timed

    def rejected():
        raise ValueError("variant 'x' does not support: head dim 300")
    assert harness.check_then_time(rejected, factory)["status"].startswith("skipped: variant 'x' does not support")
    assert harness.check_then_time(rejected, factory, rejected="rejected", reason=lambda e: "smem")["status"] == "rejected: smem"
    assert not timed
    assert harness.check_then_time(lambda: (True, None), factory) == {"status": "ok", "ms": 2.0, "p10_ms": 1.0, "p90_ms": 3.0}
    assert timed == [1]


def test_the_families_share_the_harness():
    """No family re-implements the loop: each timing family calls bench.harness."""
    for mod in ("grid", "variants_table", "blocksparse", "softmax_bench", "dropout_bench"):
        src = (ROOT / "bench" / f"{mod}.py").read_text()
        assert "check_then_time(" in src, mod
    for mod in ("io_bytes", "memory", "host_cost"):
        assert "oracle_check(" in (ROOT / "bench" / f"{mod}.py").read_text(), mod


def test_oracle_check_on_the_cpu():
    import sandbox
    ok, verdict = harness.oracle_check(sandbox.get_variant("numba-rowwise"), "float32", 8, "forward", n=16)
    assert ok, verdict


# --- python -m bench session ---------------------------------------------------------------------

@pytest.mark.skipif(has_gpu(), reason="checks what a machine without a GPU says")
@pytest.mark.parametrize("parts", [["--parts", "bench"], []])
def test_session_without_gpu_is_one_error_line(parts, tmp_path):
    line = one_error_line(cli("session", *parts, "--out", str(tmp_path / "out")))
    assert "CUDA GPU" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,why", [
    (["--parts", "tests,bogus"], "--parts"), (["--families", "grid,nope"], "--families"),
    (["--grid", "float64:64"], "--grid"), (["--profile", "nope"], "unknown variant 'nope'"),
    (["--grid-directions", "sideways"], "--grid-directions"), (["--reps", "0"], "--reps"),
])
def test_session_user_errors_are_one_line(args, why, tmp_path):
    assert why in one_error_line(cli("session", *args, "--out", str(tmp_path)))


def test_session_dry_run_lists_every_part(tmp_path):
    r = cli("session", "--dry-run", "--out", str(tmp_path / "out"), "--examples", "7", "--shards", "2")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "GPU_EXAMPLES=7" in out and "GPU_SHARDS=2" in out and "-m pytest" in out and "-m gpu --durations=15 tests" in out
    cuda = [n for n, v in registry.all_variants().items() if v.backend == "cuda"]
    for name in cuda:
        for tool in ("memcheck", "racecheck"):
            assert re.search(rf"compute-sanitizer --tool {tool} .* --variants {re.escape(name)} ", out), (tool, name)
    assert "-m bench grid --dtype float16 --headdim 64" in out and "-m bench softmax" in out
    assert "-m sandbox run --json" in out
    assert re.search(r"^ncu --profile-from-start off .* -m bench.session --profile-target \S+ 4096 64$", out, re.M)
    assert not (tmp_path / "out").exists()


def test_missing_tools_skip_default_parts_and_fail_named_ones(monkeypatch):
    monkeypatch.setattr(session, "missing_for_gpu_families", lambda: None)
    monkeypatch.setattr(session.shutil, "which", lambda tool: None)
    args = SimpleNamespace(parts=None, families="grid", grid="float32:64", grid_directions="forward", reps=1,
                           examples=1, shards=1, workers=1, sanitize_jobs=1, profile=None, profile_n=64,
                           profile_d=64, dry_run=False)
    parts, skipped = session.check_request(args)
    assert parts == ["tests", "bench"] and set(skipped) == {"sanitize", "profile"}
    assert "compute-sanitizer" in skipped["sanitize"] and "ncu" in skipped["profile"]
    from bench.common import UsageError
    with pytest.raises(UsageError, match="part profile needs ncu"):
        session.check_request(SimpleNamespace(**{**vars(args), "parts": "tests,profile"}))


def test_sanitizer_cases_cover_every_cuda_variant():
    cases = session.sanitizer_cases()
    for name, v in registry.all_variants().items():
        if v.backend != "cuda":
            continue
        mine = [c for c in cases if c[0].partition(":")[0] == name]
        small = 40 if 40 in v.caps.head_dims else min(v.caps.head_dims)   # as sanitizer_cases picks it
        assert (name, small, v.caps.backward) in mine
        assert ((name, 128, True) in mine) == v.caps.backward
        assert len(mine) >= 1 + len(v.bench_configs)


def test_sanitizer_case_sizes_within_max_query_rows():
    """`sandbox run` takes N query rows and N keys: a variant with max_query_rows (a decoding kernel)
    is sanitized at N = max_query_rows where that is below the case's 70, every other at 70."""
    for name, v in registry.all_variants().items():
        if v.backend != "cuda":
            continue
        args = session.sanitize_case(name)
        n = int(args[args.index("--seqlen") + 1])
        assert n == (70 if v.caps.max_query_rows is None else min(70, v.caps.max_query_rows)), name
        assert args[:args.index("--seqlen")] == session.SANITIZE_CASE[:args.index("--seqlen")]
    v = Variant("zz-rows", "fa2", "cuda", "test variant", impl=DummyImpl(),
                caps=Capabilities(dtypes=("float16",), head_dims=(64,), max_query_rows=4), tags=("decode",))
    registry.all_variants()
    registry.register(v)
    x = np.zeros((1, 1, 5, 64), np.float16)
    try:
        args = session.sanitize_case("zz-rows")
        assert args[args.index("--seqlen") + 1] == "4"
        assert ("zz-rows", 64, True) in session.sanitizer_cases()
        with pytest.raises(ValueError, match=r"Nq=5 query rows \(max_query_rows=4\)"):
            v.bind().check(make_problem(x, x, x))
    finally:
        registry._REGISTRY.pop(v.name, None)


NCU_DETAILS = """==PROF== Connected to process 1
  fa2_tc_forward<__half, 64, 128, 64, 4, true, 2, 1, 10, false>(Args) (32, 128, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ------------- ------------
    Metric Name               Metric Unit Metric Value
    ----------------------- ------------- ------------
    Memory Throughput                   %        31.20
    Duration                      usecond       512.42
    Compute (SM) Throughput             %        71.05
    Section: Occupancy
    Achieved Occupancy                  %        12.44
  fa2_tc_bwd_rowdot<__half>(Args) (512, 1, 1)x(256, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                      usecond         9.70
"""


def test_ncu_details_are_parsed_per_kernel():
    a, b = parse_ncu_details(NCU_DETAILS)
    assert a["kernel"].startswith("fa2_tc_forward<__half, 64") and a["Duration"] == "512.42 usecond"
    assert a["Compute (SM) Throughput"] == "71.05 %" and a["Achieved Occupancy"] == "12.44 %"
    assert b == {"kernel": "fa2_tc_bwd_rowdot<__half>(Args)", "Duration": "9.70 usecond"}


def test_summary_of_a_session_folder_and_its_archive(tmp_path, monkeypatch):
    import tarfile
    monkeypatch.setenv("COMMIT", "abc1234")
    s = tmp_path / "session"
    (s / "families").mkdir(parents=True)
    (s / "device.txt").write_text("name, driver\nNVIDIA H100, 580\ncupy 14, numpy 2\n")
    (s / "parts.json").write_text(json.dumps({"tests": "90 passed", "sanitize": "skipped: no compute-sanitizer"}))
    (s / "pytest.log").write_text("....\nFAILED tests/test_x.py::test_y - boom\n1 failed, 89 passed in 3.1s\npytest rc=1\n")
    (s / "fuzz.json").write_text(json.dumps({"total": 12, "by_variant": {"v/float16/forward": 12}}))
    (s / "sanitizer.txt").write_text("memcheck v d=40 forward rc=0 ========= ERROR SUMMARY: 0 errors\n"
                                     "racecheck v d=40 forward rc=9 ========= RACECHECK SUMMARY: 1 hazard\n")
    (s / "gemm.txt").write_text("fp16 GEMM (cuBLAS via CuPy, 8192^3): 600.0 TFLOP/s\n")
    rows = [{"N": 1024, "causal": False, "direction": "forward", "variant": v, "ms": 1.0, "tflops": t}
            for v, t in (("v", 300.0), ("sdpa-flash (fp16)", 400.0))]
    (s / "families" / "grid_float16_d64.json").write_text(json.dumps({"family": "grid", "meta": {}, "rows": rows}))
    (s / "families" / "grid_float16_d64.md").write_text("TFLOP/s, forward\n\n| v | no | 300 |")
    (s / "profile.txt").write_text(NCU_DETAILS)
    text = summarize([s])
    assert "| tests | 90 passed |" in text and "commit: abc1234" in text and "device: NVIDIA H100, 580" in text
    assert "pytest: 1 failed, 89 passed in 3.1s" in text and "FAILED tests/test_x.py::test_y - boom" in text
    assert "oracle-checked Hypothesis examples: 12" in text and "1 of 2 runs clean" in text
    assert "| v | forward | no | 1024 | 300.00 | 0.750 |" in text and "50% |" in text
    assert "## Nsight Compute profile" in text and "512.42 usecond" in text
    with tarfile.open(tmp_path / "session.tgz", "w:gz") as tar:
        tar.add(s, arcname=".")
    assert summarize([tmp_path / "session.tgz"]) == text
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_summary.py"), str(s)], capture_output=True, text=True,
                       env={**os.environ, "COMMIT": "abc1234"})
    assert r.returncode == 0 and "1 of 2 runs clean" in r.stdout, r.stderr


def test_a_session_end_to_end_with_stand_in_tools(tmp_path, monkeypatch, capsys):
    """The session's plumbing on CPU: stand-in compute-sanitizer and ncu on PATH, the GPU check
    waived; the benchmark family fails (no GPU): a failed part, exit status 1, the summary last,
    and only summary.md and session.tgz in the folder."""
    import tarfile
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "compute-sanitizer").write_text("#!/bin/sh\necho '========= ERROR SUMMARY: 0 errors'\n")
    (shims / "ncu").write_text("#!/bin/sh\nif [ \"$1\" = --import ]; then cat <<'EOF'\n" + NCU_DETAILS
                               + "EOF\nelse echo profiled; fi\n")
    for p in shims.iterdir():
        p.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("COMMIT", "feed123")
    monkeypatch.setattr(session, "missing_for_gpu_families", lambda: None)
    from bench.__main__ import main
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["session", "--out", str(out), "--parts", "sanitize,bench,profile", "--families", "softmax",
              "--sanitize-configs", "defaults"])
    assert e.value.code == 1
    assert sorted(p.name for p in out.iterdir()) == ["session.tgz", "summary.md"]
    stdout = capsys.readouterr().out
    summary = (out / "summary.md").read_text()
    assert stdout.endswith(summary) and "commit: feed123" in summary
    n = 2 * len(session.sanitizer_cases("defaults"))
    assert f"| sanitize | {n} of {n} runs clean |" in summary
    assert "| bench | softmax failed (rc 2: error: the benchmark families time CUDA kernels" in summary
    assert "| profile | 2 kernels profiled" in summary and "512.42 usecond" in summary
    with tarfile.open(out / "session.tgz") as tar:
        names = set(tar.getnames())
    assert {"./sanitizer.txt", "./sanitizer.log", "./bench.log", "./profile.txt", "./parts.json", "./device.txt"} <= names


def test_fuzz_report_is_written_per_process_with_feature_counts(tmp_path):
    """FUZZ_REPORT (set by `bench session` for its pytest workers): each process writes its
    oracle-checked counts, per variant and per feature, after every test; no half-written file stays."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "FUZZ_REPORT": str(tmp_path / "fuzz.json"), "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_modifiers.py",
                        "-k", "numba_variants_with_modifiers and numba-fa2-forward"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["fuzz.json.main"]
    report = json.loads((tmp_path / "fuzz.json.main").read_text())
    assert report["total"] == report["by_variant"]["numba-fa2/float32/forward"] > 0
    assert any(k.startswith("numba-fa2/score_mod:") for k in report["by_feature"])
