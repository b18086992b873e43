"""The cross-key rules of a run configuration: one check per section, run in order when a `Config` is made (a
single key's type, choices and bounds are checked as it is read, by `utils/typed_yaml.py`), and the warnings
run.py logs for valid settings that likely do not do what the user wants."""

from __future__ import annotations

from utils.config_schema import ADAPTIVE_TESTS, MAX_NAME_BYTES, RUN_DIR_ENTRIES, ConfigFields
from utils.errors import ConfigError


def check_run_and_logs(cfg: ConfigFields) -> None:
    """run_name and log_file are plain names inside their directories: no separators, no escapes."""
    for key, value, may_be_empty in (("run_name", cfg.run_name, True), ("log_file", cfg.log_file, False)):
        if not value and may_be_empty:
            continue
        if not value or value.strip() != value:
            raise ConfigError(key, f"{value!r} must be a non-empty name without surrounding spaces")
        if "/" in value or "\\" in value or value in (".", "..") or "\0" in value:
            raise ConfigError(key, f"{value!r} must be a plain name, not a path (no '/', '..' or absolute paths)")
        if len(value.encode()) > MAX_NAME_BYTES:
            raise ConfigError(key, f"is {len(value.encode())} bytes long; at most {MAX_NAME_BYTES}")
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ConfigError(key, f"{value!r} contains control characters (a newline, a tab, ...)")
    if cfg.log_file in RUN_DIR_ENTRIES:
        raise ConfigError("log_file", f"'{cfg.log_file}' is the name of another entry of the run directory")
    if not cfg.log_dir.strip():
        raise ConfigError("log_dir", "must not be empty (use . for the current directory)")


def check_faults(cfg: ConfigFields) -> None:
    cfg.injected_faults()  # validates the syntax


def check_algorithm(cfg: ConfigFields) -> None:
    if cfg.outer_nesterov and cfg.outer_momentum == 0:
        raise ConfigError("outer_nesterov", "Nesterov needs outer_momentum > 0 (DiLoCo uses 0.9)")
    if len(cfg.inner_betas) != 2 or not all(0 <= b < 1 for b in cfg.inner_betas):
        raise ConfigError("inner_betas", f"expected two numbers in [0, 1), got {cfg.inner_betas}")
    if cfg.distributed_algo in ("DDP", "SNOO"):  # gradients cross every inner step: no pseudo-gradient travels
        for key, value, plain in (("outer_compression", cfg.outer_compression, "none"),
                                  ("sync_fragments", cfg.sync_fragments, 1), ("sync_delay", cfg.sync_delay, 0),
                                  ("fragment_alpha", cfg.fragment_alpha, 0.0),
                                  ("inner_steps_by_speed", cfg.inner_steps_by_speed, False)):
            if value != plain:
                raise ConfigError(key, f"{value} does not apply to distributed_algo {cfg.distributed_algo}: its "
                                  "nodes average their gradients after every inner step (leave it at "
                                  f"{plain})")


def check_cluster(cfg: ConfigFields) -> None:
    if not cfg.devices:
        raise ConfigError("devices", "at least one device is needed")
    for i, spec in enumerate(cfg.device_specs):
        device = spec.device
        if device != "cpu" and not (device == "cuda" or device.startswith("cuda:")):
            raise ConfigError(f"devices[{i}]" if cfg.devices[i] is spec else "devices",
                              f"'{device}' is not cpu, cuda or cuda:N")
        if not spec.speed > 0:
            raise ConfigError(f"devices[{i}].speed", f"{spec.speed} must be > 0 (1 = the throughput curve's pace)")
    if cfg.precision == "tf32" and not any(d.startswith("cuda") for d in cfg.device_names):
        raise ConfigError("precision", "tf32 is a CUDA matmul mode; on CPU use fp32 (or bf16)")
    if cfg.dist_backend == "nccl" and not any(d.startswith("cuda") for d in cfg.device_names):
        raise ConfigError("dist_backend", "nccl needs CUDA devices; use gloo (or auto) on CPU")
    if cfg.compile and cfg.offload_idle_nodes:
        raise ConfigError("offload_idle_nodes", "moving a compiled replica's weights between rounds would recompile "
                          "it every round: use compile: false with offloading")
    if cfg.node_execution == "stacked":
        stacked_refusals(cfg)
    if cfg.compile and cfg.node_execution == "threads":
        raise ConfigError("compile", "torch.compile is not thread-safe: use node_execution: sequential or auto "
                          "(or torchrun, one node per process)")


