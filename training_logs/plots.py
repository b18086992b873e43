"""PNG plots of a run, drawn from its CSV files (so they can be redrawn at any time).

training_log.csv -> validation metric per trainer against outer step (the best model alive after each
step drawn bold) and against each trainer's own tokens; the best model alive against rounds, syncs and
bytes (the cluster's communication); requested batch per trainer, trainers alive, node assignment over
time. step_loss_log.csv -> loss per trainer. Merges are drawn dotted.

"Alive after a step" is what exists once the step's merges are done: training_log.csv scores each trainer
before the merge, so at a merge step the absorbed trainers are dropped and the survivor is scored by the
merged model (merge_events.csv's metric_after), as metrics.jsonl and the trackers report it.
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter  # noqa: E402
from matplotlib.transforms import offset_copy  # noqa: E402

from run_dir.past import value_of  # noqa: E402
from training_logs.alive import best_alive  # noqa: E402


def _read(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _integer_steps(ax) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # outer steps: no 0.5, 1.5


def readable_y(ax, values: list[float]) -> None:
    """Perplexity: a log axis when it spans a decade or more, labelled at 1-2-3-5 steps (so a final value of
    a few hundred can be read); a linear axis otherwise."""
    finite = [v for v in values if v == v and 0 < v < float("inf")]
    if not finite or max(finite) / min(finite) < 10:
        return
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _save(ax, path: Path, merges: list[float], xlabel: str, ylabel: str, title: str) -> Path:
    """merges: x positions of the merges, drawn dotted (and named in the title only when there are some)."""
    for x in merges:
        ax.axvline(x, color="grey", ls=":", lw=1)
    ax.set(title=title + (" (dotted: merges)" if merges else ""), xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    plt.close(ax.figure)
    return path


@dataclasses.dataclass
class _Run:
    """What every figure of plot_training reads: a run's rows, its merges and its best model alive per step."""
    rows: list[dict[str, str]]
    merge_rows: list[dict[str, str]]
    metric: str
    higher_is_better: bool
    out_dir: Path

    def __post_init__(self) -> None:
        self.merge_steps = [int(m["outer_step"]) for m in self.merge_rows]
        self.per_trainer: dict[str, list[dict[str, str]]] = {}
        for r in self.rows:
            self.per_trainer.setdefault(r["trainer_id"], []).append(r)
        self.label = self.metric.removeprefix("val_")
        self.values = [float(r[self.metric]) for r in self.rows]
        self.log_y = self.metric == "val_perplexity"
        # the best model alive after every step: what a user would keep at that point (the cluster's model)
        self.best = best_alive(self.rows, self.merge_rows, self.metric, self.higher_is_better)
        self.steps = sorted(self.best)


def plot_training(csv_path: Path, merge_path: Path, out_dir: Path, metric: str = "val_perplexity",
                  higher_is_better: bool = False) -> list[Path]:
    run = _Run([r for r in _read(csv_path) if r.get(metric)], _read(merge_path), metric, higher_is_better, out_dir)
    outputs = [*_plot_metric_per_trainer(run), _plot_communication(run), *_plot_sim_time(run), *_plot_batches(run),
               *_plot_node_assignment(run)]
    return outputs


