"""The round on real processes: each rank runs its own node; collectives replace the in-process combine.

Every rank runs the same controller (cluster/) and so takes the same decisions from the same numbers.
A trainer's weights and outer state live on the processes of its nodes only (`holds` in the controller
says which). What crosses the network, per round:

- the node facts (losses, tokens, faults, a stop) in one all_gather_object over the world;
- per trainer, within its own process group (created identically on every rank, cached by member set):
  one fp32 all-reduce (SUM) of the node weights, divided by the number of good nodes; every member then
  applies the same outer step to its own copy. A one-node trainer sends nothing;
  With outer_compression, each node instead encodes its pseudo-gradient (algorithms/outer_sync.py). bf16,
  fp8 and int8 travel as a ring of quantized shards (distributed/ring.py): the payload cut into one chunk-aligned shard
  per member, shard j sent to group rank j (all_to_all_single: a reduce-scatter of encoded shards), which
  decodes the good nodes' shards, sums them in fp32 in node-id order, re-encodes the mean and sends it to
  every member (all_to_all_single again: an all-gather); 2 (n-1) x C in all. The simulated cluster computes
  the same shards, sums and re-encodings, so both backends give the same numbers. top-k's payloads
  (values, indices) are all-gathered, n (n-1) x C, and every member decodes them all in node-id order;
- Streaming DiLoCo (sync_fragments, sync_delay): instead of the one sync at the round's end, each fragment
  travels on its own, within the same group, as an asynchronous collective (async_op=True) launched at its
  send and waited for at its landing `sync_delay` inner steps later, the node training in between: its
  fp32 weights plus a count of 1 (all-reduce SUM: the mean over the nodes counted), or its encoded
  pseudo-gradient's ring shards, each with 4 flag bytes (the first half in flight during the delay, the
  reduced shards sent back at the landing), or (top-k) its payload plus 4 flag bytes, all-gathered. A node
  that failed or left the round sends zeros and 0;
- per trainer, the batch test's sums within the same group (algorithms/calc_batch.py, StatisticsWire): one
  vector (`NodeGradientSums.vectors`: the b-weighted gradient sum and the batch, fp32 by default; the
  fp64 reference adds the plain sum for the nodes estimator; of sketch dimension with the count sketch),
  then 6 fp64 scalars (7 in the reference) measured against the trainer's mean, both summed in node-id order
  (`ordered_sum`, distributed/ring.py: reduce-scatter, owners adding in rank order, all-gather; the bytes of a ring
  all-reduce), so the statistics carry the simulated cluster's digits; the trainer's first node shares the
  resulting scalars with every rank (they take the same decision);
- `transfer`: a node that starts a round from a state it does not hold receives it from a process that
  holds it (send/recv: exactly the trainer's `transfer_bytes`); merges bring the absorbed trainers'
  states to the survivor's first node the same way, and checkpoints bring every trainer to rank 0.
- `evaluate`: each trainer is evaluated by one process that holds it; the metrics are gathered.

The collectives' plumbing (groups, counting, liveness, what all ranks sent) is distributed/collectives.py's
(`self.net`): it counts what this rank's collectives send, by #7's definitions (ring all-reduce: 2 (n-1)/n of the
payload per member; send/recv: the payload), weights traffic and batch-test statistics apart.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import torch
import torch.distributed as dist

from algorithms.calc_batch import NodeGradientSums
from algorithms.comm_plan import CommPlan
from algorithms.outer_sync import OuterSync, empty_wire
from distributed import plain
from distributed.collectives import Collectives
from distributed.liveness import CollectiveError, collective
from distributed.mid_round import MidRound, MidRoundPlan, evaluated_round
from distributed.node_round import advance, run_node, token_shares
from distributed.protocol import NodeFault, RoundOutcome, RoundResult
from distributed.ring import QuantizedRing, RingHalf, ordered_sum
from distributed.streamed import LEFT, streamed_round
from distributed.synchronous import synchronous_round
from node import Node, NodeJob, NodeResult, RoundAbandoned
from trainers import Trainer


class TorchrunBackend:
    """The torchrun backend (distributed/protocol.py): this process runs node `rank`; collectives combine."""

    def __init__(self, nodes: list[Node], rank: int, shapes: dict[str, torch.Size], comm_device: str = "cpu",
                 store=None, master_device: str = "cpu", plan: CommPlan | None = None) -> None:
        self.nodes, self.rank = nodes, rank
        self.net = Collectives(rank, comm_device, store)  # groups, counted collectives, liveness (collectives.py)
        self.plan = plan or CommPlan()  # how the round's results travel (algorithms/comm_plan.py)
        self.by_tokens = self.plan.by_tokens  # inner_steps_by_speed: nodes weigh in their trainer's mean by tokens
        self.names, self.shapes = sorted(shapes), shapes  # every floating tensor of the model, in a fixed order
        self.numel = sum(shapes[n].numel() for n in self.names)
        self.grad_numel = self.plan.sample_numel  # a gradient sample's length (trainable parameters, or sketch's k)
        # DDP / SNOO: a gradient's length (no nodes: a benchmark that drives the collectives alone)
        self.grad_params = sum(p.numel() for p in nodes[rank].params) if nodes else 0
        self.statistics_wire = self.plan.statistics_wire  # statistics_comm: the dtype the statistics' vectors use
        self.sync = self.plan.outer_sync  # outer_compression and error feedback
        self.streaming = self.plan.streaming  # sync_fragments / sync_delay: fragments synced during the round
        self.within_node = self.plan.within_node
        self.comm_device = comm_device  # NCCL reduces CUDA tensors; gloo CPU ones
        self.master_device = master_device  # where the trainers' masters (and so the node mean) live
        self.ring = QuantizedRing(self.sync, rank, lambda tensor, sent, got, members, async_op=False:
                                  self.net.all_to_all(tensor, sent, got, members, "weights", async_op))

    # -------------------------------------------------------------------------------------------
    def _flat(self, state: dict[str, torch.Tensor] | None) -> torch.Tensor:
        if state is None:
            return torch.zeros(self.numel, dtype=torch.float32, device=self.comm_device)
        return torch.cat([state[n].detach().to(self.comm_device, torch.float32).reshape(-1) for n in self.names])

    def _unflat(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for name in self.names:
            n = self.shapes[name].numel()
            out[name] = flat[start:start + n].view(self.shapes[name])
            start += n
        return out

    def run_round(self, jobs: list[NodeJob], trainers: dict[int, Trainer] | None = None,
                  mid_round: MidRoundPlan | None = None, moves: list[tuple[int, int, int]] = ()) -> RoundOutcome:
        self.transfer(moves, trainers)
        try:
            results, faults = self._run_round(jobs, trainers, mid_round)
        except CollectiveError as exc:  # only a collective's own failure: any other error is this rank's own
            raise self.net.failed(exc) from None
        # what this rank's collectives cost since the last round's end: this round, its moves, and what came after
        # the last round (outer steps' agreement, evaluations, the merge, a checkpoint)
        return RoundOutcome(results, faults, self.net.take_round_comm())

    def _run_round(self, jobs: list[NodeJob], trainers: dict[int, Trainer], mid_round: MidRoundPlan | None):
        trainer_ids = sorted({j.trainer_id for j in jobs})
        members = {t: tuple(j.node_id for j in jobs if j.trainer_id == t) for t in trainer_ids}
        for t in trainer_ids:  # new groups are made collectively, in the same order everywhere
            if len(members[t]) > 1:
                self.net.group(members[t])
        # node_schedule: a rank whose node is away has no job; it idles, taking part in world collectives only
        job = next((j for j in jobs if j.node_id == self.rank), None)
        evaluations = None
        if job is not None and mid_round is not None and mid_round.steps:
            evaluations = MidRound(mid_round, _States(self, members[job.trainer_id]))
        outcome, abandoned, outer_error = (None, False, "") if job is None else self._node_round(
            job, members[job.trainer_id], trainers, evaluations)
        good = isinstance(outcome, NodeResult)
        mine = None if job is None else job.trainer_id
        fact = {"node_id": self.rank, "trainer_id": mine, "abandoned": abandoned,
                "fault": None if good or abandoned or job is None else vars(outcome),
                "losses": outcome.step_losses if good else None, "tokens": outcome.tokens if good else 0,
                "lr": outcome.learning_rate if good else 0.0,
                # scored by the trainer's first node, whatever became of it (distributed/mid_round.py)
                "mid_round": evaluations.rows.get(mine, []) if evaluations is not None else [],
                "has_samples": good and outcome.grad_samples is not None}
        facts = sorted(self.net.gather(fact), key=lambda f: f["node_id"])
        if any(f["abandoned"] for f in facts):  # every rank leaves the round together
            raise RoundAbandoned("a stop was requested")
        faults = [NodeFault(**f["fault"]) for f in facts if f["fault"] is not None]
        good_facts = {t: [f for f in facts if f["trainer_id"] == t and f["losses"] is not None] for t in trainer_ids}
        own = good_facts.get(mine, [])  # this rank's trainer's good nodes (none when away)
        node_mean, statistics = None, None
        if self.streaming is not None:
            pass  # the fragments' outer steps ran during the round
        elif own and job.sync_gradients:  # the good nodes hold the same weights
            node_mean = _Gradients(self, members[mine]).common_weights(outcome if good else None,
                                                                       [f["node_id"] for f in own])
        elif own:  # the plain round's mean (distributed/plain.py), this rank's node and its group's collectives
            # each node's share of the tokens is known to all from the facts; node-id order, as the simulation sums
            shares = token_shares([f["tokens"] for f in own]) if self.by_tokens else None
            node_mean = plain.node_mean(job.master, {self.rank: outcome.state if good else None},
                                        {self.rank: outcome.payload if good else None},
                                        [f["node_id"] for f in own], shares, _GroupWeights(self, members[mine]),
                                        self.comm_device)
        statistics_seconds = time.perf_counter()
        if own and any(f["has_samples"] for f in own):
            statistics = self._statistics(outcome if good else None, members[mine])
        statistics_seconds = time.perf_counter() - statistics_seconds
        # The batch tests run on every rank: the trainer's first node shares its statistics' scalars.
        shared_statistics = {}
        if any(f["has_samples"] for f in facts):
            shared = self.net.gather({mine: dataclasses.replace(statistics, mean=torch.empty(0))}
                                  if statistics is not None and self.rank == members[mine][0] else {})
            shared_statistics = {t: s for part in shared for t, s in part.items()}
        scored = {f["trainer_id"]: f["mid_round"] for f in facts if f["mid_round"]}
        results = {t: trainer_result(good_facts[t], node_mean if t == mine else None, shared_statistics.get(t),
                                     outer_error if t == mine else "", scored.get(t, []))
                   for t in trainer_ids if good_facts[t]}
        if mine in results:
            results[mine].statistics_seconds = statistics_seconds
        return results, faults

    def _node_round(self, job: NodeJob, members: tuple[int, ...], trainers: dict[int, Trainer],
                    evaluations: MidRound | None) -> tuple[NodeResult | NodeFault | None, bool, str]:
        """This rank's node through its round, of whichever kind: (its result or fault, None when it left; whether
        it left on a stop; its trainer's streamed outer-step error)."""
        if self.streaming is not None:
            return self._run_streaming(job, members, trainers, evaluations)
        if job.sync_gradients:  # DDP / SNOO (distributed/synchronous.py): one all-reduce per inner step
            ended = synchronous_round(self.nodes, [job], _Gradients(self, members),
                                      partial(_advance_or_leave, self.nodes), evaluations)
        elif evaluations is not None:  # paused at each evaluation: the trainer's group averages its nodes
            ended = evaluated_round(self.nodes, [job], evaluations,
                                    partial(_advance_or_leave, self.nodes, sync=self.sync))
        else:
            try:
                return run_node(self.nodes[self.rank], job, self.sync), False, ""
            except RoundAbandoned:
                return None, True, ""
        left = ended[self.rank] is LEFT
        return (None if left else ended[self.rank]), left, ""

    def _run_streaming(self, job: NodeJob, members: tuple[int, ...], trainers: dict[int, Trainer],
                       evaluations: MidRound | None):
        """This rank's node through a Streaming DiLoCo round (distributed/streamed.py): at each send its fragment
        wire goes into an asynchronous collective of its trainer's group (all-reduce exact, the ring's shards, or
        all-gather top-k) and the node trains on; at the landing the rank waits for it, steps its copy of the
        trainer's fragment and mixes it into its node. A node that failed or left the round (a stop) sends
        empty wires until the round ends, so its group's collectives still match; every member steps."""
        ended, errors = streamed_round(self.streaming, self.sync, self.nodes, [job], trainers,
                                       _Collectives(self, members), partial(_advance_or_leave, self.nodes),
                                       evaluations)
        outcome = ended.get(self.rank)
        abandoned = outcome is LEFT
        return (None if abandoned else outcome), abandoned, errors.get(job.trainer_id, "")

    def _statistics(self, outcome: NodeResult | None, members: tuple[int, ...]):
        """The trainer's batch-test statistics: the nodes' vectors all-reduced in the wire dtype, then the fp64
        scalars each node measures against the trainer's mean (StatisticsWire)."""
        wire = self.statistics_wire
        have = outcome is not None and outcome.grad_samples is not None
        if have:
            share = NodeGradientSums.of(outcome.grad_samples, outcome.sample_batches, self.within_node, wire)
            vectors = share.vectors()
        else:  # this node failed: it adds nothing, but takes part in its group's reductions
            size = wire.vectors_size(self.grad_numel, self.within_node)
            vectors = torch.zeros(size, dtype=wire.dtype, device=self.comm_device)
        if len(members) > 1:
            vectors = ordered_sum(vectors, members, self.rank, partial(self.net.all_to_all, kind="statistics"))
        mean = wire.reduced_mean(vectors, self.within_node)
        scalars = share.scalars(mean) if have else torch.zeros(wire.scalars_size, dtype=torch.float64)
        if len(members) > 1:
            scalars = ordered_sum(scalars, members, self.rank, partial(self.net.all_to_all, kind="statistics"))
        return wire.statistics(vectors.cpu(), scalars.cpu(), self.within_node)

    # -------------------------------------------------------------------------------------------
    def transfer(self, moves: list[tuple[int, int, int]], trainers: dict[int, Trainer], kind: str = "weights",
                 compression: OuterSync | None = None) -> None:
        """(trainer, from node, to node), in the same order on every rank: the sender's trainer state
        (`transfer_tensors`) replaces the receiver's copy. Blocking pairs in one global order cannot deadlock.
        kind: weights (node moves, merges: #7's traffic) or checkpoint (to rank 0, for writing).
        compression: a lossy merge_compression encodes what travels; the receiver decodes it."""
        lossy = compression is not None and not compression.exact
        for t, source, target in moves:
            if self.rank not in (source, target) or source == target:
                continue
            trainer = trainers[t]
            numel = trainer.transfer_bytes() // 4
            start = time.perf_counter()
            try:
                if self.rank == source:
                    flat = torch.cat([x.detach().reshape(-1) for x in trainer.transfer_tensors()])
                    if lossy:
                        flat = compression.compressor.encode(flat)
                    flat = flat.to(self.comm_device)
                    with collective():
                        dist.send(flat, dst=target)
                    self.net.count(kind, flat.numel() * flat.element_size(), time.perf_counter() - start)
                else:
                    if lossy:
                        flat = torch.empty(compression.payload_bytes(numel), dtype=torch.uint8, device=self.comm_device)
                    else:
                        flat = torch.empty(numel, dtype=torch.float32, device=self.comm_device)
                    with collective():
                        dist.recv(flat, src=source)
                    trainer.load_transfer(compression.compressor.decode(flat.cpu(), numel) if lossy else flat.cpu())
                    self.net.waited(time.perf_counter() - start)
            except CollectiveError as exc:
                raise self.net.failed(exc, [source if self.rank == target else target]) from None

    def evaluate(self, holders: dict[int, tuple[int, dict[str, torch.Tensor]]], evaluator) -> dict:
        """trainer -> (node holding it, its weights): each trainer is evaluated by its holder; all get all."""
        mine = {t: evaluator.evaluate(weights) for t, (node, weights) in holders.items() if node == self.rank}
        return {t: result for part in self.net.gather(mine) for t, result in part.items()}

    def agree(self, flag: bool) -> bool:
        return self.net.agree(flag)

    def gather_optimizer_states(self, local: dict | None) -> list:
        return self.net.gather(local)

    def total_sent(self) -> dict[str, int]:
        return self.net.total_sent()

    def close(self) -> None:
        pass