def stacked_refusals(cfg: ConfigFields) -> None:
    """node_execution: stacked runs plain DiLoCo rounds of AdamW nodes (distributed/stacked.py); what it cannot."""
    refused = {"model_type": cfg.model_type != "microllama" and f"{cfg.model_type} (stacked runs causal language "
               "models, whose packed sequences need no attention mask)",
               "distributed_algo": cfg.distributed_algo != "DiLoCo" and f"{cfg.distributed_algo} (stacked runs "
               "DiLoCo's inner AdamW; DDP and SNOO average gradients per node, LocalSGD steps SGD)",
               "compile": cfg.compile and "true (the stacked model is not compiled)",
               "precision": cfg.precision == "fp16" and "fp16 (one loss scale per node)",
               "offload_idle_nodes": cfg.offload_idle_nodes and "true (a stack holds all of its nodes at once)"}
    for key, why in refused.items():
        if why:
            raise ConfigError(key, f"{why}: not with node_execution: stacked; use sequential")


def multi_instance_warnings(cfg: ConfigFields) -> list[str]:
    """Trainers whose batch cannot grow until a merge; merges that never happen."""
    from algorithms.round_schedule import node_counts

    out = []
    if cfg.sampling_method in ADAPTIVE_TESTS and cfg.variance_estimator == "nodes":
        counts = node_counts({t: cfg.initial_batch_size for t in range(cfg.num_init_trainers)},
                             cfg.total_nodes)
        alone = [t for t, c in counts.items() if c == 1]
        if alone:
            out.append(f"variance_estimator 'nodes': trainers {' '.join(map(str, alone))} start with one node, so "
                       "they have one gradient sample and their batch cannot grow until a merge gives them a "
                       "second node (variance_estimator: micro_batches works with one node)")
    if cfg.num_init_trainers > 1 and cfg.merge_frequency > cfg.num_outer_steps:
        out.append(f"merge_frequency {cfg.merge_frequency} is larger than num_outer_steps {cfg.num_outer_steps}: "
                   "no merge will happen (merge_frequency: 0 says that on purpose)")
    return out


def clock_warnings(cfg: ConfigFields) -> list[str]:
    """A node_schedule event after the last outer step; a curve file that is not shaped like a throughput curve."""
    from algorithms.clock import ThroughputCurve
    from algorithms.round_schedule import NodeSchedule

    out = []
    for i, event in enumerate(NodeSchedule.parse(cfg.node_schedule, cfg.total_nodes).events):
        first = event.leave or max(event.start, 1)
        if first > cfg.num_outer_steps:
            what = "leaves" if event.leave else "slows down"
            out.append(f"node_schedule[{i}]: node {event.node} {what} at outer step {first}, after the run's last "
                       f"({cfg.num_outer_steps}): it will never happen (unless the run is extended: "
                       "--resume RUN num_outer_steps=N)")
    if cfg.throughput not in ("flat", "measured"):
        problems = ThroughputCurve.load(cfg.throughput).shape_problems()
        if problems:
            out.append(f"throughput: the curve {cfg.throughput} {'; '.join(problems)}; a throughput curve rises "
                       "and flattens as the micro-batch grows: the clock uses it as given")
    return out


SKETCH_WARN_BELOW = 16  # the tests' ratio of two sketched estimates errs by about 2/sqrt(k): 50% at 16


def sketch_warnings(cfg: ConfigFields) -> list[str]:
    """A sketch too small to measure what the batch test decides on."""
    k = cfg.statistics_sketch_dim
    if cfg.statistics_comm != "sketch" or k >= SKETCH_WARN_BELOW:
        return []
    return [f"statistics_sketch_dim {k}: the sketch's estimates err by about sqrt(2/k) = {(2 / k) ** 0.5:.0%} "
            f"each, and the batch test's ratio of two of them by about {2 / k ** 0.5:.0%}: more than half of "
            "what it measures, so its decisions follow the noise; use at least "
            f"{SKETCH_WARN_BELOW} (the default 16384 errs by 1.1%)"]


