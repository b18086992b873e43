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


def ring_allreduce_bytes(num_nodes: int, payload_bytes: int) -> int:
    """Bytes all nodes together send in a ring all-reduce of `payload_bytes` among `num_nodes` nodes."""
    return 2 * (num_nodes - 1) * payload_bytes if num_nodes > 1 else 0


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

    def trainer_sync(self, num_nodes: int, payload_bytes: int, gathered: bool = False, shard_flag_bytes: int = 0
                     ) -> None:
        """One trainer's outer step over `num_nodes` nodes: a ring of the payload (an fp32 all-reduce, or the
        ring of quantized shards), or (gathered: top-k) an all-gather of each node's encoded payload, n (n - 1) x
        payload in all. shard_flag_bytes: a streamed fragment's flag, which each shard message of a ring carries
        (the payload counts one already)."""
        if num_nodes > 1:
            self.syncs += 1
            self.allreduce_bytes += (
                num_nodes * (num_nodes - 1) * payload_bytes if gathered
                else ring_allreduce_bytes(num_nodes, payload_bytes + shard_flag_bytes * (num_nodes - 1)))

    def statistics(self, num_nodes: int, payload_bytes: int, for_the_log: bool = False) -> None:
        """One trainer's batch-test statistics: ring all-reduces of each node's `payload_bytes` (for_the_log: the
        batch schedule ignores them; they are counted apart)."""
        if for_the_log:
            self.logged_statistics_bytes += ring_allreduce_bytes(num_nodes, payload_bytes)
        else:
            self.statistics_bytes += ring_allreduce_bytes(num_nodes, payload_bytes)

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
