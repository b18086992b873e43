"""The cluster's node schedule (config `node_schedule`): nodes that leave at an outer step and come back at a later one,
and nodes that run some times slower for a span of outer steps. The round driver reads it before each round (who takes
part, how slow each node is); the simulated clock (algorithms/clock.py) prices the slowdowns; nothing else changes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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
