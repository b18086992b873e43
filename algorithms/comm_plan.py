"""What a run's communication is, decided once (docs/communication.md): how the outer sync, the merges and the
batch tests' statistics travel, the Streaming DiLoCo schedule, and what each weighs on the wire. cluster/build.py
builds it from the config and the model (utils/run_plan.py); the backend, the round driver and the replay take it
whole."""

from __future__ import annotations

import dataclasses

from algorithms.calc_batch import REFERENCE_WIRE, StatisticsWire, statistics_payload_bytes
from algorithms.outer_sync import OuterSync, wire_size
from algorithms.streaming import StreamingPlan
from algorithms.traffic import SyncCost


@dataclasses.dataclass(frozen=True)
class WireSizes:
    """What travels, in bytes (docs/communication.md, "Communication accounting")."""
    param_bytes: int  # one trainer's fp32 weights (P)
    sync_bytes: int  # what one node sends its trainer per round: fp32 weights, or the encoded pseudo-gradient
    fragment_bytes: tuple[int, ...]  # streaming: one collective per fragment, each with its count/flag (else ())
    statistics_bytes: int  # one node's batch-test statistics
    gradient_bytes: int = 0  # DDP / SNOO: each inner step's all-reduce per node (fp32 gradients and a count)

    @classmethod
    def of(cls, numels: dict[str, int], plan: CommPlan, gradient_numel: int = 0) -> WireSizes:
        """The sizes of `plan`'s payloads for a model whose fp32 tensors have these sizes (gradient_numel: the
        trainable parameters, when gradients cross every inner step)."""
        sync, param_bytes = plan.outer_sync, sum(numels.values()) * 4
        fragments = () if plan.streaming is None else tuple(
            wire_size(sync, sum(numels[n] for n in names)) * (4 if sync.exact else 1)
            for names in plan.streaming.fragments)
        return cls(param_bytes, sync.payload_bytes(param_bytes // 4), fragments,
                   statistics_payload_bytes(plan.sample_numel, plan.within_node, plan.statistics_wire),
                   4 * (gradient_numel + 1) if gradient_numel else 0)


def gradient_samples(wanted: bool, within_node: bool, micro_batches: int) -> int:
    """Gradient samples a node takes per round (CommPlan.grad_chunks; what the memory plan reserves): none unless
    the batch test or the log wants statistics; one per chunk under the micro_batches estimator, else one."""
    return 0 if not wanted else micro_batches if within_node else 1


@dataclasses.dataclass(frozen=True)
class CommPlan:
    """How a round's communication travels. The defaults are a plain DiLoCo round: fp32 weights averaged, the
    fp64 reference statistics, no streaming."""
    outer_sync: OuterSync = dataclasses.field(default_factory=OuterSync)  # outer_compression, error_feedback
    merge_sync: OuterSync = dataclasses.field(default_factory=OuterSync)  # merge_compression
    statistics_wire: StatisticsWire = REFERENCE_WIRE  # statistics_comm
    streaming: StreamingPlan | None = None  # Streaming DiLoCo: the fragments and their schedule; None without it
    within_node: bool = True  # the micro_batches estimator: each node's samples form their own group
    by_tokens: bool = False  # inner_steps_by_speed: nodes weigh in their trainer's mean by their tokens
    sample_numel: int = 0  # one gradient sample's length (the sketch's dimension when sketched)
    grad_chunks: int = 0  # gradient samples per node and round (0: none are taken)
    statistics_decide: bool = True  # the batch test reads the statistics (False: sent for the log only)
    inner_steps: int = 1  # num_inner_steps: DDP / SNOO's collectives per round, the span a fragment overlaps
    overlap_steps: int = 0  # sync_delay: inner steps a streamed fragment's collective overlaps
    sizes: WireSizes | None = None  # what each payload weighs (WireSizes.of)

    @property
    def streams(self) -> bool:
        return self.streaming is not None

    def sync_cost(self, statistics_sent: bool) -> SyncCost:
        """What a trainer's round sends and costs (algorithms/traffic.py), built once per trainer-round and read by
        the traffic counters and the clock alike. statistics_sent: its nodes' gradient statistics travelled."""
        sizes = self.sizes
        return SyncCost(0 if self.outer_sync.exact else sizes.sync_bytes,
                        sizes.fragment_bytes, self.overlap_steps, self.inner_steps,
                        sizes.statistics_bytes if statistics_sent else 0, self.outer_sync.ring,
                        sizes.gradient_bytes, statistics_for_the_log=not self.statistics_decide)
