"""The clock adapter: the one place the simulated clock (algorithms/clock.py) is fed. It observes the rounds
and merges and never changes their numbers (docs/clock.md)."""

from __future__ import annotations

import math

from algorithms.clock import Clock, NodeSchedule, NodeWork, TrainerWork
from algorithms.network import describe
from algorithms.traffic import SyncCost
from node import NodeJob
from utils.config import Config


class ClockFeed:
    def __init__(self, clock: Clock, schedule: NodeSchedule, cfg: Config, higher_is_better: bool) -> None:
        self.clock, self.schedule = clock, schedule
        self.node_speeds, self.num_inner_steps = cfg.node_speeds, cfg.num_inner_steps
        self.by_speed = cfg.inner_steps_by_speed  # each node's inner steps in proportion to its throughput
        self.target_metric, self.higher_is_better = cfg.target_metric, higher_is_better
        self.round_work: dict[int, list[NodeWork]] = {}  # this round's work per trainer
        self.time_to_target: float | None = None  # target_metric: when a trainer first reached it

    def inner_steps(self, node_ids: list[int], shapes: dict[int, tuple[int, int]],
                    slowdown: dict[int, float]) -> dict[int, int]:
        """num_inner_steps for every node, or (inner_steps_by_speed) in proportion to its throughput this round,
        the trainer's fastest node taking num_inner_steps."""
        steps = self.num_inner_steps
        if not self.by_speed:
            return {n: steps for n in node_ids}
        rates = {n: self.clock.rate(n, *shapes[n], slowdown.get(n, 1.0)) for n in node_ids}
        fastest = max(rates.values())
        return {n: max(1, round(steps * rates[n] / fastest)) for n in node_ids}

    def work(self, trainer_id: int, work: NodeWork) -> None:
        """A node's work this round (tokens, shape, a state it received first)."""
        self.round_work.setdefault(trainer_id, []).append(work)

    def round(self, outer_step: int, jobs: list[NodeJob], costs: dict[int, SyncCost]
              ) -> tuple[dict[int, dict], list[dict]]:
        """The round on the clock: each trainer's (end, slowest compute, idle node-seconds), and the node rows.
        costs: what each trainer's collectives sent (CommPlan.sync_cost), as the traffic counters count them."""
        trainer_ids = sorted({j.trainer_id for j in jobs})
        inner_steps = {j.node_id: j.sample_indices.shape[0] for j in jobs}
        slowdown = self.schedule.slowdown(outer_step)
        times = self.clock.round([TrainerWork(t, self.round_work[t], costs[t])
                                  for t in trainer_ids], slowdown)
        work = {w.node_id: w for t in trainer_ids for w in self.round_work[t]}
        node_rows = [
            {"outer_step": outer_step, "node_id": n.node_id, "trainer_id": t, "speed": self.node_speeds[n.node_id],
             "slowdown": slowdown.get(n.node_id, 1.0), "inner_steps": inner_steps[n.node_id],
             "micro_batch": work[n.node_id].micro_batch, "accumulation_steps": work[n.node_id].accumulation,
             "tokens": int(work[n.node_id].tokens), "start_s": n.start, "compute_s": n.compute, "idle_s": n.idle,
             "end_s": n.end} for t in sorted(times) for n in times[t]]
        return {t: {"sim_time_s": self.clock.ready[t], "sim_compute_s": max(n.compute for n in times[t]),
                    "sim_idle_s": sum(n.idle for n in times[t])} for t in times}, node_rows

    def merge(self, survivor: int, members: list[int], payloads: list[int]) -> float:
        """A merge on the clock: when the merged model is ready."""
        return self.clock.merge(survivor, members, payloads)

    def reached(self, value: float, when: float) -> None:
        """target_metric: the first simulated time a model reached it."""
        target = self.target_metric
        if not target or self.time_to_target is not None or not math.isfinite(value):
            return
        if (value >= target) if self.higher_is_better else (value <= target):
            self.time_to_target = when

    def row(self) -> dict:
        return {"utilisation": self.clock.utilisation(), "goodput_tokens_per_s": self.clock.goodput()}

    def state_dict(self) -> dict:
        return {**self.clock.state_dict(), "curve": [list(p) for p in self.clock.curve.points],
                "curve_source": self.clock.curve.source, "time_to_target": self.time_to_target}

    def load_state_dict(self, state: dict | None) -> None:
        if state:  # checkpoints from before the clock start it at their outer step
            self.clock.load_state_dict(state)
            self.time_to_target = state["time_to_target"]

    def summary(self) -> dict:
        return {"sim_time_s": self.clock.now, "sim_time_to_target_s": self.time_to_target,
                "target_metric": self.target_metric or None, **self.row(),
                "busy_node_seconds": sum(self.clock.busy), "idle_node_seconds": self.clock.idle(),
                "clock": {"network": describe(self.clock.network), "throughput": self.clock.curve.source,
                          "node_speeds": self.node_speeds}}
