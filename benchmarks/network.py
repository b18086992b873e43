"""A network cost model: how long a run we measured would take on a cluster with a given network.

No network is emulated. A run's logs say, round by round, how many tokens each trainer's nodes processed,
how many nodes each trainer had, which merges happened and how many nodes moved (the accounting of
algorithms/traffic.py). The model turns that into predicted wall time:

    time of a round = max over trainers (compute + its collectives)    trainers work and sync in parallel
                    + merges                                           after the outer steps
                    + node moves                                       before the next round's inner steps
    compute         = tokens per node of the trainer this round / node_throughput (tokens/s of one node)
    ring all-reduce of S bytes over n nodes (the alpha-beta model): 2 (n-1) steps, each sending S/n bytes
                    = 2 (n-1) x latency + 2 (n-1)/n x S / bandwidth; 0 for n = 1
    a trainer's collectives: the weights (P bytes, fp32) in a ring all-reduce, or with outer_compression
                    an all-gather of each node's encoded pseudo-gradient (C bytes: values, scales,
                    indices) = (n-1) x (latency + C / bandwidth); and, when its batch test decides from
                    gradient statistics (norm / augmented inner product test), the statistics as the run
                    sent them (statistics_comm: the vectors in fp64 or fp32, of P or sketch-k entries, then
                    7 fp64 scalars: two ring all-reduces); `statistics=False` leaves them out
                    (algorithms/traffic.py's bytes_communicated counts the weights only)
    a merge         = latency + the absorbed trainers' state / bandwidth, into the survivor's first node;
                    merges into different survivors run in parallel, into one survivor one after another
    node moves      = latency + the state one node receives / bandwidth, all moving nodes in parallel

    streaming       (sync_fragments, sync_delay = tau): one collective per fragment (its payload as the run
                    sent it, summary.json `fragment_bytes`), each launched tau inner steps before it must
                    land: it costs only what sticks out, max(0, its time - tau x the round's compute / H)

Bandwidth is per node link and per direction; latency is per message. ASSUMPTIONS (what it ignores):
no overlap of compute and communication (except streaming's tau inner steps), no stragglers (every node
computes at node_throughput, whatever its batch), no contention between trainers or moves sharing links,
evaluation and checkpoint time left out, a node's throughput independent of its batch size (on GPUs
larger batches run faster per token, which favours large and growing batches).
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from algorithms.calc_batch import BATCH_TESTS, STATISTICS_WIRE, NodeGradientSums, statistics_payload_bytes
from algorithms.outer_sync import OuterSync
from algorithms.traffic import ring_allreduce_bytes

# named settings for --network; per node link, per direction
PRESETS = {
    "datacentre": "100Gbit/s,10us",  # one cluster, Ethernet/InfiniBand class
    "cross-region": "1Gbit/s,50ms",  # data centres in different regions or continents
    "consumer": "100Mbit/s,30ms",  # volunteers' home internet
}
_RATE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


@dataclass(frozen=True)
class Network:
    name: str
    bandwidth: float  # bytes per second, per node link and direction
    latency: float  # seconds per message

    def message(self, nbytes: float) -> float:
        """One point-to-point message of `nbytes`."""
        return self.latency + nbytes / self.bandwidth

    def allreduce(self, num_nodes: int, nbytes: float) -> float:
        """A ring all-reduce of `nbytes` among `num_nodes` nodes: 2 (n-1) steps of nbytes / n each."""
        if num_nodes <= 1:
            return 0.0
        # each node sends its share of the accounting's ring bytes (algorithms/traffic.py), one latency per step
        return 2 * (num_nodes - 1) * self.latency + ring_allreduce_bytes(num_nodes, nbytes) / num_nodes / self.bandwidth


    def allgather(self, num_nodes: int, nbytes: float) -> float:
        """A ring all-gather of each node's `nbytes`: n-1 steps, each node sending one payload per step."""
        return (num_nodes - 1) * (self.latency + nbytes / self.bandwidth) if num_nodes > 1 else 0.0


