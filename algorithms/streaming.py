"""Streaming DiLoCo (Douillard et al. 2025): the model in F fragments whose outer syncs are staggered
through the round, each overlapped with `sync_delay` inner steps of compute.

Fragments. The model's floating tensors, in model order, are cut into layer units (a transformer block:
every tensor whose name runs through the same numbered module, `model.layers.3.`; the tensors before the
first block, the embeddings, join the first block, and those after a block, the final norm and the head,
join it), and the units into F contiguous fragments balanced by size (each cut at the unit boundary
closest to an equal share). A model without numbered blocks has one unit per tensor.

Schedule. Fragment f's reduction lands after inner step e_f = (f + 1) H / F (rounded down) of every
round and is sent tau = `sync_delay` inner steps earlier, after step e_f - tau; in between the nodes keep
training on their own weights (under torchrun the collective is in flight then). The delay counts back
from the landing so that the last fragment lands at the round boundary: merges, node moves, batch tests
and checkpoints happen on round boundaries, where nothing is in flight. F = 1, tau = 0 is DiLoCo: one
sync after step H. With tau < H / F a fragment is sent only after the one before it landed.

Landing. The fragment's outer step runs on the fragment's tensors only (SGD keeps its momentum per
tensor, so each fragment's outer state advances at its own syncs: one outer optimizer state per
fragment, as torchft's _StreamingDiLoCoFragment keeps), then each node mixes the new global fragment into
its own: local <- alpha x local + (1 - alpha) x global (`fragment_alpha`, the weight of the node's own copy, as
the paper's alpha and torchft's `fragment_update_alpha`: 0 takes the global fragment, 1 keeps the local one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_BLOCK = re.compile(r"^(.*?\.\d+)\.")  # the name through its first numbered module: "model.layers.3"

FLAG_BYTES = 4  # each node's fragment payload carries one fp32: 1 when it contributes, 0 when it failed


def layer_units(names: list[str]) -> list[list[str]]:
    """The model's tensor names (in model order) grouped into layer units (see the module docstring)."""
    units: list[list[str]] = []
    before: list[str] = []  # tensors ahead of the first block
    last_key = None
    for name in names:
        match = _BLOCK.match(name)
        key = match.group(1) if match else None
        if key is not None and key != last_key:
            units.append([name])
            last_key = key
        elif units:
            units[-1].append(name)  # the same block, or a tensor after it (norm, head)
        else:
            before.append(name)
    if not units:
        return [[name] for name in before]
    units[0][:0] = before
    return units


def fragment_names(names: list[str], numels: dict[str, int], fragments: int) -> list[list[str]]:
    """`fragments` contiguous groups of layer units balanced by size; each group's names sorted (the order
    in which its pseudo-gradient is flattened). Raises ValueError when there are fewer units than fragments."""
    units = layer_units(names)
    if fragments > len(units):
        raise ValueError(f"the model has {len(units)} layers (blocks, embeddings and head joining their "
                         f"neighbours): at most that many fragments")
    sizes = [sum(numels[n] for n in unit) for unit in units]
    total = sum(sizes)
    cumulative = [sum(sizes[:i + 1]) for i in range(len(sizes))]  # size up to and including unit i
    cuts, start = [], 0
    for f in range(1, fragments):
        target = total * f / fragments
        # the last unit of fragment f-1: leaves at least one unit for each fragment still to come
        candidates = range(start, len(units) - (fragments - f))
        end = min(candidates, key=lambda i: (abs(cumulative[i] - target), i))
        cuts.append(end + 1)
        start = end + 1
    bounds = [0, *cuts, len(units)]
    return [sorted(n for unit in units[a:b] for n in unit) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class SyncEvent:
    step: int  # inner steps taken in the round when it happens
    fragment: int
    lands: bool  # False: the fragment's pseudo-gradients are sent; True: their average lands


def sync_schedule(num_inner_steps: int, fragments: int, delay: int) -> list[SyncEvent]:
    """The round's sends and landings in the order they happen (at one step, a send before a landing)."""
    if not 1 <= fragments <= num_inner_steps:
        raise ValueError(f"sync_fragments {fragments} must be between 1 and num_inner_steps {num_inner_steps}")
    lands = [(f + 1) * num_inner_steps // fragments for f in range(fragments)]
    gap = min(b - a for a, b in zip([0, *lands], lands))
    if not 0 <= delay < gap:
        raise ValueError(f"sync_delay {delay} must be below the {gap} inner steps between two fragments' syncs")
    events = [SyncEvent(land - delay, f, False) for f, land in enumerate(lands)]
    events += [SyncEvent(land, f, True) for f, land in enumerate(lands)]
    return sorted(events, key=lambda e: (e.step, e.lands, e.fragment))


@torch.no_grad()
def mix_fragment(local: dict[str, torch.Tensor], global_state: dict[str, torch.Tensor], names: list[str],
                 alpha: float) -> None:
    """local <- (1 - alpha) x global + alpha x local, in place, for the fragment's tensors (fp32 arithmetic).
    alpha is the local copy's weight: 0 copies, so the node holds exactly the global fragment; 1 leaves it alone."""
    if alpha == 1.0:
        return
    for name in names:
        own, new = local[name], global_state[name].to(local[name].device)
        if alpha == 0.0:
            own.copy_(new)
        else:
            own.copy_((1.0 - alpha) * new.float() + alpha * own.float())


@dataclass(frozen=True)
class StreamingPlan:
    """The fragments (names, each sorted) and the round's schedule; `fragment_alpha` for the landings."""

    fragments: list[list[str]]
    events: list[SyncEvent]
    alpha: float

    @classmethod
    def build(cls, names: list[str], numels: dict[str, int], num_inner_steps: int, fragments: int, delay: int,
              alpha: float) -> StreamingPlan:
        return cls(fragment_names(names, numels, fragments), sync_schedule(num_inner_steps, fragments, delay), alpha)

    @property
    def pauses(self) -> list[int]:
        """The inner-step counts after which a node's round pauses for a send or a landing."""
        return sorted({e.step for e in self.events})

    def events_at(self, step: int) -> list[SyncEvent]:
        return [e for e in self.events if e.step == step]

    def flat_order(self) -> list[str]:
        """Every name in the order a node's error-feedback residual holds them: fragment by fragment."""
        return [n for names in self.fragments for n in names]

    def offsets(self, numels: dict[str, int]) -> list[tuple[int, int]]:
        """(start, end) of each fragment in that flat order."""
        out, start = [], 0
        for names in self.fragments:
            size = sum(numels[n] for n in names)
            out.append((start, start + size))
            start += size
        return out