def trainer_result(group: list[dict], node_mean, statistics, outer_error: str, mid_round: list) -> RoundResult:
    """A trainer's RoundResult from its good nodes' facts (the same on every rank)."""
    return RoundResult(
        node_mean=node_mean, nodes=[f["node_id"] for f in group],
        train_loss=sum(sum(f["losses"]) / len(f["losses"]) for f in group) / len(group),
        tokens=sum(f["tokens"] for f in group), optimizer_steps=sum(len(f["losses"]) for f in group),
        node_step_losses={f["node_id"]: f["losses"] for f in group},
        learning_rate=group[0]["lr"], statistics=statistics, outer_error=outer_error,
        mid_round=mid_round)


class _Collectives:
    """A fragment's wires under torchrun (distributed/streamed.py's FragmentTransport): an asynchronous collective
    of the trainer's group per fragment, launched at the send and waited for at the landing."""

    def __init__(self, backend: TorchrunBackend, members: tuple[int, ...]) -> None:
        self.backend, self.members = backend, members

    def start(self, trainer_id: int, wires: list[torch.Tensor | None], numel: int) -> tuple:
        """Launch (async_op): the exact wires are summed, the encoded ones sent as a ring's shards (each with the
        node's flag) or (top-k) gathered."""
        (wire,) = wires  # this rank's node
        backend, members = self.backend, self.members
        if wire is None:
            wire = empty_wire(backend.sync, numel, backend.comm_device)
        on_device = wire.to(backend.comm_device)
        n = len(members)
        if n == 1:
            return None, on_device
        if backend.sync.ring:
            return backend.ring.send_fragment(on_device, numel, members)
        nbytes = on_device.numel() * on_device.element_size()
        if backend.sync.exact:
            with collective():
                work = dist.all_reduce(on_device, group=backend.net.group(members), async_op=True)
            backend.net.count("weights", 2 * (n - 1) / n * nbytes, 0.0)
            return work, on_device
        parts = [torch.empty_like(on_device) for _ in members]
        with collective():
            work = dist.all_gather(parts, on_device, group=backend.net.group(members), async_op=True)
        backend.net.count("weights", (n - 1) * nbytes, 0.0)
        return work, parts

    def land(self, handle: tuple):
        """Wait for the fragment's collective (the seconds counted are only what the overlap did not hide)."""
        work, arrived = handle
        backend, members = self.backend, self.members
        start = time.perf_counter()
        if work is not None:
            with collective():
                work.wait()
                if backend.comm_device != "cpu" and torch.cuda.is_available():
                    torch.cuda.synchronize(backend.comm_device)
        if isinstance(arrived, RingHalf):
            arrived = backend.ring.land_fragment(arrived, members, backend.master_device)
        backend.net.waited(time.perf_counter() - start)
        if isinstance(arrived, list):  # gathered in member order: into node-id order, as the simulation sums
            return [arrived[members.index(n)] for n in sorted(members)]
        if len(members) == 1 and not backend.sync.exact:
            return [arrived]
        return arrived


