"""CLI edges (issue 15, item 6): `python -m sandbox` and `python -m bench` as a user runs them.

A user error (unknown variant, bad parameter, a variant or family this machine cannot run, a plot
folder with nothing in it) is one `error: ...` line on stderr, no traceback, exit status 2. The
no-GPU assertions are skipped on a GPU machine; everything here stays on tiny problems.
"""
import json

import pytest

from bench import FAMILIES
from cli_helpers import cli, one_error_line
from sandbox.device import has_gpu

no_gpu_only = pytest.mark.skipif(has_gpu(), reason="checks what a machine without a GPU says")


# --- python -m sandbox -------------------------------------------------------------------------

@no_gpu_only
@pytest.mark.parametrize("cmd", [["run"], ["fuzz", "--examples", "1"]])
def test_requested_cuda_variant_without_gpu_is_an_error_that_says_why(cmd):
    line = one_error_line(cli(*cmd, "--variants", "numba-rowwise,fa2"))
    assert "fa2" in line and "no CUDA GPU" in line and "numba-rowwise" not in line


@pytest.mark.parametrize("cmd", [["run"], ["fuzz", "--examples", "1"]])
@pytest.mark.parametrize("spec,why", [
    ("nope", "unknown variant 'nope'"), ("numba-rowwise:block_r=3", "no parameter 'block_r'"),
    ("numba-rowwise:philox_rounds=8", "philox_rounds=8 is not allowed"), (",", "no variant"),
])
def test_bad_variant_specs_are_one_line_errors(cmd, spec, why):
    assert why in one_error_line(cli(*cmd, "--variants", spec))


@pytest.mark.parametrize("args", [["run", "--seqlen", "0"], ["run", "--headdim", "-1"], ["run", "--batch", "x"],
                                  ["run", "--reps", "0"], ["fuzz", "--examples", "0"]])
def test_bad_numbers_are_rejected_by_the_parser(args):
    r = cli(*args)
    assert r.returncode == 2 and "error: argument" in r.stderr


def test_problem_options_are_honoured():
    r = cli("run", "--variants", "numba-rowwise", "--seqlen", "8", "--headdim", "4", "--reps", "1", "--no-baselines")
    assert r.returncode == 0, r.stderr
    problem = "problem: B=4 H=8 N=8 d=4" if has_gpu() else "problem: B=1 H=2 N=8 d=4"
    assert problem in r.stdout and "| numba-rowwise | float32 | ok" in r.stdout


@no_gpu_only
def test_default_selection_without_gpu_says_what_it_skipped():
    r = cli("run", "--seqlen", "4", "--headdim", "4", "--batch", "1", "--heads", "1", "--reps", "1")
    assert r.returncode == 0, r.stderr
    skipped = next(line for line in r.stderr.splitlines() if line.startswith("skipping"))
    assert "fa2" in skipped and "no CUDA GPU" in skipped and "numba-" not in skipped
    assert "problem: B=1 H=1 N=4 d=4" in r.stdout
    assert all(f"| {name} | float32 | ok" in r.stdout for name in ("numba-rowwise", "numba-fa1", "numba-fa2"))


# --- python -m bench ---------------------------------------------------------------------------

def test_plot_of_a_missing_folder_is_an_error(tmp_path):
    assert "no such folder" in one_error_line(cli("plot", str(tmp_path / "nope"), module="bench"))


def test_plot_of_a_folder_without_family_json_is_an_error(tmp_path):
    assert "no family JSON" in one_error_line(cli("plot", str(tmp_path), module="bench"))
    (tmp_path / "other.json").write_text(json.dumps({"family": "unknown", "meta": {}, "rows": [{"a": 1}]}))
    assert "no family JSON" in one_error_line(cli("plot", str(tmp_path), module="bench"))


@no_gpu_only
@pytest.mark.parametrize("family", [*FAMILIES, "all"])
def test_families_without_gpu_say_what_is_missing(family, tmp_path):
    line = one_error_line(cli(family, "--out", str(tmp_path), module="bench"))
    assert "CUDA GPU" in line
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert "pip install -e .[cuda13]" in line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args,why", [
    (["grid", "--variants", "fa2,nope"], "unknown variant 'nope'"),
    (["grid", "--variants", "fa2:block_q=3"], "no parameter 'block_q'"),
    (["dropout", "--variant", "nope"], "unknown variant 'nope'"),
    (["all", "--families", "grid,nope"], "unknown family 'nope'"),
])
def test_bench_user_errors_are_one_line(args, why, tmp_path):
    assert why in one_error_line(cli(*args, "--out", str(tmp_path), module="bench"))


def test_bench_reps_must_be_positive(tmp_path):
    r = cli("grid", "--reps", "0", "--out", str(tmp_path), module="bench")
    assert r.returncode == 2 and "error: argument --reps" in r.stderr


def test_unwritable_json_path_is_one_line_error(tmp_path):
    assert "cannot write --json" in one_error_line(cli("list", "--json", str(tmp_path / "no" / "v.json")))


def test_an_interrupted_fuzz_reports_what_it_checked(monkeypatch, capsys):
    """Ctrl-C (or a time limit's SIGINT) in a long fuzz: the examples checked so far and the failures so far,
    exit status 130, no traceback (a GPU session's fuzz step ends this way at its limit)."""
    import argparse

    from sandbox import cli as sandbox_cli
    from sandbox import fuzz
    calls = []

    def checked_then_interrupted(bound, case, direction):
        calls.append(case)
        if len(calls) == 3:
            raise KeyboardInterrupt
        fuzz.EXAMPLES[f"{bound.name}/{case.dtype}/{direction}"] += 1

    monkeypatch.setattr(fuzz, "assert_case", checked_then_interrupted)
    monkeypatch.setattr(fuzz, "EXAMPLES", fuzz.Counter())
    args = argparse.Namespace(variants="numba-rowwise", examples=50, dtype="float32", direction="forward",
                              derandomize=True)
    with pytest.raises(SystemExit) as e:
        sandbox_cli.cmd_fuzz(args)
    out, err = capsys.readouterr()
    assert e.value.code == 130 and len(calls) == 3
    assert "examples checked: 2, failing configurations: 0 (interrupted)" in out
    assert "interrupted: numba-rowwise float32 forward after 2 examples" in err
