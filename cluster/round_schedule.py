"""What the simulated clock decides before a round: who is present (node_schedule) and, with inner_steps_by_speed
(DyLU), each node's inner steps from its throughput. The clock is fed after the round, by the ledgers
(cluster/ledgers.py)."""

from __future__ import annotations

from algorithms.clock import Clock
from algorithms.node_schedule import NodeSchedule
from utils.config import Config


class RoundSchedule:
    """Who runs a round, and how many inner steps each node takes."""

    def __init__(self, clock: Clock, nodes: NodeSchedule, cfg: Config) -> None:
        self.clock, self.nodes = clock, nodes  # the clock's rates only: the ledgers feed it
        self.num_inner_steps = cfg.num_inner_steps
        self.by_speed = cfg.inner_steps_by_speed  # each node's inner steps in proportion to its throughput

    def inner_steps(self, node_ids: list[int], shapes: dict[int, tuple[int, int]],
                    slowdown: dict[int, float]) -> dict[int, int]:
        """num_inner_steps for every node, or (inner_steps_by_speed) in proportion to its throughput this round,
        the trainer's fastest node taking num_inner_steps."""
        steps = self.num_inner_steps
        if not self.by_speed:
            return {n: steps for n in node_ids}
        rates = {n: self.clock.rate(n, *shapes[n], slowdown.get(n, 1.0)) for n in node_ids}
        fastest = max(rates.values())
        return {n: max(1, round(steps * rates[n] / fastest)) for n in node_ids}
