"""The simulated cluster: devices hosting nodes, node assignment, rounds, merges and the outer loop.

The controller takes every decision; a backend executes what crosses nodes:
- `run_round(jobs) -> ({trainer: RoundResult}, faults)`: one round of node jobs, combined (the mean of
  the node weights in fp32, summed in node-id order so the result never depends on thread timing);
- `transfer(moves)`: a trainer's state travelling to a node that does not hold it;
- `evaluate(holders)`: each trainer evaluated where its state is;
- `agree(flag)`: a flag that is true everywhere once true anywhere.
`RoundBackend` runs the nodes in this process (threads or a loop; transfers are no-ops, every trainer's
state is here). Under torchrun, `distributed/backend.py` runs one node per process and implements the
same methods with collectives; rounds.py, algorithms/ and trainers.py are the same for both.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from algorithms.assignment import assign_nodes, node_counts
from algorithms.calc_batch import STATISTICS_WIRE, build_batch_test, statistics_payload_bytes
from algorithms.clock import Clock, NodeSchedule, NodeWork, SyncCost, ThroughputCurve, TrainerWork
from algorithms.network import describe, parse_network
from algorithms.outer_sync import OuterSync
from algorithms.policies import build_merge_policy
from algorithms.sketch import CountSketch, sketch_coefficients
from algorithms.streaming import StreamingPlan, mix_fragment
from algorithms.switch_mode import build_switch_mode
from algorithms.traffic import Traffic
from fabrics.dataset_loader import CorpusData, ShardSampler
from fabrics.eval_tool import EvalResult, Evaluator
from fabrics.models import replicate
from fabrics.precision import build_precision
from rounds import (
    NodeFault,
    RoundResult,
    advance,
    combine,
    fragment_average,
    fragment_fault,
    run_node,
    send_fragment,
    sum_wires,
    wire_size,
)
from trainers import TRAINERS, Node, NodeJob, NodeResult, RoundAbandoned, Trainer
from training_logs.training_monitoring import TrainingLogger
from utils.checkpoint import Checkpoint, prune_checkpoints, save_checkpoint
from utils.config import Config
from utils.errors import ConfigError, RunStopped, TrainingFault, UserError
from utils.max_batch_calculator import find_max_batch_size
from utils.model_state import float_state, load_float_state
from utils.signals import StopSignals
from utils.throughput import cached_curve, device_kind, measure_curve

log = logging.getLogger(__name__)


class RoundBackend:
    """Runs the jobs of one round on their nodes and combines the good results per trainer.

    A node that raises or ends its round with non-finite numbers is reported as a NodeFault and left out
    of its trainer's mean; a stop request (RoundAbandoned) is raised once every node has left its round.
    """

    def __init__(self, nodes: list[Node], concurrent: bool, within_node: bool, master_device: str = "cpu",
                 sync: OuterSync | None = None, statistics_wire: torch.dtype = torch.float64,
                 streaming: StreamingPlan | None = None, by_tokens: bool = False) -> None:
        self.nodes, self.within_node, self.master_device = nodes, within_node, master_device
        self.by_tokens = by_tokens  # inner_steps_by_speed: nodes weigh in their trainer's mean by their tokens
        self.sync, self.statistics_wire = sync or OuterSync(), statistics_wire
        self.streaming = streaming  # sync_fragments / sync_delay: the fragments and their schedule
        self.pool = ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="node") if concurrent else None

    def _map(self, fn, items: list) -> list:
        """fn over items on the node threads (or in a loop); a stop is raised once every call has returned."""
        if self.pool is None:
            return [fn(item) for item in items]
        futures = [self.pool.submit(fn, item) for item in items]
        outcomes, abandoned = [], None
        for future in futures:  # wait for every node, so none is still writing when we go on
            try:
                outcomes.append(future.result())
            except RoundAbandoned as exc:
                abandoned = exc
        if abandoned is not None:
            raise abandoned
        return outcomes

    def run_round(self, jobs: list[NodeJob], trainers: dict[int, Trainer] | None = None
                  ) -> tuple[dict[int, RoundResult], list[NodeFault]]:
        if self.streaming is not None:
            return self._run_streaming(jobs, trainers)
        outcomes = self._map(lambda job: run_node(self.nodes[job.node_id], job, self.sync), jobs)
        faults = [o for o in outcomes if isinstance(o, NodeFault)]
        masters = {j.trainer_id: j.master for j in jobs}
        return combine([o for o in outcomes if isinstance(o, NodeResult)], self.within_node, self.master_device,
                       self.statistics_wire, self.sync, masters, by_tokens=self.by_tokens), faults

    def _run_streaming(self, jobs: list[NodeJob], trainers: dict[int, Trainer]):
        """A Streaming DiLoCo round: every node runs to each send or landing of the schedule; a send takes each
        good node's fragment wire, a landing averages them, steps the trainer's fragment and mixes it into
        the nodes (algorithms/streaming.py). Under torchrun the same happens with collectives in flight."""
        plan, sync = self.streaming, self.sync
        job_of = {j.node_id: j for j in jobs}
        members = {t: sorted(j.node_id for j in jobs if j.trainer_id == t) for t in {j.trainer_id for j in jobs}}
        round_steps = {j.node_id: self.nodes[j.node_id].steps(j, plan.pauses) for j in jobs}
        numels = {n: v.numel() for n, v in next(iter(trainers.values())).master.items()}
        spans, total = plan.offsets(numels), sum(numels.values())
        ended: dict[int, NodeResult | NodeFault] = {}  # a node's result, or its fault (it left the round)
        in_flight: dict[int, dict[int, list[torch.Tensor]]] = {}  # fragment -> trainer -> the good nodes' wires
        errors: dict[int, str] = {}
        for step in [*plan.pauses, None]:  # None: on to the end of the round
            live = [n for n in sorted(round_steps) if n not in ended]
            for node_id, out in zip(live, self._map(lambda n: advance(round_steps[n], job_of[n]), live)):
                if not isinstance(out, int):
                    ended[node_id] = out
            if step is None:
                break
            for event in plan.events_at(step):
                f, names = event.fragment, plan.fragments[event.fragment]
                if not event.lands:
                    in_flight[f] = {}
                    for t, node_ids in members.items():
                        wires = in_flight[f].setdefault(t, [])
                        for node_id in node_ids:
                            node = self.nodes[node_id]
                            fault = None if node_id in ended else fragment_fault(node, job_of[node_id], names)
                            if fault is not None:
                                ended[node_id] = fault
                            if node_id not in ended:
                                wires.append(send_fragment(node, trainers[t].master, names, spans[f], total, sync))
                    continue
                for t, wires in in_flight.pop(f).items():
                    master = trainers[t].master
                    if t in errors or not wires:
                        continue
                    mean = fragment_average(sync, master, names, sum_wires(wires, self.master_device)
                                            if sync.exact else wires)
                    try:
                        trainers[t].outer_step(mean)
                    except FloatingPointError as exc:
                        errors[t] = str(exc)
                        continue
                    for node_id in members[t]:
                        if node_id not in ended:
                            mix_fragment(float_state(self.nodes[node_id].model), master, names, plan.alpha)
        outcomes = list(ended.values())
        combined = combine([o for o in outcomes if isinstance(o, NodeResult)], self.within_node, self.master_device,
                           self.statistics_wire, self.sync, streamed=True)
        for t, message in errors.items():
            if t in combined:
                combined[t].outer_error = message
        return combined, [o for o in outcomes if isinstance(o, NodeFault)]

    def agree(self, flag: bool) -> bool:
        """Whether any node's process has `flag` set (one process here; an all-reduce under torchrun)."""
        return flag

    def gather_optimizer_states(self, local: list) -> list:
        return local

    def transfer(self, moves: list[tuple[int, int, int]], trainers: dict[int, Trainer], kind: str = "weights",
                 compression: OuterSync | None = None) -> None:
        """Every trainer's state is in this process: nothing travels (Traffic counts what would). A lossy
        `compression` (merge_compression) still changes the state as its receiver would decode it."""
        if compression is None or compression.exact:
            return
        for t, source, target in moves:
            if source != target:
                trainers[t].load_transfer(compression.round_trip(trainers[t].transfer_tensors()))

    def evaluate(self, holders: dict[int, tuple[int, dict[str, torch.Tensor]]], evaluator: Evaluator) -> dict:
        return {t: evaluator.evaluate(weights) for t, (_, weights) in holders.items()}

    def take_round_comm(self) -> dict | None:
        return None

    def total_sent(self) -> dict[str, int] | None:
        return None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def use_threads(cfg: Config) -> bool:
    if cfg.node_execution != "auto":
        return cfg.node_execution == "threads"
    if cfg.compile:  # torch.compile is not thread-safe
        return False
    # Threads pay off when nodes sit on distinct accelerators; on CPU cores they only contend.
    cuda = [d for d in cfg.device_names if d.startswith("cuda")]
    return len(set(cuda)) > 1 and len(cuda) == len(cfg.device_names)


