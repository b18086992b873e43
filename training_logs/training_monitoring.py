"""Metrics of the run: training_log.csv (one row per trainer per outer step), merge_events.csv,
the trackers, and the plots. All writes go through one lock, so concurrent callers never interleave.
"""

from __future__ import annotations

import csv
import threading
from pathlib import Path

from training_logs.plots import plot_training
from training_logs.trackers import Tracker

COLUMNS = ["outer_step", "trainer_id", "nodes", "num_nodes", "requested_batch", "loader_batch",
           "accumulation_steps", "optimizer_steps", "tokens_seen", "train_loss", "val_perplexity", "val_accuracy",
           "val_loss",
           "next_requested_batch", "T_k", "variance", "sum_sq_diffs", "inner_variance", "ortho_variance", "T_ip",
           "T_ortho", "grad_sq_norm", "communications", "bytes_communicated", "wall_time", "trainers_alive"]
MERGE_COLUMNS = ["outer_step", "survivor", "merged", "weights", "requested_batches", "bytes"]


class TrainingLogger:
    def __init__(self, report_dir: Path, tracker: Tracker, metric: str = "val_perplexity",
                 higher_is_better: bool = False) -> None:
        report_dir.mkdir(parents=True, exist_ok=True)
        self.report_dir, self.tracker = report_dir, tracker
        self.metric, self.higher_is_better = metric, higher_is_better
        self.csv_path = report_dir / "training_log.csv"
        self.merge_path = report_dir / "merge_events.csv"
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
        rows = [{"outer_step": 0, "trainer_id": t, **metrics, "tokens_seen": 0,
                 "optimizer_steps": 0, "communications": 0, "bytes_communicated": 0, "wall_time": 0.0,
                 "trainers_alive": len(trainer_ids)} for t in trainer_ids]
        with self._lock:
            self._append(self.csv_path, COLUMNS, rows)
        self.tracker.log({**{f"global/{k}": v for k, v in metrics.items()},
                          "global/trainers_alive": float(len(trainer_ids))}, 0)

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
        metrics: dict[str, float] = {}
        for r in rows:
            for key in ("val_perplexity", "val_accuracy", "val_loss", "train_loss", "requested_batch", "loader_batch",
                        "accumulation_steps", "num_nodes", "tokens_seen"):
                if key in r:
                    metrics[f"trainer_{r['trainer_id']}/{key}"] = float(r[key])
        metrics.update({
            f"global/{self.metric}": (max if self.higher_is_better else min)(r[self.metric] for r in rows),
            "global/trainers_alive": float(trainers_alive),
            "global/tokens_seen": float(sum(r["tokens_seen"] for r in rows)),
            "global/communications": float(rows[-1]["communications"] + (1 if merge_event else 0)),
            "global/bytes_communicated": float(rows[-1]["bytes_communicated"] + (merge_event or {}).get("bytes", 0)),
        })
        self.tracker.log(metrics, step)

    def plot(self) -> list[Path]:
        with self._lock:
            return plot_training(self.csv_path, self.merge_path, self.report_dir, self.metric)

    def close(self) -> None:
        self.tracker.close()
