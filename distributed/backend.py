"""The round on real processes: each rank runs its own node; collectives replace the in-process combine.

Every rank runs the same controller (cluster.py) and so takes the same decisions; this backend gives it
the same RoundResult the simulated backend builds, from collectives over the world group:

- the node facts (losses, tokens, faults, the stop flag) in one all_gather_object;
- per trainer, one fp32 all-reduce (SUM) of its nodes' weights (other ranks add zeros), divided by
  the number of good nodes: every rank gets every trainer's new weights, so all trainers stay
  replicated and merges, evaluation and checkpoints need no further transfer;
- per trainer, the batch test's sums (`NodeGradientSums.pack()`, one fp64 buffer) and one scalar.

This first version keeps every trainer on every rank and uses world collectives; per-trainer process
groups (less traffic) are the next step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from algorithms.calc_batch import NodeGradientSums
from trainers import Node, NodeJob, NodeResult, RoundAbandoned
from utils.errors import UserError


class DistributedBackend:
    def __init__(self, nodes: list[Node], rank: int, names: list[str], shapes: dict[str, torch.Size],
                 grad_numel: int, within_node: bool) -> None:
        from cluster import NodeFault  # cluster imports this module lazily; no cycle at import time

        self._fault_type = NodeFault
        self.nodes, self.rank = nodes, rank
        self.names, self.shapes = names, shapes  # every floating tensor of the model, in a fixed order
        self.numel = sum(shapes[n].numel() for n in names)
        self.grad_numel = grad_numel  # length of a gradient sample (the trainable parameters)
        self.within_node = within_node

    def _flat(self, state: dict[str, torch.Tensor] | None) -> torch.Tensor:
        if state is None:
            return torch.zeros(self.numel, dtype=torch.float32)
        return torch.cat([state[n].detach().to("cpu", torch.float32).reshape(-1) for n in self.names])

    def _unflat(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for name in self.names:
            n = self.shapes[name].numel()
            out[name] = flat[start:start + n].view(self.shapes[name])
            start += n
        return out

    def run_round(self, jobs: list[NodeJob]):
        self.round_comm = {"seconds": 0.0, "payload_bytes": 0}  # this round's collectives (benchmarks read it)
        try:
            return self._run_round(jobs)
        except RuntimeError as exc:  # gloo / NCCL: a peer died, or a collective outlived dist_timeout_s
            raise collective_failed(self.rank, exc) from None

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        start = time.perf_counter()
        dist.all_reduce(tensor)
        self.round_comm["seconds"] += time.perf_counter() - start
        self.round_comm["payload_bytes"] += tensor.numel() * tensor.element_size()

    def _run_round(self, jobs: list[NodeJob]):
        from cluster import RoundResult, run_node

        job = next(j for j in jobs if j.node_id == self.rank)
        abandoned, outcome = False, None
        try:
            outcome = run_node(self.nodes[self.rank], job)
        except RoundAbandoned:
            abandoned = True
        good = isinstance(outcome, NodeResult)
        fact = {"node_id": job.node_id, "trainer_id": job.trainer_id, "abandoned": abandoned,
                "fault": None if good or abandoned else vars(outcome),
                "losses": outcome.step_losses if good else None, "tokens": outcome.tokens if good else 0,
                "lr": outcome.learning_rate if good else 0.0,
                "has_samples": good and outcome.grad_samples is not None}
        facts: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(facts, fact)
        if any(f["abandoned"] for f in facts):  # every rank leaves the round together
            raise RoundAbandoned("a stop was requested")
        facts.sort(key=lambda f: f["node_id"])
        faults = [self._fault_type(**f["fault"]) for f in facts if f["fault"] is not None]
        results = {}
        for t in sorted({j.trainer_id for j in jobs}):
            members = [f for f in facts if f["trainer_id"] == t and f["losses"] is not None]
            mine = good and job.trainer_id == t
            weights = self._flat(outcome.state if mine else None)
            self._all_reduce(weights)
            stats = self._statistics(outcome if mine else None, any(f["has_samples"] for f in members))
            if not members:
                continue
            results[t] = RoundResult(
                node_mean=self._unflat(weights / len(members)), nodes=[f["node_id"] for f in members],
                train_loss=sum(sum(f["losses"]) / len(f["losses"]) for f in members) / len(members),
                tokens=sum(f["tokens"] for f in members), optimizer_steps=sum(len(f["losses"]) for f in members),
                node_samples={}, node_step_losses={f["node_id"]: f["losses"] for f in members},
                learning_rate=members[0]["lr"], statistics=stats)
        return results, faults

    def _statistics(self, outcome: NodeResult | None, any_samples: bool):
        """The trainer's batch-test statistics: one packed all-reduce of the nodes' sums, one of a scalar."""
        if not any_samples:
            return None
        have = outcome is not None and outcome.grad_samples is not None
        if have:
            share = NodeGradientSums.of(outcome.grad_samples, outcome.sample_batches, self.within_node)
            buffer = share.pack()
        else:
            buffer = torch.zeros(2 * self.grad_numel + 7, dtype=torch.float64)
        self._all_reduce(buffer)
        total = NodeGradientSums.unpack(buffer)
        mean = total.weighted_sum / total.batch
        inner = torch.tensor([share.inner_sum(outcome.grad_samples, outcome.sample_batches, mean, self.within_node)
                              if have else 0.0], dtype=torch.float64)
        self._all_reduce(inner)
        return total.statistics(float(inner), self.within_node)

    def agree(self, flag: bool) -> bool:
        """True on every rank when it is true on any (a stop request reaches ranks at different times)."""
        value = torch.tensor([1.0 if flag else 0.0])
        try:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        except RuntimeError as exc:
            raise collective_failed(self.rank, exc) from None
        return bool(value.item())

    def gather_optimizer_states(self, local: dict | None) -> list:
        states: list = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(states, local)
        except RuntimeError as exc:
            raise collective_failed(self.rank, exc) from None
        return states

    def close(self) -> None:
        pass


def collective_failed(rank: int, exc: RuntimeError) -> UserError:
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    hung = "timed out" in detail.lower() or "timeout" in detail.lower()
    why = "a process did not answer within dist_timeout_s (hung?)" if hung else "another process died"
    error = UserError(f"rank {rank}: a collective failed, {why} ({detail[:160]}); with torchrun --max-restarts "
                      "the group restarts and resumes from the latest checkpoint")
    error.exit_code = 1
    return error