def master_device_of(cfg: Config, node_devices: list[str]) -> str:
    """master_device auto: the nodes' GPU when every node (of this process) is on the same one, else the CPU."""
    if cfg.master_device == "cpu":
        return "cpu"
    devices = {str(torch.device(d if d != "cuda" else "cuda:0")) for d in node_devices}
    return devices.pop() if len(devices) == 1 and next(iter(devices)).startswith("cuda") else "cpu"


def rng_state(cuda: bool = False) -> dict:
    """Every global RNG (none decides anything today, but a model with dropout would use them).
    cuda: also the CUDA generators (only when the run uses CUDA: reading them initialises every device)."""
    return {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
            "python_version": random.getstate()[0], "numpy": np.random.get_state()[1].tolist(),
            "numpy_pos": int(np.random.get_state()[2]),
            "cuda": torch.cuda.get_rng_state_all() if cuda and torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), None))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


STALE = (-1, -1)  # holds: a node away from the cluster keeps no current state (it receives one when it returns)


class ClusterController:
    """The simulated cluster and the outer loop.

    resume: a verified checkpoint to continue from (node max batches, trainers, counters, RNGs come from
    it; the memory probe does not run again, so every later decision is the same as in the first run).
    stop: the SIGINT/SIGTERM request the loop turns into a checkpoint and a clean exit.
    """

    def __init__(self, cfg: Config, model: torch.nn.Module, data: CorpusData, logger: TrainingLogger,
                 weights_dir: Path, resume: Checkpoint | None = None, stop: StopSignals | None = None,
                 dist_env=None) -> None:
        self.cfg, self.data, self.logger, self.weights_dir = cfg, data, logger, weights_dir
        self.dist_env = dist_env  # torchrun: this process runs node dist_env.rank only
        self.writes = dist_env is None or dist_env.is_main  # only rank 0 writes checkpoints
        self.stop = stop or StopSignals()
        algo = TRAINERS[cfg.distributed_algo]
        make_optimizer = algo.inner_optimizer_factory(cfg)
        self.switch_mode = build_switch_mode(cfg.switch_mode)
        self.merge_policy = build_merge_policy(cfg.merging_policy)
        self.batch_test = build_batch_test(cfg.sampling_method, eta=cfg.ETA, vartheta=cfg.vartheta, nu=cfg.nu,
                                           max_batch=cfg.max_requested_batch, start=cfg.initial_batch_size,
                                           rampup_tokens=cfg.rampup_tokens or cfg.max_tokens)
        # micro_batches: each node's chunks form their own group, so drift between nodes is not noise
        self.pool_within_nodes = cfg.variance_estimator == "micro_batches"
        self.injected = cfg.injected_faults()
        self.precision = build_precision(cfg.precision)
        # gradient samples: for the batch test, or only for the log (log_batch_statistics); else none at all
        wanted = self.batch_test.uses_statistics or cfg.log_batch_statistics
        self.grad_chunks = 0 if not wanted else cfg.variance_micro_batches if self.pool_within_nodes else 1
        resume_state = resume.resume_state() if resume is not None else None
        self.nodes: list[Node] = []
        local = None if dist_env is None else dist_env.rank
        probed: dict[int, int] = {}
        for spec in cfg.device_specs:
            configured = spec.device
            for _ in range(cfg.nodes_per_gpu):
                node_id = len(self.nodes)
                mine = local is None or node_id == local
                device = configured
                if local is not None and mine:
                    from distributed.torchrun import device_of

                    device = device_of(cfg, dist_env)  # cuda:LOCAL_RANK on a multi-GPU machine
                if resume_state is not None:
                    max_batch = resume_state["nodes"][node_id]["max_batch"]  # as decided in the first run
                elif cfg.max_batch_size:
                    max_batch = cfg.max_batch_size
                elif not mine:
                    max_batch = 0  # probed by its own process, shared below
                else:
                    key = node_id // cfg.nodes_per_gpu
                    if key not in probed:
                        try:
                            probed[key] = find_max_batch_size(
                                model, make_optimizer, device, cfg.seq_len, padding_percentage=cfg.padding_percentage,
                                nodes_per_gpu=cfg.nodes_per_gpu,
                                device_memory_mb=spec.memory_mb or cfg.device_memory_mb,
                                upper=min(cfg.max_requested_batch, len(data.train)),
                                num_cpu_devices=cfg.device_names.count("cpu"))
                        except UserError as exc:
                            if not spec.memory_mb or device.startswith("cuda"):
                                raise
                            raise ConfigError(f"devices[{key}].memory_mb", f"{spec.memory_mb:g} MiB: not even one "
                                              "sequence fits a node of this device; raise it (or padding_percentage), "
                                              "or lower nodes_per_gpu or seq_len") from exc
                    max_batch = probed[key]
                replica = replicate(model, device) if mine else None  # other processes hold the other nodes
                node = Node(node_id, device, replica, make_optimizer, cfg.grad_clip, data.train, self.precision,
                            cfg.compile)
                node.max_batch = max_batch
                node.show_progress = cfg.inner_progress
                node.stop = self.stop.event
                self.nodes.append(node)
        if local is not None and not (resume_state is not None or cfg.max_batch_size):
            import torch.distributed as dist

            found: list = [None] * len(self.nodes)
            dist.all_gather_object(found, self.nodes[local].max_batch)
            for node, max_batch in zip(self.nodes, found):
                node.max_batch = max_batch
        log.info("nodes: %s", ", ".join(f"{n.node_id}@{n.device} (max batch {n.max_batch})" for n in self.nodes))
        initial = float_state(model)
        parameter_names = {n for n, _ in model.named_parameters()}
        trainer_ids = resume.trainers if resume is not None else range(cfg.num_init_trainers)
        self.master_device = master_device_of(cfg, [n.device for n in self.nodes if n.model is not None])
        self.trainers: dict[int, Trainer] = {
            t: algo(t, initial, parameter_names, cfg, ShardSampler(len(data.train), cfg.training_seed * 1000 + t),
                    self.master_device)
            for t in trainer_ids}
        self.owner: dict[int, int | None] = {n.node_id: None for n in self.nodes}
        # (trainer, weights version) each node holds; None = the common initial weights
        self.holds: dict[int, tuple[int, int] | None] = {n.node_id: None for n in self.nodes}
        eval_device = cfg.device_names[0] if local is None else self.nodes[local].device
        self.evaluator = Evaluator(replicate(model, eval_device), data.val, cfg.eval_batch_size, eval_device,
                                   self.precision)
        # communication (README "Communication"): how the outer sync, merges and the batch statistics travel
        self.outer_sync = OuterSync(cfg.outer_compression, cfg.error_feedback, cfg.topk_fraction)
        self.merge_sync = OuterSync(cfg.merge_compression)
        self.statistics_wire = STATISTICS_WIRE[cfg.statistics_comm]
        self.sketch = None
        if cfg.statistics_comm == "sketch" and self.grad_chunks:
            saved = (resume_state or {}).get("sketch")  # the run's own sketch, whatever derives it today
            self.sketch = CountSketch(cfg.statistics_sketch_dim, saved["coefficients"] if saved
                                      else sketch_coefficients(cfg.training_seed * 1_000_003 + 991))
        for node in self.nodes:
            node.sketch = self.sketch
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.sample_numel = self.sketch.dim if self.sketch is not None else trainable  # length of a gradient sample
        if self.sketch is not None and self.sketch.dim >= trainable:
            log.warning("statistics_sketch_dim %d is not smaller than the %d trainable parameters: the sketch sends "
                        "more than statistics_comm fp64 would, and only estimates", self.sketch.dim, trainable)
        # Streaming DiLoCo (README "Streaming DiLoCo"): fragments synced at staggered inner steps, overlapped
        self.streaming = None
        if cfg.sync_fragments > 1 or cfg.sync_delay > 0:
            numels = {k: v.numel() for k, v in initial.items()}
            try:
                self.streaming = StreamingPlan.build(list(initial), numels, cfg.num_inner_steps, cfg.sync_fragments,
                                                     cfg.sync_delay, cfg.fragment_alpha)
            except ValueError as exc:
                raise ConfigError("sync_fragments", f"{cfg.sync_fragments}: {exc}") from None
            shared = {}
            for f, names in enumerate(self.streaming.fragments):
                for name in names:
                    other = shared.setdefault(initial[name].data_ptr(), f)
                    if other != f:
                        raise ConfigError("sync_fragments", f"{name} shares its storage with a tensor of fragment "
                                          f"{other} (tied weights): use sync_fragments: 1")
            log.info("streaming: %d fragments of %s tensors; sends/landings after inner steps %s",
                     len(self.streaming.fragments), "/".join(str(len(f)) for f in self.streaming.fragments),
                     ", ".join(f"{'land' if e.lands else 'send'} {e.fragment}@{e.step}" for e in self.streaming.events))
        # streaming: the (trainer, weights version) whose round each node's own weights continue; None: load it
        self.continues: dict[int, tuple[int, int] | None] = {n.node_id: None for n in self.nodes}
        if local is None:
            self.backend = RoundBackend(self.nodes, use_threads(cfg), self.pool_within_nodes, self.master_device,
                                        self.outer_sync, self.statistics_wire, self.streaming, cfg.inner_steps_by_speed)
        else:
            from distributed import torchrun
            from distributed.backend import DistributedBackend

            floats = float_state(model)
            shapes = {k: v.shape for k, v in floats.items()}
            self.backend = DistributedBackend(self.nodes, local, sorted(floats), shapes, self.sample_numel,
                                              self.pool_within_nodes, torchrun.comm_device(cfg, dist_env),
                                              torchrun.store(), self.master_device, self.statistics_wire,
                                              self.outer_sync, self.streaming, cfg.inner_steps_by_speed)
        self.param_bytes = sum(v.numel() * 4 for v in initial.values())  # fp32 weights / pseudo-gradients
        # what one node sends its trainer per round: fp32 weights, or the encoded pseudo-gradient
        self.sync_bytes = self.outer_sync.payload_bytes(self.param_bytes // 4)
        if self.streaming is not None:  # one collective per fragment, each payload with its 4-byte count/flag
            numels = {k: v.numel() for k, v in initial.items()}
            self.fragment_bytes = [wire_size(self.outer_sync, sum(numels[n] for n in names))
                                   * (4 if self.outer_sync.exact else 1) for names in self.streaming.fragments]
        self.statistics_bytes = statistics_payload_bytes(self.sample_numel, self.pool_within_nodes,
                                                         self.statistics_wire)
        self.traffic = Traffic()  # rounds, syncs and bytes as a real cluster would send them
        # the simulated clock (README "A simulated clock"): it observes the rounds, never changes their numbers
        self.schedule = NodeSchedule.parse(cfg.node_schedule, len(self.nodes))
        self.clock = Clock(parse_network(cfg.network), self._throughput_curve(model, make_optimizer, resume_state),
                           cfg.node_speeds, self.param_bytes)
        log.info("clock: network %s; throughput %s; node speeds %s", describe(self.clock.network),
                 self.clock.curve.source, " ".join(f"{v:g}" for v in cfg.node_speeds))
        self.round_work: dict[int, list[NodeWork]] = {}  # this round's work per trainer, for the clock
        self.time_to_target: float | None = None  # target_metric: when a trainer first reached it
        self.tokens_total = 0
        self.last_outer_step = 0
        self.best_seen: float | None = None  # best metric of any model evaluated during the run
        self.initial_metric: float | None = None
        self.wall_before = 0.0  # seconds trained before a resume
        self._start = time.time()  # reset when training starts
        self.checkpointed_step: int | None = None  # the outer step of the last checkpoint written
        if resume is not None:
            for t, trainer in self.trainers.items():
                try:
                    trainer.load_state_dict(resume.trainer_state(t), resume.trainer_weights(t))
                except (ValueError, KeyError, RuntimeError) as exc:
                    raise UserError(f"--resume: {resume.path} does not fit this model ({exc})") from None
            self.load_state_dict(resume_state)
            self.checkpointed_step = resume.outer_step

    # -------------------------------------------------------------------------------------------
    # State: what a checkpoint holds besides the trainers (trainer_<t>_state.pt and the weights)

    def _round_state(self) -> dict:
        """What a round changes before its outer steps: restored when a round is abandoned or fails."""
        return {"owner": dict(self.owner), "holds": dict(self.holds), "traffic": dataclasses.asdict(self.traffic),
                "samplers": {t: tr.sampler.state_dict() for t, tr in self.trainers.items()},
                "optimizers": [n.optimizer_state() for n in self.nodes],
                "residuals": [None if n.residual is None else n.residual.detach().to("cpu", copy=True)
                              for n in self.nodes],
                "rng": rng_state(cuda=any(d.startswith("cuda") for d in self.cfg.device_names)),
                **(self._streaming_state() if self.streaming is not None else {})}

    def _streaming_state(self) -> dict:
        """Streaming rounds change more before the round ends: the trainers (each fragment's outer step lands
        mid-round) and the nodes' own weights, which go on from one round to the next."""
        return {"continues": dict(self.continues),
                "node_weights": [None if n.model is None else {k: v.detach().to("cpu", copy=True)
                                                               for k, v in float_state(n.model).items()}
                                 for n in self.nodes],
                "trainer_states": {t: (copy.deepcopy(tr.state_dict()), {k: v.detach().clone()
                                                                         for k, v in tr.master.items()})
                                   for t, tr in self.trainers.items()}}

    def _restore_round(self, state: dict) -> None:
        self.owner, self.holds = dict(state["owner"]), dict(state["holds"])
        self.traffic = Traffic(**state["traffic"])
        for t, sampler in state["samplers"].items():
            if t in self.trainers:
                self.trainers[t].sampler.load_state_dict(sampler)
        for node, optimizer in zip(self.nodes, state["optimizers"]):
            node.load_optimizer_state(optimizer)
        for node, residual in zip(self.nodes, state.get("residuals") or [None] * len(self.nodes)):
            if node.model is not None:  # under torchrun: this process's node only
                node.residual = None if residual is None else residual.to(node.device, copy=True)
        set_rng_state(state["rng"])
        if self.streaming is not None:
            self.continues = dict(state.get("continues") or {n.node_id: None for n in self.nodes})
            for node, weights in zip(self.nodes, state.get("node_weights") or [None] * len(self.nodes)):
                if node.model is not None and weights is not None:
                    load_float_state(node.model, weights)
            for t, (trainer_state, weights) in (state.get("trainer_states") or {}).items():
                if t in self.trainers:
                    self.trainers[t].load_state_dict(trainer_state, weights)

    def state_dict(self) -> dict:
        """Everything a checkpoint holds besides the trainers (under torchrun: a collective, every rank calls it)."""
        state = self._round_state()
        state.pop("trainer_states", None)  # the checkpoint holds the trainers themselves
        if self.dist_env is not None:  # each process holds its own node's inner optimizer
            state["optimizers"] = self.backend.gather_optimizer_states(state["optimizers"][self.dist_env.rank])
            state["residuals"] = self.backend.gather_optimizer_states(state["residuals"][self.dist_env.rank])
            if "node_weights" in state:
                state["node_weights"] = self.backend.gather_optimizer_states(state["node_weights"][self.dist_env.rank])
        return {**state, "outer_step": self.last_outer_step, "tokens_total": self.tokens_total,
                "best_seen": self.best_seen, "initial_metric": self.initial_metric,
                "nodes": [{"max_batch": n.max_batch} for n in self.nodes], "logger": self.logger.counters(),
                "sketch": self.sketch.state_dict() if self.sketch is not None else None,
                "clock": {**self.clock.state_dict(), "curve": [list(p) for p in self.clock.curve.points],
                          "curve_source": self.clock.curve.source, "time_to_target": self.time_to_target},
                "wall_time": self.wall_before + time.time() - self._start}

    def load_state_dict(self, state: dict) -> None:
        if len(state["nodes"]) != len(self.nodes):
            raise UserError(f"--resume: the checkpoint has {len(state['nodes'])} nodes, the config {len(self.nodes)}")
        self._restore_round(state)
        self.last_outer_step, self.tokens_total = int(state["outer_step"]), int(state["tokens_total"])
        self.best_seen, self.initial_metric = state["best_seen"], state["initial_metric"]
        self.logger.load_counters(state["logger"])
        self.wall_before = float(state["wall_time"])
        if state.get("clock"):  # checkpoints from before the clock start it at their outer step
            self.clock.load_state_dict(state["clock"])
            self.time_to_target = state["clock"]["time_to_target"]

    def save(self, label: str | None = None, final_id: int | None = None) -> Path:
        """A checkpoint of the state after outer step last_outer_step."""
        label = label or f"outer_step_{self.last_outer_step:04d}"
        template = self.evaluator.model if final_id is not None else None
        # under torchrun, rank 0 writes every trainer: those it does not hold come to it first
        self.backend.transfer([(t, self._holder(t), 0) for t in sorted(self.trainers)], self.trainers, "checkpoint")
        state = self.state_dict()
        path = self.weights_dir / label
        if self.writes:
            path = save_checkpoint(self.weights_dir, label, self.last_outer_step, self.trainers, state,
                                   self.cfg.meaning_hash(), template, self.data.tokenizer, final_id)
            for old in prune_checkpoints(self.weights_dir, self.cfg.keep_checkpoints, path):
                log.debug("keep_checkpoints: removed %s", old)
        self.checkpointed_step = self.last_outer_step
        return path

    # -------------------------------------------------------------------------------------------
    # The simulated clock

    def _throughput_curve(self, model: torch.nn.Module, make_optimizer, resume_state: dict | None) -> ThroughputCurve:
        """config throughput: flat, measured (cached) or a file; a resumed run keeps its own curve."""
        cfg = self.cfg
        saved = (resume_state or {}).get("clock")
        if saved:
            return ThroughputCurve(tuple((int(b), int(a), float(v)) for b, a, v in saved["curve"]),
                                   saved["curve_source"])
        if cfg.throughput == "flat":
            return ThroughputCurve.flat(cfg.node_tokens_per_s)
        largest = max(n.max_batch for n in self.nodes)
        if cfg.throughput != "measured":
            curve = ThroughputCurve.load(cfg.throughput)
            if curve.largest_micro_batch < largest:
                worst = max(self.nodes, key=lambda n: n.max_batch)
                raise ConfigError("throughput", f"{cfg.throughput} covers micro-batches up to "
                                  f"{curve.largest_micro_batch} (accumulation 1), but node {worst.node_id}'s max batch "
                                  f"is {largest}: measure the curve up to it (benchmarks.system --curve)")
            return curve
        curve = None
        node = self.nodes[0 if self.dist_env is None else self.dist_env.rank]
        if self.dist_env is None or self.dist_env.is_main:  # one measurement, shared: every rank decides alike
            key = {"device": device_kind(node.device), "model": cfg.model_config.name, "seq_len": cfg.seq_len,
                   "precision": cfg.precision, "largest": largest, "algorithm": cfg.distributed_algo}
            curve, path = cached_curve(Path(cfg.cache_dir), key, lambda: measure_curve(
                model, make_optimizer, node.device, cfg.seq_len, largest, autocast=lambda: self.precision.autocast(
                    node.device)))
            log.info("throughput: measured curve %s: %s", path, ", ".join(
                f"{b}x{a}: {v:.0f}" for b, a, v in curve.points if a == 1))
        if self.dist_env is not None:
            import torch.distributed as dist

            box = [curve]
            dist.broadcast_object_list(box, src=0)
            curve = box[0]
        return curve

    def _inner_steps(self, node_ids: list[int], shapes: dict[int, tuple[int, int]],
                     slowdown: dict[int, float]) -> dict[int, int]:
        """num_inner_steps for every node, or (inner_steps_by_speed) in proportion to its throughput this round,
        the trainer's fastest node taking num_inner_steps."""
        steps = self.cfg.num_inner_steps
        if not self.cfg.inner_steps_by_speed:
            return {n: steps for n in node_ids}
        rates = {n: self.clock.rate(n, *shapes[n], slowdown.get(n, 1.0)) for n in node_ids}
        fastest = max(rates.values())
        return {n: max(1, round(steps * rates[n] / fastest)) for n in node_ids}

    def _sync_cost(self, result: RoundResult | None) -> SyncCost:
        """What a trainer's collectives carried this round, for the clock."""
        return SyncCost(0 if self.outer_sync.exact else self.sync_bytes,
                        tuple(self.fragment_bytes) if self.streaming is not None else (), self.cfg.sync_delay,
                        self.cfg.num_inner_steps,
                        self.statistics_bytes if result is not None and result.statistics is not None else 0)

    def _clock_round(self, outer_step: int, jobs: list[NodeJob], results: dict[int, RoundResult]) -> dict:
        """The round on the clock: each trainer's (end, slowest compute, idle node-seconds); node rows logged."""
        trainer_ids = sorted({j.trainer_id for j in jobs})
        inner_steps = {j.node_id: j.sample_indices.shape[0] for j in jobs}
        slowdown = self.schedule.slowdown(outer_step)
        times = self.clock.round([TrainerWork(t, self.round_work[t], self._sync_cost(results.get(t)))
                                  for t in trainer_ids], slowdown)
        speeds = self.cfg.node_speeds
        work = {w.node_id: w for t in trainer_ids for w in self.round_work[t]}
        self.logger.log_node_times([
            {"outer_step": outer_step, "node_id": n.node_id, "trainer_id": t, "speed": speeds[n.node_id],
             "slowdown": slowdown.get(n.node_id, 1.0), "inner_steps": inner_steps[n.node_id],
             "micro_batch": work[n.node_id].micro_batch, "accumulation_steps": work[n.node_id].accumulation,
             "tokens": int(work[n.node_id].tokens), "start_s": n.start, "compute_s": n.compute, "idle_s": n.idle,
             "end_s": n.end} for t in sorted(times) for n in times[t]])
        return {t: {"sim_time_s": self.clock.ready[t], "sim_compute_s": max(n.compute for n in times[t]),
                    "sim_idle_s": sum(n.idle for n in times[t])} for t in times}

    def _reached(self, value: float, when: float) -> None:
        """target_metric: the first simulated time a model reached it."""
        target = self.cfg.target_metric
        if not target or self.time_to_target is not None or not math.isfinite(value):
            return
        if (value >= target) if self.evaluator.higher_is_better else (value <= target):
            self.time_to_target = when

    def _clock_row(self) -> dict:
        return {"utilisation": self.clock.utilisation(), "goodput_tokens_per_s": self.clock.goodput()}

    # -------------------------------------------------------------------------------------------
    def _holder(self, trainer_id: int) -> int:
        """The lowest node holding this trainer's current state (under torchrun: a process that has it).
        No node yet: every process has it (the common initial weights, or a checkpoint all loaded)."""
        version = (trainer_id, self.trainers[trainer_id].weights_version)
        return min((n for n, held in self.holds.items() if held == version), default=0)

    def _evaluate(self, trainer_ids) -> dict[int, EvalResult]:
        holders = {t: (self._holder(t), self.trainers[t].master) for t in trainer_ids}
        return self.backend.evaluate(holders, self.evaluator)

    def _seen(self, value: float) -> None:
        better = self.best_seen is None or (value > self.best_seen) == self.evaluator.higher_is_better
        if math.isfinite(value) and better:
            self.best_seen = value

    # -------------------------------------------------------------------------------------------
    def _jobs(self, outer_step: int) -> tuple[list[NodeJob], list[tuple[int, int, int]]]:
        """This round's node jobs, and the moves (trainer, from node, to node) that must come first. Nodes away
        this round (node_schedule) get no job; one that comes back joins as a new node would."""
        requested = {t: tr.requested_batch for t, tr in self.trainers.items()}
        present = self.schedule.present(outer_step, len(self.nodes))
        away = sorted(set(self.owner) - set(present))
        for node_id in away:
            self.owner[node_id] = None  # its inner optimizer state is stale when it comes back
            self.continues[node_id] = None
        for change in self.schedule.changes(outer_step):
            log.info("outer step %d: %s", outer_step, change)
        assignment = assign_nodes(node_counts(requested, len(present)), {n: self.owner[n] for n in present})
        slowdown = self.schedule.slowdown(outer_step)
        jobs, moves = [], []
        self.round_work = {}
        sources = {t: self._holder(t) for t in assignment}  # before this round changes holds
        for node_id in away:  # it may hand its state on now; its copy goes stale as its trainer trains on
            self.holds[node_id] = STALE
        for t in sorted(assignment):
            trainer = self.trainers[t]
            version = (t, trainer.weights_version)
            shapes = {n: self.switch_mode.decide(trainer.requested_batch, self.nodes[n].max_batch)
                      for n in assignment[t]}
            inner_steps = self._inner_steps(assignment[t], shapes, slowdown)
            for node_id in assignment[t]:
                moved = self.holds[node_id] not in (None, version)
                if moved:
                    self.traffic.node_move(trainer.transfer_bytes())  # the node receives this trainer's state
                    moves.append((t, sources[t], node_id))
                self.holds[node_id] = version
                loader_batch, accumulation = shapes[node_id]
                steps = inner_steps[node_id]
                indices = trainer.sampler.take(steps * accumulation * loader_batch).view(steps, accumulation,
                                                                                         loader_batch)
                jobs.append(NodeJob(node_id, t, trainer.master, indices, self.grad_chunks,
                                    reset_optimizer=self.owner[node_id] != t,
                                    inject_fault=self.injected.get((outer_step, node_id), ""),
                                    keep_local=self.streaming is not None and self.continues[node_id] == version))
                tokens = float(self.data.train.tokens_per_sequence[indices.reshape(-1)].sum())
                self.round_work.setdefault(t, []).append(NodeWork(node_id, tokens, loader_batch, accumulation,
                                                                  trainer.transfer_bytes() if moved else 0))
        for t, node_ids in assignment.items():
            for node_id in node_ids:
                self.owner[node_id] = t
        return jobs, moves

    def _handle_faults(self, outer_step: int, faults: list[NodeFault], before: dict, any_result: bool) -> None:
        """on_node_fault: stop -> back to the last good state and raise; skip -> log, reset the failed nodes."""
        action = self.cfg.on_node_fault if any_result else "stop"
        self.logger.log_faults([{"outer_step": outer_step, "trainer_id": f.trainer_id, "node_id": f.node_id,
                                 "kind": f.kind, "action": action, "message": f.message} for f in faults])
        first = faults[0]
        where = f"outer step {outer_step}, trainer {first.trainer_id}, node {first.node_id}: {first.message}"
        more = f" (and {len(faults) - 1} more node faults)" if len(faults) > 1 else ""
        if action == "stop":
            self._restore_round(before)
            reason = "" if any_result or self.cfg.on_node_fault == "stop" else "every node failed; "
            raise TrainingFault(f"node fault at {where}{more}; {reason}stopped (on_node_fault: stop)")
        for f in faults:  # the node's inner state is whatever the failure left: back to the round's start
            self.nodes[f.node_id].load_optimizer_state(before["optimizers"][f.node_id])
        log.warning("node fault at %s%s; its contribution is dropped (on_node_fault: skip)", where, more)

    def run_outer_step(self, outer_step: int) -> list[dict]:
        """One round for every trainer, outer steps, evaluation, batch tests; returns the metric rows."""
        before = self._round_state()
        jobs, moves = self._jobs(outer_step)
        # (loader_batch, accumulation_steps) each node ran, read off its job's index tensor
        plan = {j.node_id: (j.sample_indices.shape[2], j.sample_indices.shape[1]) for j in jobs}
        self.logger.memory.begin_round(outer_step)
        try:
            self.backend.transfer(moves, self.trainers)
            results, faults = self.backend.run_round(jobs, self.trainers)
        except RoundAbandoned:
            self._restore_round(before)
            raise
        finally:
            self.logger.memory.end_round(outer_step)
        comm = self.backend.take_round_comm()
        if comm is not None:  # torchrun: what this rank's collectives cost since the last round (metrics.jsonl)
            self.logger.tracker.log({"comm/seconds": comm["seconds"], "comm/weights_mb": comm["weights_bytes"] / 1e6,
                                     "comm/statistics_mb": comm["statistics_bytes"] / 1e6}, outer_step)
        if faults:
            self._handle_faults(outer_step, faults, before, any_result=bool(results))
        self.logger.log_step_losses([
            {"outer_step": outer_step, "trainer_id": t, "node_id": node, "inner_step": i, "loss": f"{loss:.6g}",
             "micro_batch": plan[node][0], "accumulation_steps": plan[node][1], "learning_rate": res.learning_rate}
            for t, res in sorted(results.items()) for node, losses in sorted(res.node_step_losses.items())
            for i, loss in enumerate(losses)])
        self.traffic.rounds += 1
        self.tokens_total += sum(res.tokens for res in results.values())
        trainer_ids = sorted({j.trainer_id for j in jobs})
        failed = {}
        for t, res in sorted(results.items()):
            if res.outer_error:  # streaming: a fragment's outer step, during the round
                failed[t] = FloatingPointError(res.outer_error)
            if res.node_mean is None:  # torchrun: this process is not one of t's nodes (it gets t when it joins);
                continue  # streaming: the fragments stepped during the round
            try:
                self.trainers[t].outer_step(res.node_mean)
            except FloatingPointError as exc:
                failed[t] = exc
        if self.backend.agree(bool(failed)):  # earlier trainers already stepped: this state is not checkpointed
            detail = f"trainer {min(failed)}: {failed[min(failed)]}" if failed else "in another process"
            fault = TrainingFault(f"fault at outer step {outer_step}, {detail}")
            fault.state_is_good = False
            raise fault
        clock = self._clock_round(outer_step, jobs, results)
        if self.streaming is not None:  # the good nodes' own weights go on next round, if their trainer stays the same
            for f in faults:
                self.continues[f.node_id] = None
            for t, res in results.items():
                for node_id in res.nodes:
                    self.continues[node_id] = (t, self.trainers[t].weights_version)
        evaluations = self._evaluate(trainer_ids)
        rows = []
        for t in trainer_ids:
            trainer = self.trainers[t]
            evaluation = evaluations[t]
            if t not in results:  # every node of this trainer failed: it keeps its weights this round
                node_ids = [j.node_id for j in jobs if j.trainer_id == t]
                loader_batch, accumulation = plan[node_ids[0]]
                rows.append({"outer_step": outer_step, "trainer_id": t, "nodes": "", "num_nodes": 0,
                             "requested_batch": trainer.requested_batch, "loader_batch": loader_batch,
                             "accumulation_steps": accumulation, "optimizer_steps": trainer.stats.optimizer_steps,
                             "tokens_seen": trainer.stats.tokens_seen, "global_tokens": self.tokens_total,
                             "train_loss": math.nan, **evaluation.metrics,
                             "next_requested_batch": trainer.requested_batch, **clock[t]})
                continue
            res = results[t]
            requested_before = trainer.requested_batch
            for payload in self.fragment_bytes if self.streaming is not None else [self.sync_bytes]:
                self.traffic.trainer_sync(len(res.nodes), payload, gathered=not self.outer_sync.exact)
            if res.statistics is not None:
                self.traffic.statistics(len(res.nodes), self.statistics_bytes)
            self._seen(evaluation.value)
            self._reached(evaluation.value, clock[t]["sim_time_s"])
            decision = self.batch_test(res.statistics, trainer.requested_batch, len(res.nodes),
                                       tokens_seen=self.tokens_total)
            trainer.requested_batch = decision.requested_batch
            s = trainer.stats
            s.sync_number += 1
            s.optimizer_steps += res.optimizer_steps
            s.tokens_seen += res.tokens
            loader_batch, accumulation = plan[res.nodes[0]]
            rows.append({
                "outer_step": outer_step, "trainer_id": t, "nodes": " ".join(map(str, res.nodes)),
                "num_nodes": len(res.nodes), "requested_batch": requested_before, "loader_batch": loader_batch,
                "accumulation_steps": accumulation, "optimizer_steps": s.optimizer_steps,
                "tokens_seen": s.tokens_seen, "global_tokens": self.tokens_total, "train_loss": res.train_loss,
                **evaluation.metrics,
                "next_requested_batch": decision.requested_batch, **decision.stats, **clock[t]})
        return rows
    def merge(self, outer_step: int, metrics: dict[int, float]) -> dict | None:
        """Merge by the policy, then evaluate the result; metrics: each trainer's metric before the merge."""
        if not self.merge_policy.should_merge(outer_step, self.cfg.merge_frequency, len(self.trainers)):
            return None
        requested = {t: tr.requested_batch for t, tr in self.trainers.items()}
        plan = self.merge_policy.plan(requested)
        survivor = self.trainers[plan.survivor]
        others = [self.trainers[m] for m in plan.members[1:]]
        # the absorbed states travel to the survivor's first node, which computes the average
        coordinator = min((n for n, t in self.owner.items() if t == plan.survivor), default=self._holder(plan.survivor))
        moved = sum(self.merge_sync.payload_bytes(o.transfer_bytes() // 4) for o in others)
        self.backend.transfer([(m, self._holder(m), coordinator) for m in plan.members[1:]], self.trainers,
                              compression=self.merge_sync)
        survivor.absorb(others, list(plan.weights))  # under torchrun, only the coordinator's result is used
        for other in others:
            del self.trainers[other.trainer_id]
            survivor.stats.tokens_seen += other.stats.tokens_seen
            survivor.stats.optimizer_steps += other.stats.optimizer_steps
        self.traffic.merge(moved)
        ready = self.clock.merge(plan.survivor, list(plan.members),
                                 [self.merge_sync.payload_bytes(o.transfer_bytes() // 4) for o in others])
        self.holds[coordinator] = (plan.survivor, survivor.weights_version)  # the others receive it when they start
        after = self._evaluate([plan.survivor])[plan.survivor].value  # does averaging hurt? measured, not assumed
        self._seen(after)
        self._reached(after, ready)
        return {"outer_step": outer_step, "survivor": plan.survivor,
                "merged": " ".join(map(str, plan.members[1:])),
                "weights": " ".join(f"{w:.4f}" for w in plan.weights),
                "requested_batches": " ".join(str(requested[m]) for m in plan.members), "bytes": moved,
                "metric": self.evaluator.metric,
                "metric_before": " ".join(f"{metrics[m]:.6g}" for m in plan.members),
                "metric_weighted_before": sum(w * metrics[m] for m, w in zip(plan.members, plan.weights)),
                "metric_after": after, "sim_time_s": ready}

    # -------------------------------------------------------------------------------------------
    def _stopped(self) -> RunStopped:
        """The stop request turned into a checkpoint of the last complete outer step."""
        self.stop.signum = self.stop.signum or signal.SIGTERM  # under torchrun: another rank got the signal
        path = self.weights_dir / f"outer_step_{self.last_outer_step:04d}"
        if self.checkpointed_step != self.last_outer_step:
            path = self.save()
        return RunStopped(self.stop.signum or 2, f"stopped by {self.stop.name} after outer step "
                          f"{self.last_outer_step}; checkpoint {path}")

    def _fault_stop(self, fault: TrainingFault) -> TrainingFault:
        """on_node_fault: stop. The round was rolled back: checkpoint the last good state, say where it is."""
        if not getattr(fault, "state_is_good", True):
            return TrainingFault(f"{fault}; the last checkpoint in {self.weights_dir} is intact")
        path = self.weights_dir / f"outer_step_{self.last_outer_step:04d}"
        if self.checkpointed_step != self.last_outer_step:
            path = self.save()
        return TrainingFault(f"{fault}; the state after outer step {self.last_outer_step} is in {path}")

    def train(self) -> dict:
        cfg = self.cfg
        self._start = time.time()
        first_step = self.last_outer_step + 1
        if self.initial_metric is None:
            initial = self._evaluate([min(self.trainers)])[min(self.trainers)]
            self.initial_metric = initial.value
            log.info("outer step 0: %s %.4g (all trainers start from the same weights)", initial.name, initial.value)
            self.logger.log_initial(initial.metrics, list(self.trainers))
        else:
            log.info("resuming after outer step %d of %d", self.last_outer_step, cfg.num_outer_steps)
        budget_left = not (cfg.max_tokens and self.tokens_total >= cfg.max_tokens)
        steps = range(first_step, cfg.num_outer_steps + 1) if budget_left else range(0)
        bar = tqdm(steps, desc="outer steps", unit="step", dynamic_ncols=True, initial=first_step - 1,
                   total=cfg.num_outer_steps)
        self.stop.can_checkpoint = True
        try:
            for outer_step in bar:
                if self.backend.agree(self.stop.requested):
                    raise self._stopped()
                try:
                    rows = self.run_outer_step(outer_step)
                except RoundAbandoned:
                    raise self._stopped() from None
                except TrainingFault as fault:
                    raise self._fault_stop(fault) from None
                self.logger.memory.record("after_outer_step", outer_step)
                merge_event = self.merge(outer_step, {r["trainer_id"]: r[self.evaluator.metric] for r in rows})
                if merge_event:
                    self.logger.memory.record("after_merge", outer_step)
                wall = self.wall_before + time.time() - self._start
                for row in rows:  # counters at the end of the outer step, its merge included
                    row.update(self.traffic.row(), wall_time=wall, **self._clock_row())
                # the bar shows what exists after the step: the trainers left after its merge, their best model
                best = self.logger.log_step(rows, merge_event, trainers_alive=len(self.trainers))
                log.info(self._step_line(outer_step, rows, merge_event))
                bar.set_postfix(trainers=len(self.trainers), **{self.evaluator.metric[4:]: f"{best:.4g}"},
                                batch=max(t.requested_batch for t in self.trainers.values()))
                self.last_outer_step = outer_step
                if cfg.save_weights_every and outer_step % cfg.save_weights_every == 0 \
                        and outer_step < cfg.num_outer_steps:
                    self.save()
                if outer_step % cfg.plot_every == 0:
                    self.logger.plot(outer_step)
                if cfg.max_tokens and self.tokens_total >= cfg.max_tokens:
                    log.info("token budget reached: %d >= max_tokens %d", self.tokens_total, cfg.max_tokens)
                    break
            if self.backend.agree(self.stop.requested):
                raise self._stopped()
        finally:
            bar.close()
            self.backend.close()
        # A signal from here on only sets the flag: the final checkpoint is short and completes the run.
        return self._finish(self.initial_metric, self.wall_before + time.time() - self._start)
    def _step_line(self, outer_step: int, rows: list[dict], merge_event: dict | None) -> str:
        metric = self.evaluator.metric
        parts = [f"[outer {outer_step}/{self.cfg.num_outer_steps}] trainers {len(rows)}"]
        for r in rows:
            parts.append(f"T{r['trainer_id']} nodes [{r['nodes']}] req {r['requested_batch']} "
                         f"loader {r['loader_batch']}x{r['accumulation_steps']} loss {r['train_loss']:.3f} "
                         f"{metric[4:]} {r[metric]:.4g} -> req {r['next_requested_batch']}")
        if merge_event:
            parts.append(f"merged T{merge_event['merged']} into T{merge_event['survivor']} "
                         f"(weights {merge_event['weights']}; {metric[4:]} "
                         f"{' '.join(f'{float(v):.4g}' for v in merge_event['metric_before'].split())} -> "
                         f"{merge_event['metric_after']:.4g})")
        return " | ".join(parts)

    def _finish(self, initial_metric: float, wall: float) -> dict:
        scores = {t: result.value for t, result in self._evaluate(sorted(self.trainers)).items()}
        sign = -1 if self.evaluator.higher_is_better else 1
        final_id = min(scores, key=lambda t: (sign * scores[t], t))
        final = self.trainers[final_id]
        sent = self.backend.total_sent()  # torchrun: what the collectives sent, all ranks together
        self.save("final", final_id)
        self.logger.plot(self.last_outer_step)
        summary = {
            "metric": self.evaluator.metric, "initial_metric": initial_metric, "final_trainer": final_id,
            "final_metric": scores[final_id], "surviving_trainers": scores,
            "outer_steps": self.last_outer_step, "wall_time_s": wall,
            "best_metric_seen": self.best_seen, "tokens_seen": self.tokens_total, **self.traffic.row(),
            "weight_bytes": self.param_bytes,  # P of the accounting: one trainer's fp32 weights
            "final_requested_batch": final.requested_batch,
            "max_batch_per_node": {n.node_id: n.max_batch for n in self.nodes},
            "accumulation_used": self.logger.accumulation_used, "merges": self.logger.merges,
            "batch_increases": self.logger.batch_increases,
            # decisions where max_requested_batch, not the batch test, set the batch; the largest the test asked
            "capped_requests": self.logger.capped_requests,
            "largest_capped_request": self.logger.largest_capped_request,
            # the simulated clock (README "A simulated clock")
            "sim_time_s": self.clock.now, "sim_time_to_target_s": self.time_to_target,
            "target_metric": self.cfg.target_metric or None, **self._clock_row(),
            "busy_node_seconds": sum(self.clock.busy), "idle_node_seconds": self.clock.idle(),
            "clock": {"network": describe(self.clock.network), "throughput": self.clock.curve.source,
                      "node_speeds": self.cfg.node_speeds},
        }
        if self.streaming is not None:  # each node's payload per fragment (benchmarks/network.py prices them)
            summary["fragment_bytes"] = self.fragment_bytes
        if sent is not None:  # weights == bytes_communicated: the accounting is what was sent
            summary["bytes_sent_by_collectives"] = sent
        if not math.isfinite(scores[final_id]):
            log.warning("final %s is not finite", self.evaluator.metric)
        return summary
