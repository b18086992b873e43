"""The simulated clock: what a heterogeneous cluster and its network would take, round by round.

It observes and never changes training's numbers (only `inner_steps_by_speed` asks it how many inner
steps each node can take). The cluster (cluster/) drives it live, from each round's jobs; benchmarks/
replay.py replays finished runs through it. Its parts:

ThroughputCurve  tokens/s of one node at speed 1 against its micro-batch and accumulation steps: flat
                 (today's assumption), measured on the device in hand (`benchmarks.system --curve`), or
                 a file of the user's own measurements. Between measured micro-batches: linear; above the
                 largest: its value (saturated); accumulation levels between those measured: the largest
                 measured level below.
SyncCost         (algorithms/traffic.py) what a trainer's collectives send and take at the end of its round:
                 the one model of a sync's bytes and seconds, shared with the traffic counters and the replay.
NodeSchedule     (algorithms/round_schedule.py) nodes that leave and come back, and nodes that slow down: the
                 rounds' input (who is present, how slow), decided before a round; the clock only prices it.
Clock            the timeline. Each node computes its round in tokens / (curve x speed / slowdown)
                 seconds, from when both it and its trainer are ready (plus receiving the trainer's state
                 when it moves); a trainer's round ends when its slowest node and then its collectives
                 finish. Trainers advance independently between merges; a merge waits for its members, then
                 for the absorbed states to reach the survivor. A node is idle whenever it is present and
                 not computing (waiting for stragglers, collectives, merges, or its trainer's turn).
                 lockstep=True is the older model: every round starts when the slowest trainer's last round
                 (and merges, and node moves) ended.

Utilisation = busy node-seconds / available node-seconds (nodes that left are not available);
goodput = tokens trained / simulated seconds. Evaluation and checkpoint time are left out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from algorithms.network import Network
from algorithms.traffic import SyncCost


# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ThroughputCurve:
    """Tokens per second of one node at speed 1: (micro_batch, accumulation, tokens_per_s) points."""

    points: tuple[tuple[int, int, float], ...]
    source: str = ""

    @classmethod
    def flat(cls, tokens_per_s: float) -> ThroughputCurve:
        return cls(((1, 1, float(tokens_per_s)),), f"flat, {tokens_per_s:g} tokens/s")

    @property
    def is_flat(self) -> bool:
        return len(self.points) == 1

    @property
    def largest_micro_batch(self) -> int:
        """The largest micro-batch measured without accumulation (a flat curve covers every batch)."""
        return math.inf if self.is_flat else max(b for b, a, _ in self.points if a == 1)

    def device_shape(self, micro_batch: int, accumulation: int = 1) -> tuple[int, int]:
        """How the curve's device would run a step of micro_batch x accumulation sequences: in the largest
        micro-batch it measured without accumulation that divides the step (the rest accumulated), not in the
        micro-batches another machine's memory allowed. A flat curve keeps the shape as run."""
        if self.is_flat:
            return micro_batch, accumulation
        sequences = micro_batch * accumulation
        fits = max((b for b, a, _ in self.points if a == 1 and b <= sequences and sequences % b == 0), default=1)
        return fits, sequences // fits

    def tokens_per_s(self, micro_batch: int, accumulation: int = 1) -> float:
        levels = sorted({a for _, a, _ in self.points})
        level = max((a for a in levels if a <= accumulation), default=levels[0])
        row = sorted((b, v) for b, a, v in self.points if a == level)
        if micro_batch <= row[0][0]:
            return row[0][1]
        for (b0, v0), (b1, v1) in zip(row, row[1:]):
            if micro_batch <= b1:
                return v0 + (v1 - v0) * (micro_batch - b0) / (b1 - b0)
        return row[-1][1]  # above the largest measured micro-batch: saturated

    def to_dict(self, **about) -> dict:
        return {**about, "points": [{"micro_batch": b, "accumulation": a, "tokens_per_s": v}
                                    for b, a, v in self.points]}

    @classmethod
    def from_dict(cls, data: dict, source: str) -> ThroughputCurve:
        """A curve file's contents; ValueError names what is wrong."""
        points = data.get("points") if isinstance(data, dict) else None
        if not isinstance(points, list) or not points:
            raise ValueError(f"{source}: expected a mapping with a non-empty list 'points' of "
                             "{micro_batch, accumulation, tokens_per_s}")
        out = []
        for i, p in enumerate(points):
            try:
                b, a, v = int(p["micro_batch"]), int(p.get("accumulation", 1)), float(p["tokens_per_s"])
            except (TypeError, KeyError, ValueError):
                raise ValueError(f"{source}: points[{i}] needs integer micro_batch (and accumulation) and a number "
                                 "tokens_per_s") from None
            if b < 1 or a < 1 or not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{source}: points[{i}]: micro_batch and accumulation must be >= 1 and tokens_per_s "
                                 f"a positive number (got {b}, {a}, {v})")
            out.append((b, a, v))
        if not any(a == 1 for _, a, _ in out):
            raise ValueError(f"{source}: no point has accumulation 1")
        if len({(b, a) for b, a, _ in out}) != len(out):
            raise ValueError(f"{source}: a (micro_batch, accumulation) pair appears twice")
        flat = data.get("flat", False)
        if not isinstance(flat, bool) or (flat and len(out) != 1):
            raise ValueError(f"{source}: \"flat\": true marks a file of exactly one point (one tokens/s at every "
                             f"batch); this one has {len(out)}")
        if len(out) == 1 and not flat:  # one point would silently cover every batch, however large
            (b, a, v), = out
            raise ValueError(f"{source}: one point (micro-batch {b}) says nothing about other batches: measure more "
                             "(python -m benchmarks.system --curve), or add \"flat\": true to the file to use its "
                             f"{v:g} tokens/s at every batch")
        return cls(tuple(sorted(out)), f"{source} (flat, {out[0][2]:g} tokens/s)" if flat else source)

    SHAPE_TOLERANCE = 0.02  # measurements are noisy: only departures beyond 2% are named

    def shape_problems(self) -> list[str]:
        """Where the curve is not what a throughput curve is (AdaptDL's goodput tests assert both): tokens/s that
        fall as the micro-batch grows, or a curve that is not concave (a point below its neighbours' chord)."""
        tol, out = self.SHAPE_TOLERANCE, []
        for level in sorted({a for _, a, _ in self.points}):
            row = sorted((b, v) for b, a, v in self.points if a == level)
            for (b0, v0), (b1, v1) in zip(row, row[1:]):
                if v1 < v0 * (1 - tol):
                    out.append(f"falls from micro-batch {b0} to {b1} ({v0:.0f} -> {v1:.0f} tokens/s, accumulation "
                               f"{level})")
            for (b0, v0), (b1, v1), (b2, v2) in zip(row, row[1:], row[2:]):
                chord = v0 + (v2 - v0) * (b1 - b0) / (b2 - b0)
                if v1 < chord * (1 - tol):
                    out.append(f"is not concave at micro-batch {b1} ({v1:.0f} tokens/s, below the {chord:.0f} of the "
                               f"chord from {b0} to {b2}, accumulation {level})")
        return out

    @classmethod
    def load(cls, path: str | Path) -> ThroughputCurve:
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ValueError(f"cannot read the curve file {path} ({exc.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path} is not a JSON curve file") from None
        return cls.from_dict(data, str(path))


