"""The in-process backend (distributed/protocol.py): every node of the cluster runs in this process.

Nodes run as threads, in a loop, or in stacked groups (node_execution); a trainer's state is always here, so
transfers move nothing (Traffic counts what a real cluster would send).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from algorithms.comm_plan import CommPlan
from algorithms.outer_sync import OuterSync, empty_wire, flatten, sum_wires
from distributed.mid_round import MidRound, MidRoundPlan, SummedStates, evaluated_round, own_steps
from distributed.node_round import advance, combine, run_node
from distributed.protocol import NodeFault, RoundOutcome
from distributed.stacked import stacked_steps
from distributed.streamed import LEFT, streamed_round
from distributed.synchronous import SummedGradients, synchronous_round
from fabrics.eval_tool import Evaluator
from node import Node, NodeJob, NodeResult, RoundAbandoned
from trainers import Trainer


class InProcessBackend:
    """Runs the jobs of one round on their nodes and combines the good results per trainer.

    A node that raises or ends its round with non-finite numbers is reported as a NodeFault and left out
    of its trainer's mean; a stop request (RoundAbandoned) is raised once every node has left its round.
    """

    def __init__(self, nodes: list[Node], concurrent: bool, plan: CommPlan | None = None,
                 master_device: str = "cpu", device_of: list[int] | None = None, max_concurrent: int = 0,
                 stacked: bool = False) -> None:
        """device_of: each node's simulated device (its index in `devices`); max_concurrent (max_concurrent_nodes):
        at most this many nodes of one device compute at once on the node threads (0: all). stacked
        (node_execution: stacked): a plain round's nodes of one shape and device run as one stacked model
        (distributed/stacked.py)."""
        self.nodes, self.master_device, self.stacked = nodes, master_device, stacked
        # each round's nodes: their own (Node.steps), or stacked groups whose Stacks are kept for the next round
        self.steps_of = partial(stacked_steps, stacks={}) if stacked else own_steps
        self.plan = plan or CommPlan()  # how the round's results travel (algorithms/comm_plan.py)
        self.sync, self.streaming = self.plan.outer_sync, self.plan.streaming
        self.pool = ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="node") if concurrent else None
        self.gates: dict[int, threading.Semaphore] = {}  # node id -> its device's turns
        if concurrent and max_concurrent and device_of is not None:
            turns = {d: threading.Semaphore(max_concurrent) for d in set(device_of)}
            self.gates = {node.node_id: turns[d] for node, d in zip(nodes, device_of)}

    def _map(self, fn, items: list, node_of=lambda item: item.node_id) -> list:
        """fn over items on the node threads (or in a loop), each waiting for its device's turn (max_concurrent);
        a stop is raised once every call has returned."""
        if self.pool is None:
            return [fn(item) for item in items]

        def in_turn(item):
            gate = self.gates.get(node_of(item))
            if gate is None:
                return fn(item)
            with gate:
                return fn(item)

        futures = [self.pool.submit(in_turn, item) for item in items]
        outcomes, abandoned = [], None
        for future in futures:  # wait for every node, so none is still writing when we go on
            try:
                outcomes.append(future.result())
            except RoundAbandoned as exc:
                abandoned = exc
        if abandoned is not None:
            raise abandoned
        return outcomes

    def run_round(self, jobs: list[NodeJob], trainers: dict[int, Trainer] | None = None,
                  mid_round: MidRoundPlan | None = None, moves: list[tuple[int, int, int]] = ()) -> RoundOutcome:
        self.transfer(moves, trainers)
        evaluations = MidRound(mid_round, SummedStates(self.master_device)) if mid_round and mid_round.steps else None
        if self.streaming is not None:
            combined, faults = self._run_streaming(jobs, trainers, evaluations)
        elif any(job.sync_gradients for job in jobs):
            combined, faults = self._run_synchronous(jobs, evaluations)
        else:
            combined, faults = self._run_plain(jobs, evaluations)
        for t, rows in (evaluations.rows if evaluations is not None else {}).items():
            if t in combined:  # a trainer whose every node failed keeps no row
                combined[t].mid_round = rows
        return RoundOutcome(combined, faults)

    def _run_plain(self, jobs: list[NodeJob], evaluations: MidRound | None):
        """Each node's round start to end (run_node), or paused at the mid-round evaluations."""
        if not self.sync.exact:  # each trainer's master flattened once, not once per node
            flat = {}
            for job in jobs:
                if job.trainer_id not in flat:
                    device = next(iter(job.master.values())).device
                    flat[job.trainer_id] = flatten(job.master, sorted(job.master), device)
            jobs = [dataclasses.replace(job, flat_master=flat[job.trainer_id]) for job in jobs]
        if evaluations is None and not self.stacked:
            outcomes = self._map(lambda job: run_node(self.nodes[job.node_id], job, self.sync), jobs)
        else:  # paused at the evaluations (stacked: none, or some), each node's outcome as run_node makes it
            evaluations = evaluations or MidRound(MidRoundPlan([], None), None)
            outcomes = list(evaluated_round(self.nodes, jobs, evaluations,
                                            partial(self._advance, sync=self.sync, release_paused=True),
                                            self.steps_of).values())
        faults = [o for o in outcomes if isinstance(o, NodeFault)]
        masters = {j.trainer_id: j.master for j in jobs}
        members = {t: sum(j.trainer_id == t for j in jobs) for t in masters}
        return combine([o for o in outcomes if isinstance(o, NodeResult)], self.plan, self.master_device, masters,
                       members), faults

    def _run_streaming(self, jobs: list[NodeJob], trainers: dict[int, Trainer], evaluations: MidRound | None):
        """A Streaming DiLoCo round (distributed/streamed.py); a stop leaves it at once, every node together."""
        ended, errors = streamed_round(
            self.streaming, self.sync, self.nodes, jobs, trainers, _Wires(self.sync, self.master_device),
            self._advance, evaluations, self.steps_of)
        outcomes = [o for o in ended.values() if o is not LEFT]
        combined = combine([o for o in outcomes if isinstance(o, NodeResult)], self.plan, self.master_device,
                           streamed=True)
        for t, message in errors.items():
            if t in combined:
                combined[t].outer_error = message
        return combined, [o for o in outcomes if isinstance(o, NodeFault)]

    def _run_synchronous(self, jobs: list[NodeJob], evaluations: MidRound | None):
        """A DDP / SNOO round (distributed/synchronous.py): the gradients averaged after every inner step."""
        ended = synchronous_round(self.nodes, jobs, SummedGradients(), self._advance, evaluations)
        outcomes = list(ended.values())
        return (combine([o for o in outcomes if isinstance(o, NodeResult)], self.plan, self.master_device,
                        identical=True), [o for o in outcomes if isinstance(o, NodeFault)])

    def _advance(self, node_ids: list[int], round_steps: dict, job_of: dict, sync: OuterSync | None = None,
                 release_paused: bool = False) -> list:
        """Those nodes to their next pause (distributed/node_round.py: advance), each in its device's turn."""
        return self._map(lambda n: advance(round_steps[n], job_of[n], self.nodes[n], sync, release_paused), node_ids,
                         int)

    def agree(self, flag: bool) -> bool:
        """Whether any node's process has `flag` set (one process here; an all-reduce under torchrun)."""
        return flag

    def gather_optimizer_states(self, local: list) -> list:
        return local

    def transfer(self, moves: list[tuple[int, int, int]], trainers: dict[int, Trainer], kind: str = "weights",
                 compression: OuterSync | None = None) -> None:
        """Every trainer's state is in this process: nothing travels (Traffic counts what would). A lossy
        `compression` (merge_compression) still changes the state as its receiver would decode it."""
        if compression is None or compression.exact:
            return
        for t, source, target in moves:
            if source != target:
                trainers[t].load_transfer(compression.round_trip(trainers[t].transfer_tensors()))

    def evaluate(self, holders: dict[int, tuple[int, dict[str, torch.Tensor]]], evaluator: Evaluator) -> dict:
        return {t: evaluator.evaluate(weights) for t, (_, weights) in holders.items()}

    def total_sent(self) -> dict[str, int] | None:
        return None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


class _Wires:
    """A fragment's wires in this process, kept at the send: the good nodes' summed at the landing (exact), or
    every member's in node-id order (compressed: a node that contributes nothing sends an empty wire, as under
    torchrun, so the ring has an owner for each member's shard)."""

    def __init__(self, sync: OuterSync, device: str) -> None:
        self.sync, self.device = sync, device

    def start(self, trainer_id: int, wires: list[torch.Tensor | None], numel: int) -> list[torch.Tensor]:
        if self.sync.exact:
            return [w for w in wires if w is not None]
        return [empty_wire(self.sync, numel, self.device) if w is None else w for w in wires]

    def land(self, wires: list[torch.Tensor]):
        if not wires:
            return None
        return sum_wires(wires, self.device) if self.sync.exact else wires