def parse_bandwidth(text: str) -> float:
    """'10Gbit/s', '100 Mbps', '1.25GB/s' -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([kmgt]?)(bit/s|bps|b/s|byte/s)\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"bandwidth '{text}': write a number and a unit, e.g. 10Gbit/s, 100Mbps, 1.25GB/s")
    value, prefix, unit = float(m[1]), _RATE[m[2].lower()], m[3]
    is_bits = unit.lower() in ("bit/s", "bps") or unit == "b/s"
    rate = value * prefix / (8 if is_bits else 1)
    if rate <= 0:
        raise ValueError(f"bandwidth '{text}' must be > 0")
    return rate


def parse_latency(text: str) -> float:
    """'1ms', '50 ms', '10us', '0.2s' -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*(s|ms|us|µs|ns)\s*", text)
    if not m:
        raise ValueError(f"latency '{text}': write a number and a unit, e.g. 1ms, 10us, 0.05s")
    return float(m[1]) * _TIME[m[2]]


def parse_network(spec: str) -> Network:
    """A preset name ('datacentre', 'cross-region', 'consumer'), 'BANDWIDTH,LATENCY' or 'NAME=BANDWIDTH,LATENCY'."""
    name, _, value = spec.rpartition("=")
    value = PRESETS.get(value.strip(), value)
    name = name.strip() or (spec.strip() if spec.strip() in PRESETS else value.replace(" ", ""))
    parts = value.split(",")
    if len(parts) != 2:
        raise ValueError(f"'{spec}': give BANDWIDTH,LATENCY (e.g. '10Gbit/s,1ms') or a preset: {', '.join(PRESETS)}")
    return Network(name, parse_bandwidth(parts[0]), parse_latency(parts[1]))


def format_rate(bits_per_s: float, digits: int = 6) -> str:
    """1.25e10 -> '12.5 Gbit/s'."""
    unit, factor = next((u, f) for u, f in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3), ("bit/s", 1.0))
                        if bits_per_s >= f * 0.999 or f == 1.0)
    return f"{bits_per_s / factor:.{digits}g} {unit}"


def describe(net: Network) -> str:
    lat = f"{net.latency * 1e3:g} ms" if net.latency >= 1e-3 else f"{net.latency * 1e6:g} us"
    return f"{net.name} ({format_rate(net.bandwidth * 8)}, {lat})"


# ---------------------------------------------------------------------------------------------------------
@dataclass
class TrainerRound:
    num_nodes: int
    tokens: float  # tokens all the trainer's nodes processed in the round
    statistics_bytes: int = 0  # the batch test's statistics per node, both reductions (0: none travel)
    sync_bytes: int = 0  # outer_compression: each node's encoded payload, all-gathered (0: fp32 all-reduce of P)
    # Streaming DiLoCo: each fragment's payload per node (one collective each; empty: one sync of the whole
    # model), the inner steps a collective overlaps (sync_delay) and the round's inner steps
    fragment_bytes: tuple[int, ...] = ()
    overlap_steps: int = 0
    inner_steps: int = 1

    def sync_time(self, net: Network, weight_bytes: int, compute: float) -> float:
        """What the outer sync adds to the round: one collective of the whole model, or (streaming) each
        fragment's collective minus the `overlap_steps` inner steps of compute that hide it."""
        gathered = self.sync_bytes > 0
        if not self.fragment_bytes:
            return net.allgather(self.num_nodes, self.sync_bytes) if gathered else net.allreduce(self.num_nodes,
                                                                                                weight_bytes)
        hidden = self.overlap_steps * compute / self.inner_steps
        return sum(max(0.0, (net.allgather(self.num_nodes, b) if gathered else net.allreduce(self.num_nodes, b))
                       - hidden) for b in self.fragment_bytes)

    def sent_bytes(self, weight_bytes: int) -> int:
        """All nodes' outer-sync bytes in the round, on algorithms/traffic.py's definitions."""
        n = self.num_nodes
        payloads = self.fragment_bytes or (self.sync_bytes or weight_bytes,)
        return sum(n * (n - 1) * b if self.sync_bytes else ring_allreduce_bytes(n, b) for b in payloads)


