"""What is decided before a round, in one answer (`RoundSchedule.plan`): who is present (node_schedule), which
trainer each present node trains (algorithms/assignment.py), how each node runs its trainer's requested batch (switch
mode: loader batch and accumulation steps) and, with inner_steps_by_speed (DyLU), each node's inner steps from its
throughput. The clock is fed after the round, by the ledgers (cluster/ledgers.py)."""

from __future__ import annotations

import dataclasses

from algorithms.assignment import assign
from algorithms.clock import Clock
from algorithms.node_schedule import NodeSchedule
from algorithms.switch_mode import SwitchMode
from utils.config import Config


@dataclasses.dataclass(frozen=True)
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

    def __init__(self, clock: Clock, nodes: NodeSchedule, switch_mode: SwitchMode, cfg: Config) -> None:
        self.clock = clock  # its rates only (DyLU): the ledgers feed it after the round
        self.nodes, self.switch_mode = nodes, switch_mode
        self.num_inner_steps = cfg.num_inner_steps
        self.by_speed = cfg.inner_steps_by_speed  # each node's inner steps in proportion to its throughput

    def plan(self, outer_step: int, requested: dict[int, int], owners: dict[int, int | None],
             max_batch: list[int]) -> RoundPlan:
        """Outer step `outer_step`'s plan. requested: each trainer's requested batch; owners: the trainer each node
        last trained (None: none, or stale), kept where it can be (algorithms/assignment.py); max_batch: each node's
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
