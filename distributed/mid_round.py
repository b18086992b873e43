"""Evaluations within a round (eval_every_inner_steps), written once for both backends and every kind of round.

At each evaluation step k, every node of the round pauses after its k-th inner step (Node.steps' pauses). Per
trainer, the paused nodes' weights are averaged in fp32 in node-id order (a node whose weights are not finite
offers nothing, as in the round's own mean), and `score` applies the trainer's outer step to a copy of its state
(Trainer.synced_model) and evaluates that: the model the trainer would hold if its round ended at step k. The
same rule for every method (a DDP trainer's nodes hold the same weights: their mean is them). The real state is
untouched and the simulated clock and traffic count nothing: an evaluation is the experimenter's, not the
method's. Under torchrun the mean is one ordered sum within the trainer's group (the bytes of a ring all-reduce of
the weights per evaluation, counted apart as `evaluation` bytes, never in the method's), and the trainer's first
node scores it.

Memory: one fp32 copy of the weights (and of the outer optimizer's state) per evaluation, freed after it; no node
keeps a snapshot, so the paper's scale (MicroLlama 300M, an evaluation every 10 of 200 inner steps) costs what one
evaluation does. With offload_idle_nodes a node paused for an evaluation waits in host memory (its weights are read
there) and moves back in when it goes on, so a plain round holds no more nodes on a device than without
evaluations (the 16-node reading's bound); DDP / SNOO and Streaming DiLoCo rounds keep their nodes in as they do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from node import Node, NodeJob
from utils.model_state import float_state

Score = Callable[[int, dict[str, torch.Tensor]], dict[str, float]]  # trainer id, its nodes' mean -> metrics


def evaluation_steps(every: int, jobs: list[NodeJob]) -> list[int]:
    """The inner steps evaluated this round: every `every`-th, short of the round's end (the trainer is evaluated
    after its outer step) and of the shortest node's round (inner_steps_by_speed: step k is every node's k-th)."""
    if every <= 0 or not jobs:
        return []
    shortest = min(j.sample_indices.shape[0] for j in jobs)
    return list(range(every, shortest, every))


@dataclass
class MidRoundPlan:
    """What the controller asks of a round: the steps to evaluate and how to score a trainer's synced model."""

    steps: list[int]
    score: Score


Offered = tuple[dict[str, torch.Tensor], list[int]]  # the nodes' fp32 mean, and which nodes it averages


class NodeMeans(Protocol):
    def mean(self, trainer_id: int, node_ids: list[int], states: list[dict[str, torch.Tensor] | None]
             ) -> Offered | None:
        """The fp32 mean of the states offered (this process's nodes of the trainer, in node-id order; None: that
        node offers nothing) and the nodes that offered them (of all the trainer's `node_ids`), where it is scored;
        None elsewhere, or when no node offered one."""


@dataclass
class MidRound:
    """One round's evaluations: `at` is called at each step of `plan.steps` by every process, whatever became of
    its nodes (so the collectives match); `rows` holds what was scored here, per trainer: (step, nodes, metrics)."""

    plan: MidRoundPlan
    means: NodeMeans
    rows: dict[int, list[tuple[int, list[int], dict[str, float]]]] = field(default_factory=dict)

    @property
    def steps(self) -> list[int]:
        return self.plan.steps

    def at(self, step: int, nodes: list[Node], members: dict[int, list[int]], paused: set[int]) -> None:
        for t, node_ids in members.items():
            mine = [n for n in node_ids if nodes[n].model is not None]  # torchrun: this process's node
            states = [_finite_state(nodes[n]) if n in paused else None for n in mine]
            averaged = self.means.mean(t, node_ids, states)
            if averaged is not None:
                mean, offered = averaged
                self.rows.setdefault(t, []).append((step, offered, self.plan.score(t, mean)))


def _finite_state(node: Node) -> dict[str, torch.Tensor] | None:
    state = float_state(node.model)
    return state if all(bool(torch.isfinite(v).all()) for v in state.values()) else None


class SummedStates:
    """In one process: the offered states summed in fp32 in node-id order on `device` (the masters'), divided by
    their number, as `combine` takes the round's own mean."""

    def __init__(self, device: str) -> None:
        self.device = device

    def mean(self, trainer_id: int, node_ids: list[int], states: list[dict[str, torch.Tensor] | None]
             ) -> Offered | None:
        offered = [s for s in states if s is not None]
        if not offered:
            return None
        mean = {}
        for name in offered[0]:
            total = torch.zeros(offered[0][name].shape, dtype=torch.float32, device=self.device)
            for state in offered:
                total += state[name].detach().to(self.device, torch.float32)
            mean[name] = total / len(offered)
        return mean, [n for n, s in zip(node_ids, states) if s is not None]


StepsOf = Callable[[list[Node], list[NodeJob], list[int]], dict]  # each job's round, pausing at the steps given


def own_steps(nodes: list[Node], jobs: list[NodeJob], pauses: list[int]) -> dict:
    """Each job's round on its own node (Node.steps); node_execution stacked gives them otherwise
    (distributed/stacked.py: stacked_steps)."""
    return {j.node_id: nodes[j.node_id].steps(j, pauses) for j in jobs}


def evaluated_round(nodes: list[Node], jobs: list[NodeJob], mid_round: MidRound,
                    run_nodes: Callable[[list[int], dict, dict], list], steps_of: StepsOf = own_steps
                    ) -> dict[int, object]:
    """A round without other pauses (no streaming, no gradient averaging), paused at the evaluation steps.

    run_nodes(node_ids, round_steps, job_of): advance those nodes to their next pause (node_round.advance),
    returning each one's outcome (the pause's step, its result, its fault, or LEFT).
    Returns {node: NodeResult | NodeFault | LEFT} for every node."""
    job_of = {j.node_id: j for j in jobs}
    members = trainer_members(jobs)
    round_steps = steps_of(nodes, jobs, mid_round.steps)
    ended: dict[int, object] = {}
    for step in [*mid_round.steps, None]:  # None: on to the end of the round
        live = advance_live(round_steps, ended, job_of, run_nodes)
        if step is None:
            break
        mid_round.at(step, nodes, members, {n for n in live if n not in ended})
    return ended


def trainer_members(jobs: list[NodeJob]) -> dict[int, list[int]]:
    """Each trainer's nodes this round, in node-id order."""
    return {t: sorted(j.node_id for j in jobs if j.trainer_id == t) for t in sorted({j.trainer_id for j in jobs})}


def advance_live(round_steps: dict, ended: dict, job_of: dict, run_nodes: Callable) -> list[int]:
    """Every node still in its round to its next pause; those whose round ended (a result, a fault, LEFT) go into
    `ended`. Returns the nodes that were advanced."""
    live = [n for n in sorted(round_steps) if n not in ended]
    for node_id, out in zip(live, run_nodes(live, round_steps, job_of)):
        if not isinstance(out, int):
            ended[node_id] = out
    return live
