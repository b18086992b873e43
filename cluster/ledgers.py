"""The ledgers: what the run counts after each step, read from the step's record in one place. The simulated clock
(algorithms/clock.py, docs/clock.md), the traffic counters (algorithms/traffic.py), the best metric seen and the time
to the target observe the rounds and merges the round driver records; they never change a decision."""

from __future__ import annotations

import math

from algorithms.clock import Clock, TrainerWork
from algorithms.network import describe
from cluster.state import ClusterState
from utils.config import Config


class Ledgers:
    def __init__(self, clock: Clock, state: ClusterState, cfg: Config, higher_is_better: bool,
                 param_bytes: int) -> None:
        self.clock, self.state, self.param_bytes = clock, state, param_bytes
        self.node_speeds = cfg.node_speeds
        self.target_metric, self.higher_is_better = cfg.target_metric, higher_is_better
        self.time_to_target: float | None = None  # target_metric: when a trainer first reached it

    def count(self, record) -> None:
        """A finished outer step (cluster/round_driver.py RoundRecord), in one place: its round, its merge, then the
        counters after both, which every trainer row of the step carries (the cluster's, the same in every row)."""
        self._round(record)
        if record.merge is not None:
            self._merge(record.merge)
        counters = {**self.state.traffic.row(), **self.clock.counters()}
        for row in record.rows:
            row.update(counters)
        record.counted = True

    def _round(self, record) -> None:
        """A round: its node moves and collectives counted, its round on the clock (node_clock.csv's rows, each
        trainer row's sim_time_s, sim_compute_s, sim_idle_s), its evaluations seen."""
        # the traffic counters the state checkpoints (counted once the step is whole: a rollback never undoes them)
        self.state.traffic.round([node.receives_bytes for work in record.work.values() for node in work
                                  if node.receives_bytes], record.synced, record.costs, self.param_bytes)
        times = self.clock.round([TrainerWork(t, record.work[t], record.costs[t]) for t in sorted(record.work)],
                                 record.slowdown)
        work = {w.node_id: w for nodes in record.work.values() for w in nodes}
        record.node_times = [
            {"outer_step": record.outer_step, "node_id": n.node_id, "trainer_id": t,
             "speed": self.node_speeds[n.node_id], "slowdown": record.slowdown.get(n.node_id, 1.0),
             "inner_steps": record.inner_steps[n.node_id], "micro_batch": work[n.node_id].micro_batch,
             "accumulation_steps": work[n.node_id].accumulation, "tokens": int(work[n.node_id].tokens),
             "received_bytes": work[n.node_id].receives_bytes, "start_s": n.start, "compute_s": n.compute,
             "idle_s": n.idle, "end_s": n.end} for t in sorted(times) for n in times[t]]
        ends = {t: {"sim_time_s": self.clock.ready[t], "sim_compute_s": max(n.compute for n in times[t]),
                    "sim_idle_s": sum(n.idle for n in times[t])} for t in times}
        for row in record.rows:
            row.update(ends[row["trainer_id"]])
        for t, value in sorted(record.scores.items()):
            self._seen(value, ends[t]["sim_time_s"])

    def _merge(self, record) -> None:
        """A merge (cluster/round_driver.py MergeRecord): its payloads counted and on the clock, its result seen;
        merge_events.csv's sim_time_s: when the merged model is ready."""
        self.state.traffic.merge(sum(record.payloads))
        ready = self.clock.merge(record.survivor, record.members, record.payloads)
        self._seen(record.metric_after, ready)
        record.event["sim_time_s"] = ready

    def _seen(self, value: float, when: float) -> None:
        """The best metric of any model evaluated (kept in the state, which checkpoints it), and (target_metric) the
        first simulated time a model reached it."""
        best = self.state.best_seen
        if math.isfinite(value) and (best is None or (value > best) == self.higher_is_better):
            self.state.best_seen = value
        target = self.target_metric
        if not target or self.time_to_target is not None or not math.isfinite(value):
            return
        if (value >= target) if self.higher_is_better else (value <= target):
            self.time_to_target = when

    def state_dict(self) -> dict:
        return {**self.clock.state_dict(), "curve": [list(p) for p in self.clock.curve.points],
                "curve_source": self.clock.curve.source, "time_to_target": self.time_to_target}

    def load_state_dict(self, state: dict | None) -> None:
        if state:  # checkpoints from before the clock start it at their outer step
            self.clock.load_state_dict(state)
            self.time_to_target = state["time_to_target"]

    def summary(self) -> dict:
        return {"sim_time_s": self.clock.now, "sim_time_to_target_s": self.time_to_target,
                "target_metric": self.target_metric or None, **self.clock.counters(),
                "busy_node_seconds": sum(self.clock.busy), "idle_node_seconds": self.clock.idle(),
                "clock": {"network": describe(self.clock.network), "throughput": self.clock.curve.source,
                          "node_speeds": self.node_speeds}}