# ---------------------------------------------------------------------------------------------------------
@dataclass
class NodeWork:
    """One node's part of a trainer's round."""

    node_id: int
    tokens: float
    micro_batch: int
    accumulation: int
    receives_bytes: int = 0  # the trainer's state it must receive before it starts (a node move)


@dataclass
class TrainerWork:
    trainer_id: int
    nodes: list[NodeWork]
    sync: SyncCost = field(default_factory=SyncCost)


@dataclass
class NodeTime:
    """What one node did in one round, in simulated seconds."""

    node_id: int
    trainer_id: int
    start: float  # it begins computing (after receiving a state, if it moved)
    compute: float
    idle: float  # present and not computing since its previous round ended
    end: float  # its trainer's round (collectives included) ended


class Clock:
    def __init__(self, network: Network, curve: ThroughputCurve, speeds: list[float], weight_bytes: int,
                 lockstep: bool = False) -> None:
        self.network, self.curve, self.speeds = network, curve, list(speeds)
        self.weight_bytes, self.lockstep = weight_bytes, lockstep
        n = len(self.speeds)
        self.free = [0.0] * n  # when each node's last round ended
        self.busy = [0.0] * n  # node-seconds computing
        self.away = [0.0] * n  # node-seconds absent (left the cluster)
        self.away_since: dict[int, float] = {}  # nodes absent now, since when
        self.ready: dict[int, float] = {}  # trainer -> when its state is ready (its round or its merge ended)
        self.round_end = 0.0  # lockstep: when the last round (and its merges) ended everywhere
        self.tokens = 0.0

    # -- rates ----------------------------------------------------------------------------------------
    def rate(self, node_id: int, micro_batch: int, accumulation: int, slowdown: float = 1.0) -> float:
        """Tokens/s of this node at this micro-batch and accumulation."""
        return self.curve.tokens_per_s(micro_batch, accumulation) * self.speeds[node_id] / slowdown

    # -- the timeline ---------------------------------------------------------------------------------
    @property
    def now(self) -> float:
        """The latest moment anything finished: the run's length so far."""
        return max([self.round_end, *self.ready.values()], default=0.0)

    def round(self, trainers: list[TrainerWork], slowdown: dict[int, float] | None = None) -> dict[int, list[NodeTime]]:
        """One outer step of every trainer in `trainers`; nodes in none of them are away (left the cluster).
        Returns each trainer's node times; the trainers' ready times move to their rounds' ends."""
        slowdown = slowdown or {}
        present = {w.node_id for t in trainers for w in t.nodes}
        for node in range(len(self.speeds)):
            if node not in present and node not in self.away_since:
                self.away_since[node] = self.free[node]
        base_all = max([self.round_end, *self.ready.values()], default=0.0)
        if self.lockstep:  # everyone starts together, once every moving node has its state
            base_all += max((self.network.message(w.receives_bytes) for t in trainers for w in t.nodes
                             if w.receives_bytes), default=0.0)
        out: dict[int, list[NodeTime]] = {}
        for t in sorted(trainers, key=lambda t: t.trainer_id):
            if not t.nodes:
                continue
            base = base_all if self.lockstep else self.ready.get(t.trainer_id, 0.0)
            starts, computes, since = {}, {}, {}
            for w in t.nodes:
                node = w.node_id
                if node in self.away_since:  # back from away: it was not available until its trainer needed it
                    came = max(base, self.away_since.pop(node))
                    self.away[node] += came - self.free[node]
                    self.free[node] = came
                since[node] = self.free[node]
                start = base if self.lockstep else max(base, self.free[node])
                if w.receives_bytes and not self.lockstep:
                    start += self.network.message(w.receives_bytes)
                starts[node] = start
                computes[node] = w.tokens / self.rate(node, w.micro_batch, w.accumulation, slowdown.get(node, 1.0))
            slowest = max(computes.values())
            end = max(starts[n] + computes[n] for n in starts) + t.sync.seconds(self.network, len(t.nodes),
                                                                               self.weight_bytes, slowest)
            out[t.trainer_id] = []
            for w in t.nodes:
                node = w.node_id
                self.busy[node] += computes[node]
                self.free[node] = end
                out[t.trainer_id].append(NodeTime(node, t.trainer_id, starts[node], computes[node],
                                                  max(0.0, end - since[node] - computes[node]), end))
            self.ready[t.trainer_id] = end
            self.tokens += sum(w.tokens for w in t.nodes)
        self.round_end = max([self.round_end, *(self.ready[t] for t in out)])
        return out

    def merge(self, survivor: int, members: list[int], absorbed_bytes: list[int]) -> float:
        """The absorbed trainers' states travel, one after another, to the survivor once every member's round
        has ended (lockstep: once every trainer's has). Returns when the survivor is ready."""
        waits = [self.ready.get(m, 0.0) for m in members]  # the survivor first: merges into it go one after another
        base = max([self.round_end, waits[0]]) if self.lockstep else max(waits)
        ready = base + sum(self.network.message(b) for b in absorbed_bytes)
        for m in members:
            self.ready.pop(m, None)
        self.ready[survivor] = ready
        return ready

    # -- what it adds up to ---------------------------------------------------------------------------
    def available(self, until: float | None = None) -> float:
        """Node-seconds the present nodes were available from 0 to `until` (default: now)."""
        until = self.now if until is None else until
        return sum(until - self.away[n] - (until - self.away_since[n] if n in self.away_since else 0.0)
                   for n in range(len(self.speeds)))

    def utilisation(self) -> float:
        available = self.available()
        return sum(self.busy) / available if available > 0 else 0.0

    def goodput(self) -> float:
        """Tokens per simulated second so far."""
        return self.tokens / self.now if self.now > 0 else 0.0

    def counters(self) -> dict[str, float]:
        """The clock's counters as training_log.csv and summary.json carry them."""
        return {"utilisation": self.utilisation(), "goodput_tokens_per_s": self.goodput()}

    def idle(self) -> float:
        """Node-seconds present and not computing, up to now."""
        return self.available() - sum(self.busy)

    def state_dict(self) -> dict:
        return {"free": list(self.free), "busy": list(self.busy), "away": list(self.away),
                "away_since": {str(k): v for k, v in self.away_since.items()},
                "ready": {str(k): v for k, v in self.ready.items()}, "round_end": self.round_end,
                "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.free, self.busy, self.away = list(state["free"]), list(state["busy"]), list(state["away"])
        self.away_since = {int(k): v for k, v in state["away_since"].items()}
        self.ready = {int(k): v for k, v in state["ready"].items()}
        self.round_end, self.tokens = state["round_end"], state["tokens"]
