"""The replay: how long a run we measured would take on a cluster with a given network (a network cost model).

No network is emulated. A run's records say, round by round, what each node of each trainer did (node_clock.csv,
written from the round driver's record: its tokens, micro-batch, accumulation, slowdown and the state it received
first, a node move), which merges happened with which payloads (merge_events.csv), and what each sync sent (the
run's plan, utils/run_plan.py; the accounting of algorithms/traffic.py). `timeline` replays them through the
simulated clock (algorithms/clock.py: the same component the cluster drives live) on a network (algorithms/
network.py's ring model), a throughput (tokens/s of one node: a number, or a curve against the micro-batch)
and, optionally, each node's speed:

    a node's compute    = its tokens this round / (curve x speed / slowdown)
    a trainer's round   = its slowest node + its collectives: the weights (P bytes, fp32) in a ring
                          all-reduce, or with outer_compression each node's encoded pseudo-gradient (C
                          bytes) as a ring of quantized shards (priced as a ring all-reduce of C; runs made
                          before the ring, and top-k: an all-gather), one per fragment with Streaming
                          DiLoCo (each hidden by sync_delay inner steps), and the batch test's statistics
                          as the run sent them (statistics_comm; `statistics=False` leaves them out)
    a merge             = the absorbed trainers' states, one message each, into the survivor's first node,
                          once every member's round ended
    a node move         = one message of the trainer's state before the moving node starts

Trainers advance independently between merges (lockstep=True: every round starts when the slowest
trainer's last round, its merges and the node moves ended everywhere: this model's first version).
ASSUMPTIONS (what it ignores): no overlap of compute and communication (except streaming's sync_delay), no
contention between trainers or moves sharing links, evaluation and checkpoint time left out. Runs written before
node_clock.csv carried `received_bytes` are read as run_dir/past.py rebuilds their rounds from training_log.csv (each
node of a trainer processing the same number of tokens, node moves re-simulated).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from algorithms.clock import Clock, NodeWork, ThroughputCurve, TrainerWork
from algorithms.comm_plan import WireSizes
from algorithms.network import INSTANT, Network
from algorithms.traffic import SyncCost
from run_dir.past import reduced_as_ring, value_of
from run_dir.reader import RunFiles
from training_logs.records import MergeEvent, NodeTime
from utils import run_plan
from utils.config import Config


@dataclass
class TrainerRound:
    num_nodes: int
    tokens: float  # tokens all the trainer's nodes processed in the round
    sync: SyncCost = field(default_factory=SyncCost)  # what its collectives sent (algorithms/traffic.py)
    trainer_id: int = 0
    nodes: tuple[int, ...] = ()  # node ids (empty: numbered after the round's other trainers' nodes)
    micro_batch: int = 1
    accumulation: int = 1
    receivers: tuple[int, ...] = ()  # nodes that received the trainer's state before the round (node moves)
    work: tuple[NodeWork, ...] = ()  # each node's own work, as the run recorded it (empty: tokens split evenly)


@dataclass
class MergeWork:
    survivor: int
    nbytes: int  # what travelled into the survivor
    members: tuple[int, ...] = ()  # the survivor first (empty: the survivor alone waits)
    payloads: tuple[int, ...] = ()  # each absorbed state's bytes, one message each (empty: nbytes, one message)


@dataclass
class RoundWork:
    """What one round (outer step) of a run computed and sent."""

    step: int
    trainers: list[TrainerRound]
    merges: list[MergeWork] = field(default_factory=list)
    node_moves: int = 0
    node_move_bytes: int = 0  # all moving nodes together
    slowdown: dict[int, float] = field(default_factory=dict)  # node_schedule: nodes slowed down this round


def _curve(throughput: float | ThroughputCurve) -> ThroughputCurve:
    return throughput if isinstance(throughput, ThroughputCurve) else ThroughputCurve.flat(throughput)


def replay(rounds: list[RoundWork], net: Network, throughput: float | ThroughputCurve, weight_bytes: int,
           speeds: list[float] | None = None, lockstep: bool = False,
           device_shapes: bool = False) -> tuple[Clock, dict[int, float]]:
    """The finished run's rounds through the clock: the clock at the end, and when each outer step ended.
    device_shapes: each step priced in the micro-batches the curve's device would use (ThroughputCurve.device_shape:
    re-pricing a run made elsewhere), not those it ran in (a run's own curve: its live clock)."""
    curve = _curve(throughput)

    def shape(t: TrainerRound | NodeWork) -> tuple[int, int]:
        return curve.device_shape(t.micro_batch, t.accumulation) if device_shapes else (t.micro_batch,
                                                                                         t.accumulation)

    numbered = []
    for work in rounds:  # node ids where the logs had none (hand-made rounds)
        first = 0
        for t in work.trainers:
            numbered.append(t.nodes or tuple(range(first, first + t.num_nodes)))
            first = max(numbered[-1], default=first - 1) + 1
    total = max((max(n, default=-1) for n in numbered), default=-1) + 1
    clock = Clock(net, curve, speeds or [1.0] * total, weight_bytes, lockstep)
    times, ids = {0: 0.0}, iter(numbered)
    for work in rounds:
        move = work.node_move_bytes / work.node_moves if work.node_moves else 0
        nodes_of = [next(ids) for _ in work.trainers]
        receivers = {n for t in work.trainers for n in t.receivers}
        if move and not receivers:  # moves without their nodes (hand-made rounds): the first node receives
            receivers = set(next((nodes for nodes in nodes_of if nodes), ())[:1])
        clock.round([TrainerWork(t.trainer_id, [NodeWork(w.node_id, w.tokens, *shape(w), w.receives_bytes)
                                                for w in t.work] if t.work else
                                 [NodeWork(n, t.tokens / t.num_nodes, *shape(t), move if n in receivers else 0)
                                  for n in nodes], t.sync)
                     for t, nodes in zip(work.trainers, nodes_of) if t.num_nodes], work.slowdown)
        for m in work.merges:
            clock.merge(m.survivor, list(m.members or (m.survivor,)), list(m.payloads or (m.nbytes,)))
        times[work.step] = clock.now
    return clock, times


def timeline(rounds: list[RoundWork], net: Network, node_throughput: float | ThroughputCurve, weight_bytes: int,
             speeds: list[float] | None = None, lockstep: bool = False,
             device_shapes: bool = False) -> tuple[dict[int, float], float]:
    """Predicted wall time at the end of each round, by outer step ({0: 0.0, 1: t1, 2: ...}), and how much of the
    whole compute alone would take (the same run on an infinitely fast network). device_shapes: as `replay`."""
    _, times = replay(rounds, net, node_throughput, weight_bytes, speeds, lockstep, device_shapes)
    compute = replay(rounds, INSTANT, node_throughput, weight_bytes, speeds, lockstep, device_shapes)[0].now
    return times, compute


# ---------------------------------------------------------------------------------------------------------
def _statistics_bytes(cfg: Config | None, weight_bytes: int, statistics: bool) -> int:
    """Bytes per node of the batch test's statistics reductions (distributed/torchrun_backend.py), 0 if none travel
    or the batch schedule ignores them (those sent for the log only are charged to no method)."""
    if cfg is None or not statistics or not run_plan.batch_test_of(cfg).uses_statistics:
        return 0
    return run_plan.statistics_bytes(cfg, weight_bytes)


def read_rounds(run_dir: Path, statistics: bool = True, model_bytes: int | None = None
                ) -> tuple[list[RoundWork], int, int]:
    """A finished run's rounds, the bytes P of its fp32 weights and the weights_traffic_bytes they add up to.
    statistics: the batch test's statistics, when it decides with them, as the run sent them (its live clock
    prices the same: a replay gives the run's own sim_time). Statistics sent for the log only are not priced.
    model_bytes: price the rounds as if the fp32 weights were this many bytes (another model size): everything that
    travels in proportion to the model (the all-reduce, compressed payloads and fragments, DDP's gradients, merges,
    node moves, full-size statistics) scales by model_bytes / P; sketched statistics, the rounds, the tokens and the
    trajectory stay the run's. The bytes returned are then model_bytes and the run's traffic scaled alike.

    Runs written before summary.json carried `weight_bytes` get P from their all-reduce traffic."""
    run = RunFiles(run_dir)
    summary = run.summary()
    # the run's config in today's meaning (run_dir's migrations), read by the one derivation of its plan
    cfg = run.config() if run.config_path.is_file() else None
    merges_at: dict[int, list[MergeEvent]] = {}
    for m in run.records(MergeEvent):
        merges_at.setdefault(m.outer_step, []).append(m)
    run_bytes = run.weight_bytes()  # older runs: inferred (run_dir/past.py)
    weight_bytes = model_bytes or run_bytes
    scale = weight_bytes / run_bytes if run_bytes else 1.0  # 1 unless another model size is priced
    # every round of the run sent alike: CommPlan.sync_cost of the plan its config derives, on its recorded sizes
    sizes = WireSizes(weight_bytes, run_plan.sync_payload_bytes(cfg, weight_bytes) if cfg is not None else 0,
                      tuple(round(b * scale) for b in summary.get("fragment_bytes") or ()),
                      _statistics_bytes(cfg, weight_bytes, statistics),
                      round(int(summary.get("gradient_bytes") or 0) * scale))
    sync = run_plan.recorded_comm_plan(cfg, sizes).sync_cost(True) if cfg is not None else \
        SyncCost(0, sizes.fragment_bytes, step_bytes=sizes.gradient_bytes)
    if sync.ring and not reduced_as_ring(summary):  # older runs all-gathered theirs (run_dir/past.py)
        sync = dataclasses.replace(sync, ring=False)
    rounds = _recorded_rounds(run.node_times(), merges_at, sync, scale)  # older runs: rebuilt (run_dir/past.py)
    return rounds, weight_bytes, round(int(value_of(summary, "weights_traffic_bytes", 0)) * scale)


def _merges(merges: list[MergeEvent], scale: float) -> list[MergeWork]:
    return [MergeWork(m.survivor, round(m.bytes * scale), (m.survivor, *map(int, m.merged.split())),
                      tuple(round(int(b) * scale) for b in (m.payloads or "").split()))
            for m in merges]


def _recorded_rounds(recorded: list[NodeTime], merges_at: dict[int, list[MergeEvent]], sync: SyncCost,
                     scale: float) -> list[RoundWork]:
    """The rounds as the round driver recorded them (node_clock.csv): each node's own tokens, shape, slowdown and
    the state it received first; the trainers in the order the run's clock took them."""
    nodes_at: dict[int, list[NodeTime]] = {}
    for n in recorded:
        nodes_at.setdefault(n.outer_step, []).append(n)
    rounds = []
    for step in sorted(nodes_at):
        trainers: dict[int, list[NodeWork]] = {}
        for n in nodes_at[step]:
            trainers.setdefault(n.trainer_id, []).append(
                NodeWork(n.node_id, float(n.tokens), n.micro_batch, n.accumulation_steps,
                         round(n.received_bytes * scale)))
        moved = [w.receives_bytes for work in trainers.values() for w in work if w.receives_bytes]
        work = RoundWork(step, [], _merges(merges_at.get(step, []), scale), len(moved), sum(moved),
                         {n.node_id: n.slowdown for n in nodes_at[step] if n.slowdown != 1.0})
        for t, nodes in sorted(trainers.items()):
            work.trainers.append(TrainerRound(len(nodes), sum(w.tokens for w in nodes), sync, trainer_id=t,
                                              nodes=tuple(w.node_id for w in nodes), micro_batch=nodes[0].micro_batch,
                                              accumulation=nodes[0].accumulation,
                                              receivers=tuple(w.node_id for w in nodes if w.receives_bytes),
                                              work=tuple(nodes)))
        rounds.append(work)
    return rounds


def accounted_bytes(rounds: list[RoundWork], weight_bytes: int) -> int:
    """The weights traffic the model charges, on algorithms/traffic.py's definitions (a check against the run)."""
    total = 0
    for work in rounds:
        total += sum(t.sync.sent_bytes(t.num_nodes, weight_bytes) for t in work.trainers)
        total += sum(m.nbytes for m in work.merges) + work.node_move_bytes
    return total


def bandwidth_grid(low: float = 1e6 / 8, high: float = 4e11 / 8, per_decade: int = 8) -> list[float]:
    """Bandwidths (bytes/s) evenly spaced in log from `low` to `high`, for the crossover plot."""
    n = int(round(math.log10(high / low) * per_decade))
    return [low * (high / low) ** (i / n) for i in range(n + 1)]
