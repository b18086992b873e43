"""A compressed outer sync as a ring of quantized shards, under torchrun (algorithms/outer_sync.py has the math).

A trainer of n members cuts each node's encoded payload into n chunk-aligned shards; shard j goes to the
member of group rank j (the j-th of the sorted members: how process groups number their ranks) in one
all_to_all_single (a reduce-scatter of encoded shards). The owner decodes the good nodes' shards, sums them in
fp32 in node-id order, re-encodes the mean, and sends it to every member in a second all_to_all_single (an
all-gather). A streamed fragment's ring carries each sender's 4 flag bytes with every shard message; its first
half is in flight while the nodes train through `sync_delay`, the second runs at the landing.

`ordered_sum` is the same shape without compression: the batch-test statistics summed in node-id order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from algorithms.outer_sync import OuterSync, RingArrival
from algorithms.streaming import FLAG_BYTES


@dataclasses.dataclass
class RingHalf:
    """A fragment's ring between its two halves: the shards received by this rank (one per member, each with its
    flag), their sizes and the fragment's entries."""

    received: torch.Tensor
    sizes: list[int]
    numel: int


class QuantizedRing:
    """all_to_all(tensor, in_splits, out_splits, members, async_op) -> (received, work): the backend's counted
    collective."""

    def __init__(self, sync: OuterSync, rank: int, all_to_all: Callable) -> None:
        self.sync, self.rank, self.all_to_all = sync, rank, all_to_all

    def mean(self, master: dict[str, torch.Tensor], payload: torch.Tensor, numel: int, members: tuple[int, ...],
             good: list[int], shares: list[float] | None) -> dict[str, torch.Tensor]:
        """The trainer's node mean: master minus the decoded mean of the good nodes' pseudo-gradients."""
        ranks = sorted(members)  # shard j's owner: group rank j
        n, mine = len(ranks), ranks.index(self.rank)
        shards = self.sync.shards(payload, numel, n)
        sizes = [s.numel() for s in shards]
        received, _ = self.all_to_all(torch.cat(shards), sizes, [sizes[mine]] * n, members)
        # one part per member, each sizes[mine] long: a list split (an int split of an empty shard gives one part)
        parts = dict(zip(ranks, received.split([sizes[mine]] * n)))
        a, b = self.sync.ring_spans(numel, n)[mine]
        device = next(iter(master.values())).device
        reduced = self.sync.reduce_shard([parts[g] for g in good], b - a, shares, device)
        gathered, _ = self.all_to_all(reduced.repeat(n), [sizes[mine]] * n, sizes, members)
        return self.sync.ring_mean(master, list(gathered.split(sizes)))

    def send_fragment(self, wire: torch.Tensor, numel: int, members: tuple[int, ...]) -> tuple:
        """The first half, launched: this node's fragment wire (payload and flag) as shards to their owners.
        Returns (work, RingHalf)."""
        n, mine = len(members), sorted(members).index(self.rank)
        flag = wire[-FLAG_BYTES:]
        shards = [torch.cat([s, flag]) for s in self.sync.shards(wire[:-FLAG_BYTES], numel, n)]
        sizes = [s.numel() for s in shards]
        received, work = self.all_to_all(torch.cat(shards), sizes, [sizes[mine]] * n, members, async_op=True)
        return work, RingHalf(received, sizes, numel)

    def land_fragment(self, half: RingHalf, members: tuple[int, ...], device: str) -> RingArrival:
        """The second half, once the shards arrived: this rank's shard reduced from the nodes that contributed
        (node-id order), re-encoded and sent to every member with a flag (whether any contributed)."""
        ranks = sorted(members)
        n, mine = len(ranks), ranks.index(self.rank)
        a, b = self.sync.ring_spans(half.numel, n)[mine]
        parts = dict(zip(ranks, half.received.split([half.sizes[mine]] * n)))
        good = [parts[r][:-FLAG_BYTES] for r in ranks if int(parts[r][-FLAG_BYTES]) == 1]
        reduced = self.sync.reduce_shard(good, b - a, device=device) if good else \
            torch.zeros(half.sizes[mine] - FLAG_BYTES, dtype=torch.uint8, device=device)
        flag = torch.tensor([1 if good else 0, 0, 0, 0], dtype=torch.uint8, device=device)
        gathered, _ = self.all_to_all(torch.cat([reduced, flag]).repeat(n), [half.sizes[mine]] * n, half.sizes,
                                      members)
        wires = gathered.split(half.sizes)
        return RingArrival([w[:-FLAG_BYTES] for w in wires], any(int(w[-FLAG_BYTES]) == 1 for w in wires))


def ordered_sum(tensor: torch.Tensor, members: tuple[int, ...], rank: int, all_to_all: Callable) -> torch.Tensor:
    """SUM over the group `members` added in node-id order, as the simulated cluster adds
    (calc_batch.trainer_statistics): a reduce-scatter whose shard owners add the members' shards in rank order,
    then an all-gather. The same digits on both backends, whatever order the backend's all-reduce adds in (a
    difference of close sums amplifies the last digit); the same bytes, over the ranks, as a ring all-reduce.
    all_to_all(tensor, in_splits, out_splits, members) -> (received, work): the backend's counted collective."""
    ranks, n = sorted(members), len(members)
    mine = ranks.index(rank)
    base, extra = divmod(tensor.numel(), n)
    sizes = [base + (j < extra) for j in range(n)]
    received, _ = all_to_all(tensor, sizes, [sizes[mine]] * n, members)
    parts = received.split([sizes[mine]] * n)  # a list split: an empty shard still gives n parts
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    gathered, _ = all_to_all(total.repeat(n), [sizes[mine]] * n, sizes, members)
    return gathered
