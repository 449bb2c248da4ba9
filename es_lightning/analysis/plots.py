"""The analyses' pictures (matplotlib, Agg backend: no display needed). Each function writes one PNG and returns its path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_pass_at_k_curves(results: Mapping[str, Mapping[str, Mapping[str, float]]], ks: Sequence[int], path: str | Path) -> Path:
    """Pass@k against k (log2 axis): one panel per task, one line per model — base, GRPO and ES side by side."""
    plt = _pyplot()
    tasks = list(dict.fromkeys(task for per_task in results.values() for task in per_task))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for label, per_task in results.items():
            if task in per_task:
                ax.plot(ks, [per_task[task][f"pass@{k}"] for k in ks], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("k")
        ax.set_ylabel("Pass@k")
        ax.set_ylim(0, 1.02)
        ax.set_title(task)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_drift(per_kind: Mapping[str, Mapping[str, float]], taus: Sequence[float], sparsity: Sequence[float], path: str | Path) -> Path:
    """Left: relative drift and share of the squared update per module kind. Right: sparsity s_τ against τ."""
    plt = _pyplot()
    kinds = [k for k, v in per_kind.items() if v["num_params"] > 0]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = range(len(kinds))
    ax1.bar([i - 0.2 for i in x], [per_kind[k]["relative_drift"] for k in kinds], width=0.4, label="D_rel = ‖Δθ‖/‖θ₀‖")
    ax1b = ax1.twinx()
    ax1b.bar([i + 0.2 for i in x], [per_kind[k]["update_share"] for k in kinds], width=0.4, color="tab:orange",
             label="share of ‖Δθ‖²")
    ax1.set_xticks(list(x), kinds, rotation=20)
    ax1.set_ylabel("relative drift")
    ax1b.set_ylabel("share of squared update")
    ax1b.set_ylim(0, 1)
    handles = ax1.get_legend_handles_labels()[0] + ax1b.get_legend_handles_labels()[0]
    ax1.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper left")
    positive = [(t, s) for t, s in zip(taus, sparsity) if t > 0]
    if positive:
        ax2.plot([t for t, _ in positive], [s for _, s in positive], marker="o")
        ax2.set_xscale("log")
    ax2.set_xlabel("τ")
    ax2.set_ylabel("s_τ = fraction with |Δθ| ≤ τ")
    ax2.set_ylim(0, 1.02)
    ax2.grid(alpha=0.3)
    return _save(fig, path)


def plot_ablation(rows: Sequence[Mapping[str, float]], ks: Sequence[int], path: str | Path) -> Path:
    """Score against the sparsity of the kept update (Ba et al. Tables 4, 11, 12 as a picture)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ordered = sorted(rows, key=lambda r: r["sparsity"])
    for k in ks:
        ax.plot([r["sparsity"] for r in ordered], [r[f"pass@{k}"] for r in ordered], marker="o", label=f"pass@{k}")
    ax.set_xlabel("sparsity of the update (fraction of weights reset to base)")
    ax.set_ylabel("score")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_forgetting(changes: Mapping[str, Mapping[str, float]], ks: Sequence[int], path: str | Path) -> Path:
    """Pass@k change (tuned − base) per task, grouped bars per k."""
    plt = _pyplot()
    tasks = list(changes)
    fig, ax = plt.subplots(figsize=(1.5 + 1.6 * len(tasks), 3.8))
    width = 0.8 / max(1, len(ks))
    for j, k in enumerate(ks):
        ax.bar([i + (j - (len(ks) - 1) / 2) * width for i in range(len(tasks))], [changes[t][f"pass@{k}"] for t in tasks],
               width=width, label=f"Δ pass@{k}")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("tuned − base")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_sweep(rows: Sequence[Mapping[str, float]], path: str | Path, k: int | None = None) -> Path:
    """Final training reward and held-out Pass@1 (and Pass@k) against the population size N (Ba et al. Table 6)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    sizes = [r["population_size"] for r in rows]
    ax.plot(sizes, [r["reward"] for r in rows], marker="o", label="train reward (last updates)")
    ax.plot(sizes, [r["pass@1"] for r in rows], marker="s", label="held-out pass@1")
    if k is not None and k != 1:
        ax.plot(sizes, [r[f"pass@{k}"] for r in rows], marker="^", label=f"held-out pass@{k}")
    base = rows[0].get("base_pass@1") if rows else None
    if base is not None:
        ax.axhline(base, color="gray", linestyle="--", label="base pass@1")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("population size N")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
