"""A Streaming DiLoCo round (algorithms/streaming.py), written once for both backends.

Every node of this process runs to each send or landing of the plan. At a send each live node's fragment
wire goes to its trainer's `FragmentTransport` (a node that failed or left the round contributes nothing);
at the landing the transport hands back what arrived, the trainer steps its fragment and mixes it into its
live nodes. In one process the transport keeps the wires and sums them at the landing; under torchrun it
launches an asynchronous collective at the send and waits for it at the landing, the node training on in
between. Both see the same wires in the same (node-id) order, so both give the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from algorithms.outer_sync import OuterSync, fragment_average, fragment_wire
from algorithms.streaming import StreamingPlan, mix_fragment
from distributed.mid_round import MidRound, StepsOf, advance_live, own_steps, trainer_members
from distributed.protocol import NodeFault
from node import Node, NodeJob, NodeResult
from trainers import Trainer
from utils.model_state import float_state

LEFT = "left"  # a node that left the round on a stop request (torchrun: it still takes part in collectives)


def fragment_fault(node: Node, job: NodeJob, names: list[str]) -> NodeFault | None:
    """Before a fragment travels: a node whose losses so far or whose fragment are not finite leaves the round
    (it would poison its trainer's fragment)."""
    losses = torch.stack(node.round_losses).float() if node.round_losses else torch.zeros(1)
    own = node.model.state_dict(keep_vars=True)
    if not bool(torch.isfinite(losses).all()) or not all(bool(torch.isfinite(own[n]).all()) for n in names):
        why = f"inject_fault: {job.inject_fault}" if job.inject_fault else "diverged? lower lr_inner"
        return NodeFault(job.node_id, job.trainer_id, "nan", f"non-finite loss or weights before a fragment sync "
                         f"({why})")
    return None


def send_fragment(node: Node, master: dict[str, torch.Tensor], names: list[str], span: tuple[int, int],
                  total: int, sync: OuterSync) -> torch.Tensor:
    """A node's wire for one fragment; with error feedback its residual's slice `span` (the fragment's place
    in the flat residual of `total` entries) is read and updated in place."""
    residual = None
    if sync.error_feedback:
        if node.residual is None:
            node.residual = torch.zeros(total, dtype=torch.float32, device=node.device)
        residual = node.residual[span[0]:span[1]]
    wire, kept = fragment_wire(sync, master, float_state(node.model), names, residual, node.device)
    if kept is not None:
        node.residual[span[0]:span[1]] = kept
    return wire


class FragmentTransport(Protocol):
    """How one fragment's wires travel between a trainer's nodes."""

    def start(self, trainer_id: int, wires: list[torch.Tensor | None], numel: int) -> object:
        """Launch the fragment's exchange; wires: this process's nodes of the trainer, in node-id order
        (None: that node contributes nothing). Returns a handle for `land`."""

    def land(self, handle: object) -> list[torch.Tensor] | torch.Tensor | None:
        """What arrived, as `fragment_average` (algorithms/outer_sync.py) reads it; None when nothing can arrive."""


def streamed_round(plan: StreamingPlan, sync: OuterSync, nodes: list[Node], jobs: list[NodeJob],
                   trainers: dict[int, Trainer], transport: FragmentTransport,
                   run_nodes: Callable[[list[int], dict, dict], list],
                   mid_round: MidRound | None = None, steps_of: StepsOf = own_steps) -> tuple[dict, dict[int, str]]:
    """Run this process's `jobs` through one streamed round.

    run_nodes(node_ids, round_steps, job_of): advance those nodes to their next pause (`rounds.advance`), returning
    each one's outcome (a pause's step count, its result, its fault, or LEFT).
    mid_round: the nodes also pause at its steps, where each trainer's synced model is scored (before that step's
    sends and landings: the round ending there). steps_of: each job's round (its own node's, or a stacked group's).
    Returns ({node: NodeResult | NodeFault | LEFT} for every node, {trainer: outer-step error})."""
    job_of = {j.node_id: j for j in jobs}
    members = trainer_members(jobs)
    evaluated = set(mid_round.steps) if mid_round is not None else set()
    pauses = sorted(set(plan.pauses) | evaluated)
    round_steps = steps_of(nodes, jobs, pauses)
    numels = {n: v.numel() for n, v in next(iter(trainers.values())).master.items()}
    spans, total = plan.offsets(numels), sum(numels.values())
    ended: dict[int, NodeResult | NodeFault | str] = {}  # a node's result, fault, or LEFT: it left the round
    in_flight: dict[int, dict[int, object]] = {}  # fragment -> trainer -> the transport's handle
    errors: dict[int, str] = {}
    for step in [*pauses, None]:  # None: on to the end of the round
        live = advance_live(round_steps, ended, job_of, run_nodes)
        if step is None:
            break
        if step in evaluated:
            mid_round.at(step, nodes, members, {n for n in live if n not in ended})
        for event in plan.events_at(step):
            f, names = event.fragment, plan.fragments[event.fragment]
            if not event.lands:
                in_flight[f] = {}
                for t, node_ids in members.items():
                    wires = []
                    for node_id in node_ids:
                        fault = None if node_id in ended else fragment_fault(nodes[node_id], job_of[node_id], names)
                        if fault is not None:
                            ended[node_id] = fault
                        wires.append(None if node_id in ended else send_fragment(
                            nodes[node_id], trainers[t].master, names, spans[f], total, sync))
                    in_flight[f][t] = transport.start(t, wires, sum(numels[n] for n in names))
                continue
            for t, handle in in_flight.pop(f).items():
                arrived = transport.land(handle)
                master = trainers[t].master
                mean = None if t in errors or arrived is None else fragment_average(sync, master, names, arrived)
                if mean is None:
                    continue
                try:
                    trainers[t].outer_step(mean)
                except FloatingPointError as exc:
                    errors[t] = str(exc)
                    continue
                for node_id in members[t]:
                    if node_id not in ended:
                        mix_fragment(float_state(nodes[node_id].model), master, names, plan.alpha)
    return ended, errors
