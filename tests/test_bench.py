"""The benchmark harness on CPU: the IO model, the Nsight Compute parser, layouts, best marking,
markdown, stamps and the PNG of every family (drawn from synthetic rows shaped like a real run)."""
import importlib.util
import json

import numpy as np
import pytest

from bench import FAMILIES, blocksparse, common, grid, io_bytes, memory, plots, variants_table


def test_every_family_has_arguments_and_main():
    import bench
    for name in FAMILIES:
        mod = bench.family(name)
        assert callable(mod.add_arguments) and callable(mod.main), name


def test_materialised_io_model_counts_each_pass():
    N, d, e = 1024, 64, 2
    # forward: QK^T (2Nd read, N^2 write), softmax in place (2 N^2, lse), PV (N^2 + Nd read, Nd write)
    assert io_bytes.model_bytes("materialised", "forward", N, d, e) == e * (4 * N * d + 4 * N * N) + 4 * N


def test_q_outer_model_is_linear_in_passes_and_below_materialised():
    N, d, e, tiles = 4096, 64, 2, (64, 64, 64)
    fa2 = io_bytes.model_bytes("q-outer", "forward", N, d, e, tiles)
    assert fa2 == e * 2 * N * d + (N // 64) * e * 2 * N * d + 4 * N
    assert fa2 < io_bytes.model_bytes("materialised", "forward", N, d, e)
    # a taller Q tile (Br = 128) reads K and V half as often
    assert io_bytes.model_bytes("q-outer", "forward", N, d, e, (128, 64, 64)) == e * 2 * N * d + 32 * e * 2 * N * d + 4 * N
    for m in ("materialised", "kv-outer", "q-outer"):
        assert io_bytes.model_bytes(m, "both", N, d, e, tiles) > io_bytes.model_bytes(m, "forward", N, d, e, tiles)
        assert io_bytes.compulsory_bytes("both", N, d, e) <= io_bytes.model_bytes(m, "both", N, d, e, tiles)
    assert io_bytes.model_bytes(None, "forward", N, d, e) is None
    with pytest.raises(ValueError, match="no byte model"):
        io_bytes.model_bytes("kv-inner", "forward", N, d, e, tiles)
    with pytest.raises(ValueError, match="needs the variant's tiles"):
        io_bytes.model_bytes("q-outer", "forward", N, d, e)


def test_kv_outer_model_grows_as_theorem_2():
    # Theorem 2: Theta(N^2 d^2 / M); at fixed tiles the quadratic term dominates: 4x bytes per 2x N
    d, e, tiles = 64, 4, (16, 128, 64)
    r = (io_bytes.model_bytes("kv-outer", "forward", 16384, d, e, tiles)
         / io_bytes.model_bytes("kv-outer", "forward", 8192, d, e, tiles))
    assert 3.8 < r < 4.0


def test_io_tiles_are_read_from_each_variants_config():
    """Br, Bc and the backward's Bc come from the bound config (a non-default Br included), not a table."""
    import sandbox
    from bench.selection import io_model
    tiled = [v for v in sandbox.registry.all_variants().values() if io_model(v) in ("kv-outer", "q-outer")]
    assert tiled
    for v in tiled:
        bound = v.bind()
        br, bc, bwd_bc = io_bytes.tiles_of(bound, 64)
        cfg = bound.config.for_head_dim(64) if hasattr(bound.config, "for_head_dim") else bound.config
        assert br == cfg.block_r and bc in (cfg.block_c, cfg.bc(64) if hasattr(cfg, "bc") else None) and bwd_bc > 0
        other = next(x for x in (16, 32, 64, 128) if x != br and x in next(p for p in v.params if p.name == "block_r").choices)
        assert io_bytes.tiles_of(v.bind(block_r=other), 64)[0] == other
    # the tensor-core flagship's forward Q tile is its default Br (128 since bench/results/h100 2026-11-22)
    tc = next(v for v in tiled if "flagship" in v.tags and "float16" in v.caps.dtypes)
    assert io_bytes.tiles_of(tc.bind(), 64)[0] == next(p for p in tc.params if p.name == "block_r").default


NCU = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python","h","io_case_marker","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","512"
"0","1","python","h","io_case_marker","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"1","1","python","h","standard_gemm<float, float, float>(const float*)","1","7","(256, 1, 1)","(16, 16, 64)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,000,000"
"1","1","python","h","standard_gemm<float, float, float>(const float*)","1","7","(256, 1, 1)","(16, 16, 64)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","250"
"2","1","python","h","standard_softmax","1","7","(256, 1, 1)","(16, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","10"
"2","1","python","h","standard_softmax","1","7","(256, 1, 1)","(16, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","20"
"3","1","python","h","io_case_marker","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","512"
"3","1","python","h","io_case_marker","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
==PROF== Disconnected from process 1
'''


def test_ncu_rows_are_cut_into_cases_at_the_markers():
    a, b = io_bytes.parse_ncu_csv(NCU, 2)
    assert a["dram__bytes_read.sum"] == 1_000_010 and a["dram__bytes_write.sum"] == 270 and a["kernels"] == 2
    assert a["names"] == ["standard_gemm<float, float, float>", "standard_softmax"]
    assert b == {"dram__bytes_read.sum": 0.0, "dram__bytes_write.sum": 0.0, "kernels": 0, "names": []}
    with pytest.raises(ValueError, match="2 case markers for 3 cases"):
        io_bytes.parse_ncu_csv(NCU, 3)
    header, *body = [l for l in NCU.splitlines() if l.startswith('"')]
    with pytest.raises(ValueError, match="before the first case marker"):
        io_bytes.parse_ncu_csv("\n".join([header] + body[2:]), 1)


def test_io_cases_cover_the_papers_setting_and_the_sweep():
    import sandbox
    from bench.selection import io_model
    cs = io_bytes.cases((512, 1024))
    gpt2 = [c for c in cs if c["setting"] == "gpt2-medium"]
    assert {(c["B"], c["H"], c["N"], c["d"]) for c in gpt2} == {(64, 16, 1024, 64)}
    tagged = {n for n, v in sandbox.registry.all_variants().items() if io_model(v)}
    assert {c["variant"] for c in gpt2} == tagged | {"sdpa-flash", "sdpa-math"}
    assert all(c["model"] == io_model(sandbox.registry.all_variants()[c["variant"]]) for c in cs
               if not c["variant"].startswith("sdpa-"))
    with_backward = {n for n in tagged if sandbox.registry.all_variants()[n].caps.backward}
    assert {c["variant"] for c in gpt2 if c["direction"] == "both"} == with_backward | {"sdpa-flash", "sdpa-math"}
    assert len([c for c in cs if c["setting"] == "sweep"]) == 2 * len(tagged)


@pytest.mark.parametrize("density", [0.05, 0.3, 1.0])
def test_blocksparse_layout_has_the_asked_density(density):
    lay = blocksparse.layout(density, 32, seed=1)
    assert lay.shape == (1, 32, 32) and lay.sum() == round(density * 1024)
    assert not np.array_equal(lay, blocksparse.layout(density, 32, seed=2)) or density == 1.0


def test_variants_best_is_the_fastest_per_group():
    rows = [{"variant": "fa2", "dtype": "float32", "d": 64, "N": 2048, "B": 8, "H": 32, "split": s, "block_r": br,
             "block_c": 64, "warps": 4, "tflops": t, "ms": 1.0, "status": "ok"}
            for s, br, t in (("q", 16, 10.0), ("q", 64, 18.0), ("k", 16, 9.0))]
    rows.append({**rows[0], "split": "k", "block_r": 128, "status": "rejected: shared memory"})
    del rows[-1]["tflops"], rows[-1]["ms"]
    variants_table.mark_best(rows)
    assert [r["best"] for r in rows] == [False, True, False, False]
    md = variants_table.markdown(rows)
    assert "**18.00**" in md and "rejected: shared memory" in md and "2.00x" in md


def test_configs_is_the_full_product():
    assert len(list(variants_table.configs({"a": (1, 2), "b": (3, 4, 5)}))) == 6


def test_stamp_without_a_gpu(monkeypatch):
    monkeypatch.setenv("COMMIT", "abc1234")
    meta = common.stamp(d=64)
    assert meta["commit"] == "abc1234" and meta["d"] == 64 and meta["date"].endswith("UTC")
    assert "abc1234" in common.stamp_line(meta)


def synthetic():
    """Rows shaped like each family's real output."""
    grid_rows = [{"N": n, "B": 16384 // n, "H": 32, "d": 64, "causal": c, "direction": dr, "dtype": "float32",
                  "variant": v, "status": "ok", "ms": 1.0, "tflops": t * n / 1024}
                 for n in (1024, 2048) for c in (False, True) for dr in ("forward", "backward")
                 for v, t in (("fa2", 15.0), ("sdpa-flash (fp16)", 300.0))]
    var_rows = [{"variant": "fa2-tc", "dtype": "float16", "d": 64, "N": 4096, "B": 4, "H": 32, "block_r": br,
                 "block_c": 64, "warps": 4, "min_blocks": "auto", "tflops": t, "ms": 1.0, "status": "ok"}
                for br, t in ((64, 200.0), (128, 230.0))]
    variants_table.mark_best(var_rows)
    soft = [{"n": n, "kernel": k, "ms": 1.0, "gbps": g} for n in (1024, 2048) for k, g in
            (("copy", 3000.0), ("safe (cuda)", 1500.0), ("online (cuda)", 2000.0))]
    io_rows = [{"setting": s, "variant": v, "model": "materialised" if m else None, "dtype": "float16", "direction": "forward", "B": 4, "H": 16, "N": n, "d": 64,
                "read_bytes": 1e9, "write_bytes": 1e8, "total_bytes": 1.1e9, "model_bytes": m, "compulsory_bytes": 1e8,
                "kernels": 3, "kernel_names": "a b c"}
               for s, n in (("gpt2-medium", 1024), ("sweep", 512), ("sweep", 1024)) for v, m in (("standard", 2e9), ("sdpa-flash", None))]
    mem = [{"variant": "fa2", "dtype": "float32", "direction": "forward", "N": n, "B": 1, "H": 16, "d": 128, **r}
           for n, r in ((1024, {"status": "ok", "peak_bytes": 1e7}), (2048, {"status": "ok", "peak_bytes": 2e7}),
                        (4096, {"status": "out of memory"}))]
    bs = [{"variant": "fa2-tc", "dtype": "float16", "case": c, "density": dn, "status": "ok", "ms": 2 * dn,
           "ideal_ms": 2 * dn, "time_over_ideal": 1.0} for c, dn in (("random 1", 1.0), ("random 0.1", 0.1), ("causal=True", 0.5))]
    drop = [{"N": n, "store": s, "fwd_ms": 1.0, "bwd_ms": b} for n in (1024, 2048) for s, b in (("replay", 2.0), ("packed", 2.5))]
    return {"grid_float32_d64_forward_backward": ("grid", grid_rows), "variants": ("variants", var_rows),
            "softmax": ("softmax", soft), "io": ("io", io_rows), "memory": ("memory", mem),
            "blocksparse": ("blocksparse", bs), "dropout": ("dropout", drop)}


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib (the bench extra) not installed")
def test_every_family_draws_a_png(tmp_path, monkeypatch):
    monkeypatch.setenv("COMMIT", "test")
    for stem, (fam, rows) in synthetic().items():
        (tmp_path / f"{stem}.json").write_text(json.dumps({"family": fam, "meta": common.stamp(), "rows": rows}))
    written = plots.plot_dir(tmp_path)
    assert sorted(p.stem for p in written) == sorted(synthetic())
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_markdown_of_the_families():
    s = synthetic()
    md = grid.markdown(s["grid_float32_d64_forward_backward"][1])
    assert "TFLOP/s, forward" in md and "TFLOP/s, backward" in md and "| fa2 | yes |" in md
    md = memory.markdown(s["memory"][1], ["fa2 float32 forward: ok"])
    assert "**OOM**" in md and "N=1k" in md
    md = blocksparse.markdown(s["blocksparse"][1])
    assert "causal=True" in md and "| 1.00 |" in md
    md = io_bytes.markdown(s["io"][1], ["standard float16: ok"])
    assert "GPT-2 medium" in md and "measured GB / model GB" in md


def test_write_stamps_every_output(tmp_path, monkeypatch):
    monkeypatch.setenv("COMMIT", "c0ffee1")
    common.write(tmp_path, "t", "grid", common.stamp(), [{"a": 1, "b": 2}], "| a |")
    assert json.loads((tmp_path / "t.json").read_text())["meta"]["commit"] == "c0ffee1"
    assert "c0ffee1" in (tmp_path / "t.md").read_text()
    assert (tmp_path / "t.csv").read_text().splitlines() == ["a,b", "1,2"]
    assert common.load(tmp_path / "t.json")["rows"] == [{"a": 1, "b": 2}]


@pytest.mark.parametrize("argv,bad", [
    (["grid", "--dtype", "bfloat16"], "bfloat16"), (["grid", "--directions", "forward,backwards"], "backwards"),
    (["grid", "--baselines", "flashy"], "flashy"), (["grid", "--seqlens", "1024,abc"], "abc"),
    (["variants", "--shapes", "exact,fp8"], "fp8"), (["blocksparse", "--densities", "0.5,1.5"], "1.5"), (["blocksparse", "--densities", "0"], "outside"),
    (["io", "--sweep", "0"], "'0'"), (["softmax", "--backends", "triton"], "triton"),
    (["modifiers", "--cases", "softcap,alibis"], "alibis"), (["varlen", "--directions", "forward,backward"], "backward"),
])
def test_bad_options_are_rejected_before_anything_runs(argv, bad, capsys):
    from bench.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(argv + ["--out", "/nonexistent"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: argument" in err and bad in err


def test_csv_of_parses_and_names_the_bad_entry():
    import argparse
    assert common.csv_of(kind=int, low=1)("512, 1024,") == (512, 1024)
    assert common.csv_of(("q", "k"))("k,q") == ("k", "q")
    with pytest.raises(argparse.ArgumentTypeError, match="'1.5' is outside"):
        common.csv_of(kind=float, low=0.0, high=1.0)("0.2,1.5")


def test_host_speed_table_reports_cudnn_ratios_for_fwd_and_fwd_bwd():
    """bench host's speed table: kernel-only, from-torch and fwd+bwd ratios to SDPA cuDNN beside flash
    (issue 17 asks for both ratios as a PyTorch user calls the kernels); a missing backend is '-'."""
    from bench import host_cost
    row = {"variant": "fa3", "d": 128, "causal": False, "N": 4096, "ours kernel TFLOP/s": 600.0,
           "sdpa-flash kernel TFLOP/s": 300.0, "sdpa-cudnn kernel TFLOP/s": 500.0, "ours torch TFLOP/s": 580.0,
           "sdpa-flash torch TFLOP/s": 290.0, "sdpa-cudnn torch TFLOP/s": 580.0, "ours torch both TFLOP/s": 450.0,
           "sdpa-flash torch both TFLOP/s": 300.0, "sdpa-cudnn torch both TFLOP/s": 500.0}
    line = host_cost.markdown([], [row]).splitlines()[-1]
    assert line == "| fa3 | 128 | False | 4096 | 600 | 2.00 | 1.20 | 580 | 2.00 | 1.00 | 450 | 1.50 | 0.90 |"
    del row["sdpa-cudnn torch both TFLOP/s"]
    assert host_cost.markdown([], [row]).splitlines()[-1].endswith("| 450 | 1.50 | - |")


def test_host_table_reports_a_training_steps_host_time_beside_sdpas():
    """bench host's host table: the forward + backward column (a training step's attention through autograd)
    sits beside SDPA's with its ratio, as the forward's do; a failed variant's row keeps the column count."""
    from bench import host_cost
    row = {"variant": "fa3", "B": 1, "N": 128, "H": 16, "d": 64, "sdpa_flash_us": 20.0, "sdpa_flash_train_us": 40.0,
           "sandbox_torch_train_us": 60.0, "sdpa_flash_step_us": 100.0, "sandbox_torch_step_us": 250.0}
    row.update({f"{name} us": 30.0 for name in host_cost.ENTRIES})
    lines = host_cost.markdown([row, {"variant": "x", "status": "FAIL"}], []).splitlines()
    header, body, failed = lines[2], lines[4], lines[5]
    assert header.count("|") == body.count("|") == failed.count("|") == lines[3].count("|")
    assert body.endswith("| 40.0 | 60.0 | 1.50 | 100.0 | 250.0 | 2.50 |")


def test_modifiers_plot_draws_bars_for_one_length_and_lines_for_several(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import modifiers_bench as mb
    meta = {"device": "test", "commit": "abc", "date": "2026-11-26"}
    rows = [{"impl": impl, "d": 64, "N": n, "case": case, "fwd_overhead": 0.1 * k, "bwd_overhead": -0.2 * k}
            for impl in ("fa3", "flex_attention") for n in (4096,) for k, case in enumerate(("softcap", "alibi"))]
    rows.append({"impl": "flex_attention", "d": 64, "N": 4096, "case": "sinks", "status": "skipped: sinks"})
    mb.plot({"meta": meta, "rows": rows}, tmp_path / "bars.png")
    rows += [dict(r, N=8192) for r in rows if "fwd_overhead" in r]
    mb.plot({"meta": meta, "rows": rows}, tmp_path / "lines.png")
    assert (tmp_path / "bars.png").stat().st_size > 10_000 and (tmp_path / "lines.png").stat().st_size > 10_000


def test_varlen_table_and_plot_keep_training_rows_apart(tmp_path):
    """The varlen family's training-step rows (forward + backward through autograd) are compared with the
    device-offsets row of their own group, not with the forward's single launch, and plotted as groups of their own."""
    from bench import varlen_bench as vb
    base = {"variant": "v", "mix": "8:1-9", "causal": True, "flops": 1e9, "baseline": ""}
    rows = [{**base, "method": m, "direction": d, "status": "ok", "ms": ms, "TFLOPs": 1.0, "host_ms": 2 * ms,
             "host_TFLOPs": 1.0} for m, d, ms in (("single", "forward", 1.0), ("per-seq", "forward", 2.0),
                                                 ("train-device", "train", 4.0), ("train-host", "train", 6.0))]
    rows.append({**base, "method": "train-torch", "direction": "train", "status": "skipped: no torch"})
    vb.relative_times(rows)
    assert [r.get("single_speedup") for r in rows] == [1.0, 2.0, 1.0, 1.5, None]
    assert [r.get("single_host_speedup") for r in rows] == [1.0, 2.0, 1.0, 1.5, None]
    md = vb.markdown(rows)
    assert "| train-host | 6.000 |" in md and "| 1.50x | 1.50x |" in md and "train rows" in md
    assert "| train-torch | skipped: no torch" in md
    if importlib.util.find_spec("matplotlib") is not None:
        vb.plot({"meta": common.stamp(), "rows": rows}, tmp_path / "varlen.png")
        assert (tmp_path / "varlen.png").stat().st_size > 5000
