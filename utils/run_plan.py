"""A run's plan, derived once from its config: the only place the communication and statistics keys are read
(outer_compression, error_feedback, topk_fraction, merge_compression, statistics_comm, statistics_sketch_dim,
variance_estimator, variance_micro_batches, log_batch_statistics, sync_fragments, sync_delay, fragment_alpha) and
the batch-test policy is built from its keys. Pure functions of the config (and of the model's tensor sizes where a
payload is weighed): cluster/build.py, the memory plan, the preflight checks, the replay and the probes call them,
so none of them decides anew what a key means (tests/test_layout.py walks the code for other readers; the config's
own checks in utils/config_rules.py and the migration of old run directories in run_dir/ are the exceptions).
"""

from __future__ import annotations

import dataclasses

from algorithms.calc_batch import STATISTICS_WIRE, build_batch_test, statistics_payload_bytes
from algorithms.comm_plan import CommPlan, WireSizes, gradient_samples
from algorithms.outer_sync import OuterSync
from algorithms.streaming import StreamingPlan
from utils.config import Config

FP64 = 8  # a sketched gradient sample's entries are fp64


def batch_test_of(cfg: Config):
    """The batch-size policy (algorithms/calc_batch.py, BATCH_TESTS) the config names, with its parameters."""
    return build_batch_test(cfg.sampling_method, eta=cfg.ETA, vartheta=cfg.vartheta, nu=cfg.nu,
                            max_batch=cfg.max_requested_batch, start=cfg.initial_batch_size,
                            rampup_tokens=cfg.rampup_tokens or cfg.max_tokens)


def within_node(cfg: Config) -> bool:
    """The micro_batches estimator: each node's samples form their own group (drift between nodes is not noise)."""
    return cfg.variance_estimator == "micro_batches"


def grad_chunks(cfg: Config, batch_test=None) -> int:
    """Gradient samples each node takes per round: for the batch test (batch_test_of's, or the one already built),
    or only for the log (log_batch_statistics); else none."""
    test = batch_test if batch_test is not None else batch_test_of(cfg)
    return gradient_samples(test.uses_statistics or cfg.log_batch_statistics, within_node(cfg),
                            cfg.variance_micro_batches)


def sketch_dim(cfg: Config) -> int:
    """statistics_comm sketch: the count sketch's dimension; 0 when samples travel whole."""
    return cfg.statistics_sketch_dim if cfg.statistics_comm == "sketch" else 0


def sample_numel(cfg: Config, trainable: int) -> int:
    """The length of one gradient sample: the sketch's dimension, or the trainable parameters."""
    return sketch_dim(cfg) or trainable


def sample_bytes(cfg: Config, trainable: int) -> int:
    """What one node holds of gradient samples until its trainer's statistics are taken: grad chunks x a sample
    (fp32 gradients, or the fp64 sketch)."""
    each = sketch_dim(cfg) * FP64 if sketch_dim(cfg) else trainable * 4
    return grad_chunks(cfg) * each


def outer_sync(cfg: Config) -> OuterSync:
    """How a node's pseudo-gradient travels (outer_compression, error_feedback, topk_fraction)."""
    return OuterSync(cfg.outer_compression, cfg.error_feedback, cfg.topk_fraction)


def keeps_residual(cfg: Config) -> bool:
    """Whether each node keeps an error-feedback residual (a gradient's size) between rounds."""
    sync = outer_sync(cfg)
    return not sync.exact and sync.error_feedback


def fragments(cfg: Config) -> int:
    """Streaming DiLoCo's fragments: 1 (the whole model at once) without it."""
    return cfg.sync_fragments


def overlap_steps(cfg: Config) -> int:
    """Inner steps a streamed fragment's collective overlaps (sync_delay)."""
    return cfg.sync_delay


def streaming(cfg: Config, numels: dict[str, int]) -> StreamingPlan | None:
    """Streaming DiLoCo's fragments and schedule for tensors of these sizes (in the model's order); None without
    it. ValueError names what the tensors cannot be split into."""
    if not cfg.streams:
        return None
    return StreamingPlan.build(list(numels), numels, cfg.num_inner_steps, cfg.sync_fragments, cfg.sync_delay,
                               cfg.fragment_alpha)


def _wires(cfg: Config, sample_length: int, batch_test, stream: StreamingPlan | None) -> CommPlan:
    """The plan's wires and schedule, before anything is weighed."""
    return CommPlan(outer_sync(cfg), OuterSync(cfg.merge_compression), STATISTICS_WIRE[cfg.statistics_comm],
                    stream, within_node=within_node(cfg), by_tokens=cfg.inner_steps_by_speed,
                    sample_numel=sample_length, grad_chunks=grad_chunks(cfg, batch_test),
                    statistics_decide=batch_test.uses_statistics, inner_steps=cfg.num_inner_steps,
                    overlap_steps=overlap_steps(cfg))


def comm_plan(cfg: Config, numels: dict[str, int], sample_length: int, batch_test, gradient_numel: int = 0,
              stream: StreamingPlan | None = None) -> CommPlan:
    """How the run's rounds travel (docs/communication.md): the outer sync, merges and batch statistics' wires, the
    Streaming DiLoCo plan (`stream`, from `streaming`), and what each payload weighs for a model whose fp32
    tensors have these sizes. batch_test: the run's (batch_test_of), whose use of the statistics decides whether
    they count as the method's traffic."""
    plan = _wires(cfg, sample_length, batch_test, stream)
    return dataclasses.replace(plan, sizes=WireSizes.of(numels, plan, gradient_numel))


def recorded_comm_plan(cfg: Config, sizes: WireSizes) -> CommPlan:
    """The plan of a finished run whose payloads weighed `sizes` (its summary.json's, or scaled to another model
    size): the replay prices its rounds with the same CommPlan.sync_cost the live run did (no streaming schedule:
    the fragments are in `sizes`)."""
    return dataclasses.replace(_wires(cfg, 0, batch_test_of(cfg), None), sizes=sizes)


def statistics_bytes(cfg: Config, weight_bytes: int) -> int:
    """One node's batch-test statistics on the wire for a model of `weight_bytes` fp32 bytes (the sketch's size
    does not depend on it)."""
    return statistics_payload_bytes(sketch_dim(cfg) or weight_bytes // 4, within_node(cfg),
                                    STATISTICS_WIRE[cfg.statistics_comm])


def sync_payload_bytes(cfg: Config, weight_bytes: int) -> int:
    """Each node's encoded pseudo-gradient under outer_compression; 0 for the fp32 all-reduce."""
    sync = outer_sync(cfg)
    return 0 if sync.exact else sync.payload_bytes(weight_bytes // 4)
