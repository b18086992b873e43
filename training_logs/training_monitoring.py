"""Everything a run records: training_log.csv (one row per trainer per outer step), merge_events.csv,
step_loss_log.csv, the memory monitor, the trackers and the plots. CSV writes go through locks, so
concurrent callers never interleave.
"""

from __future__ import annotations

import csv
import threading
from pathlib import Path

from algorithms.traffic import Traffic
from training_logs.memory_monitor import MemoryMonitor
from training_logs.plots import plot_step_loss, plot_training
from training_logs.step_loss_logger import StepLossLogger
from training_logs.trackers import Tracker

COLUMNS = ["outer_step", "trainer_id", "nodes", "num_nodes", "requested_batch", "loader_batch",
           "accumulation_steps", "optimizer_steps", "tokens_seen", "global_tokens", "train_loss", "val_perplexity",
           "val_accuracy", "val_loss", "next_requested_batch", "T_k", "variance", "sum_sq_diffs", "inner_variance",
           "ortho_variance", "T_ip", "T_ortho", "grad_sq_norm", "rounds", "syncs", "bytes_communicated",
           "allreduce_bytes", "merge_bytes", "node_move_bytes", "node_moves", "wall_time", "trainers_alive"]
# metric_before: each member's metric (survivor first) right before the merge; metric_after: the merged model's
MERGE_COLUMNS = ["outer_step", "survivor", "merged", "weights", "requested_batches", "bytes", "metric",
                 "metric_before", "metric_weighted_before", "metric_after"]
TRAFFIC = tuple(Traffic().row())  # the traffic counters (algorithms/traffic.py), all in COLUMNS
TRACKED = ("val_perplexity", "val_accuracy", "val_loss", "train_loss", "requested_batch", "loader_batch",
           "accumulation_steps", "num_nodes", "tokens_seen")


class TrainingLogger:
    def __init__(self, report_dir: Path, tracker: Tracker, memory: MemoryMonitor, metric: str = "val_perplexity",
                 higher_is_better: bool = False) -> None:
        report_dir.mkdir(parents=True, exist_ok=True)
        self.report_dir, self.tracker, self.memory = report_dir, tracker, memory
        self.metric, self.higher_is_better = metric, higher_is_better
        self.csv_path = report_dir / "training_log.csv"
        self.merge_path = report_dir / "merge_events.csv"
        self.step_losses = StepLossLogger(report_dir / "step_loss_log.csv")
        self._lock = threading.Lock()
        for path, columns in ((self.csv_path, COLUMNS), (self.merge_path, MERGE_COLUMNS)):
            with path.open("w", newline="") as f:
                csv.writer(f).writerow(columns)
        self.merges = 0
        self.batch_increases = 0
        self.accumulation_used = False

    def _append(self, path: Path, columns: list[str], rows: list[dict]) -> None:
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            for row in rows:
                writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})

    def log_initial(self, metrics: dict[str, float], trainer_ids: list[int]) -> None:
        rows = [{"outer_step": 0, "trainer_id": t, **metrics, "tokens_seen": 0, "global_tokens": 0,
                 "optimizer_steps": 0, **Traffic().row(), "wall_time": 0.0,
                 "trainers_alive": len(trainer_ids)} for t in trainer_ids]
        with self._lock:
            self._append(self.csv_path, COLUMNS, rows)
        scalars = {f"trainer_{t}/{k}": v for t in trainer_ids for k, v in metrics.items()}
        scalars.update({f"global/{k}": v for k, v in metrics.items()})
        scalars["global/trainers_alive"] = float(len(trainer_ids))
        self.tracker.log(scalars, 0)

    def log_step_losses(self, rows: list[dict]) -> None:
        self.step_losses.log(rows)

    def log_step(self, rows: list[dict], merge_event: dict | None, trainers_alive: int) -> None:
        for row in rows:
            row["trainers_alive"] = trainers_alive
        with self._lock:
            self._append(self.csv_path, COLUMNS, rows)
            if merge_event:
                self._append(self.merge_path, MERGE_COLUMNS, [merge_event])
                self.merges += 1
            self.batch_increases += sum(r["next_requested_batch"] > r["requested_batch"] for r in rows)
            self.accumulation_used |= any(r["accumulation_steps"] > 1 for r in rows)
        step = rows[0]["outer_step"]
        scalars = {f"trainer_{r['trainer_id']}/{k}": float(r[k]) for r in rows for k in TRACKED if k in r}
        pick = max if self.higher_is_better else min
        alive = {r["trainer_id"]: r[self.metric] for r in rows}  # the models that exist after this step
        if merge_event:
            for merged in merge_event["merged"].split():
                alive.pop(int(merged), None)
            alive[merge_event["survivor"]] = merge_event["metric_after"]
            members = [float(v) for v in merge_event["metric_before"].split()]
            scalars.update({f"merge/{self.metric}_after": float(merge_event["metric_after"]),
                            f"merge/{self.metric}_best_member": pick(members),
                            f"merge/{self.metric}_weighted_members": float(merge_event["metric_weighted_before"])})
        scalars.update({
            f"global/{self.metric}": pick(alive.values()),
            "global/train_loss": sum(r["train_loss"] for r in rows) / len(rows),
            "global/trainers_alive": float(trainers_alive),
            "global/tokens_seen": float(rows[-1]["global_tokens"]),
            **{f"global/{k}": float(rows[-1].get(k, 0)) for k in TRAFFIC},
            "global/merges": float(self.merges),
        })
        self.tracker.log(scalars, step)

    def plot(self, step: int) -> list[Path]:
        with self._lock:
            paths = plot_training(self.csv_path, self.merge_path, self.report_dir, self.metric, self.higher_is_better)
        step_plot = plot_step_loss(self.step_losses.path, self.merge_path, self.report_dir / "step_loss.png")
        paths += [step_plot] if step_plot else []
        paths.append(self.memory.plot())
        for path in paths:
            self.tracker.log_image(path.stem, path, step)
        return paths

    def finish(self, summary: dict) -> None:
        """Final artifacts: the CSV files and the summary."""
        for path in (self.csv_path, self.merge_path, self.step_losses.path, self.memory.csv_path):
            self.tracker.log_artifact(path.name, path)
        self.tracker.log_artifact("summary", summary)

    def close(self) -> None:
        self.step_losses.close()
        self.tracker.close()
