"""One round of node jobs: what a node returns, what a trainer's combined round is, and how nodes combine.

Both backends use this module: the simulated cluster (cluster.py `RoundBackend`) runs the nodes in this
process and calls `combine`; under torchrun (distributed/backend.py) each process runs its own node with
`run_node` and collectives replace `combine`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from algorithms.calc_batch import GradientStatistics, trainer_statistics
from algorithms.outer_sync import OuterSync
from trainers import Node, NodeJob, NodeResult, RoundAbandoned

log = logging.getLogger(__name__)


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


@dataclass
class NodeFault:
    """A node whose round failed: an exception, or a non-finite loss or weights."""

    node_id: int
    trainer_id: int
    kind: str  # error | nan
    message: str


def check_finite(result: NodeResult) -> NodeFault | None:
    bad = next((i for i, loss in enumerate(result.step_losses) if not math.isfinite(loss)), None)
    if bad is not None:
        return NodeFault(result.node_id, result.trainer_id, "nan",
                         f"non-finite loss at inner step {bad} (diverged? lower lr_inner)")
    if not all(bool(torch.isfinite(v).all()) for v in result.state.values()):
        return NodeFault(result.node_id, result.trainer_id, "nan", "non-finite weights after the round")
    return None


def run_node(node: Node, job: NodeJob, sync: OuterSync | None = None) -> NodeResult | NodeFault:
    """One node's round; an exception or non-finite numbers become a NodeFault (RoundAbandoned passes).
    A compressed outer sync encodes the node's pseudo-gradient here, on the node, and updates its residual
    (a round that is rolled back restores the residual with the rest of the round's state)."""
    try:
        result = node.run(job)
    except RoundAbandoned:
        raise
    except Exception as exc:  # a node fault, handled by the on_node_fault policy
        log.debug("node %d failed", job.node_id, exc_info=True)
        return NodeFault(job.node_id, job.trainer_id, "error", f"{type(exc).__name__}: {exc}")
    fault = check_finite(result)
    if fault is not None and job.inject_fault:
        fault.message = f"non-finite loss (inject_fault: {job.inject_fault})"
    if fault is None and sync is not None and not sync.exact:
        result.payload, node.residual = sync.encode(job.master, result.state, node.residual)
    return fault or result


def combine(results: list[NodeResult], within_node: bool, device: str = "cpu", wire: torch.dtype = torch.float64,
            sync: OuterSync | None = None, masters: dict[int, dict[str, torch.Tensor]] | None = None
            ) -> dict[int, RoundResult]:
    """Per trainer: the mean of its good nodes' weights, in fp32 on `device` (the masters'), summed in node-id
    order (compressed: master minus the mean of the decoded pseudo-gradients, `masters` giving each trainer's);
    and the batch test's statistics from the nodes' samples (their vectors summed in the `wire` dtype)."""
    by_trainer: dict[int, list[NodeResult]] = {}
    for r in sorted(results, key=lambda r: r.node_id):
        by_trainer.setdefault(r.trainer_id, []).append(r)
    combined = {}
    for trainer_id, group in by_trainer.items():
        if sync is not None and not sync.exact:
            mean = sync.node_mean(masters[trainer_id], [r.payload for r in group])
        else:
            mean = {}
            for name in group[0].state:
                acc = torch.zeros(group[0].state[name].shape, dtype=torch.float32, device=device)
                for r in group:
                    acc += r.state[name].detach().to(device, torch.float32)
                mean[name] = acc / len(group)
        combined[trainer_id] = RoundResult(
            node_mean=mean, nodes=[r.node_id for r in group],
            train_loss=sum(sum(r.step_losses) / len(r.step_losses) for r in group) / len(group),
            tokens=sum(r.tokens for r in group), optimizer_steps=sum(len(r.step_losses) for r in group),
            node_step_losses={r.node_id: r.step_losses for r in group},
            learning_rate=group[0].learning_rate)
        samples = [(r.grad_samples, r.sample_batches) for r in group if r.grad_samples is not None]
        if samples:
            combined[trainer_id].statistics = trainer_statistics(samples, within_node, wire)
    return combined
