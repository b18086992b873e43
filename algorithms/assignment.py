"""Node assignment: how many nodes each trainer gets, and which ones.

Counts are proportional to each trainer's requested batch (not to nodes x batch, which feeds on
itself), every live trainer keeps at least one node, and the rounding uses largest remainders.
Nodes stay with their trainer where possible, so inner optimizer state is kept.
"""

from __future__ import annotations

import math


def node_counts(requested: dict[int, int], total_nodes: int) -> dict[int, int]:
    """trainer id -> number of nodes; sums to total_nodes, each >= 1."""
    trainers = sorted(requested)
    if len(trainers) > total_nodes:
        raise ValueError(f"{len(trainers)} trainers cannot each get a node out of {total_nodes}")
    spare = total_nodes - len(trainers)  # one node each is guaranteed; the rest is shared
    total = sum(requested.values())
    shares = {t: spare * requested[t] / total for t in trainers}
    counts = {t: 1 + math.floor(shares[t]) for t in trainers}
    left = total_nodes - sum(counts.values())
    # Largest remainder first; ties go to the larger request, then the smaller id.
    for t in sorted(trainers, key=lambda t: (-(shares[t] - math.floor(shares[t])), -requested[t], t))[:left]:
        counts[t] += 1
    return counts


def assign_nodes(counts: dict[int, int], previous: dict[int, int | None]) -> dict[int, list[int]]:
    """trainer id -> node ids. previous: node id -> trainer it served last round (None = free).

    A trainer keeps its own nodes (lowest ids first) up to its count; freed nodes go, in id order,
    to the trainers (in id order) that need more.
    """
    result: dict[int, list[int]] = {t: [] for t in counts}
    free = []
    for node in sorted(previous):
        owner = previous[node]
        if owner in result and len(result[owner]) < counts[owner]:
            result[owner].append(node)
        else:
            free.append(node)
    for t in sorted(counts):
        while len(result[t]) < counts[t]:
            result[t].append(free.pop(0))
    return result
