"""What is decided before a round, in one answer (`RoundSchedule.plan`, a `RoundPlan`): who takes part and who runs
slower (the config's `node_schedule`: `NodeSchedule`), which trainer each present node trains (node assignment:
`assign`), how each node runs its trainer's requested batch (switch mode, algorithms/switch_mode.py: loader batch and
accumulation steps) and, with inner_steps_by_speed (DyLU), each node's inner steps from its throughput (the clock's
rates). The round driver (cluster/round_driver.py) turns the plan into jobs; the clock is fed after the round, by the
ledgers (cluster/ledgers.py).

The node schedule: nodes that leave at an outer step and come back at a later one, and nodes that run some times
slower for a span of outer steps; the simulated clock (algorithms/clock.py) prices the slowdowns; nothing else
changes.

Node assignment: how many nodes each trainer gets, and which ones.
Counts are proportional to each trainer's requested batch (not to nodes x batch, which feeds on
itself), with a floor of one node per live trainer, rounded by largest remainders (Hamilton's method):
a trainer whose share is below one node gets exactly one, and the other trainers share the rest in
proportion; each gets the floor of its share, and the nodes left go to the largest remainders
(ties: the larger request, then the smaller id). Nodes stay with their trainer where possible, so
inner optimizer state is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from algorithms.clock import Clock
from algorithms.switch_mode import SwitchMode


@dataclass(frozen=True)
class ScheduleEvent:
    """node leaves at outer step `leave` and is back from `back` (0: never), or runs `slowdown` times slower
    in outer steps [start, end) (end 0: to the run's end)."""

    node: int
    leave: int = 0
    back: int = 0
    slowdown: float = 1.0
    start: int = 0
    end: int = 0

    def covers(self, step: int, first: int, last: int) -> bool:
        return step >= first and (last == 0 or step < last)


@dataclass(frozen=True)
class RoundNodes:
    """The schedule's answer for one outer step: who takes part, who runs how many times slower (nodes at full speed
    left out), and what starts or ends then, in words (for the log)."""

    present: list[int]
    slowdown: dict[int, float] = field(default_factory=dict)
    changes: list[str] = field(default_factory=list)


class NodeSchedule:
    """config node_schedule: [{node: 3, leave: 4, return: 8}, {node: 1, slowdown: 4, from: 2, until: 6}]."""

    KEYS = {"node", "leave", "return", "slowdown", "from", "until"}

    def __init__(self, events: list[ScheduleEvent] = ()) -> None:
        self.events = list(events)

    @classmethod
    def parse(cls, raw: list, total_nodes: int) -> NodeSchedule:
        """ValueError names the item and what is wrong with it."""
        events = []
        for i, item in enumerate(raw or []):
            where = f"node_schedule[{i}]"
            if not isinstance(item, dict):
                raise ValueError(f"{where}: expected a mapping such as {{node: 3, leave: 4, return: 8}}")
            unknown = set(item) - cls.KEYS
            if unknown:
                raise ValueError(f"{where}: unknown key {sorted(unknown)[0]!r}; use node, leave, return, slowdown, "
                                 "from, until")
            ints = {}
            for key in ("node", "leave", "return", "from", "until"):
                value = item.get(key, 0)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{where}: {key} must be a non-negative integer, got {value!r}")
                ints[key] = value
            node = ints["node"]
            if "node" not in item or node >= total_nodes:
                raise ValueError(f"{where}: node {item.get('node')!r} does not exist (node ids run from 0 to "
                                 f"{total_nodes - 1})")
            if "leave" in item:
                if "slowdown" in item or "from" in item or "until" in item:
                    raise ValueError(f"{where}: one event per item: leave/return or slowdown/from/until")
                if ints["leave"] < 1 or (ints["return"] and ints["return"] <= ints["leave"]):
                    raise ValueError(f"{where}: leave must be an outer step >= 1 and return a later one")
                events.append(ScheduleEvent(node, leave=ints["leave"], back=ints["return"]))
            elif "slowdown" in item:
                factor = item["slowdown"]
                if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0 \
                        or not math.isfinite(factor):
                    raise ValueError(f"{where}: slowdown must be a positive number (4 = four times slower)")
                if "return" in item or (ints["until"] and ints["until"] <= ints["from"]):
                    raise ValueError(f"{where}: a slowdown runs from an outer step until a later one")
                events.append(ScheduleEvent(node, slowdown=float(factor), start=ints["from"], end=ints["until"]))
            else:
                raise ValueError(f"{where}: give leave (and return) or slowdown (and from, until)")
        return cls(events)

    def round(self, step: int, total_nodes: int) -> RoundNodes:
        """Outer step `step` as the round driver needs it, in one answer."""
        return RoundNodes(self.present(step, total_nodes), self.slowdown(step), self.changes(step))

    def present(self, step: int, total_nodes: int) -> list[int]:
        """The nodes that take part in outer step `step`."""
        away = {e.node for e in self.events if e.leave and e.covers(step, e.leave, e.back)}
        return [n for n in range(total_nodes) if n not in away]

    def slowdown(self, step: int) -> dict[int, float]:
        """node -> how many times slower it runs in outer step `step` (nodes at full speed left out)."""
        out: dict[int, float] = {}
        for e in self.events:
            if e.slowdown != 1.0 and e.covers(step, e.start, e.end):
                out[e.node] = out.get(e.node, 1.0) * e.slowdown
        return out

    def changes(self, step: int) -> list[str]:
        """What starts or ends at outer step `step`, in words (for the log)."""
        out = []
        for e in self.events:
            if e.leave and step == e.leave:
                out.append(f"node {e.node} leaves" + (f" until outer step {e.back}" if e.back else ""))
            elif e.leave and step == e.back:
                out.append(f"node {e.node} returns")
            elif not e.leave and step == max(e.start, 1):
                until = f" until outer step {e.end}" if e.end else ""
                out.append(f"node {e.node} slows down {e.slowdown:g}x{until}")
            elif not e.leave and e.end and step == e.end:
                out.append(f"node {e.node} is back to full speed")
        return out


# ---- node assignment ----

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


# ---- the round's plan ----

@dataclass(frozen=True)
class RoundPlan:
    """One round's decisions: the nodes present, what changes in words (for the log), who runs slower, each trainer's
    nodes, and each of those nodes' (loader batch, accumulation steps) and inner steps."""
    present: list[int]
    changes: list[str]
    slowdown: dict[int, float]
    assignment: dict[int, list[int]]
    shapes: dict[int, tuple[int, int]]
    inner_steps: dict[int, int]


class RoundSchedule:
    """Who runs a round, on what shape, and how many inner steps each node takes."""

    def __init__(self, clock: Clock, nodes: NodeSchedule, switch_mode: SwitchMode, num_inner_steps: int,
                 by_speed: bool) -> None:
        self.clock = clock  # its rates only (DyLU): the ledgers feed it after the round
        self.nodes, self.switch_mode = nodes, switch_mode
        self.num_inner_steps = num_inner_steps
        self.by_speed = by_speed  # inner_steps_by_speed: each node's inner steps in proportion to its throughput

    def plan(self, outer_step: int, requested: dict[int, int], owners: dict[int, int | None],
             max_batch: list[int]) -> RoundPlan:
        """Outer step `outer_step`'s plan. requested: each trainer's requested batch; owners: the trainer each node
        last trained (None: none, or stale), kept where it can be (`assign`); max_batch: each node's
        largest micro-batch."""
        present = self.nodes.round(outer_step, len(owners))
        assignment = assign(requested, {n: owners[n] for n in present.present})
        shapes = {n: self.switch_mode.decide(requested[t], max_batch[n])
                  for t in sorted(assignment) for n in assignment[t]}
        inner_steps = {n: steps for t in sorted(assignment)
                       for n, steps in self.inner_steps(assignment[t], shapes, present.slowdown).items()}
        return RoundPlan(present.present, present.changes, present.slowdown, assignment, shapes, inner_steps)

    def inner_steps(self, node_ids: list[int], shapes: dict[int, tuple[int, int]],
                    slowdown: dict[int, float]) -> dict[int, int]:
        """num_inner_steps for every node of a trainer, or (inner_steps_by_speed) in proportion to its throughput this
        round, the trainer's fastest node taking num_inner_steps."""
        steps = self.num_inner_steps
        if not self.by_speed:
            return {n: steps for n in node_ids}
        rates = {n: self.clock.rate(n, *shapes[n], slowdown.get(n, 1.0)) for n in node_ids}
        fastest = max(rates.values())
        return {n: max(1, round(steps * rates[n] / fastest)) for n in node_ids}