@dataclass
class RoundWork:
    """What one round (outer step) of a run computed and sent."""

    step: int
    trainers: list[TrainerRound]
    merges: list[tuple[int, int]]  # (survivor, bytes that travelled into it)
    node_moves: int = 0
    node_move_bytes: int = 0  # all moving nodes together


@dataclass
class RoundTime:
    compute: float  # the slowest trainer's compute: the round's length on an infinitely fast network
    total: float

    @property
    def communication(self) -> float:
        """What the network adds to the round."""
        return self.total - self.compute


def round_time(work: RoundWork, net: Network, node_throughput: float, weight_bytes: int) -> RoundTime:
    """The predicted wall time of one round (see the module docstring)."""
    compute, slowest = 0.0, 0.0
    for t in work.trainers:
        if t.num_nodes == 0:  # every node of the trainer failed this round (on_node_fault: skip)
            continue
        own = t.tokens / t.num_nodes / node_throughput
        sync = t.sync_time(net, weight_bytes, own)
        if t.statistics_bytes and t.num_nodes > 1:
            scalars = 8 * NodeGradientSums.SCALARS  # the second reduction, once the trainer's mean is known
            sync += net.allreduce(t.num_nodes, t.statistics_bytes - scalars) + net.allreduce(t.num_nodes, scalars)
        compute, slowest = max(compute, own), max(slowest, own + sync)
    into: dict[int, float] = {}
    for survivor, nbytes in work.merges:
        into[survivor] = into.get(survivor, 0.0) + net.message(nbytes)
    moves = net.message(work.node_move_bytes / work.node_moves) if work.node_moves else 0.0
    return RoundTime(compute, slowest + max(into.values(), default=0.0) + moves)


def timeline(rounds: list[RoundWork], net: Network, node_throughput: float,
             weight_bytes: int) -> tuple[dict[int, float], float]:
    """Predicted wall time at the end of each round, by outer step ({0: 0.0, 1: t1, 2: t1 + t2, ...}), and how
    much of the whole is compute (the rest is what the network adds)."""
    times, now, compute = {0: 0.0}, 0.0, 0.0
    for work in rounds:
        spent = round_time(work, net, node_throughput, weight_bytes)
        now, compute = now + spent.total, compute + spent.compute
        times[work.step] = now
    return times, compute


# ---------------------------------------------------------------------------------------------------------
def _statistics_bytes(run_config: dict, weight_bytes: int, statistics: bool) -> int:
    """Bytes per node of the batch test's statistics reductions (distributed/backend.py), 0 if none travel."""
    test = BATCH_TESTS.get(run_config.get("sampling_method", ""))
    if not statistics or test is None or not test.uses_statistics:
        return 0
    within_node = run_config.get("variance_estimator", "micro_batches") == "micro_batches"
    mode = run_config.get("statistics_comm", "fp64")
    numel = int(run_config.get("statistics_sketch_dim", 16384)) if mode == "sketch" else weight_bytes // 4
    return statistics_payload_bytes(numel, within_node, STATISTICS_WIRE[mode])


