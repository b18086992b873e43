"""Everything a run records: the console and the run's log (`setup_logging`; a step's console line is written with
its rows), training_log.csv (one row per trainer per outer step), merge_events.csv, step_loss_log.csv,
fault_events.csv, node_clock.csv (the simulated clock, one row per node per outer step), the memory monitor, the
trackers and the plots. A step is logged in one call (`log_step`). CSV writes go through locks, so concurrent callers
never interleave.

On a resume (resume_step = the checkpoint's outer step) every file keeps its rows up to that step and
new rows are appended: rows written after the checkpoint by the interrupted run are dropped, so the
files read as if the run had never stopped.
"""

from __future__ import annotations

import csv
import logging
import sys
import threading
from pathlib import Path

from tqdm import tqdm

from algorithms.traffic import Traffic
from training_logs.alive import models_alive
from training_logs.csv_files import start_csv
from training_logs.memory_monitor import MemoryMonitor
from training_logs.records import CSV_FILES, FaultEvent, InnerEval, MergeEvent, NodeTime, StepLoss, TrainerRow, columns
from training_logs.trackers import Tracker

log = logging.getLogger(__name__)
# the files' columns: the fields of their records (training_logs/records.py)
COLUMNS = columns(TrainerRow)
MERGE_COLUMNS = columns(MergeEvent)
NODE_COLUMNS = columns(NodeTime)
INNER_EVAL_COLUMNS = columns(InnerEval)
FAULT_COLUMNS = columns(FaultEvent)
STEP_LOSS_COLUMNS = columns(StepLoss)
TRAFFIC = tuple(Traffic().row())  # the traffic counters (algorithms/traffic.py), all in COLUMNS
TRACKED = ("val_perplexity", "val_accuracy", "val_loss", "train_loss", "requested_batch", "loader_batch",
           "accumulation_steps", "num_nodes", "tokens_seen", "sim_time_s", "sim_idle_s")


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    parts, start = [], steps[0]
    for prev, cur in zip(steps, [*steps[1:], None]):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


