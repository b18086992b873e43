"""The plain DiLoCo round's mean, written once for both backends (as distributed/streamed.py and synchronous.py write
theirs): each process adds up its own good nodes, and a small transport per backend carries what crosses processes.
`InProcessBackend` holds every node, so its transport moves nothing (`LocalWeights`); `TorchrunBackend` holds one,
and its transport is its trainer group's collectives (torchrun_backend.py `_GroupWeights`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from algorithms.outer_sync import OuterSync, flatten, unflatten


class WeightsTransport(Protocol):
    """A trainer's group as its round's mean sees it: how the group syncs (`sync`), how many nodes it has this round,
    failed ones included (`group_size`: the owners of a compressed ring), and what crosses processes when it averages
    its nodes. `local`: this process's nodes of the trainer, by id: a compressed outer sync's payload, or None for a
    node that failed (it still takes part in its group's collectives)."""

    sync: OuterSync
    group_size: int

    def sum(self, total: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of every process's `total` (fp32)."""

    def payloads(self, local: dict[int, torch.Tensor | None], good_ids: list[int]) -> list[torch.Tensor]:
        """The good nodes' payloads, in `good_ids` order (every process gets all of them: an all-gather)."""

    def ring_mean(self, master: dict[str, torch.Tensor], local: dict[int, torch.Tensor | None], good_ids: list[int],
                  shares: list[float] | None) -> dict[str, torch.Tensor]:
        """master minus the good nodes' mean pseudo-gradient, reduced as a ring of quantized shards."""


def node_mean(master: dict[str, torch.Tensor], local: dict[int, dict[str, torch.Tensor] | None],
              payloads: dict[int, torch.Tensor | None], good_ids: list[int], shares: list[float] | None,
              group: WeightsTransport, device: str) -> dict[str, torch.Tensor]:
    """A trainer's node mean after a plain round, in fp32 on the master's device. Exact: the good nodes' weights
    summed in node-id order (this process's `local` ones here, the others' by the transport), each times its token
    share under inner_steps_by_speed (`shares`, in `good_ids` order), divided by their count otherwise; `device`:
    where the sum travels. Compressed: master minus the mean of the decoded pseudo-gradients (`payloads`), a ring
    among the group's several members for a reducible compression, else every good payload decoded. group: the
    trainer's group and its transport (in this process, LocalWeights; under torchrun, its collectives)."""
    sync = group.sync
    if not sync.exact:
        if sync.ring and group.group_size > 1:
            return group.ring_mean(master, payloads, good_ids, shares)
        return sync.node_mean(master, group.payloads(payloads, good_ids), shares)
    names = sorted(master)
    total = torch.zeros(sum(master[n].numel() for n in names), dtype=torch.float32, device=device)
    for node_id in sorted(local):
        state = local[node_id]
        if state is not None:
            weights = flatten(state, names, device)
            total += weights if shares is None else weights * shares[good_ids.index(node_id)]
    master_device = next(iter(master.values())).device
    total = group.sum(total).to(master_device)
    return unflatten(total if shares is not None else total / len(good_ids), master, names)


@dataclass
class LocalWeights:
    """The in-process transport: every node is in this process, so nothing crosses."""

    sync: OuterSync
    group_size: int

    def sum(self, total: torch.Tensor) -> torch.Tensor:
        return total

    def payloads(self, local: dict[int, torch.Tensor | None], good_ids: list[int]) -> list[torch.Tensor]:
        return [local[g] for g in good_ids]

    def ring_mean(self, master: dict[str, torch.Tensor], local: dict[int, torch.Tensor | None], good_ids: list[int],
                  shares: list[float] | None) -> dict[str, torch.Tensor]:
        """The ring computed in this process: what every node of a real ring ends with."""
        return self.sync.ring_node_mean(master, [local[g] for g in good_ids], self.group_size, shares)
