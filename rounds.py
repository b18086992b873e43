"""One round of node jobs: what a node returns, what a trainer's combined round is, and how nodes combine.

Both backends use this module: the simulated cluster (cluster.py `RoundBackend`) runs the nodes in this
process and calls `combine`; under torchrun (distributed/backend.py) each process runs its own node with
`run_node` and collectives replace `combine`. Streaming DiLoCo rounds (sync_fragments, sync_delay) pause
the nodes at each fragment's send and landing (`advance`); both backends build each node's fragment
payload with `fragment_wire` and average what arrived with `fragment_average`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from algorithms.calc_batch import GradientStatistics, trainer_statistics
from algorithms.comm_plan import CommPlan, wire_size
from algorithms.outer_sync import OuterSync, flatten, unflatten
from algorithms.streaming import FLAG_BYTES
from trainers import InjectedCrash, Node, NodeJob, NodeResult, RoundAbandoned
from utils.model_state import float_state

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
    outer_error: str = ""  # streaming: a fragment's outer step failed (non-finite pseudo-gradient)
    node_mid_round: dict[int, list] = field(default_factory=dict)  # eval_every_inner_steps: node -> (step, metrics)


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


def _failed(job: NodeJob, exc: Exception) -> NodeFault:
    log.debug("node %d failed", job.node_id, exc_info=True)
    return NodeFault(job.node_id, job.trainer_id, "error", f"{type(exc).__name__}: {exc}")


def _checked(job: NodeJob, result: NodeResult) -> NodeFault | None:
    fault = check_finite(result)
    if fault is not None and job.inject_fault:
        fault.message = f"non-finite loss (inject_fault: {job.inject_fault})"
    return fault


def run_node(node: Node, job: NodeJob, sync: OuterSync | None = None) -> NodeResult | NodeFault:
    """One node's round; an exception or non-finite numbers become a NodeFault (RoundAbandoned passes).
    A compressed outer sync encodes the node's pseudo-gradient here, on the node, and updates its residual
    (a round that is rolled back restores the residual with the rest of the round's state)."""
    try:
        result = node.run(job)
    except (RoundAbandoned, InjectedCrash):  # a stop, or a crash the fault policy must not absorb
        raise
    except Exception as exc:  # a node fault, handled by the on_node_fault policy
        return _failed(job, exc)
    fault = _checked(job, result)
    if fault is None and sync is not None and not sync.exact:
        result.payload, node.residual = sync.encode(job.master, result.state, node.residual, job.flat_master)
    return fault or result


# ---------------------------------------------------------------------------------------------------
# Streaming DiLoCo rounds (algorithms/streaming.py has the fragments and the schedule)

def advance(round_steps, job: NodeJob) -> int | NodeResult | NodeFault:
    """Run a node's round (`Node.steps`) to its next pause: the pause's step count, or at the end its result;
    an exception or, at the end, non-finite numbers become a NodeFault (RoundAbandoned passes)."""
    try:
        return next(round_steps)
    except StopIteration as done:
        result = done.value
    except (RoundAbandoned, InjectedCrash):  # a stop, or a crash the fault policy must not absorb
        raise
    except Exception as exc:
        return _failed(job, exc)
    return _checked(job, result) or result


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


@torch.no_grad()
def fragment_wire(sync: OuterSync, master: dict[str, torch.Tensor], local: dict[str, torch.Tensor],
                  names: list[str], residual: torch.Tensor | None, device: torch.device | str
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What one node sends for a fragment (names sorted), and its next residual for the fragment.
    exact: its fp32 fragment weights and a 1 (an all-reduce sums both: the weights' sum and the nodes counted);
    compressed: the encoded pseudo-gradient (master - local + residual) and 4 flag bytes [1, 0, 0, 0]."""
    if sync.exact:
        flat = flatten(local, names, device)
        return torch.cat([flat, torch.ones(1, dtype=torch.float32, device=device)]), None
    payload, residual = sync.encode({n: master[n] for n in names}, {n: local[n] for n in names}, residual)
    flag = torch.tensor([1, 0, 0, 0], dtype=torch.uint8, device=payload.device)
    return torch.cat([payload, flag]), residual


def empty_wire(sync: OuterSync, numel: int, device: torch.device | str) -> torch.Tensor:
    """The payload of a node that contributes nothing (it failed or left the round): zeros, count/flag 0."""
    return torch.zeros(wire_size(sync, numel), dtype=torch.float32 if sync.exact else torch.uint8, device=device)


@dataclass
class RingArrival:
    """A fragment's ring as a member ends it: every owner's reduced shard, in shard order, and whether any node
    contributed (a shard's flag)."""

    reduced: list[torch.Tensor]
    contributed: bool


@torch.no_grad()
def fragment_average(sync: OuterSync, master: dict[str, torch.Tensor], names: list[str],
                     wires: list[torch.Tensor] | torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The nodes' mean fragment (fp32, on the master's device) from what arrived: the summed exact wires, every
    member's compressed wire in node-id order (averaged as a ring of quantized shards, or decoded one by one for
    top-k: OuterSync.mean_of), or torchrun's finished ring; None when no node contributed."""
    fragment = {n: master[n] for n in names}
    device = master[names[0]].device
    if sync.exact:
        summed = wires.to(device)
        count = float(summed[-1])
        return unflatten(summed[:-1] / count, fragment, names) if count > 0 else None
    if isinstance(wires, RingArrival):  # torchrun's ring: the owners' reduced shards
        return sync.ring_mean(fragment, wires.reduced) if wires.contributed else None
    good = [w[:-FLAG_BYTES] for w in wires if int(w[-FLAG_BYTES]) == 1]
    return sync.mean_of(fragment, good, len(wires)) if good else None


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


def sum_wires(wires: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The exact wires summed in fp32 in the order given (node-id order): what the all-reduce computes."""
    total = torch.zeros_like(wires[0], device=device)
    for wire in wires:
        total += wire.to(device)
    return total


def token_shares(tokens: list[float]) -> list[float]:
    """Each node's weight in its trainer's mean under inner_steps_by_speed: its share of the tokens."""
    total = sum(tokens)
    return [t / total if total else 1 / len(tokens) for t in tokens]


def combine(results: list[NodeResult], plan: CommPlan, device: str = "cpu",
            masters: dict[int, dict[str, torch.Tensor]] | None = None, members: dict[int, int] | None = None, *,
            streamed: bool = False, identical: bool = False) -> dict[int, RoundResult]:
    """Per trainer: the mean of its good nodes' weights, in fp32 on `device` (the masters'), summed in node-id
    order (compressed by plan.outer_sync: master minus the mean of the decoded pseudo-gradients, `masters` giving
    each trainer's); and the batch test's statistics from the nodes' samples (their vectors summed in the plan's
    statistics wire dtype). plan.by_tokens (inner_steps_by_speed): each node weighs in by its share of the
    trainer's tokens.
    members: each trainer's number of nodes this round, failed ones included (the owners of a compressed ring).
    streamed: the fragments' outer steps already ran during the round; no mean is taken.
    identical (DDP, SNOO): the good nodes hold the same weights; the lowest id's are the mean, nothing travels."""
    sync, within_node, wire = plan.outer_sync, plan.within_node, plan.statistics_wire
    by_trainer: dict[int, list[NodeResult]] = {}
    for r in sorted(results, key=lambda r: r.node_id):
        by_trainer.setdefault(r.trainer_id, []).append(r)
    combined = {}
    for trainer_id, group in by_trainer.items():
        shares = token_shares([r.tokens for r in group]) if plan.by_tokens else None
        if streamed:
            mean = None
        elif identical:
            mean = {name: v.detach().to(device, torch.float32, copy=True) for name, v in group[0].state.items()}
        elif not sync.exact:
            mean = sync.mean_of(masters[trainer_id], [r.payload for r in group],
                                (members or {}).get(trainer_id, len(group)), shares)
        else:
            mean = {}
            for name in group[0].state:
                acc = torch.zeros(group[0].state[name].shape, dtype=torch.float32, device=device)
                for i, r in enumerate(group):
                    value = r.state[name].detach().to(device, torch.float32)
                    acc += value if shares is None else value * shares[i]
                mean[name] = acc / len(group) if shares is None else acc
        combined[trainer_id] = RoundResult(
            node_mean=mean, nodes=[r.node_id for r in group],
            train_loss=sum(sum(r.step_losses) / len(r.step_losses) for r in group) / len(group),
            tokens=sum(r.tokens for r in group), optimizer_steps=sum(len(r.step_losses) for r in group),
            node_step_losses={r.node_id: r.step_losses for r in group},
            learning_rate=group[0].learning_rate, node_mid_round={r.node_id: r.mid_round for r in group if r.mid_round})
        samples = [(r.grad_samples, r.sample_batches) for r in group if r.grad_samples is not None]
        if samples:
            combined[trainer_id].statistics = trainer_statistics(samples, within_node, wire)
    return combined