def _sync_bytes(run_config: dict, weight_bytes: int) -> int:
    """Each node's encoded pseudo-gradient under outer_compression; 0 for the fp32 all-reduce."""
    sync = OuterSync(run_config.get("outer_compression", "none"), topk_fraction=run_config.get("topk_fraction", 0.02))
    return 0 if sync.exact else sync.payload_bytes(weight_bytes // 4)


def read_rounds(run_dir: Path, statistics: bool = True) -> tuple[list[RoundWork], int, int]:
    """A finished run's rounds, the bytes P of its fp32 weights and the bytes_communicated they add up to.

    Runs written before summary.json carried `weight_bytes` get P from their all-reduce traffic."""
    report = run_dir / "model_training_report"
    with (report / "training_log.csv").open() as f:
        rows = list(csv.DictReader(f))
    with (report / "merge_events.csv").open() as f:
        merges = list(csv.DictReader(f))
    summary = json.loads((run_dir / "summary.json").read_text())
    run_config = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    by_step: dict[int, list[dict[str, str]]] = {}
    for r in rows:
        by_step.setdefault(int(r["outer_step"]), []).append(r)
    merges_at: dict[int, list[dict[str, str]]] = {}
    for m in merges:
        merges_at.setdefault(int(m["outer_step"]), []).append(m)
    weight_bytes = summary.get("weight_bytes") or _infer_weight_bytes(by_step)
    stats = _statistics_bytes(run_config, weight_bytes, statistics)
    sync_bytes = _sync_bytes(run_config, weight_bytes)
    streaming = {"fragment_bytes": tuple(summary.get("fragment_bytes") or ()),
                 "overlap_steps": int(run_config.get("sync_delay", 0)),
                 "inner_steps": int(run_config.get("num_inner_steps", 1))}
    tokens_before = {r["trainer_id"]: 0.0 for r in by_step.get(0, [])}
    moves_before = move_bytes_before = 0
    rounds = []
    for step in sorted(s for s in by_step if s > 0):
        trained = by_step[step]
        first = trained[0]
        work = RoundWork(step, [], [(int(m["survivor"]), int(m["bytes"])) for m in merges_at.get(step, [])],
                         int(first["node_moves"] or 0) - moves_before,
                         int(first["node_move_bytes"] or 0) - move_bytes_before)
        moves_before, move_bytes_before = int(first["node_moves"] or 0), int(first["node_move_bytes"] or 0)
        for r in trained:
            seen = float(r["tokens_seen"])
            work.trainers.append(TrainerRound(int(r["num_nodes"]), seen - tokens_before.get(r["trainer_id"], 0.0),
                                              stats, sync_bytes, **streaming))
            tokens_before[r["trainer_id"]] = seen
        for m in merges_at.get(step, []):  # the survivor's count goes on from its members' sum
            for merged in m["merged"].split():
                tokens_before[m["survivor"]] = tokens_before.get(m["survivor"], 0.0) + tokens_before.pop(merged, 0.0)
        rounds.append(work)
    return rounds, weight_bytes, int(summary.get("bytes_communicated", 0))


def _infer_weight_bytes(by_step: dict[int, list[dict[str, str]]]) -> int:
    """P from a round with an all-reduce: its allreduce_bytes grew by sum over trainers of 2 (n-1) P."""
    before = 0
    for step in sorted(by_step):
        rows = by_step[step]
        total = int(rows[0]["allreduce_bytes"] or 0)
        ring = sum(ring_allreduce_bytes(int(r["num_nodes"]), 1) for r in rows if r["num_nodes"])
        if step > 0 and ring and total > before:
            return (total - before) // ring
        before = total
    return 0  # the run never all-reduced: its weights never crossed a link in an all-reduce


def accounted_bytes(rounds: list[RoundWork], weight_bytes: int) -> int:
    """The weights traffic the model charges, on algorithms/traffic.py's definitions (a check against the run)."""
    total = 0
    for work in rounds:
        total += sum(t.sent_bytes(weight_bytes) for t in work.trainers)
        total += sum(nbytes for _, nbytes in work.merges) + work.node_move_bytes
    return total


def bandwidth_grid(low: float = 1e6 / 8, high: float = 4e11 / 8, per_decade: int = 8) -> list[float]:
    """Bandwidths (bytes/s) evenly spaced in log from `low` to `high`, for the crossover plot."""
    n = int(round(math.log10(high / low) * per_decade))
    return [low * (high / low) ** (i / n) for i in range(n + 1)]
