"""Benchmark plots: passes ratio vs budget, tokens/s vs budget, acceptance by depth."""

from __future__ import annotations

import os
from pathlib import Path

PLOT_FILES = ("passes_ratio_vs_budget.png", "tokens_per_second_vs_budget.png", "acceptance_by_depth.png")


def _settings(rows: list[dict]) -> list[tuple[str, float]]:
    return sorted({(r["task"], r["temperature"]) for r in rows})


def acceptance_by_depth(hist: dict[str, int], max_depth: int) -> list[float]:
    """P(accepted length >= k) for k = 1 .. max_depth, from the per-pass accepted-length histogram."""
    total = sum(hist.values())
    if not total:
        return [0.0] * max_depth
    return [sum(v for k, v in hist.items() if int(k) >= depth) / total for depth in range(1, max_depth + 1)]


def plot_report(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = report["results"]
    paths = []
    settings = _settings(rows)
    for metric, label, name in (
        ("passes_ratio_vs_standard", "target passes ratio (baseline / method)", PLOT_FILES[0]),
        ("tokens_per_second", "tokens / s (this machine)", PLOT_FILES[1]),
    ):
        fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 4), squeeze=False)
        for ax, (task, temperature) in zip(axes[0], settings):
            subset = [r for r in rows if r["task"] == task and r["temperature"] == temperature]
            for method in sorted({r["method"] for r in subset if r["budget"] is not None}):
                for tau in sorted({r["tau"] for r in subset if r["method"] == method}, key=lambda t: t or 0):
                    line = sorted(
                        (r for r in subset if r["method"] == method and r["tau"] == tau), key=lambda r: r["budget"]
                    )
                    tag = method if tau is None else f"{method} tau={tau}"
                    ax.plot([r["budget"] for r in line], [r[metric] for r in line], marker="o", label=tag)
            for r in subset:
                if r["budget"] is None:
                    tag = r["method"] if r["tau"] is None else f"{r['method']} tau={r['tau']}"
                    ax.axhline(r[metric], linestyle="--", linewidth=0.8, color="grey")
                    ax.annotate(tag, (ax.get_xlim()[0], r[metric]), fontsize=7, color="grey")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("draft budget (nodes per pass)")
            ax.set_ylabel(label)
            ax.set_title(f"{task}, T={temperature:g}")
            ax.legend(fontsize=7)
        paths.append(save_figure(fig, out_dir / name))
    fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 4), squeeze=False)
    for ax, (task, temperature) in zip(axes[0], settings):
        subset = [r for r in rows if r["task"] == task and r["temperature"] == temperature and r["budget"]]
        best_budget = max((r["budget"] for r in subset), default=None)
        for r in subset:
            if r["budget"] != best_budget:
                continue
            curve = acceptance_by_depth(r["accepted_lengths"], 10)
            tag = r["method"] if r["tau"] is None else f"{r['method']} tau={r['tau']}"
            ax.plot(range(1, 11), curve, marker="o", label=tag)
        ax.set_xlabel("accepted length k (free commit included)")
        ax.set_ylabel("P(accepted length >= k)")
        ax.set_title(f"acceptance by depth, budget {best_budget}, {task}, T={temperature:g}")
        ax.legend(fontsize=7)
    paths.append(save_figure(fig, out_dir / PLOT_FILES[2]))
    return paths


def save_figure(fig, path: Path, dpi: int = 110) -> Path:
    """Save a PNG under a temporary name, then rename it into place (a plot there stays whole until then)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=dpi, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path
