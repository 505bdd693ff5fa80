"""One PNG per table family, drawn from the family's JSON (so a GPU machine without matplotlib can
run the benchmark and another machine can draw it): `python -m bench plot bench/results/h100`.
Each figure carries the run's stamp (device, commit, date) in its title."""
from __future__ import annotations

from pathlib import Path

from .common import load, stamp_line
from .variants_table import ROW_KEYS


def _figure(ncols=1, width=6.5):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, 4.4), squeeze=False)
    return plt, fig, axes[0]


def _finish(plt, fig, meta, title, path):
    fig.suptitle(f"{title}\n{stamp_line(meta).strip('_')}" if meta else title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def grid(data, path):
    rows = data["rows"]
    directions = list(dict.fromkeys(r.get("direction", "forward") for r in rows))
    plt, fig, axes = _figure(2 * len(directions), 5.0)
    for i, (direction, causal) in enumerate((dr, c) for dr in directions for c in (False, True)):
        ax = axes[i]
        sub = [r for r in rows if r.get("direction", "forward") == direction and r["causal"] == causal and "tflops" in r]
        for label in dict.fromkeys(r["variant"] for r in sub):
            pts = sorted((r["N"], r["tflops"]) for r in sub if r["variant"] == label)
            ax.plot(*zip(*pts), marker="o", ls="--" if label.startswith("sdpa") else "-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{direction}, {'causal' if causal else 'non-causal'}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=6)
    d = rows[0]["d"]
    _finish(plt, fig, data["meta"], f"FA2 paper grid, d = {d}, B*N = 16k tokens, hidden 2048", path)


def variants(data, path):
    groups = list(dict.fromkeys((r["variant"], r["dtype"], r["d"]) for r in data["rows"]))
    plt, fig, axes = _figure(len(groups), 5.0)
    for ax, g in zip(axes, groups):
        sub = sorted((r for r in data["rows"] if (r["variant"], r["dtype"], r["d"]) == g and "tflops" in r),
                     key=lambda r: r["tflops"])
        labels = [" ".join(f"{k}={r[k]}" for k in r if k not in ROW_KEYS) for r in sub]
        ax.barh(range(len(sub)), [r["tflops"] for r in sub], color=["tab:red" if r["best"] else "tab:blue" for r in sub])
        ax.set_yticks(range(len(sub)), labels, fontsize=5)
        ax.set_xlabel("TFLOP/s")
        ax.set_title(f"{g[0]} {g[1]} d={g[2]} (best in red)", fontsize=9)
    _finish(plt, fig, data["meta"], "Warp partitioning x Br/Bc x warps, forward", path)


def softmax(data, path):
    plt, fig, (ax,) = _figure()
    for kernel in dict.fromkeys(r["kernel"] for r in data["rows"]):
        pts = sorted((r["n"], r["gbps"]) for r in data["rows"] if r["kernel"] == kernel and "gbps" in r)
        ax.plot(*zip(*pts), marker="o", ls="--" if kernel == "copy" else "-", label=kernel)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("vector length")
    ax.set_ylabel("GB/s (one read + one write)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    _finish(plt, fig, data["meta"], "Softmax: naive / safe / online against the copy bandwidth", path)


def io(data, path):
    plt, fig, (a1, a2) = _figure(2)
    g = [r for r in data["rows"] if r["setting"] == "gpt2-medium"]
    labels = [f"{r['variant']}\n{r['dtype'].replace('float', 'fp')}\n{r['direction']}" for r in g]
    x = range(len(g))
    a1.bar([i - 0.2 for i in x], [r["total_bytes"] / 1e9 for r in g], 0.4, label="measured (ncu)")
    a1.bar([i + 0.2 for i in x], [(r["model_bytes"] or float("nan")) / 1e9 for r in g], 0.4, label="model (no cache)")
    a1.set_xticks(list(x), labels, fontsize=5)
    a1.set_yscale("log")
    a1.set_ylabel("HBM bytes read + written, GB")
    a1.set_title("GPT-2 medium (B=64, H=16, N=1024, d=64)", fontsize=9)
    a1.legend(fontsize=7)
    sweep = [r for r in data["rows"] if r["setting"] == "sweep"]
    for i, key in enumerate(dict.fromkeys((r["variant"], r["dtype"]) for r in sweep)):
        pts = sorted((r["N"], r["total_bytes"] / 1e9, (r["model_bytes"] or float("nan")) / 1e9)
                     for r in sweep if (r["variant"], r["dtype"]) == key)
        color = f"C{i}"
        a2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, label=f"{key[0]} {key[1]} measured")
        a2.plot([p[0] for p in pts], [p[2] for p in pts], ls="--", color=color, label="model")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("N (B=4, H=16, d=64, forward)")
    a2.set_ylabel("GB")
    a2.legend(fontsize=5)
    a2.grid(True, which="both", alpha=0.3)
    _finish(plt, fig, data["meta"], "HBM traffic: Nsight Compute against the analytic IO model", path)


def memory(data, path):
    plt, fig, (ax,) = _figure(width=7.5)
    rows = data["rows"]
    top = max((r["peak_bytes"] for r in rows if r["status"] == "ok"), default=1) / 1e9 * 2
    for i, key in enumerate(dict.fromkeys((r["variant"], r["dtype"], r["direction"]) for r in rows)):
        sub = [r for r in rows if (r["variant"], r["dtype"], r["direction"]) == key]
        pts = sorted((r["N"], r["peak_bytes"] / 1e9) for r in sub if r["status"] == "ok")
        if pts:
            ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=" ".join(key))
        oom = [r["N"] for r in sub if r["status"] == "out of memory"]
        if oom:
            ax.plot(oom[:1], [top], marker="x", ms=10, color=f"C{i}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N (B=1, H=16, d=128)")
    ax.set_ylabel("peak memory beyond inputs, GB (x = out of memory)")
    ax.legend(fontsize=6)
    ax.grid(True, which="both", alpha=0.3)
    _finish(plt, fig, data["meta"], "Peak memory against sequence length", path)


def blocksparse(data, path):
    plt, fig, (ax,) = _figure()
    for i, key in enumerate(dict.fromkeys((r["variant"], r["dtype"]) for r in data["rows"])):
        sub = [r for r in data["rows"] if (r["variant"], r["dtype"]) == key and "ms" in r]
        rnd = sorted((r["density"], r["ms"], r.get("ideal_ms")) for r in sub if r["case"].startswith("random"))
        ax.plot([p[0] for p in rnd], [p[1] for p in rnd], marker="o", color=f"C{i}", label=f"{key[0]} ({key[1]})")
        ax.plot([p[0] for p in rnd], [p[2] for p in rnd], ls="--", color=f"C{i}", alpha=0.6, label="ideal (dense x density)")
        for r in sub:
            if not r["case"].startswith("random"):
                ax.plot([r["density"]], [r["ms"]], marker="s" if r["case"] == "causal=True" else "^", color=f"C{i}", ms=8,
                        ls="none", label=f"{r['case']}")
    ax.set_xlabel("block density")
    ax.set_ylabel("forward ms")
    ax.legend(fontsize=6)
    ax.grid(True, alpha=0.3)
    _finish(plt, fig, data["meta"], "Block-sparse attention: time against density", path)


def dropout(data, path):
    plt, fig, (ax,) = _figure()
    for variant in dict.fromkeys(r.get("variant", "") for r in data["rows"]):
        for store in ("replay", "packed"):
            pts = sorted((r["N"], r["bwd_ms"]) for r in data["rows"]
                         if r["store"] == store and r.get("variant", "") == variant and "bwd_ms" in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{variant} backward, mask {store}".strip())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)
    _finish(plt, fig, data["meta"], "Dropout: replayed vs stored mask", path)


def modifiers(data, path):
    from .modifiers_bench import plot
    plot(data, path)


def varlen(data, path):
    from .varlen_bench import plot
    plot(data, path)


DRAW = {"grid": grid, "variants": variants, "softmax": softmax, "io": io, "memory": memory,
        "blocksparse": blocksparse, "dropout": dropout, "modifiers": modifiers, "varlen": varlen}


def family_jsons(folder) -> list[tuple[Path, dict, str]]:
    """(path, data, family) of every JSON in folder that a figure exists for and that has rows.

    A missing folder, or one with no such JSON, is a FileNotFoundError that says so: a plot run that
    draws nothing is a mistake (a wrong path, a run that wrote no table), not a success."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")
    found = []
    for js in sorted(folder.glob("*.json")):
        data = load(js)
        family = data.get("family", "")
        if family not in DRAW and js.stem.startswith("grid_"):
            family = "grid"
        if family in DRAW and data["rows"]:
            found.append((js, data, family))
    if not found:
        raise FileNotFoundError(f"{folder}: no family JSON with rows to plot (families: {', '.join(DRAW)})")
    return found


def plot_dir(folder) -> list[Path]:
    """A PNG beside every family JSON in folder; returns the paths written."""
    written = []
    for js, data, family in family_jsons(folder):
        DRAW[family](data, js.with_suffix(".png"))
        written.append(js.with_suffix(".png"))
    return written
