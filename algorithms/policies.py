"""Trainer merging (paper section 4.1): which trainers merge, and the batch-weighted average.

A merge replaces a group of trainers by one representative whose parameters are the average of the
group's parameters with weights proportional to their requested batch sizes. Only floating-point
tensors are averaged; integer buffers (counters, position ids) are taken from the survivor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MergePlan:
    survivor: int  # trainer id kept
    members: tuple[int, ...]  # all merged trainer ids, survivor included
    weights: tuple[float, ...]  # one per member, summing to 1

    def __post_init__(self) -> None:
        # A merge of a trainer with itself would delete it without any averaging.
        if len(self.members) < 2 or len(set(self.members)) != len(self.members) or self.members[0] != self.survivor:
            raise ValueError(f"a merge needs distinct trainers with the survivor first, got {self.members}")
        if len(self.weights) != len(self.members):
            raise ValueError("one weight per merged trainer")


def batch_weights(requested_batches: list[int]) -> list[float]:
    total = sum(requested_batches)
    if total <= 0:
        return [1.0 / len(requested_batches)] * len(requested_batches)
    return [b / total for b in requested_batches]


def weighted_average(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """Average floating-point entries with `weights` (in fp32 or better); others come from states[0]."""
    out = {}
    for name, first in states[0].items():
        if not torch.is_floating_point(first):
            out[name] = first.clone()
            continue
        acc = torch.zeros_like(first, dtype=torch.promote_types(first.dtype, torch.float32))
        for state, w in zip(states, weights):
            acc.add_(state[name].to(acc.dtype), alpha=w)
        out[name] = acc.to(first.dtype)
    return out


class MergePolicy(ABC):
    name: str

    def should_merge(self, outer_step: int, frequency: int, num_trainers: int) -> bool:
        return frequency > 0 and num_trainers > 1 and outer_step % frequency == 0

    def decide(self, outer_step: int, frequency: int, requested: dict[int, int]) -> MergePlan | None:
        """The merge at this outer step (requested: each live trainer's requested batch), or None."""
        return self.plan(requested) if self.should_merge(outer_step, frequency, len(requested)) else None

    @abstractmethod
    def plan(self, requested: dict[int, int]) -> MergePlan:
        """requested: trainer id -> requested batch. Ties are broken by the smaller trainer id."""


class WorstWithWorst(MergePolicy):
    """The paper's policy: the two trainers with the smallest requested batches merge."""

    name = "worst_with_worst"

    def plan(self, requested):
        a, b = sorted(requested, key=lambda t: (requested[t], t))[:2]
        # The larger request of the pair survives (ties: the smaller id).
        survivor = b if requested[b] > requested[a] else a
        members = (survivor, b if survivor == a else a)
        return MergePlan(survivor, members, tuple(batch_weights([requested[m] for m in members])))


class BestWithWorst(MergePolicy):
    """The trainer with the largest requested batch absorbs the one with the smallest (two distinct trainers).

    worst: smallest request, ties to the smaller id; best: largest request among the others, ties to the
    smaller id. With all requests equal (batch 1 everywhere at the paper's start) T1 absorbs T0.
    """

    name = "best_with_worst"

    def plan(self, requested):
        worst = min(requested, key=lambda t: (requested[t], t))
        best = min((t for t in requested if t != worst), key=lambda t: (-requested[t], t))
        members = (best, worst)
        return MergePlan(best, members, tuple(batch_weights([requested[m] for m in members])))


MERGE_POLICIES = {cls.name: cls for cls in (WorstWithWorst, BestWithWorst)}


def build_merge_policy(name: str) -> MergePolicy:
    if name not in MERGE_POLICIES:
        raise ValueError(f"unknown merging_policy '{name}'; choose from {', '.join(MERGE_POLICIES)}")
    return MERGE_POLICIES[name]()
