"""The node side of a round, for both backends: run a node's round (`run_node`; Streaming DiLoCo and DDP rounds
pause at each fragment or gradient step: `advance`), turn an exception or non-finite numbers into a `NodeFault`,
and combine a trainer's good results into its `RoundResult` (`combine`; under torchrun collectives do it,
distributed/torchrun_backend.py)."""

from __future__ import annotations

import logging
import math
import time

import torch

from algorithms.calc_batch import trainer_statistics
from algorithms.comm_plan import CommPlan
from algorithms.outer_sync import OuterSync
from distributed.plain import LocalWeights, node_mean
from distributed.protocol import NodeFault, RoundResult
from node import InjectedCrash, Node, NodeJob, NodeResult, RoundAbandoned

log = logging.getLogger(__name__)


def check_finite(result: NodeResult) -> NodeFault | None:
    bad = next((i for i, loss in enumerate(result.step_losses) if not math.isfinite(loss)), None)
    if bad is not None:
        return NodeFault(result.node_id, result.trainer_id, "nan",
                         f"non-finite loss at inner step {bad} (diverged? lower lr_inner)")
    if not all(bool(torch.isfinite(v).all()) for v in result.state.values()):
        return NodeFault(result.node_id, result.trainer_id, "nan", "non-finite weights after the round")
    return None


def failed(job: NodeJob, exc: Exception) -> NodeFault:
    log.debug("node %d failed", job.node_id, exc_info=True)
    return NodeFault(job.node_id, job.trainer_id, "error", f"{type(exc).__name__}: {exc}")


def _checked(job: NodeJob, result: NodeResult) -> NodeFault | None:
    fault = check_finite(result)
    if fault is not None and job.inject_fault:
        fault.message = f"non-finite loss (inject_fault: {job.inject_fault})"
    return fault


def run_node(node: Node, job: NodeJob, sync: OuterSync | None = None) -> NodeResult | NodeFault:
    """One node's whole round: `advance` to its end (a plain round never pauses), which makes its outcome (an
    exception or non-finite numbers a NodeFault, RoundAbandoned passing; a compressed outer sync's pseudo-gradient
    encoded on the node, its residual updated) and releases the node once it is encoded (offload_idle_nodes). A round
    that is rolled back restores the residual with the rest of the round's state."""
    round_steps = node.steps(job)
    while not isinstance(outcome := advance(round_steps, job, node, sync), (NodeResult, NodeFault)):
        pass  # a pause (none in a plain round): on to the end, as Node.run
    return outcome


def finished(job: NodeJob, result: NodeResult, node: Node | None, sync: OuterSync | None) -> NodeResult | NodeFault:
    """A node's round that ended: its NodeFault if its numbers are not finite; else its result, with a compressed
    outer sync's pseudo-gradient encoded on the node (its residual updated), before the node is released
    (offload_idle_nodes: its state leaves the device before the next node computes; the callers release it)."""
    fault = _checked(job, result)
    if fault is None and sync is not None and not sync.exact and node is not None:
        result.payload, node.residual = sync.encode(job.master, result.state, node.residual, job.flat_master)
    return fault or result


def advance(round_steps, job: NodeJob, node: Node | None = None, sync: OuterSync | None = None,
            release_paused: bool = False) -> int | NodeResult | NodeFault:
    """Run a node's round (`Node.steps`) to its next pause: the pause's step count, or at the end its result;
    an exception or, at the end, non-finite numbers become a NodeFault (RoundAbandoned passes). node: released
    (offload_idle_nodes) once its round has ended, and at each pause too with release_paused (a pause where only
    its weights are read: a mid-round evaluation; it moves back in when it goes on). sync: a compressed outer sync's
    pseudo-gradient is encoded at the end (`finished`; not in a streamed round, whose fragments travel on their
    own)."""
    try:
        paused = next(round_steps)
        if release_paused and node is not None:
            node.release()
        return paused
    except StopIteration as done:
        result = done.value
    except (RoundAbandoned, InjectedCrash):  # a stop, or a crash the fault policy must not absorb
        if node is not None:
            node.release()
        raise
    except Exception as exc:
        if node is not None:
            node.release()
        return failed(job, exc)
    try:
        return finished(job, result, node, sync)
    finally:  # released once the result is encoded, and by an error in encoding too
        if node is not None:
            node.release()


def token_shares(tokens: list[float]) -> list[float]:
    """Each node's weight in its trainer's mean under inner_steps_by_speed: its share of the tokens."""
    total = sum(tokens)
    return [t / total if total else 1 / len(tokens) for t in tokens]


def combine(results: list[NodeResult], plan: CommPlan, device: str = "cpu",
            masters: dict[int, dict[str, torch.Tensor]] | None = None, members: dict[int, int] | None = None, *,
            streamed: bool = False, identical: bool = False) -> dict[int, RoundResult]:
    """Per trainer: the mean of its good nodes' weights (distributed/plain.py: node_mean, in fp32 on `device`, the
    masters', summed in node-id order; compressed by plan.outer_sync: master minus the mean of the decoded
    pseudo-gradients), `masters` giving each trainer's; and the batch test's statistics from the nodes' samples
    (their vectors summed in the plan's statistics wire dtype). plan.by_tokens (inner_steps_by_speed): each node
    weighs in by its share of the trainer's tokens.
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
        else:  # the plain round's mean (distributed/plain.py), every node here
            owners = (members or {}).get(trainer_id, len(group))
            mean = node_mean(masters[trainer_id], {r.node_id: r.state for r in group},
                             {r.node_id: r.payload for r in group}, [r.node_id for r in group], shares,
                             LocalWeights(sync, owners), device)
        combined[trainer_id] = RoundResult(
            node_mean=mean, nodes=[r.node_id for r in group],
            train_loss=sum(sum(r.step_losses) / len(r.step_losses) for r in group) / len(group),
            tokens=sum(r.tokens for r in group), optimizer_steps=sum(len(r.step_losses) for r in group),
            node_step_losses={r.node_id: r.step_losses for r in group},
            learning_rate=group[0].learning_rate)
        samples = [(r.grad_samples, r.sample_batches) for r in group if r.grad_samples is not None]
        if samples:
            start = time.perf_counter()
            combined[trainer_id].statistics = trainer_statistics(samples, within_node, wire)
            combined[trainer_id].statistics_seconds = time.perf_counter() - start
    return combined