def alpha_warnings(cfg: ConfigFields) -> list[str]:
    """fragment_alpha 1 keeps every node's own copy: the trainers' weights never reach the nodes."""
    if cfg.fragment_alpha == 1.0:
        return ["fragment_alpha 1.0 keeps the nodes' own weights at every landing: they never take their trainer's "
                "(since 2026-11-24 alpha is the local copy's weight, as torchft's fragment_update_alpha; 0 takes "
                "the global weights, which is what 1.0 meant before)"]
    return []


def norm_test_warnings(cfg: ConfigFields) -> list[str]:
    """ETA >= 1: the norm test can (almost) never ask for a larger batch. Its gradient norm is that of the sampled
    mean m, which holds its own noise (E ||m||^2 = ||g||^2 + sigma^2 / B over the trainer's B examples), so its target
    sigma^2 / (M ETA^2 ||m||^2) is at most about b / ETA^2 for a node's batch b: not above b once ETA >= 1."""
    if cfg.sampling_method != "norm_test" or cfg.ETA < 1:
        return []
    return [f"ETA {cfg.ETA:g} >= 1: the norm test asks for at most about b / ETA^2 = {1 / cfg.ETA ** 2:.2g} b (the "
            "sampled gradient's norm holds its own noise), so batches will (almost) never grow; the paper's eta is "
            "below 1 (its runs: 0.8)"]


CONFIG_WARNINGS = (multi_instance_warnings, clock_warnings, sketch_warnings, alpha_warnings, norm_test_warnings)


def check_multi_instance(cfg: ConfigFields) -> None:
    if cfg.num_init_trainers > cfg.total_nodes:
        raise ConfigError("num_init_trainers", f"{cfg.num_init_trainers} trainers need at least as many "
                          f"nodes, but devices x nodes_per_gpu = {cfg.total_nodes}")


def check_clock(cfg: ConfigFields) -> None:
    """The cluster description (network, throughput, node_schedule, inner_steps_by_speed), before any work."""
    from algorithms.clock import ThroughputCurve
    from algorithms.network import parse_network
    from algorithms.round_schedule import NodeSchedule

    try:
        parse_network(cfg.network)
    except ValueError as exc:
        raise ConfigError("network", str(exc)) from None
    if cfg.throughput not in ("flat", "measured"):
        try:
            curve = ThroughputCurve.load(cfg.throughput)
        except ValueError as exc:
            raise ConfigError("throughput", f"{exc} (or use flat / measured)") from None
        if cfg.max_batch_size > curve.largest_micro_batch:  # a probed max batch is checked once probed
            raise ConfigError("throughput", f"{cfg.throughput} covers micro-batches up to "
                              f"{curve.largest_micro_batch} (accumulation 1), but max_batch_size is "
                              f"{cfg.max_batch_size}: measure the curve up to it (benchmarks.system --curve)")
    try:
        schedule = NodeSchedule.parse(cfg.node_schedule, cfg.total_nodes)
    except ValueError as exc:
        raise ConfigError("node_schedule", str(exc)) from None
    trainers = cfg.num_init_trainers
    for step in range(1, cfg.num_outer_steps + 1):
        present = len(schedule.present(step, cfg.total_nodes))
        if present < trainers:
            raise ConfigError("node_schedule", f"leaves {present} nodes at outer step {step} for {trainers} "
                              "trainers: each trainer needs a node")
        if cfg.merge_frequency and trainers > 1 and step % cfg.merge_frequency == 0:
            trainers -= 1
    if cfg.inner_steps_by_speed and cfg.streams:
        raise ConfigError("inner_steps_by_speed", "cannot be combined with Streaming DiLoCo (sync_fragments, "
                          "sync_delay, fragment_alpha): its fragments are scheduled at fixed inner steps")


