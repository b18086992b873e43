"""The composition root: `build_cluster` makes every part of the cluster from the config, in one place: the nodes
(and the memory probe), the trainers, the evaluator, the communication plan (the streaming plan, what each sync weighs
on the wire), the state, the backend, the clock and the round driver. Each builder below is handed what it needs;
`ClusterController` (controller.py) takes the parts, loads a resume and runs the loop."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import torch

from algorithms.buckets import micro_batch_buckets
from algorithms.clock import Clock, ThroughputCurve
from algorithms.comm_plan import CommPlan
from algorithms.network import describe, parse_network
from algorithms.policies import build_merge_policy
from algorithms.round_schedule import NodeSchedule, RoundSchedule
from algorithms.sketch import CountSketch, sketch_coefficients
from algorithms.streaming import StreamingPlan
from algorithms.switch_mode import build_switch_mode
from cluster.ledgers import Ledgers
from cluster.max_batch_calculator import NodeShare, find_max_batch_size
from cluster.memory_plan import MemoryPlan, idle_state_bytes, plan_of_run
from cluster.placement import (
    card_of,
    computing_per_device,
    device_index_of_nodes,
    master_device_of,
    nodes_on_card,
    use_threads,
)
from cluster.round_driver import Policies, RoundDriver
from cluster.state import ClusterState
from cluster.throughput import cached_curve, device_kind, measure_curve
from distributed.in_process import InProcessBackend
from distributed.protocol import Backend
from fabrics.dataset_loader import CorpusData, ShardSampler
from fabrics.eval_tool import Evaluator
from fabrics.models import reinit_output_layers, replicate
from fabrics.precision import build_precision
from node import Node
from trainers import TRAINERS, Trainer
from utils import run_plan
from utils.checkpoint import Checkpoint
from utils.config import Config
from utils.errors import ConfigError, UserError
from utils.model_state import float_state

log = logging.getLogger("cluster")


@dataclasses.dataclass(frozen=True)
class ClusterParts:
    """What `build_cluster` makes; `ClusterController` runs the loop over it."""

    nodes: list[Node]
    trainers: dict[int, Trainer]
    evaluator: Evaluator
    sketch: CountSketch | None  # statistics_comm sketch: the one count sketch every node projects with
    plan: CommPlan
    state: ClusterState
    backend: Backend
    ledgers: Ledgers
    driver: RoundDriver
    resume_state: dict | None  # the checkpoint's state besides the trainers, read once
    memory_plan: MemoryPlan | None = None  # at the nodes' max batch (cluster/memory_plan.py); None under torchrun
    compiled: dict | None = None  # compile: the buckets and the warm-up's graphs (warm_up_compiled)


def build_cluster(cfg: Config, model: torch.nn.Module, data: CorpusData, stop_event: threading.Event,
                  resume: Checkpoint | None = None, dist_env=None) -> ClusterParts:
    """Every part of the cluster, from the config (and a resume's checkpoint: node max batches, trainer ids, the
    sketch and the clock's curve come from it, so the memory probe does not run again)."""
    algo = TRAINERS[cfg.distributed_algo]
    make_optimizer = algo.inner_optimizer_factory(cfg)
    policies = Policies(run_plan.batch_test_of(cfg), build_merge_policy(cfg.merging_policy))
    precision = build_precision(cfg.precision)
    grad_chunks = run_plan.grad_chunks(cfg, policies.batch_test)  # for the batch test or the log; else none
    resume_state = resume.resume_state() if resume is not None else None
    nodes = build_nodes(cfg, model, data, make_optimizer, precision, stop_event, resume_state, dist_env)
    initial = float_state(model)
    parameter_names = {n for n, _ in model.named_parameters()}
    trainer_ids = resume.trainers if resume is not None else range(cfg.num_init_trainers)
    local = None if dist_env is None else dist_env.rank
    master_device = master_device_of(cfg, [n.device for n in nodes if n.model is not None])
    trainers = {t: algo(t, initial, parameter_names, cfg,
                        ShardSampler(len(data.train), cfg.training_seed * 1000 + t), master_device)
                for t in trainer_ids}
    if cfg.need_to_reinit_output_layers and resume is None:  # the authors' key; a resume has its trainers' own
        reinit_output_layers(model, {t: tr.master for t, tr in trainers.items()}, cfg.training_seed)
    eval_device = cfg.device_names[0] if local is None else nodes[local].device
    evaluator = Evaluator(replicate(model, eval_device), data.val, cfg.eval_batch_size, eval_device, precision)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sketch = build_sketch(cfg, nodes, grad_chunks, trainable, resume_state)
    sample_numel = sketch.dim if sketch is not None else trainable  # length of a gradient sample
    # communication (docs/communication.md): how the outer sync, merges and the batch statistics travel, and
    # Streaming DiLoCo's fragments synced at staggered inner steps, overlapped
    plan = run_plan.comm_plan(cfg, {k: v.numel() for k, v in initial.items()}, sample_numel, policies.batch_test,
                              trainable if algo.syncs_gradients else 0, build_streaming(cfg, initial))
    state = ClusterState(nodes, trainers, plan.streams, cuda=any(d.startswith("cuda") for d in cfg.device_names))
    backend = build_backend(cfg, nodes, model, master_device, plan, dist_env)
    # the simulated clock (docs/clock.md): it observes the rounds, never changes their numbers
    clock = Clock(parse_network(cfg.network), throughput_curve(cfg, nodes, model, make_optimizer, precision,
                                                               resume_state, dist_env),
                  cfg.node_speeds, plan.sizes.param_bytes)
    log.info("clock: network %s; throughput %s; node speeds %s", describe(clock.network), clock.curve.source,
             " ".join(f"{v:g}" for v in cfg.node_speeds))
    ledgers = Ledgers(clock, state, cfg, evaluator.higher_is_better, plan.sizes.param_bytes)
    schedule = RoundSchedule(clock, NodeSchedule.parse(cfg.node_schedule, len(nodes)),
                             build_switch_mode(cfg.switch_mode), cfg.num_inner_steps, cfg.inner_steps_by_speed)
    driver = RoundDriver(cfg, state, backend, schedule, evaluator, policies, plan)
    memory = None
    if dist_env is None:  # what each device holds at the nodes' max batch (run.py checked it at batch 1)
        memory = plan_of_run(cfg, model, max(n.max_batch for n in nodes), master_device)
        for line in memory.lines():
            log.info("%s", line)
    compiled = warm_up_compiled(nodes, data) if cfg.compile else None
    return ClusterParts(nodes, trainers, evaluator, sketch, plan, state, backend, ledgers, driver, resume_state, memory,
                        compiled)


def build_sketch(cfg: Config, nodes: list[Node], grad_chunks: int, trainable: int,
                 resume_state: dict | None) -> CountSketch | None:
    """statistics_comm sketch: the count sketch every node projects its gradient samples with."""
    sketch = None
    if run_plan.sketch_dim(cfg) and grad_chunks:
        saved = (resume_state or {}).get("sketch")  # the run's own sketch, whatever derives it today
        sketch = CountSketch(run_plan.sketch_dim(cfg), saved["coefficients"] if saved
                             else sketch_coefficients(cfg.training_seed * 1_000_003 + 991))
    for node in nodes:
        node.sketch = sketch
    if sketch is not None and sketch.dim >= trainable:
        log.warning("statistics_sketch_dim %d is not smaller than the %d trainable parameters: the sketch sends "
                    "more than statistics_comm fp64 would, and only estimates", sketch.dim, trainable)
    return sketch


def _probe(cfg: Config, model: torch.nn.Module, make_optimizer, device: str, key: int, spec, data: CorpusData) -> int:
    """The largest micro-batch a node of device `key` fits (cluster/max_batch_calculator.py)."""
    try:
        bounded = cfg.max_concurrent_nodes and use_threads(cfg)  # else every node of a device counts
        computing = computing_per_device(cfg, True) if bounded else 0
        share = NodeShare(
            cfg.padding_percentage, cfg.nodes_per_gpu,
            memory_mb=spec.memory_mb if device.startswith("cuda") else spec.memory_mb or cfg.device_memory_mb,
            num_cpu_devices=cfg.device_names.count("cpu"), nodes_on_card=nodes_on_card(cfg, device),
            computing=computing, computing_on_card=computing * nodes_on_card(cfg, device) // cfg.nodes_per_gpu,
            idle_bytes=0 if cfg.offload_idle_nodes or not bounded else idle_state_bytes(model, make_optimizer))
        return find_max_batch_size(model, make_optimizer, device, cfg.seq_len, share,
                                   upper=min(cfg.max_requested_batch, len(data.train)))
    except UserError as exc:
        if not spec.memory_mb or device.startswith("cuda"):
            raise
        raise ConfigError(f"devices[{key}].memory_mb", f"{spec.memory_mb:g} MiB: not even one "
                          "sequence fits a node of this device; raise it (or padding_percentage), "
                          "or lower nodes_per_gpu or seq_len") from exc


def build_nodes(cfg: Config, model: torch.nn.Module, data: CorpusData, make_optimizer, precision, stop_event,
                resume_state: dict | None, dist_env=None) -> list[Node]:
    """devices x nodes_per_gpu nodes, each with its max batch: from the checkpoint (as decided in the first run),
    max_batch_size, or the memory probe (once per device; under torchrun each process probes its own)."""
    nodes: list[Node] = []
    local = None if dist_env is None else dist_env.rank
    probed: dict[tuple, int] = {}
    for key, spec in enumerate(cfg.device_specs):
        for _ in range(cfg.nodes_per_gpu):
            node_id = len(nodes)
            mine = local is None or node_id == local
            device = spec.device
            if local is not None and mine:
                from distributed.torchrun import device_of

                device = device_of(cfg, dist_env)  # cuda:LOCAL_RANK on a multi-GPU machine
            if resume_state is not None:
                max_batch = resume_state["nodes"][node_id]["max_batch"]
            elif cfg.max_batch_size:
                max_batch = cfg.max_batch_size
            elif not mine:
                max_batch = 0  # probed by its own process, shared below
            else:
                # CUDA: once per card and memory_mb (a device probed after others on its card would count their
                # replicas against itself); CPU: once per budget (simulated devices of one memory_mb share its answer:
                # the probe reads the budget, the model and the nodes per device, the same for each)
                same = (card_of(device), spec.memory_mb) if device.startswith("cuda") else ("cpu", spec.memory_mb)
                if same not in probed:
                    probed[same] = _probe(cfg, model, make_optimizer, device, key, spec, data)
                max_batch = probed[same]
            replica = replicate(model, device) if mine else None  # other processes hold the other nodes
            node = Node(node_id, device, replica, make_optimizer, cfg.grad_clip, data.train, precision, cfg.compile,
                        cfg.compile_backend)
            node.max_batch, node.show_progress, node.stop = max_batch, cfg.inner_progress, stop_event
            node.offload.enabled = cfg.offload_idle_nodes
            node.release()  # offloaded: it waits for its first round in host memory
            nodes.append(node)
    if local is not None and not (resume_state is not None or cfg.max_batch_size):
        import torch.distributed as dist

        found: list = [None] * len(nodes)
        dist.all_gather_object(found, nodes[local].max_batch)
        for node, max_batch in zip(nodes, found):
            node.max_batch = max_batch
    log.info("nodes: %s", ", ".join(f"{n.node_id}@{n.device} (max batch {n.max_batch})" for n in nodes))
    return nodes


def warm_up_compiled(nodes: list[Node], data: CorpusData) -> dict:
    """compile: each node's micro-batch buckets (algorithms/buckets.py) compiled before training, and reported;
    what the summary records (`graphs_after_warm_up` is filled in at the end: 0 when no shape was new)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    mine = [n for n in nodes if n.model is not None]
    for node in mine:
        node.buckets = micro_batch_buckets(node.max_batch) if data.train.labels is None else []
    largest = max((len(n.buckets) for n in mine), default=0)
    # dynamo runs eager, silently, past this many graphs of one function: room for every bucket, and for the
    # evaluation's and the probe's own shapes
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * largest + 8)
    start, before = time.perf_counter(), counters["stats"]["unique_graphs"]
    for node in mine:
        node.warm_up()
    graphs = counters["stats"]["unique_graphs"] - before
    buckets = sorted({b for n in mine for b in n.buckets})
    log.info("compile: micro-batches padded to the buckets %s; warm-up compiled %d graphs in %.1f s, before "
             "training", " ".join(map(str, buckets)), graphs, time.perf_counter() - start)
    return {"buckets": buckets, "warm_up_graphs": graphs, "graphs_before_training": counters["stats"]["unique_graphs"]}


def build_streaming(cfg: Config, initial: dict[str, torch.Tensor]) -> StreamingPlan | None:
    """Streaming DiLoCo (run_plan.streaming): the fragments and their schedule, checked against the model's tied
    weights; None without it."""
    try:
        plan = run_plan.streaming(cfg, {k: v.numel() for k, v in initial.items()})
    except ValueError as exc:
        raise ConfigError("sync_fragments", f"{run_plan.fragments(cfg)}: {exc}") from None
    if plan is None:
        return None
    shared = {}
    for f, names in enumerate(plan.fragments):
        for name in names:
            other = shared.setdefault(initial[name].data_ptr(), f)
            if other != f:
                raise ConfigError("sync_fragments", f"{name} shares its storage with a tensor of fragment "
                                  f"{other} (tied weights): use sync_fragments: 1")
    log.info("streaming: %d fragments of %s tensors; sends/landings after inner steps %s",
             len(plan.fragments), "/".join(str(len(f)) for f in plan.fragments),
             ", ".join(f"{'land' if e.lands else 'send'} {e.fragment}@{e.step}" for e in plan.events))
    return plan


def build_backend(cfg: Config, nodes: list[Node], model: torch.nn.Module, master_device: str, plan: CommPlan,
                  dist_env=None) -> Backend:
    """In this process (InProcessBackend), or one node per torchrun process (TorchrunBackend)."""
    if dist_env is None:
        return InProcessBackend(nodes, use_threads(cfg), plan, master_device, device_index_of_nodes(cfg),
                                cfg.max_concurrent_nodes, stacked=cfg.node_execution == "stacked")
    from distributed import torchrun
    from distributed.torchrun_backend import TorchrunBackend

    shapes = {k: v.shape for k, v in float_state(model).items()}
    return TorchrunBackend(nodes, dist_env.rank, shapes, torchrun.comm_device(cfg, dist_env), torchrun.store(),
                              master_device, plan)


def throughput_curve(cfg: Config, nodes: list[Node], model: torch.nn.Module, make_optimizer, precision,
                     resume_state: dict | None, dist_env=None) -> ThroughputCurve:
    """config throughput: flat, measured (cached) or a file; a resumed run keeps its own curve."""
    saved = (resume_state or {}).get("clock")
    if saved:
        return ThroughputCurve(tuple((int(b), int(a), float(v)) for b, a, v in saved["curve"]), saved["curve_source"])
    if cfg.throughput == "flat":
        return ThroughputCurve.flat(cfg.node_tokens_per_s)
    largest = max(n.max_batch for n in nodes)
    if cfg.throughput != "measured":
        curve = ThroughputCurve.load(cfg.throughput)
        if curve.largest_micro_batch < largest:
            worst = max(nodes, key=lambda n: n.max_batch)
            raise ConfigError("throughput", f"{cfg.throughput} covers micro-batches up to "
                              f"{curve.largest_micro_batch} (accumulation 1), but node {worst.node_id}'s max batch "
                              f"is {largest}: measure the curve up to it (benchmarks.system --curve)")
        return curve
    curve = None
    node = nodes[0 if dist_env is None else dist_env.rank]
    if dist_env is None or dist_env.is_main:  # one measurement, shared: every rank decides alike
        key = {"device": device_kind(node.device), "model": cfg.model_config.name, "seq_len": cfg.seq_len,
               "precision": cfg.precision, "largest": largest, "algorithm": cfg.distributed_algo}
        curve, path = cached_curve(Path(cfg.cache_dir), key, lambda: measure_curve(
            model, make_optimizer, node.device, cfg.seq_len, largest,
            autocast=lambda: precision.autocast(node.device)))
        log.info("throughput: measured curve %s: %s", path or "(not cached)", ", ".join(
            f"{b}x{a}: {v:.0f}" for b, a, v in curve.points if a == 1))
    if dist_env is not None:
        import torch.distributed as dist

        box = [curve]
        dist.broadcast_object_list(box, src=0)
        curve = box[0]
    return curve
