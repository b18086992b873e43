"""A synchronous round (DDP, SNOO: trainers whose `syncs_gradients`), written once for both backends.

Every node of this process runs to each inner step's gradients (Node.steps yields GRADIENTS after the step's
backward); each trainer's gradients are averaged by its `GradientTransport` and every live node steps with the
mean, so a trainer's nodes keep the same weights and inner optimizer state through the round. In one process
the gradients are summed in fp32 in node-id order; under torchrun each step is one all-reduce of the trainer's
group (the gradient and a count). A node that failed, left the round (a stop), or whose gradient is not finite
offers nothing (it would poison every node); the mean is over the nodes that offered one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from distributed.mid_round import MidRound, advance_live, trainer_members
from node import GRADIENTS, Node, NodeJob


class GradientTransport(Protocol):
    def mean(self, trainer_id: int, gradients: list[torch.Tensor | None]) -> torch.Tensor | None:
        """The mean over the trainer's nodes of the gradients offered (this process's nodes of the trainer, in
        node-id order; None: that node offers nothing); None when no node of the trainer offered one."""


def synchronous_round(nodes: list[Node], jobs: list[NodeJob], transport: GradientTransport,
                      run_nodes: Callable[[list[int], dict, dict], list],
                      mid_round: MidRound | None = None) -> dict[int, object]:
    """Run this process's `jobs` through one synchronous round.

    run_nodes(node_ids, round_steps, job_of): advance those nodes to their next pause (`rounds.advance`), returning
    each one's outcome (GRADIENTS, its result, its fault, or LEFT). Every process calls the transport once per
    inner step and trainer, whatever became of its nodes, so the collectives match.
    mid_round: after the optimizer steps of its steps the nodes pause again, and each trainer's synced model is
    scored.
    Returns {node: NodeResult | NodeFault | LEFT} for every node."""
    job_of = {j.node_id: j for j in jobs}
    members = trainer_members(jobs)
    evaluated = set(mid_round.steps) if mid_round is not None else set()
    round_steps = {j.node_id: nodes[j.node_id].steps(j, sorted(evaluated)) for j in jobs}
    steps = max((j.sample_indices.shape[0] for j in jobs), default=0)  # the same for every node (config checks)
    ended: dict[int, object] = {}
    for step in range(steps + 1):  # each inner step's gradients, then on to the end of the round
        live = [n for n in sorted(round_steps) if n not in ended]
        paused = set()
        for node_id, out in zip(live, run_nodes(live, round_steps, job_of)):
            if isinstance(out, str) and out == GRADIENTS:
                paused.add(node_id)
            else:
                ended[node_id] = out
        if step == steps:
            break
        for t, node_ids in members.items():
            offered = []
            for node_id in node_ids:
                grad = nodes[node_id].gradients() if node_id in paused else None
                offered.append(grad if grad is not None and bool(torch.isfinite(grad).all()) else None)
            mean = transport.mean(t, offered)
            for node_id in node_ids:
                if node_id in paused and mean is not None:
                    nodes[node_id].load_gradients(mean)
        if step + 1 in evaluated:  # on through the optimizer step, to the evaluation's pause
            live = advance_live(round_steps, ended, job_of, run_nodes)
            mid_round.at(step + 1, nodes, members, {n for n in live if n not in ended})
    return ended


class SummedGradients:
    """The in-process transport: the offered gradients summed in fp32 in node-id order, on the first one's device."""

    def mean(self, trainer_id: int, gradients: list[torch.Tensor | None]) -> torch.Tensor | None:
        offered = [g for g in gradients if g is not None]
        if not offered:
            return None
        total = torch.zeros_like(offered[0])
        for grad in offered:
            total += grad.to(total.device)
        return total / len(offered)
