"""PNG plots of a run, drawn from its CSV files (so they can be redrawn at any time)."""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def plot_training(csv_path: Path, merge_path: Path, out_dir: Path, metric: str = "val_perplexity") -> list[Path]:
    rows = _read(csv_path)
    merges = _read(merge_path)
    per_trainer: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        per_trainer.setdefault(r["trainer_id"], []).append(r)
    outputs = []

    def finish(ax, title: str, ylabel: str, name: str) -> None:
        for m in merges:
            ax.axvline(int(m["outer_step"]), color="grey", ls=":", lw=1)
        ax.set(title=title, xlabel="outer step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        path = out_dir / name
        ax.figure.tight_layout()
        ax.figure.savefig(path, dpi=120)
        plt.close(ax.figure)
        outputs.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t, rs in per_trainer.items():
        ax.plot([int(r["outer_step"]) for r in rs], [float(r[metric]) for r in rs], marker="o", ms=3,
                label=f"trainer {t}")
    label = metric.removeprefix("val_")
    if metric == "val_perplexity":
        ax.set_yscale("log")
    finish(ax, f"Validation {label} (dotted: merges)", label, f"{metric}_per_trainer.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t, rs in per_trainer.items():
        rs = [r for r in rs if r["requested_batch"]]
        ax.step([int(r["outer_step"]) for r in rs], [int(r["requested_batch"]) for r in rs], where="post",
                label=f"trainer {t}")
    finish(ax, "Requested batch per node", "sequences", "requested_batch_per_trainer.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    alive: dict[int, int] = {}
    for r in rows:
        alive[int(r["outer_step"])] = int(r["trainers_alive"])
    ax.step(list(alive), list(alive.values()), where="post")
    finish(ax, "Trainers alive after each outer step", "trainers", "trainers_alive.png")
    return outputs