def _plot_metric_per_trainer(run: _Run) -> list[Path]:
    """Each trainer against outer steps, and against the tokens it has trained on itself."""
    metric, rows, best, steps, outputs = run.metric, run.rows, run.best, run.steps, []
    for x_key, x_label, name in (("outer_step", "outer step", f"{metric}_per_trainer.png"),
                                 ("tokens_seen", "tokens seen by the trainer (its merged members' included)",
                                  f"{metric}_vs_tokens.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for t, rs in run.per_trainer.items():
            ax.plot([float(r[x_key] or 0) for r in rs], [float(r[metric]) for r in rs], marker="o", ms=3, lw=1,
                    alpha=0.7, label=f"trainer {t}")
        marks: list[float] = []
        if x_key == "outer_step":
            ax.plot(steps, [best[s][1] for s in steps], color="black", lw=2, label="best model alive")
            _integer_steps(ax)
            marks = run.merge_steps
        else:  # a merge happens at a different token count for each trainer: the merged model is marked at
            # its members' tokens together (where the survivor's curve goes on from)
            tokens = {(r["outer_step"], r["trainer_id"]): float(r["tokens_seen"] or 0) for r in rows}
            merged = [(sum(tokens.get((m["outer_step"], t), 0.0) for t in (m["survivor"], *m["merged"].split())),
                       float(m["metric_after"])) for m in run.merge_rows if m.get("metric_after")]
            if merged:
                ax.scatter(*zip(*merged), marker="x", s=60, color="black", zorder=3, label="merged model")
        if run.log_y:
            readable_y(ax, run.values)
        title = f"Validation {run.label}" + (" per trainer" if x_key == "outer_step" else ": each trainer's own tokens")
        outputs.append(_save(ax, run.out_dir / name, marks, x_label, run.label, title))
    return outputs


def _counter(row: dict, key: str) -> float:
    """A traffic counter of a training_log.csv row, under its old name in an older file (rows before 2026-11-24
    have no total: their weights' traffic stands in)."""
    value = value_of(row, key)
    if value in (None, "") and key == "total_traffic_bytes":
        value = value_of(row, "weights_traffic_bytes")
    return float(value or 0)


def _plot_communication(run: _Run) -> Path:
    """The cluster's model against what the cluster spent on communication (#7's counters)."""
    best, steps = run.best, run.steps
    counters = [("rounds", "rounds (outer steps)", 1.0), ("syncs", "syncs (cross-node all-reduces + merges)", 1.0),
                ("total_traffic_bytes", "MB communicated (weights + batch-test statistics)", 1e6)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), sharey=True)
    for ax, (key, x_label, scale) in zip(axes, counters):
        xs = [_counter(best[s][0], key) / scale for s in steps]
        ax.plot(xs, [best[s][1] for s in steps], color="black", lw=2, marker="o", ms=3)
        for step in run.merge_steps:
            if step in best:
                ax.axvline(_counter(best[step][0], key) / scale, color="grey", ls=":", lw=1)
        ax.set(xlabel=x_label)
        ax.grid(alpha=0.3)
        if run.log_y:
            readable_y(ax, run.values)
    axes[0].set_ylabel(f"{run.label} of the best model alive")
    fig.suptitle(f"Validation {run.label} against communication" + (" (dotted: merges)" if run.merge_steps else ""))
    fig.tight_layout()
    path = run.out_dir / f"{run.metric}_vs_communication.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_sim_time(run: _Run) -> list[Path]:
    """The simulated clock (docs/clock.md): each trainer on its own time, the cluster's utilisation."""
    metric, label = run.metric, run.label
    timed = [r for r in run.rows if r.get("sim_time_s")]
    if not timed:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for t, rs in run.per_trainer.items():
        rs = [r for r in rs if r.get("sim_time_s")]
        axes[0].plot([float(r["sim_time_s"]) for r in rs], [float(r[metric]) for r in rs], marker="o", ms=3,
                     lw=1, alpha=0.7, label=f"trainer {t}")
    merges = [m for m in run.merge_rows if m.get("sim_time_s")]
    if merges:
        axes[0].scatter([float(m["sim_time_s"]) for m in merges], [float(m["metric_after"]) for m in merges],
                        marker="x", s=60, color="black", zorder=3, label="merged model")
    if run.log_y:
        readable_y(axes[0], run.values)
    axes[0].set(xlabel="simulated time (s)", ylabel=label, title=f"Validation {label} on the simulated clock")
    axes[0].legend(fontsize=7)
    cluster: dict[int, tuple[float, float]] = {}  # step -> (its last trainer's end, utilisation after it)
    for r in timed:
        step = int(r["outer_step"])
        cluster[step] = (max(cluster.get(step, (0.0, 0.0))[0], float(r["sim_time_s"])), float(r["utilisation"]))
    axes[1].plot([cluster[k][0] for k in sorted(cluster)], [cluster[k][1] for k in sorted(cluster)], color="black")
    axes[1].set(xlabel="simulated time (s)", ylabel="busy / available node-seconds", ylim=(0, 1.05),
                title="Cluster utilisation so far")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = run.out_dir / f"{metric}_vs_sim_time.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def _plot_batches(run: _Run) -> list[Path]:
    """Requested batch per trainer, and trainers alive."""
    # equal batches would hide each other: each trainer's line is shifted a little and has its own marker
    fig, ax = plt.subplots(figsize=(7, 4.5))
    per_trainer = run.per_trainer
    for i, (t, rs) in enumerate(per_trainer.items()):
        rs = [r for r in rs if r["requested_batch"]]
        shift = offset_copy(ax.transData, fig=fig, y=1.5 * (i - (len(per_trainer) - 1) / 2), units="points")
        xs, ys = [int(r["outer_step"]) for r in rs], [int(r["requested_batch"]) for r in rs]
        ax.step(xs, ys, where="post", marker="os^vD<>ph*"[i % 10], ms=4, transform=shift, label=f"trainer {t}")
        ax.update_datalim(list(zip(xs, ys)))  # a shifted transform is not autoscaled by itself
    ax.autoscale_view()
    _integer_steps(ax)
    outputs = [_save(ax, run.out_dir / "requested_batch_per_trainer.png", run.merge_steps, "outer step",
                     "sequences (lines shifted apart slightly)", "Requested batch per trainer")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    alive = {int(r["outer_step"]): int(r["trainers_alive"]) for r in run.rows if r.get("trainers_alive")}
    ax.step(list(alive), list(alive.values()), where="post")
    _integer_steps(ax)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    outputs.append(_save(ax, run.out_dir / "trainers_alive.png", run.merge_steps, "outer step", "trainers",
                         "Trainers alive after each outer step"))
    return outputs


def _plot_node_assignment(run: _Run) -> list[Path]:
    """Which trainer each node served in each round."""
    assigned = [(int(r["outer_step"]), int(n), int(r["trainer_id"])) for r in run.rows if r.get("nodes")
                for n in r["nodes"].split()]
    if not assigned:
        return []
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
    _integer_steps(ax)
    return [_save(ax, run.out_dir / "node_assignment.png", [], "outer step", "node", "Node assignment")]


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
    _integer_steps(ax)
    return _save(ax, out_path, merges, "outer step", "training loss (mean over the trainer's nodes)",
                 "Inner-step training loss")


def plot_memory(rows: list[dict], cuda_devices: list[str], out_path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for stage in ("before_round", "round_peak", "after_outer_step", "after_merge"):
        points = [(r["outer_step"], r["process_rss_mib"]) for r in rows if r["stage"] == stage]
        if points:
            ax.plot(*zip(*points), marker="o", ms=3, label=f"process RSS, {stage}")
    for d in cuda_devices:
        points = [(r["outer_step"], r[f"{d}_peak_mib"]) for r in rows if r["stage"] == "round_peak"]
        ax.plot(*zip(*points), ls="--", label=f"{d} peak allocated")
    _integer_steps(ax)
    ax.set(title="Memory by stage", xlabel="outer step", ylabel="MiB")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # beside the plot, never over the peak
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path