class _GroupWeights:
    """The plain round's transport under torchrun (distributed/plain.py's WeightsTransport): this rank's node's part,
    summed (all-reduce), all-gathered (top-k) or reduced in a ring of quantized shards within the trainer's group;
    a node that failed sends zeros."""

    def __init__(self, backend: TorchrunBackend, members: tuple[int, ...]) -> None:
        self.backend, self.members = backend, members
        self.sync, self.group_size = backend.sync, len(members)

    def sum(self, total: torch.Tensor) -> torch.Tensor:
        return self.backend.net.all_reduce(total, self.members, "weights") if len(self.members) > 1 else total

    def _own(self, local: dict[int, torch.Tensor | None]) -> torch.Tensor:
        payload, backend = local[self.backend.rank], self.backend
        return payload if payload is not None else torch.zeros(backend.sync.payload_bytes(backend.numel),
                                                               dtype=torch.uint8)

    def payloads(self, local: dict[int, torch.Tensor | None], good_ids: list[int]) -> list[torch.Tensor]:
        payload = self._own(local)
        parts = self.backend.net.all_gather(payload, self.members, "weights") if len(self.members) > 1 else [payload]
        return [parts[self.members.index(g)] for g in good_ids]

    def ring_mean(self, master: dict[str, torch.Tensor], local: dict[int, torch.Tensor | None], good_ids: list[int],
                  shares: list[float] | None) -> dict[str, torch.Tensor]:
        backend = self.backend
        return backend.ring.mean(master, self._own(local).to(backend.comm_device), backend.numel, self.members,
                                 good_ids, shares)


