"""The collectives' plumbing under torchrun, in one place: the trainers' process groups (made identically on every
rank, cached by member set), each collective counted (the bytes this rank sends, by #7's definitions and by kind:
weights traffic, batch-test statistics, checkpoint transfers, mid-round evaluations; and the seconds they take),
the liveness marks that name who failed when a collective does (distributed/liveness.py), and what all ranks sent
over the run. TorchrunBackend (torchrun_backend.py) and its transports call it; nothing here knows about rounds."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from distributed.liveness import CollectiveError, Liveness, collective, collective_failed
from utils.errors import UserError

KINDS = ("weights", "statistics", "checkpoint", "evaluation")


def no_comm() -> dict:
    """A round's collectives before any ran: seconds, and bytes sent by kind."""
    return {"seconds": 0.0, **{f"{kind}_bytes": 0 for kind in KINDS}}


class Collectives:
    """This rank's collectives (its `rank` in a world of `world_size`); tensors travel on `comm_device` (NCCL reduces
    CUDA tensors, gloo CPU ones)."""

    def __init__(self, rank: int, comm_device: str = "cpu", store=None) -> None:
        self.rank, self.comm_device = rank, comm_device
        self.world_size = dist.get_world_size()
        self.liveness = Liveness(store, rank, self.world_size)  # who did not arrive, or ended first, on a failure
        self.groups: dict[tuple[int, ...], object] = {}
        # bytes this rank sent over the run: the algorithm's weights traffic (#7), the batch tests' statistics,
        # trainers brought to rank 0 for checkpoints, and (evaluation) the mid-round evaluations' means, which are
        # the experimenter's, not the method's
        self.sent = {kind: 0.0 for kind in KINDS}
        self.round_comm = no_comm()

    def take_round_comm(self) -> dict:
        """What the collectives since the last call cost this rank (seconds, bytes sent by kind)."""
        comm, self.round_comm = self.round_comm, no_comm()
        return comm

    def group(self, members: tuple[int, ...]):
        """The process group of these ranks; every rank must ask for the same groups in the same order."""
        if members not in self.groups:
            with collective():
                self.groups[members] = dist.new_group(list(members))
        return self.groups[members]

    def count(self, kind: str, sent_bytes: float, seconds: float) -> None:
        self.sent[kind] += sent_bytes  # a float: a ring's 2 (n-1)/n shares add up to whole bytes over the ranks
        self.round_comm[f"{kind}_bytes"] += sent_bytes
        if kind != "evaluation":  # an evaluation's collective is the experimenter's time, not the method's
            self.round_comm["seconds"] += seconds

    def waited(self, seconds: float) -> None:
        """Seconds spent waiting for a collective counted already (a landing, a receive)."""
        self.round_comm["seconds"] += seconds

    def all_reduce(self, tensor: torch.Tensor, members: tuple[int, ...], kind: str) -> torch.Tensor:
        """SUM over the group `members` (this rank among them); the result stays on the comm device."""
        start = time.perf_counter()
        on_device = tensor.to(self.comm_device)
        with collective():
            dist.all_reduce(on_device, group=self.group(members))
            if on_device.is_cuda:  # NCCL returns at once: wait, so the seconds are the collective's
                torch.cuda.synchronize(on_device.device)
        n = len(members)
        self.count(kind, 2 * (n - 1) / n * tensor.numel() * tensor.element_size(), time.perf_counter() - start)
        return on_device

    def all_to_all(self, tensor: torch.Tensor, in_splits: list[int], out_splits: list[int],
                   members: tuple[int, ...], kind: str, async_op: bool = False):
        """The member of group rank j (the j-th of the sorted members) gets in_splits[j] entries of `tensor`;
        out_splits: what each sends this rank, in the same order. Returns (the received tensor, the work when
        async_op). What this rank sends to the others is counted."""
        start = time.perf_counter()
        on_device = tensor.to(self.comm_device)
        out = torch.empty(sum(out_splits), dtype=on_device.dtype, device=self.comm_device)
        with collective():
            work = dist.all_to_all_single(out, on_device, out_splits, in_splits, group=self.group(members),
                                          async_op=async_op)
            if not async_op and out.is_cuda:
                torch.cuda.synchronize(out.device)
        sent = (sum(in_splits) - in_splits[sorted(members).index(self.rank)]) * on_device.element_size()
        self.count(kind, sent, 0.0 if async_op else time.perf_counter() - start)
        return out, work

    def all_gather(self, tensor: torch.Tensor, members: tuple[int, ...], kind: str) -> list[torch.Tensor]:
        """Every member's tensor (same size everywhere), in the order of `members`."""
        start = time.perf_counter()
        on_device = tensor.to(self.comm_device)
        parts = [torch.empty_like(on_device) for _ in members]
        with collective():
            dist.all_gather(parts, on_device, group=self.group(members))
            if on_device.is_cuda:
                torch.cuda.synchronize(on_device.device)
        self.count(kind, (len(members) - 1) * tensor.numel() * tensor.element_size(), time.perf_counter() - start)
        return parts

    def failed(self, exc: RuntimeError, absent: list[int] | None = None) -> UserError:
        """A failed collective in one line (distributed/liveness.py): the first cause a rank recorded, else who
        ended first, or who did not arrive."""
        live = self.liveness
        return collective_failed(self.rank, exc, live.absent() if absent is None else absent, live.ended_first(),
                                 live.first_cause())

    def gather(self, value) -> list:
        """all_gather_object over the world, with an arrival mark first."""
        self.liveness.arrive()
        out: list = [None] * self.world_size
        try:
            with collective():
                dist.all_gather_object(out, value)
        except CollectiveError as exc:  # gloo / NCCL: a peer died, or a collective outlived dist_timeout_s
            raise self.failed(exc) from None
        return out

    def agree(self, flag: bool) -> bool:
        """True on every rank when it is true on any (a stop request reaches ranks at different times)."""
        value = torch.tensor([1.0 if flag else 0.0], device=self.comm_device)
        self.liveness.arrive()
        try:
            with collective():
                dist.all_reduce(value, op=dist.ReduceOp.MAX)
        except CollectiveError as exc:
            raise self.failed(exc) from None
        return bool(value.item())

    def total_sent(self) -> dict[str, int]:
        """Bytes all ranks sent over the run, by kind: one all-reduce at the end."""
        kinds = sorted(self.sent)
        totals = torch.tensor([self.sent[k] for k in kinds], dtype=torch.float64, device=self.comm_device)
        self.liveness.arrive()
        try:
            with collective():
                dist.all_reduce(totals)
        except CollectiveError as exc:
            raise self.failed(exc) from None
        return {k: int(round(float(v))) for k, v in zip(kinds, totals.cpu())}
