"""Reading a finished run back: its curve of the best model alive, finals, merges and the shapes it ran."""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

import yaml

from run_dir.past import scored_synced_models
from run_dir.reader import RunFiles, report_file
from training_logs.alive import models_alive
from training_logs.records import InnerEval, MergeEvent, TrainerRow
from utils import run_plan
from utils.config import Config


def damage(run_dir: Path) -> str | None:
    """What keeps a finished run (one with a summary.json) from being read back, in words, or None: a summary.json
    that is not JSON or lacks its metric, a config.yaml that is not a valid config, a training_log.csv that is
    missing, truncated (a row shorter than its header) or holds a cell that is not a number."""
    from utils.errors import UserError

    run = RunFiles(run_dir)
    try:
        summary = run.summary()
    except (OSError, UnicodeDecodeError, ValueError):
        return "summary.json is not readable JSON"
    if not isinstance(summary, dict) or not {"metric", "final_metric"} <= summary.keys():
        return "summary.json lacks its metric or final_metric"
    try:
        run.config()
    except (UserError, OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        return f"config.yaml is not a valid config ({str(exc).splitlines()[0][:120]})"
    log, name = run.csv(TrainerRow), report_file(TrainerRow)
    try:
        with log.open(newline="") as f:
            lines = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error):
        return f"{name} is missing or unreadable"
    if len(lines) < 2 or any(len(line) != len(lines[0]) for line in lines[1:]):
        return f"{name} is truncated (no rows, or a row shorter than its header)"
    try:
        run.records(TrainerRow)
    except (ValueError, TypeError):
        return f"{name} holds a cell that is not a number"
    return None


def read_run(run_dir: Path, reprice_on: Config | None = None) -> dict:
    """A finished run: its curve (one point per outer step, the models alive after that step's merge),
    the real final metric, the best metric seen, merge diagnostics and what batches it really ran.
    reprice_on: a config that differs from the run's only in what the clock reads: its sim_time and clock figures
    are those of that config's clock (repriced)."""
    run = RunFiles(run_dir)
    rows, merges, summary = run.records(TrainerRow), run.records(MergeEvent), run.summary()
    metric = summary["metric"]
    pick = max if metric == "val_accuracy" else min
    merge_at = {m.outer_step: m for m in merges}
    cfg = run.config()  # through run_dir's migration, as the run itself reads it
    decides = run_plan.batch_test_of(cfg).uses_statistics  # whether its batch test decides with the statistics
    inner_steps = cfg.num_inner_steps
    by_step: dict[int, list[TrainerRow]] = {}
    for r in rows:
        by_step.setdefault(r.outer_step, []).append(r)
    curve = []
    for step in sorted(by_step):
        rs = by_step[step]
        # the merged model replaces its members from this point on (as the plots and the trackers read it)
        alive = models_alive({r.trainer_id: getattr(r, metric) for r in rs},
                             [dataclasses.asdict(merge_at[step])] if step in merge_at else [])
        best = pick(alive, key=alive.get)
        batch = next((r.requested_batch for r in rs if r.trainer_id == best), rs[-1].requested_batch)
        last = rs[-1]
        # the run's own simulated clock: when this step's last trainer (or its merge) finished
        sim = [r.sim_time_s for r in rs if r.sim_time_s is not None]
        if step in merge_at and merge_at[step].sim_time_s is not None:
            sim.append(merge_at[step].sim_time_s)
        curve.append({"step": step, "metric": alive[best], "tokens": last.global_tokens or 0,
                      "steps": step * inner_steps,  # optimizer steps in sequence (each node's, every round)
                      "batch": batch,  # the requested batch of the best model alive
                      "rounds": last.rounds or 0, "syncs": last.syncs or 0, "bytes": total_traffic_bytes(last, decides),
                      "weights_bytes": last.weights_traffic_bytes or 0,
                      "statistics_bytes": total_traffic_bytes(last, decides) - (last.weights_traffic_bytes or 0),
                      "logged_statistics_bytes": logged_statistics(last, decides),
                      "wall": last.wall_time or 0.0, "sim_time": max(sim, default=0.0)})
    trained = [r for r in rows if r.outer_step != 0]
    if reprice_on is not None:
        summary = repriced(run_dir, summary, curve, reprice_on)
    evaluations = run.records_if_any(InnerEval)
    return {"run_dir": run_dir, "curve": curve, "fine_curve": fine_curve(curve, evaluations, metric, inner_steps),
            "evaluated_every": min((e.inner_step for e in evaluations), default=inner_steps),
            "synced_mid_round": scored_synced_models(evaluations),  # older runs: the first node's (run_dir/past.py)
            "summary": summary, "metric": metric, "final": summary["final_metric"],
            "best_seen": summary.get("best_metric_seen"), "ran": ran_shapes([dataclasses.asdict(r) for r in trained]),
            "merges": [{"before": [float(v) for v in m.metric_before.split()], "weighted": m.metric_weighted_before,
                        "after": m.metric_after} for m in merges],
            "requested_batches": sorted({r.requested_batch for r in trained}),
            "max_accumulation": max(r.accumulation_steps for r in trained),
            "grad_sq_norm": [r.grad_sq_norm for r in trained if r.grad_sq_norm is not None],
            "train_loss_first": trained[0].train_loss}


