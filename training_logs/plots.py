"""PNG plots of a run, drawn from its CSV files (so they can be redrawn at any time).

training_log.csv -> validation metric per trainer against outer step, tokens and syncs (the
best trainer of each step drawn bold: the surviving model's path), requested batch per trainer,
trainers alive, node assignment over time. step_loss_log.csv -> loss per trainer with merges marked.
"""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402


def _read(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _save(ax, path: Path, merges: list[int], xlabel: str, ylabel: str, title: str) -> Path:
    for step in merges:
        ax.axvline(step, color="grey", ls=":", lw=1)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    plt.close(ax.figure)
    return path


def plot_training(csv_path: Path, merge_path: Path, out_dir: Path, metric: str = "val_perplexity",
                  higher_is_better: bool = False) -> list[Path]:
    rows = [r for r in _read(csv_path) if r.get(metric)]
    merge_steps = [int(m["outer_step"]) for m in _read(merge_path)]
    per_trainer: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        per_trainer.setdefault(r["trainer_id"], []).append(r)
    label = metric.removeprefix("val_")
    outputs = []

    # the best trainer of every step: what a user would keep at that point
    best: dict[int, dict[str, str]] = {}
    for r in rows:
        step, value = int(r["outer_step"]), float(r[metric])
        if step not in best or (value > float(best[step][metric])) == higher_is_better:
            best[step] = r
    for x_key, x_label, name in (("outer_step", "outer step", f"{metric}_per_trainer.png"),
                                 ("global_tokens", "tokens seen (all trainers)", f"{metric}_vs_tokens.png"),
                                 ("syncs", "syncs (cross-node all-reduces + merges)",
                                  f"{metric}_vs_syncs.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for t, rs in per_trainer.items():
            ax.plot([float(r[x_key] or 0) for r in rs], [float(r[metric]) for r in rs], marker="o", ms=3, lw=1,
                    alpha=0.7, label=f"trainer {t}")
        steps = sorted(best)
        ax.plot([float(best[s][x_key] or 0) for s in steps], [float(best[s][metric]) for s in steps], color="black",
                lw=2, label="best trainer (surviving model)")
        if metric == "val_perplexity":
            ax.set_yscale("log")
        marks = merge_steps if x_key == "outer_step" else []
        outputs.append(_save(ax, out_dir / name, marks, x_label, label, f"Validation {label} (dotted: merges)"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t, rs in per_trainer.items():
        rs = [r for r in rs if r["requested_batch"]]
        ax.step([int(r["outer_step"]) for r in rs], [int(r["requested_batch"]) for r in rs], where="post",
                label=f"trainer {t}")
    outputs.append(_save(ax, out_dir / "requested_batch_per_trainer.png", merge_steps, "outer step", "sequences",
                         "Requested batch per node"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    alive = {int(r["outer_step"]): int(r["trainers_alive"]) for r in rows if r.get("trainers_alive")}
    ax.step(list(alive), list(alive.values()), where="post")
    outputs.append(_save(ax, out_dir / "trainers_alive.png", merge_steps, "outer step", "trainers",
                         "Trainers alive after each outer step"))

    # node assignment: which trainer each node served in each round
    assigned = [(int(r["outer_step"]), int(n), int(r["trainer_id"])) for r in rows if r.get("nodes")
                for n in r["nodes"].split()]
    if assigned:
        steps = sorted({s for s, _, _ in assigned})
        nodes = sorted({n for _, n, _ in assigned})
        trainers = sorted({t for _, _, t in assigned})
        grid = [[float("nan")] * len(steps) for _ in nodes]
        for s, n, t in assigned:
            grid[nodes.index(n)][steps.index(s)] = trainers.index(t)
        fig, ax = plt.subplots(figsize=(7, 1.2 + 0.4 * len(nodes)))
        cmap = ListedColormap(plt.cm.tab10.colors[: len(trainers)])
        image = ax.imshow(grid, aspect="auto", cmap=cmap, vmin=-0.5, vmax=len(trainers) - 0.5,
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, nodes[-1] + 0.5, nodes[0] - 0.5))
        bar = fig.colorbar(image, ax=ax, ticks=range(len(trainers)))
        bar.ax.set_yticklabels([f"trainer {t}" for t in trainers])
        ax.set_yticks(nodes)
        outputs.append(_save(ax, out_dir / "node_assignment.png", [], "outer step", "node", "Node assignment"))
    return outputs


def plot_step_loss(step_csv: Path, merge_path: Path, out_path: Path) -> Path | None:
    """Mean inner-step loss per trainer per outer step (x = outer step + step fraction), merges marked."""
    rows = _read(step_csv)
    if not rows:
        return None
    steps_per_round = max(int(r["inner_step"]) for r in rows) + 1
    curves: dict[str, dict[float, list[float]]] = {}
    for r in rows:
        x = int(r["outer_step"]) - 1 + (int(r["inner_step"]) + 1) / steps_per_round
        curves.setdefault(r["trainer_id"], {}).setdefault(x, []).append(float(r["loss"]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for t, points in sorted(curves.items()):
        xs = sorted(points)
        ax.plot(xs, [sum(points[x]) / len(points[x]) for x in xs], lw=1, label=f"trainer {t}")
    merges = [int(m["outer_step"]) for m in _read(merge_path)]
    return _save(ax, out_path, merges, "outer step", "training loss (mean over the trainer's nodes)",
                 "Inner-step training loss (dotted: merges)")


def plot_memory(rows: list[dict], cuda_devices: list[str], out_path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for stage in ("before_round", "round_peak", "after_outer_step", "after_merge"):
        points = [(r["outer_step"], r["process_rss_mib"]) for r in rows if r["stage"] == stage]
        if points:
            ax.plot(*zip(*points), marker="o", ms=3, label=f"process RSS, {stage}")
    for d in cuda_devices:
        points = [(r["outer_step"], r[f"{d}_peak_mib"]) for r in rows if r["stage"] == "round_peak"]
        ax.plot(*zip(*points), ls="--", label=f"{d} peak allocated")
    return _save(ax, out_path, [], "outer step", "MiB", "Memory by stage")
