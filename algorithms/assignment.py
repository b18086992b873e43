"""Node assignment: how many nodes each trainer gets, and which ones.

Counts are proportional to each trainer's requested batch (not to nodes x batch, which feeds on
itself), with a floor of one node per live trainer, rounded by largest remainders (Hamilton's method):
a trainer whose share is below one node gets exactly one, and the other trainers share the rest in
proportion; each gets the floor of its share, and the nodes left go to the largest remainders
(ties: the larger request, then the smaller id). Nodes stay with their trainer where possible, so
inner optimizer state is kept.
"""

from __future__ import annotations

import math


def node_counts(requested: dict[int, int], total_nodes: int) -> dict[int, int]:
    """trainer id -> number of nodes; sums to total_nodes, each >= 1, otherwise proportional to requested."""
    trainers = sorted(requested)
    if len(trainers) > total_nodes:
        raise ValueError(f"{len(trainers)} trainers cannot each get a node out of {total_nodes}")
    floored: set[int] = set()  # trainers held at the one-node floor
    while True:
        free = [t for t in trainers if t not in floored]
        nodes_left = total_nodes - len(floored)
        total = sum(requested[t] for t in free)
        quotas = {t: nodes_left * requested[t] / total for t in free} if free else {}
        below = {t for t, q in quotas.items() if q < 1}
        if not below:
            break
        floored |= below
    counts = {t: 1 for t in floored} | {t: math.floor(q) for t, q in quotas.items()}
    left = total_nodes - sum(counts.values())
    for t in sorted(quotas, key=lambda t: (-(quotas[t] - math.floor(quotas[t])), -requested[t], t))[:left]:
        counts[t] += 1
    return counts


def assign(requested: dict[int, int], previous: dict[int, int | None]) -> dict[int, list[int]]:
    """A round's assignment: trainer id -> node ids, the counts proportional to the requests (node_counts) among the
    nodes in `previous` (the present ones: node id -> the trainer it served last, None = free; assign_nodes)."""
    return assign_nodes(node_counts(requested, len(previous)), previous)


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