def check_adaptive_batching(cfg: ConfigFields) -> None:
    """Adaptive batching whose estimator can never see two gradient samples is a silent no-op: refuse it."""
    if cfg.initial_batch_size > cfg.max_requested_batch:
        raise ConfigError("initial_batch_size", "is larger than max_requested_batch")
    if cfg.sampling_method in ADAPTIVE_TESTS:
        total_nodes = cfg.total_nodes
        if cfg.variance_estimator == "nodes":
            if total_nodes == 1 or (total_nodes == cfg.num_init_trainers and cfg.merge_frequency == 0):
                raise ConfigError("variance_estimator", f"'nodes' needs >= 2 nodes per trainer, but {total_nodes} "
                                  f"nodes serve {cfg.num_init_trainers} trainers that never merge: batches would "
                                  "never grow; use variance_estimator: micro_batches, more nodes, or merging")
        elif cfg.initial_batch_size == 1:
            raise ConfigError("variance_estimator", "'micro_batches' splits each node's last step, but "
                              "initial_batch_size 1 gives one example per step: batches would never grow; use "
                              "initial_batch_size >= 2 or variance_estimator: nodes")
    if cfg.sampling_method == "linear_rampup" and not (cfg.rampup_tokens or cfg.max_tokens):
        raise ConfigError("rampup_tokens", "linear_rampup needs rampup_tokens > 0 or a max_tokens budget")


def check_model(cfg: ConfigFields) -> None:
    if (cfg.model_type == "bert") != (cfg.dataset == "imdb"):
        raise ConfigError("model_type", f"'{cfg.model_type}' does not go with dataset '{cfg.dataset}': "
                          "bert trains on imdb, microllama on embedded or c4")


def check_communication(cfg: ConfigFields) -> None:
    if cfg.sync_fragments > cfg.num_inner_steps:
        raise ConfigError("sync_fragments", f"{cfg.sync_fragments} fragments need at least as many inner steps "
                          f"(num_inner_steps {cfg.num_inner_steps}): each syncs once per round")
    if cfg.sync_delay >= cfg.num_inner_steps // cfg.sync_fragments:
        raise ConfigError("sync_delay", f"{cfg.sync_delay} must be below num_inner_steps / sync_fragments = "
                          f"{cfg.num_inner_steps} / {cfg.sync_fragments} (rounded down: "
                          f"{cfg.num_inner_steps // cfg.sync_fragments}): a fragment must land before the "
                          "next is sent")
    if not 0 <= cfg.fragment_alpha <= 1:
        raise ConfigError("fragment_alpha", f"{cfg.fragment_alpha} is not in [0, 1] (the weight of the local copy)")
    if not 0 < cfg.topk_fraction <= 1:
        raise ConfigError("topk_fraction", f"{cfg.topk_fraction} is not in (0, 1] (the share of entries sent)")


def check_data(cfg: ConfigFields) -> None:
    unknown = set(cfg.embedded_sources) - {"wiki", "c4", "tiny"}
    if unknown or not cfg.embedded_sources:
        raise ConfigError("embedded_sources", f"choose from wiki, c4, tiny (got {cfg.embedded_sources})")


def check_evaluation(cfg: ConfigFields) -> None:
    if cfg.eval_every_inner_steps > cfg.num_inner_steps:  # no node runs more (inner_steps_by_speed: the fastest's)
        raise ConfigError("eval_every_inner_steps", f"{cfg.eval_every_inner_steps} is more than a round's "
                          f"num_inner_steps {cfg.num_inner_steps}, so it would never evaluate; use at most "
                          f"{cfg.num_inner_steps} (0: only after each outer step)")


# section -> its check, in the order they run (the order of the checks before they were split by section)
SECTION_CHECKS = {"run and logs": check_run_and_logs, "faults": check_faults, "algorithm": check_algorithm,
                  "cluster": check_cluster, "multi-instance training": check_multi_instance,
                  "the simulated clock": check_clock, "adaptive batching": check_adaptive_batching,
                  "model": check_model, "communication": check_communication, "data": check_data,
                  "evaluation and outputs": check_evaluation}