class _States:
    """A trainer's mid-round mean under torchrun (distributed/mid_round.py's NodeMeans): the fp32 weights and a flag
    per member (zeros from a node that offers nothing) summed within the trainer's group in node-id order
    (`ordered_sum`: the simulated cluster's digits), counted as evaluation bytes; the first member scores it."""

    def __init__(self, backend: TorchrunBackend, members: tuple[int, ...]) -> None:
        self.backend, self.members = backend, members

    def mean(self, trainer_id: int, node_ids: list[int], states: list[dict[str, torch.Tensor] | None]):
        (state,) = states  # this rank's node
        backend, members = self.backend, tuple(sorted(self.members))  # node-id order
        flags = torch.zeros(len(members), device=backend.comm_device)
        if state is not None:
            flags[members.index(backend.rank)] = 1.0
        wire = torch.cat([backend._flat(state), flags])
        if len(members) > 1:
            wire = ordered_sum(wire, members, backend.rank, partial(backend.net.all_to_all, kind="evaluation"))
        offered = [m for m, flag in zip(members, wire[-len(members):].tolist()) if flag]
        if backend.rank != min(members) or not offered:
            return None
        return backend._unflat((wire[:-len(members)] / len(offered)).to(backend.master_device)), offered


class _Gradients:
    """A synchronous trainer's gradients under torchrun (distributed/synchronous.py's GradientTransport): one
    all-reduce (SUM) of the trainer's group per inner step, the fp32 gradient and a count of 1 (0 and zeros from
    a node that offers nothing), so the mean is over the nodes that offered one."""

    def __init__(self, backend: TorchrunBackend, members: tuple[int, ...]) -> None:
        self.backend, self.members = backend, members

    def mean(self, trainer_id: int, gradients: list[torch.Tensor | None]) -> torch.Tensor | None:
        (grad,) = gradients  # this rank's node
        if len(self.members) == 1:
            return grad
        backend = self.backend
        if grad is None:
            wire = torch.zeros(backend.grad_params + 1, dtype=torch.float32, device=backend.comm_device)
        else:
            wire = torch.cat([grad.to(backend.comm_device), torch.ones(1, device=backend.comm_device)])
        total = backend.net.all_reduce(wire, self.members, "weights")
        count = float(total[-1])
        return total[:-1] / count if count else None

    def common_weights(self, outcome: NodeResult | None, good_ids: list[int]) -> dict[str, torch.Tensor]:
        """The trainer's weights after the round: this node's own, which every good node shares. When a member
        failed, the lowest good node's reach every member (a broadcast: a fault's cost, outside the accounting)."""
        backend = self.backend
        flat = backend._flat(outcome.state if outcome is not None else None)
        if len(good_ids) < len(self.members):
            with collective():
                dist.broadcast(flat, src=min(good_ids), group=backend.net.group(self.members))
        return backend._unflat(flat.to(backend.master_device))




def _advance_or_leave(nodes: list, node_ids: list[int], round_steps: dict, job_of: dict,
                      sync: OuterSync | None = None) -> list:
    """This rank's node to its next pause (released once its round ends: offload_idle_nodes); a stop request leaves
    the round (the node then sends empty wires). sync: a plain round's compressed outer sync, encoded at the end."""
    outcomes = []
    for node_id in node_ids:
        try:
            outcomes.append(advance(round_steps[node_id], job_of[node_id], nodes[node_id], sync))
        except RoundAbandoned:
            outcomes.append(LEFT)
    return outcomes
