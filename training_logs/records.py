"""The rows of a run's CSV files as dataclasses: a record's fields are its file's columns, in order, and
`CSV_FILES` names each record's file.

The logger writes them (training_monitoring.py); they are read back with `read_records`, as
typed records (an empty cell is None): by the plots (plots.py) and, for a run directory, through run_dir/reader.py
(`RunFiles`: the harness, the replay, the tuner and the probes). A new column is one field here, and the value its
producer puts in the row.
"""

from __future__ import annotations

import csv
import dataclasses
import types
import typing
from pathlib import Path
from typing import TypeVar

from run_dir.past import value_of  # renamed columns (run_dir/past.py: what older versions wrote)

Int = int | None
Float = float | None


@dataclasses.dataclass
class TrainerRow:
    """training_log.csv: one row per trainer per outer step (step 0: the initial evaluation)."""
    outer_step: int
    trainer_id: int
    nodes: str | None = None  # the node ids it ran on, space-separated ("" when every node failed)
    num_nodes: Int = None
    requested_batch: Int = None
    loader_batch: Int = None
    accumulation_steps: Int = None
    optimizer_steps: Int = None
    tokens_seen: Int = None  # this trainer's (its merged members' included)
    global_tokens: Int = None  # all trainers'
    train_loss: Float = None
    val_perplexity: Float = None
    val_accuracy: Float = None
    val_loss: Float = None
    next_requested_batch: Int = None
    test_requested_batch: Int = None  # what the batch test asked for, before max_requested_batch capped it
    # the batch tests' statistics (algorithms/calc_batch.py)
    T_k: Float = None
    variance: Float = None
    sum_sq_diffs: Float = None
    inner_variance: Float = None
    ortho_variance: Float = None
    T_ip: Float = None
    T_ortho: Float = None
    grad_sq_norm: Float = None
    # the traffic so far, this step's merge included (algorithms/traffic.py)
    rounds: Int = None
    syncs: Int = None
    weights_traffic_bytes: Int = None  # allreduce + merge + node move bytes (older files: bytes_communicated)
    allreduce_bytes: Int = None
    merge_bytes: Int = None
    node_move_bytes: Int = None
    node_moves: Int = None
    statistics_bytes: Int = None
    logged_statistics_bytes: Int = None  # sent for the log only (rows written before 2026-11-24: in statistics_bytes)
    total_traffic_bytes: Int = None  # weights_traffic_bytes + statistics_bytes (older files: bytes_needed; rows
    # before 2026-11-24: absent)
    wall_time: Float = None
    trainers_alive: Int = None
    # the simulated clock (docs/clock.md)
    sim_time_s: Float = None
    sim_compute_s: Float = None
    sim_idle_s: Float = None
    utilisation: Float = None
    goodput_tokens_per_s: Float = None


@dataclasses.dataclass
class MergeEvent:
    """merge_events.csv: one row per merge. metric_before: each member's metric (survivor first) right before
    the merge; metric_weighted_before: their merge-weighted mean; metric_after: the merged model's."""
    outer_step: int
    survivor: int
    merged: str  # the absorbed trainers, space-separated
    weights: str
    requested_batches: str
    bytes: int
    metric: str
    metric_before: str
    metric_weighted_before: float
    metric_after: float
    sim_time_s: Float = None
    payloads: str | None = None  # each absorbed state's bytes, one message each (runs before it: bytes, one message)


@dataclasses.dataclass
class InnerEval:
    """inner_eval.csv (eval_every_inner_steps): one row per mid-round evaluation of a trainer's synced model (its
    outer step applied to a copy, on the mean of `nodes`' weights at that inner step: distributed/mid_round.py).
    global_tokens: what every node of every trainer had seen by that inner step, from the run's start."""
    outer_step: int
    trainer_id: int
    nodes: str
    inner_step: int
    global_tokens: int
    val_perplexity: float | None = None
    val_accuracy: float | None = None
    val_loss: float | None = None


@dataclasses.dataclass
class NodeTime:
    """node_clock.csv: the simulated clock's view of each node's round (algorithms/clock.py), seconds from the
    run's start: each node's work as the round driver recorded it (trainer, inner steps, shape, tokens, a state it
    received), which the replay (benchmarks/replay.py) reads back."""
    outer_step: int
    node_id: int
    trainer_id: int
    speed: float
    slowdown: float
    inner_steps: int
    micro_batch: int
    accumulation_steps: int
    tokens: int
    start_s: float
    compute_s: float
    idle_s: float
    end_s: float
    received_bytes: Int = None  # the trainer's state it received before it started (a node move); None: runs before it


@dataclasses.dataclass
class FaultEvent:
    """fault_events.csv: one row per node fault."""
    outer_step: int
    trainer_id: int
    node_id: int
    kind: str
    action: str
    message: str


@dataclasses.dataclass
class StepLoss:
    """step_loss_log.csv: one row per node per inner optimizer step."""
    outer_step: int
    trainer_id: int
    node_id: int
    inner_step: int
    loss: float
    micro_batch: int
    accumulation_steps: int
    learning_rate: float


Record = TypeVar("Record")

# each record's file in the run directory's model_training_report/: the logger writes it there, run_dir/reader.py
# reads it back
CSV_FILES: dict[type, str] = {TrainerRow: "training_log.csv", MergeEvent: "merge_events.csv",
                              InnerEval: "inner_eval.csv", NodeTime: "node_clock.csv",
                              FaultEvent: "fault_events.csv", StepLoss: "step_loss_log.csv"}


def columns(record: type) -> list[str]:
    """The CSV columns of a record type, in order."""
    return [f.name for f in dataclasses.fields(record)]


def _parser(tp) -> type:
    """The type a cell is parsed as: the annotation, without its None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def read_records(path: Path, record: type[Record]) -> list[Record]:
    """Every row of a CSV file written with `columns(record)`, typed; an empty cell is None. A column the record
    does not know (a file of a newer version) is ignored; one it knows but the file lacks (an older file) is None;
    a renamed column is read under its old name (run_dir/past.py)."""
    hints = typing.get_type_hints(record)
    parse = {name: _parser(hints[name]) for name in columns(record)}
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for row in rows:
        values = {}
        for name, tp in parse.items():
            cell = value_of(row, name)
            if cell is None or cell == "":
                values[name] = None
            elif tp is int:
                values[name] = int(float(cell)) if "." in cell or "e" in cell else int(cell)
            elif tp is float:
                values[name] = float(cell)
            else:
                values[name] = cell
        out.append(record(**values))
    return out
