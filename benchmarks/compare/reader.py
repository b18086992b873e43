"""Reading a finished run back: its curve of the best model alive, finals, merges and the shapes it ran."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from training_logs.plots import models_alive
from training_logs.records import MergeEvent, TrainerRow, read_records


def read_run(run_dir: Path) -> dict:
    """A finished run: its curve (one point per outer step, the models alive after that step's merge),
    the real final metric, the best metric seen, merge diagnostics and what batches it really ran."""
    report = run_dir / "model_training_report"
    rows = read_records(report / "training_log.csv", TrainerRow)
    merges = read_records(report / "merge_events.csv", MergeEvent)
    summary = json.loads((run_dir / "summary.json").read_text())
    metric = summary["metric"]
    pick = max if metric == "val_accuracy" else min
    merge_at = {m.outer_step: m for m in merges}
    by_step: dict[int, list[TrainerRow]] = {}
    for r in rows:
        by_step.setdefault(r.outer_step, []).append(r)
    curve = []
    for step in sorted(by_step):
        rs = by_step[step]
        # the merged model replaces its members from this point on (as the plots and the trackers read it)
        alive = models_alive({r.trainer_id: getattr(r, metric) for r in rs},
                             [dataclasses.asdict(merge_at[step])] if step in merge_at else [])
        last = rs[-1]
        # the run's own simulated clock: when this step's last trainer (or its merge) finished
        sim = [r.sim_time_s for r in rs if r.sim_time_s is not None]
        if step in merge_at and merge_at[step].sim_time_s is not None:
            sim.append(merge_at[step].sim_time_s)
        curve.append({"step": step, "metric": pick(alive.values()), "tokens": last.global_tokens or 0,
                      "rounds": last.rounds or 0, "syncs": last.syncs or 0, "bytes": last.bytes_communicated or 0,
                      "wall": last.wall_time or 0.0, "sim_time": max(sim, default=0.0)})
    trained = [r for r in rows if r.outer_step != 0]
    return {"run_dir": run_dir, "curve": curve, "summary": summary, "metric": metric, "final": summary["final_metric"],
            "best_seen": summary.get("best_metric_seen"), "ran": ran_shapes([dataclasses.asdict(r) for r in trained]),
            "merges": [{"before": [float(v) for v in m.metric_before.split()], "weighted": m.metric_weighted_before,
                        "after": m.metric_after} for m in merges],
            "requested_batches": sorted({r.requested_batch for r in trained}),
            "max_accumulation": max(r.accumulation_steps for r in trained),
            "grad_sq_norm": [r.grad_sq_norm for r in trained if r.grad_sq_norm is not None],
            "train_loss_first": trained[0].train_loss}


def ran_shapes(rows: list[dict]) -> str:
    """What a run really ran, loader batch x accumulation steps: one shape, or the smallest..largest by the
    batch they make (every trainer, every step; not the first and last rows)."""
    shapes = {(int(r["loader_batch"]) * int(r["accumulation_steps"]), int(r["accumulation_steps"]),
               f"{r['loader_batch']}x{r['accumulation_steps']}") for r in rows}
    low, high = min(shapes), max(shapes)
    return low[2] if low == high else f"{low[2]}..{high[2]}"


def value_at(curve: list[dict], axis: str, budget: float, log_scale: bool = True) -> tuple[float, bool]:
    """The metric at exactly `budget` on `axis`: interpolated between the last point at or under the budget
    and the next one (in log space for perplexity). (value, True) when the run reached the budget;
    (its last value, False) when it ended below it."""
    under = [p for p in curve if p[axis] <= budget]
    after = next((p for p in curve if p[axis] > budget), None)
    last = under[-1]
    if after is None or last[axis] == budget:
        return last["metric"], last[axis] >= budget
    frac = (budget - last[axis]) / (after[axis] - last[axis])
    if log_scale:
        return math.exp(math.log(last["metric"]) + frac * (math.log(after["metric"]) - math.log(last["metric"]))), True
    return last["metric"] + frac * (after["metric"] - last["metric"]), True


def first_reaching(curve: list[dict], target: float, key: str, higher_is_better: bool) -> float | None:
    for point in curve:
        if (point["metric"] >= target) if higher_is_better else (point["metric"] <= target):
            return point[key]
    return None
