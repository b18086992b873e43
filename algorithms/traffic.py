"""Communication accounting: what a real cluster would send for the rounds, merges and node moves we run.

Definitions (also in docs/communication.md, "Communication accounting"). P = bytes of one trainer's fp32 weights.

rounds              outer steps: synchronisation events of the whole cluster, DiLoCo's wall-clock unit.
syncs               per-trainer all-reduces that actually cross nodes (a trainer with one node sends
                    nothing, so it counts 0) plus merges.
allreduce_bytes     a ring all-reduce of the fp32 pseudo-gradients among a trainer's n nodes: each node
                    sends 2 (n-1)/n x P, so 2 (n-1) x P in all; 0 for n = 1. Every node then applies the
                    same outer step to its own copy of the trainer's weights, so no weights move.
                    With outer_compression bf16 / fp8 / int8, each node's encoded pseudo-gradient C
                    (values and scales) travels as a ring of quantized shards (a reduce-scatter of
                    encoded shards, then an all-gather of the re-encoded reduced shards): 2 (n-1) x C in
                    all, as a ring all-reduce of C. top-k's payloads (values, indices) are all-gathered:
                    n (n-1) x C in all. Streaming DiLoCo (sync_fragments): one such collective per
                    fragment, each payload with a 4-byte count (exact) or flag (compressed; in a ring
                    every shard message carries the sender's flag, 2 (n-1) x (C + 4 n) in all); each
                    counts as a sync.
merge_bytes         the absorbed trainers' fp32 weights (and outer momentum, when it exists) travel to
                    the survivor's first node, which computes the weighted average (encoded by
                    merge_compression, when set).
node_move_bytes     a node that starts a round from weights it does not hold (it joined another trainer,
                    or its trainer was merged on another node) receives them: P. The common initial
                    weights are not counted.
weights_traffic_bytes  allreduce_bytes + merge_bytes + node_move_bytes: the weights' traffic (files written
                    before 2026-11-26 call it bytes_communicated).
statistics_bytes    the batch tests' two reductions per trainer and round (2 (n-1) x each node's payload), in
                    the precision the run sent them (statistics_comm), when the batch test decides with them.
total_traffic_bytes weights_traffic_bytes + statistics_bytes: the traffic a method needs for its own decisions
                    (AdLoCo's batch test included), what a run's final line calls "MB communicated". Byte
                    budgets, bytes columns and plots count this (files written before 2026-11-26 call it
                    bytes_needed).
logged_statistics_bytes  the same reductions sent for the log only (log_batch_statistics with a batch schedule
                    that ignores them): shown apart, charged to no method, not priced by the clock.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from algorithms.network import Network, ring_allreduce_bytes
from algorithms.streaming import FLAG_BYTES

__all__ = ["SyncCost", "Traffic", "ring_allreduce_bytes"]


@dataclass(frozen=True)
class SyncCost:
    """One trainer's communication in one round: what its nodes send (bytes, on the definitions above) and how long
    that takes on a network (seconds, algorithms/network.py's model). The one model of a sync: CommPlan.sync_cost
    builds it once per trainer-round; the traffic counters (`Traffic.add`), the clock (`seconds`) and the replay of a
    finished run (benchmarks/replay.py) read it. Sizes are per node, in bytes; `weight_bytes` is P."""

    sync_bytes: int = 0  # outer_compression: each node's encoded payload (0: fp32 all-reduce of P)
    fragment_bytes: tuple[int, ...] = ()  # Streaming DiLoCo: each fragment's payload (one collective each)
    overlap_steps: int = 0  # sync_delay: inner steps a fragment's collective overlaps
    inner_steps: int = 1
    statistics_bytes: int = 0  # the batch test's statistics (both reductions; 0: none travel)
    ring: bool = False  # the encoded payloads travel as a ring of quantized shards (else all-gathered)
    step_bytes: int = 0  # DDP / SNOO: each inner step's all-reduce (gradients and a count); nothing at the end
    statistics_for_the_log: bool = False  # the statistics travel for the log only: counted apart, never priced

    @property
    def gathered(self) -> bool:
        """top-k: each node's encoded payload is all-gathered, n (n - 1) x payload in all."""
        return self.sync_bytes > 0 and not self.ring

    def payloads(self, weight_bytes: int) -> list[int]:
        """Each collective's payload per node: one per inner step (DDP / SNOO), one per fragment, or the whole
        model's."""
        if self.step_bytes:
            return [self.step_bytes] * self.inner_steps
        return list(self.fragment_bytes) or [self.sync_bytes or weight_bytes]

    def _flags(self, num_nodes: int) -> int:
        """A streamed fragment's flag, which each shard message of a ring carries (the payload counts one)."""
        return FLAG_BYTES * (num_nodes - 1) if self.fragment_bytes and self.sync_bytes and self.ring else 0

    def sent_bytes(self, num_nodes: int, weight_bytes: int) -> int:
        """All nodes' outer-sync bytes in the round."""
        if num_nodes <= 1:
            return 0
        if self.gathered and not self.step_bytes:
            return sum(num_nodes * (num_nodes - 1) * b for b in self.payloads(weight_bytes))
        return sum(ring_allreduce_bytes(num_nodes, b + self._flags(num_nodes)) for b in self.payloads(weight_bytes))

    def seconds(self, net: Network, num_nodes: int, weight_bytes: int, compute: float) -> float:
        """What the collectives add after the slowest node's `compute` seconds."""
        if num_nodes <= 1:
            return 0.0

        def collective(nbytes: int) -> float:
            return net.allgather(num_nodes, nbytes) if self.gathered else net.allreduce(num_nodes, nbytes)

        if self.step_bytes:  # one all-reduce after each inner step's backward, not overlapped
            total = self.inner_steps * net.allreduce(num_nodes, self.step_bytes)
        elif self.fragment_bytes:
            hidden = self.overlap_steps * compute / self.inner_steps
            total = sum(max(0.0, collective(b + self._flags(num_nodes)) - hidden) for b in self.fragment_bytes)
        else:
            total = collective(self.sync_bytes or weight_bytes)
        if self.statistics_bytes and not self.statistics_for_the_log:
            # two reductions: the vector, then the scalars once the trainer's mean is known; a ring's time is
            # linear in its bytes, so only their number and their total matter (StatisticsWire has the split)
            total += net.allreduce(num_nodes, self.statistics_bytes) + net.allreduce(num_nodes, 0)
        return total


@dataclass
class Traffic:
    rounds: int = 0
    syncs: int = 0
    allreduce_bytes: int = 0
    merge_bytes: int = 0
    node_move_bytes: int = 0
    node_moves: int = 0
    statistics_bytes: int = 0  # the batch tests' reductions; not part of weights_traffic_bytes
    logged_statistics_bytes: int = 0  # the same, sent for the log only: charged to no method

    @property
    def weights_traffic_bytes(self) -> int:
        return self.allreduce_bytes + self.merge_bytes + self.node_move_bytes

    @property
    def total_traffic_bytes(self) -> int:
        """What the method sends for its own decisions: the weights traffic and the batch test's statistics."""
        return self.weights_traffic_bytes + self.statistics_bytes

    def round(self, moved_bytes: list[int], synced: dict[int, int], costs: dict[int, SyncCost],
              weight_bytes: int) -> None:
        """One outer step: the states sent to nodes before it (moved_bytes, one per move), then each trainer's
        collectives over the nodes it synced (synced: trainer id -> nodes; costs: trainer id -> its SyncCost)."""
        for nbytes in moved_bytes:
            self.node_move(nbytes)
        self.rounds += 1
        for t, num_nodes in sorted(synced.items()):
            self.add(costs[t], num_nodes, weight_bytes)

    def add(self, cost: SyncCost, num_nodes: int, weight_bytes: int) -> None:
        """One trainer's round over `num_nodes` nodes: each collective that crosses nodes counts as a sync; the
        batch test's statistics count apart (for the log only: apart again, charged to no method)."""
        if num_nodes > 1:
            self.syncs += len(cost.payloads(weight_bytes))
            self.allreduce_bytes += cost.sent_bytes(num_nodes, weight_bytes)
        sent = ring_allreduce_bytes(num_nodes, cost.statistics_bytes)
        if cost.statistics_for_the_log:
            self.logged_statistics_bytes += sent
        else:
            self.statistics_bytes += sent

    def merge(self, moved_bytes: int) -> None:
        self.syncs += 1
        self.merge_bytes += moved_bytes

    def node_move(self, weight_bytes: int) -> None:
        self.node_moves += 1
        self.node_move_bytes += weight_bytes

    def row(self) -> dict[str, int]:
        """The counters as they appear in training_log.csv, summary.json and the trackers."""
        return {**asdict(self), "weights_traffic_bytes": self.weights_traffic_bytes,
                "total_traffic_bytes": self.total_traffic_bytes}
