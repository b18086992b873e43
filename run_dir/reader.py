"""A run directory read back, its files named once: what a run leaves (summary.json, status.json, config.yaml,
metrics.jsonl, the CSVs of model_training_report/, model_weights/) as `RunFiles`, each file read by one method.

The run writes them under these names (named in run_dir/run_state.py, which loads no torch, for
run_dir/lifecycle.py; the CSVs under the names their records give, training_logs/records.py `CSV_FILES`). The
harness, the replay, the tuner and the probes read runs through this, and nothing else in benchmarks/ names a run's
files (tests/test_layout.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TypeVar

import yaml

from run_dir.past import infer_weight_bytes, node_times_before_the_record
from run_dir.run_config import load_run_config
from run_dir.run_state import CONFIG, METRICS, REPORT, STATUS_FILE, SUMMARY, WEIGHTS, read_status
from training_logs.records import CSV_FILES, InnerEval, MergeEvent, NodeTime, TrainerRow, read_records
from utils.config import Config

Record = TypeVar("Record")


def report_file(record: type) -> str:
    """A record type's CSV file, relative to the run directory."""
    return f"{REPORT}/{CSV_FILES[record]}"


# what a finished run is read back from (the harness's reader, the replay): the files a replay bundle keeps
READ_BACK = (CONFIG, SUMMARY, STATUS_FILE, *(report_file(r) for r in (TrainerRow, MergeEvent, InnerEval, NodeTime)))


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """One run directory's files (`path`: the run directory)."""

    path: Path

    @property
    def summary_path(self) -> Path:
        return self.path / SUMMARY

    @property
    def finished(self) -> bool:
        """Whether the run completed (its summary.json is written last)."""
        return self.summary_path.is_file()

    def summary(self) -> dict:
        return json.loads(self.summary_path.read_text())

    def summary_or_empty(self) -> dict:
        return self.summary() if self.finished else {}

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG

    def config(self) -> Config:
        """The run's config in today's meaning (run_dir/run_config.py's migrations)."""
        return load_run_config(self.config_path)

    def config_as_written(self) -> dict:
        """config.yaml's keys and values as the run wrote them, in its version's meaning (no migration; {} when
        empty): what the run itself said, where a report quotes it."""
        return yaml.safe_load(self.config_path.read_text()) or {}

    @property
    def status_path(self) -> Path:
        return self.path / STATUS_FILE

    def status(self) -> dict | None:
        """status.json (how the run ended), None when missing or unreadable."""
        return read_status(self.path)

    def csv(self, record: type) -> Path:
        """The CSV file of a record type (training_logs/records.py)."""
        return self.path / report_file(record)

    def records(self, record: type[Record]) -> list[Record]:
        """Every row of the record type's CSV file, typed (training_logs/records.py read_records)."""
        return read_records(self.csv(record), record)

    def records_if_any(self, record: type[Record]) -> list[Record]:
        """As `records`, [] when the run has not written that file (an older run, or one that stopped early)."""
        return self.records(record) if self.csv(record).is_file() else []

    def node_times(self) -> list[NodeTime]:
        """Each node's round (node_clock.csv: trainer, shape, tokens, a state it received first); of a run written
        before node_clock.csv carried `received_bytes`, rebuilt from training_log.csv (run_dir/past.py)."""
        recorded = self.records_if_any(NodeTime)
        if recorded and recorded[0].received_bytes is not None:
            return recorded
        return [NodeTime(**row) for row in node_times_before_the_record(self.records(TrainerRow),
                                                                         self.records_if_any(MergeEvent))]

    def weight_bytes(self) -> int:
        """P, the bytes of the run's fp32 weights (summary.json); of a run written before the summary carried it,
        inferred from its all-reduce traffic (run_dir/past.py; 0: it never all-reduced)."""
        recorded = self.summary().get("weight_bytes")
        if recorded:
            return recorded
        by_step: dict[int, list[TrainerRow]] = {}
        for r in self.records(TrainerRow):
            by_step.setdefault(r.outer_step, []).append(r)
        return infer_weight_bytes(by_step)

    def metrics(self) -> list[dict]:
        """metrics.jsonl: every scalar the trackers got, a line per call."""
        return [json.loads(line) for line in (self.path / METRICS).read_text().splitlines()]

    @property
    def weights(self) -> Path:
        """model_weights/: the checkpoints and the final model."""
        return self.path / WEIGHTS
