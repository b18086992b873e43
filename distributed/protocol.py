"""The contract between the controller and a backend: what crosses nodes, and nothing else.

The controller (cluster/) takes every decision; a backend executes what crosses nodes. Two implement
it, side by side in this folder: `in_process.InProcessBackend` (every node in this process, threads or a loop)
and `torchrun_backend.TorchrunBackend` (one node per torchrun process, collectives). algorithms/,
trainers.py, `node_round.py` (a node's round and how a trainer's results combine) and `streamed.py` (a Streaming
DiLoCo round) are the same for both. What a round returns is here: `RoundOutcome`, with a `RoundResult` per trainer
and a `NodeFault` per failed node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from algorithms.calc_batch import GradientStatistics
from algorithms.outer_sync import OuterSync
from distributed.mid_round import MidRoundPlan
from fabrics.eval_tool import EvalResult, Evaluator
from node import NodeJob
from trainers import Trainer


@dataclass
class RoundResult:
    """One trainer's combined round: mean node weights plus what the batch test and the logs need."""

    node_mean: dict[str, torch.Tensor] | None  # None under torchrun on processes outside the trainer
    nodes: list[int]
    train_loss: float
    tokens: int
    optimizer_steps: int
    node_step_losses: dict[int, list[float]]  # node id -> loss of each inner step
    learning_rate: float
    statistics: GradientStatistics | None = None  # the batch test's sums (None: no gradient samples)
    statistics_seconds: float = 0.0  # wall seconds this process spent making them (benchmarks.system reads it)
    outer_error: str = ""  # streaming: a fragment's outer step failed (non-finite pseudo-gradient)
    # eval_every_inner_steps (distributed/mid_round.py): (inner step, nodes averaged, the synced model's metrics)
    mid_round: list[tuple[int, list[int], dict[str, float]]] = field(default_factory=list)


@dataclass
class NodeFault:
    """A node whose round failed: an exception, or a non-finite loss or weights."""

    node_id: int
    trainer_id: int
    kind: str  # error | nan
    message: str


@dataclass
class RoundOutcome:
    """A round as a backend ran it: each trainer's combined result, the nodes that failed, and (torchrun) what this
    process's collectives cost since the last round: seconds, bytes by kind (metrics.jsonl's comm/*; None in one
    process)."""

    results: dict[int, RoundResult]
    faults: list[NodeFault]
    comm: dict | None = None


class Backend(Protocol):
    def run_round(self, jobs: list[NodeJob], trainers: dict[int, Trainer], mid_round: MidRoundPlan | None = None,
                  moves: list[tuple[int, int, int]] = ()) -> RoundOutcome:
        """The round's moves first (`transfer`: each trainer's state to a node that does not hold it), then one round
        of node jobs, combined per trainer (the mean of its good nodes' weights in fp32, summed in node-id order, so
        the result never depends on timing); the nodes that failed, as faults. mid_round: the nodes pause at its
        steps and each trainer's synced model is scored (distributed/mid_round.py)."""

    def transfer(self, moves: list[tuple[int, int, int]], trainers: dict[int, Trainer], kind: str = "weights",
                 compression: OuterSync | None = None) -> None:
        """(trainer, from node, to node): a trainer's state travelling to a node that does not hold it."""

    def evaluate(self, holders: dict[int, tuple[int, dict[str, torch.Tensor]]], evaluator: Evaluator
                 ) -> dict[int, EvalResult]:
        """trainer -> (a node holding it, its weights): each trainer evaluated where its state is."""

    def agree(self, flag: bool) -> bool:
        """A flag that is true everywhere once it is true anywhere (a stop request, a failed outer step)."""

    def gather_optimizer_states(self, local: object) -> list:
        """Every node's piece of per-node state (its inner optimizer, residual, weights), in node order."""

    def total_sent(self) -> dict[str, int] | None:
        """Bytes all processes' collectives sent over the run, by kind; None in one process."""

    def close(self) -> None:
        """Release threads and groups."""