class _TqdmHandler(logging.StreamHandler):
    """Console lines that do not break the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:  # pragma: no cover - logging must never crash training
            self.handleError(record)


def setup_logging(log_file: Path | None) -> None:
    """The console (lines that keep the progress bar whole) and, when given, the run's log file."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.INFO)
    console = _TqdmHandler()
    console.setFormatter(logging.Formatter("%(message)s"))
    # records with extra={"file_only": True}: the run's log keeps them; the console gets them from main()
    console.addFilter(lambda record: not getattr(record, "file_only", False))
    root.addHandler(console)
    if log_file is not None:
        file_handler = logging.FileHandler(log_file, encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(file_handler)
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class TrainingLogger:
    def __init__(self, report_dir: Path, tracker: Tracker, memory: MemoryMonitor, metric: str = "val_perplexity",
                 higher_is_better: bool = False, resume_step: int | None = None, num_outer_steps: int = 0) -> None:
        report_dir.mkdir(parents=True, exist_ok=True)
        self.report_dir, self.tracker, self.memory = report_dir, tracker, memory
        self.metric, self.higher_is_better = metric, higher_is_better
        self.num_outer_steps = num_outer_steps  # the console line's "[outer 2/12]" (0: "[outer 2]")
        self.csv_path = report_dir / CSV_FILES[TrainerRow]
        self.merge_path = report_dir / CSV_FILES[MergeEvent]
        self.fault_path = report_dir / CSV_FILES[FaultEvent]
        self.node_path = report_dir / CSV_FILES[NodeTime]
        self.inner_eval_path = report_dir / CSV_FILES[InnerEval]
        self._lock = threading.Lock()
        for path, header in ((self.csv_path, COLUMNS), (self.merge_path, MERGE_COLUMNS)):
            problem = start_csv(path, header, resume_step)
            if problem is None and path == self.csv_path and resume_step:
                steps = {row["outer_step"] for row in csv.DictReader(path.open(newline=""))}
                missing = [k for k in range(1, resume_step + 1) if str(k) not in steps]
                if missing:
                    problem = f"has no rows for outer steps {_ranges(missing)}"
            if problem:
                log.warning("resume: %s %s: the rows of outer steps 1-%d are lost, so this log and its plots "
                            "disagree with summary.json, which counts the whole run", path, problem, resume_step)
        # a fault that stopped the run is why it was resumed: its record stays
        start_csv(self.fault_path, FAULT_COLUMNS, resume_step, lambda row: row[FAULT_COLUMNS.index("action")] == "stop")
        start_csv(self.node_path, NODE_COLUMNS, resume_step)
        start_csv(self.inner_eval_path, INNER_EVAL_COLUMNS, resume_step)
        self.step_loss_path = report_dir / CSV_FILES[StepLoss]
        start_csv(self.step_loss_path, STEP_LOSS_COLUMNS, resume_step)
        self.merges = 0
        self.batch_increases = 0
        self.accumulation_used = False
        self.faults = 0
        self.capped_requests = 0  # batch-test decisions that max_requested_batch cut down
        self.largest_capped_request = 0
        self._cap_reported: set = set()

    def counters(self) -> dict:
        return {"merges": self.merges, "batch_increases": self.batch_increases,
                "accumulation_used": self.accumulation_used, "faults": self.faults,
                "capped_requests": self.capped_requests, "largest_capped_request": self.largest_capped_request}

    def load_counters(self, state: dict) -> None:
        self.merges, self.batch_increases = int(state["merges"]), int(state["batch_increases"])
        self.accumulation_used, self.faults = bool(state["accumulation_used"]), int(state["faults"])
        self.capped_requests = int(state.get("capped_requests", 0))  # checkpoints of older versions lack them
        self.largest_capped_request = int(state.get("largest_capped_request", 0))

    def log_step(self, record) -> float | None:
        """What an outer step did (cluster/round_driver.py RoundRecord), in one call: the round's files
        (fault_events.csv, step_loss_log.csv, node_clock.csv, inner_eval.csv: also what a failed step did before it
        failed), then, once the ledgers counted the whole step, its rows, its merge and the console line; their
        scalars and the memory readings of the step reach the trackers together. Returns the metric of the best
        model alive after the step (None: the step failed)."""
        scalars = self._round_files(record)
        best = None
        if record.counted:
            merge_event = record.merge.event if record.merge is not None else None
            scalars.update(self._step_rows(record.rows, merge_event, record.trainers_alive))
            best = scalars[f"global/{self.metric}"]
            log.info(self._step_line(record.outer_step, record.rows, merge_event))
        self._send(scalars, record.outer_step)
        return best

    def _round_files(self, record) -> dict[str, float]:
        """The round's files, and their scalars (node_<id>/compute_s, idle_s; under torchrun, comm/*: what this
        rank's collectives cost since the last round)."""
        scalars = {}
        if record.comm is not None:
            comm = record.comm
            scalars.update({"comm/seconds": comm["seconds"], "comm/weights_mb": comm["weights_bytes"] / 1e6,
                            "comm/statistics_mb": comm["statistics_bytes"] / 1e6,
                            "comm/evaluation_mb": comm["evaluation_bytes"] / 1e6})
        with self._lock:
            if record.faults:
                self._append(self.fault_path, FAULT_COLUMNS, record.faults)
                self.faults += len(record.faults)
                scalars["global/node_faults"] = float(self.faults)
            if record.node_times:
                self._append(self.node_path, NODE_COLUMNS, record.node_times)
                scalars.update({f"node_{r['node_id']}/{k}": float(r[k])
                                for r in record.node_times for k in ("compute_s", "idle_s")})
            if record.inner_evals:
                self._append(self.inner_eval_path, INNER_EVAL_COLUMNS, record.inner_evals)
            if record.step_losses:  # as the round driver gives them (each loss already at 6 digits)
                with self.step_loss_path.open("a", newline="") as f:
                    csv.writer(f).writerows([row[c] for c in STEP_LOSS_COLUMNS] for row in record.step_losses)
        return scalars

    def _send(self, scalars: dict[str, float], step: int) -> None:
        """The step's scalars to the trackers in one call, the memory monitor's readings of the step with them."""
        pending, self.memory.pending = self.memory.pending, {}
        for at, readings in sorted(pending.items()):
            if at == step:
                scalars = {**readings, **scalars}
            else:  # a reading of another step (none in a run's loop): on its own
                self.tracker.log(readings, at)
        if scalars:
            self.tracker.log(scalars, step)

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

    def _step_rows(self, rows: list[dict], merge_event: dict | None, trainers_alive: int) -> dict[str, float]:
        """training_log.csv's rows and merge_events.csv's row of a step, and their scalars (global/<metric>: the best
        model alive after the step's merge)."""
        for row in rows:
            row["trainers_alive"] = trainers_alive
        with self._lock:
            self._append(self.csv_path, COLUMNS, rows)
            if merge_event:
                self._append(self.merge_path, MERGE_COLUMNS, [merge_event])
                self.merges += 1
            self.batch_increases += sum(r["next_requested_batch"] > r["requested_batch"] for r in rows)
            self.accumulation_used |= any(r["accumulation_steps"] > 1 for r in rows)
            for r in rows:  # max_requested_batch decided instead of the test: say so, once per trainer
                asked = r.get("test_requested_batch")
                if asked is None or asked <= r["next_requested_batch"]:
                    continue
                self.capped_requests += 1
                self.largest_capped_request = max(self.largest_capped_request, int(asked))
                if r["trainer_id"] not in self._cap_reported:
                    self._cap_reported.add(r["trainer_id"])
                    log.warning("batch test: trainer %s asked for a batch of %d at outer step %s; max_requested_batch "
                                "caps it at %d (the run follows the cap, not the test: raise max_requested_batch to "
                                "follow it)", r["trainer_id"], asked, r["outer_step"], r["next_requested_batch"])
        scalars = {f"trainer_{r['trainer_id']}/{k}": float(r[k]) for r in rows for k in TRACKED if k in r}
        pick = max if self.higher_is_better else min
        alive = models_alive({r["trainer_id"]: r[self.metric] for r in rows}, [merge_event] if merge_event else [])
        if merge_event:
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
            **{f"clock/{k}": float(rows[-1][k]) for k in ("utilisation", "goodput_tokens_per_s") if k in rows[-1]},
            "clock/sim_time_s": max(float(r.get("sim_time_s", 0.0)) for r in rows),
        })
        return scalars

    def _step_line(self, outer_step: int, rows: list[dict], merge_event: dict | None) -> str:
        """The console's line for a step: each trainer's nodes, batch, loss, metric and next batch; the merge."""
        metric = self.metric
        total = f"/{self.num_outer_steps}" if self.num_outer_steps else ""
        parts = [f"[outer {outer_step}{total}] trainers {len(rows)}"]
        for r in rows:
            parts.append(f"T{r['trainer_id']} nodes [{r['nodes']}] req {r['requested_batch']} "
                         f"loader {r['loader_batch']}x{r['accumulation_steps']} loss {r['train_loss']:.3f} "
                         f"{metric[4:]} {r[metric]:.4g} -> req {r['next_requested_batch']}")
        if merge_event:
            parts.append(f"merged T{merge_event['merged']} into T{merge_event['survivor']} "
                         f"(weights {merge_event['weights']}; {metric[4:]} "
                         f"{' '.join(f'{float(v):.4g}' for v in merge_event['metric_before'].split())} -> "
                         f"{merge_event['metric_after']:.4g})")
        return " | ".join(parts)

    def plot(self, step: int) -> list[Path]:
        from training_logs.plots import plot_step_loss, plot_training  # matplotlib: only a run that plots loads it

        with self._lock:
            paths = plot_training(self.csv_path, self.merge_path, self.report_dir, self.metric, self.higher_is_better)
        step_plot = plot_step_loss(self.step_loss_path, self.merge_path, self.report_dir / "step_loss.png")
        paths += [step_plot] if step_plot else []
        paths.append(self.memory.plot())
        for path in paths:
            self.tracker.log_image(path.stem, path, step)
        return paths

    def finish(self, summary: dict) -> None:
        """Final artifacts: the CSV files and the summary."""
        for path in (self.csv_path, self.merge_path, self.fault_path, self.node_path, self.step_loss_path,
                     self.inner_eval_path, self.memory.csv_path):
            self.tracker.log_artifact(path.name, path)
        self.tracker.log_artifact("summary", summary)

    def close(self) -> None:
        self._send({}, -1)  # readings of a step that failed before it was logged
        self.tracker.close()