def fine_curve(curve: list[dict], evaluations: list[InnerEval], metric: str, inner_steps: int) -> list[dict]:
    """The curve with the mid-round evaluations (eval_every_inner_steps) between its outer steps: at inner step j
    of outer step s, the best trainer's synced-model metric (older runs: its first node's), at steps (s - 1) H + j
    and the tokens seen by then; the simulated time interpolated by j / H; the counters (rounds, syncs, bytes) those
    of the step before. Steps and time to a target read it, at the evaluations' granularity; without evaluations it
    is the curve."""
    if not evaluations:
        return curve
    pick = max if metric == "val_accuracy" else min
    at: dict[tuple[int, int], list[InnerEval]] = {}
    for e in evaluations:
        at.setdefault((e.outer_step, e.inner_step), []).append(e)
    by_step = {p["step"]: p for p in curve}
    points = list(curve)
    for (step, j), rows in at.items():
        before, after = by_step.get(step - 1), by_step.get(step)
        if before is None or after is None:
            continue  # a step with no end-of-round row (a failed step): its evaluations are not placed
        share = j / inner_steps
        points.append({**before, "step": step - 1 + share, "metric": pick(getattr(r, metric) for r in rows),
                       "tokens": max(r.global_tokens for r in rows), "steps": (step - 1) * inner_steps + j,
                       "sim_time": before["sim_time"] + share * (after["sim_time"] - before["sim_time"])})
    return sorted(points, key=lambda p: p["step"])


def total_traffic_bytes(row: TrainerRow, decides: bool) -> int:
    """The traffic the method needs for its own decisions: weights, and its batch test's statistics when it decides
    with them (rows before 2026-11-24 have no total_traffic_bytes and counted statistics for the log in
    statistics_bytes)."""
    if row.total_traffic_bytes is not None:
        return row.total_traffic_bytes
    return (row.weights_traffic_bytes or 0) + ((row.statistics_bytes or 0) if decides else 0)


def logged_statistics(row: TrainerRow, decides: bool) -> int:
    """Statistics sent for the log only: charged to no method."""
    if row.logged_statistics_bytes is not None:
        return row.logged_statistics_bytes
    return 0 if decides else (row.statistics_bytes or 0)


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
    """`key` (steps, tokens, time, ...) at the first point that reaches the target; None if none does within the
    token budget (a point marked past_budget, by within_budget, never counts: a run that reaches a target only
    after its budget has not reached it)."""
    for point in curve:
        if point.get("past_budget"):
            return None
        if (point["metric"] >= target) if higher_is_better else (point["metric"] <= target):
            return point[key]
    return None


def last_within_budget(curve: list[dict]) -> dict:
    """The curve's last point within the token budget (its first, if even that one lies past it)."""
    inside = [p for p in curve if not p.get("past_budget")]
    return inside[-1] if inside else curve[0]


def within_budget(run: dict, budget: float) -> dict:
    """Mark the points of a run's curves that lie past the token budget (the last outer step may overshoot it):
    steps, tokens and time to a target stop counting there."""
    for curve in (run["curve"], run["fine_curve"]):
        for point in curve:
            point["past_budget"] = bool(budget) and point["tokens"] > budget
    return run


def repriced(run_dir: Path, summary: dict, curve: list[dict], cfg: Config) -> dict:
    """The run's rounds replayed through the clock `cfg` describes (benchmarks/replay.py: the same clock the run
    drove live, fed from its logs): the curve's sim_time in place, and the summary's clock figures."""
    from algorithms.clock import ThroughputCurve
    from algorithms.network import describe, parse_network
    from benchmarks import replay

    rounds, weight_bytes, _ = replay.read_rounds(run_dir)  # what the run's live clock charged
    throughput = ThroughputCurve.flat(cfg.node_tokens_per_s) if cfg.throughput == "flat" else \
        ThroughputCurve.load(cfg.throughput)
    clock, times = replay.replay(rounds, parse_network(cfg.network), throughput, weight_bytes, cfg.node_speeds)
    for point in curve:
        point["sim_time"] = times.get(point["step"], point["sim_time"])
    return {**summary, "sim_time_s": clock.now, **clock.counters(), "busy_node_seconds": sum(clock.busy),
            "idle_node_seconds": clock.idle(), "sim_time_to_target_s": None, "target_metric": cfg.target_metric or None,
            "repriced": True, "clock": {"network": describe(clock.network), "throughput": throughput.source,
                                        "node_speeds": cfg.node_speeds}}
