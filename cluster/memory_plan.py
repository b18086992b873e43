"""The memory plan: what each device holds, before any work (docs/running.md, "Memory: the plan").

From the model built on the meta device (no weights, no GPU), the config and a micro-batch, per device: the bytes
resident for the whole run (the trainers' masters and outer optimizer state where the masters live, the evaluator's
replica, each node's weights and inner optimizer state unless offload_idle_nodes keeps them in host memory, the
error-feedback residuals) and the transient bytes of a round (the gradients and activations of the nodes that compute
at once, the weights and optimizer state moved in for them, the gradient samples held until their trainer's
statistics are taken), against the device's memory; and in host memory, the offloaded state, the masters when they
live on the CPU, and two copies of every node's optimizer state: the rollback snapshot each round takes, and a
checkpoint's while it is written. A CUDA card shared by several simulated devices is one device
here (they share its memory); each simulated CPU device has its own budget (devices[i].memory_mb or
device_memory_mb). The activations come from a meta forward pass in the precision's dtype, which saves about 10% more
than a real CPU pass does (and more than a flash-attention kernel saves): the plan errs on the safe side.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from cluster.max_batch_calculator import MiB, default_device_memory_mb, saved_bytes, weight_storages
from cluster.placement import card_of, computing_per_device, computing_together, master_device_of
from utils import run_plan
from utils.config import Config
from utils.errors import UserError

log = logging.getLogger(__name__)
GiB = 1 << 30
# the model class for each model_type, and the preset whose architecture a Hub model has when its own config.json is
# not on this machine (the authors' MicroLlama: fabrics/model_configs/microllama-300m.json)
HUB_PRESETS = {"keeeeenw/MicroLlama": "microllama-300m"}
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """One replica's bytes on its device: fp32 weights (parameters and float buffers), gradients (the trainable
    parameters), the inner optimizer's state, and the activations saved for backward at a micro-batch of 1 and per
    further sequence."""
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes_one: int
    activation_bytes_per_sequence: int
    trainable: int  # trainable parameters: the length of a gradient sample

    def activation_bytes(self, micro_batch: int) -> int:
        return self.activation_bytes_one + self.activation_bytes_per_sequence * max(micro_batch - 1, 0)


def meta_model(cfg: Config) -> torch.nn.Module:
    """The run's model on the meta device: its preset, its local directory's config.json, or (a Hub model not on this
    machine) the preset of the same architecture. A model trained from scratch gets the vocabulary its tokenizer
    will have: bpe's tokenizer_vocab_size; auto's the larger of that and the preset's (MicroLlama's own tokenizer
    when it is cached, else a BPE)."""
    from fabrics.models import MODEL_TYPES, load_preset
    from utils.preflight import preset_names

    model_class, config_class, _ = MODEL_TYPES[cfg.model_type]
    name = cfg.model_config.name
    if (Path(name).expanduser() / "config.json").is_file():
        config = config_class.from_pretrained(str(Path(name).expanduser()))
    elif name in preset_names():
        config = load_preset(name)
    else:
        try:  # the Hub cache (never the network: a plan must not wait on it)
            config = config_class.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError):
            if name not in HUB_PRESETS:
                raise UserError(f"model_config.name: '{name}' has no config.json on this machine, so its memory "
                                f"cannot be planned; download it first (`hf download {name} config.json`)") from None
            config = load_preset(HUB_PRESETS[name])
    if not cfg.model_config.pretrained and cfg.tokenizer in ("bpe", "auto"):
        config.vocab_size = (cfg.tokenizer_vocab_size if cfg.tokenizer == "bpe"
                             else max(cfg.tokenizer_vocab_size, config.vocab_size))
    with torch.device("meta"):
        return model_class(config).float()


def _optimizer_bytes(make_optimizer, params: list[torch.nn.Parameter]) -> int:
    """The inner optimizer's state on the parameters' device, after one step on meta tensors (AdamW: two moments;
    its step counters live on the CPU unless fused)."""
    probes = [torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in params]
    for p in probes:
        p.grad = torch.empty_like(p)
    opt = make_optimizer(probes)
    opt.step()
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.is_meta)


def _activations(model: torch.nn.Module, seq_len: int, batch: int, weights_are_counted: bool) -> int:
    """Bytes saved for backward by one training forward pass on the meta device (+ the logits' gradient).
    weights_are_counted: the weights a layer saves are the node's own (fp32), counted already; under autocast
    they are the layer's half-precision copies, which are new bytes."""
    own = weight_storages(model) if weights_are_counted else frozenset()
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    classifier = type(model).__name__.endswith("ForSequenceClassification")
    labels = torch.zeros(batch, dtype=torch.long, device="meta") if classifier else ids
    model.train()
    # no attention mask: the meta device cannot decide a mask's shortcuts; the packed sequences' mask is all ones
    return saved_bytes(lambda: model(input_ids=ids, labels=labels), own)


def model_sizes(model: torch.nn.Module, make_optimizer, seq_len: int, precision: str = "fp32") -> ModelSizes:
    """A meta model's bytes (weights and gradients in fp32, as the nodes hold them; activations in the precision's
    autocast dtype)."""
    weights = sum(v.numel() * 4 for v in model.state_dict().values() if torch.is_floating_point(v))
    trainable = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in trainable)
    optimizer = _optimizer_bytes(make_optimizer, trainable)  # of the fp32 parameters, before the cast below
    autocast = precision in AUTOCAST_DTYPES
    if autocast:
        model = model.to(AUTOCAST_DTYPES[precision])  # autocast does not run on meta tensors: the dtype stands in
    one = _activations(model, seq_len, 1, not autocast)
    two = _activations(model, seq_len, 2, not autocast)
    return ModelSizes(weights, numel * 4, optimizer, one, max(two - one, 0), numel)


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    device: str  # a CUDA card ("cuda:0") or a simulated CPU device ("cpu[1]": devices[1])
    nodes: int
    computing: int  # nodes of this device computing at once
    resident: dict[str, int]
    transient: dict[str, int]
    capacity_bytes: int  # 0: not known (a CUDA card that is not here, without --capacity_gb)

    @property
    def planned_bytes(self) -> int:
        return sum(self.resident.values()) + sum(self.transient.values())

    @property
    def fits(self) -> bool | None:
        return None if not self.capacity_bytes else self.planned_bytes <= self.capacity_bytes

    def as_dict(self) -> dict:
        return {"device": self.device, "planned_bytes": self.planned_bytes, "capacity_bytes": self.capacity_bytes,
                "fits": self.fits, "nodes": self.nodes, "computing_at_once": self.computing,
                "resident": dict(self.resident), "transient": dict(self.transient)}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    devices: list[DevicePlan]
    host: dict[str, int]  # offloaded nodes' state (pinned on CUDA), masters on the CPU, the state's copies
    micro_batch: int

    @property
    def fits(self) -> bool:
        return all(d.fits is not False for d in self.devices)

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    def as_dict(self) -> dict:
        return {"devices": [d.as_dict() for d in self.devices], "host_bytes": self.host_bytes, "host": dict(self.host),
                "micro_batch": self.micro_batch, "fits": self.fits}

    def lines(self) -> list[str]:
        """One line per device group, for the log and the console."""
        parts = []
        for d in self.devices:
            cap = f"{d.capacity_bytes / GiB:.3g} GiB" if d.capacity_bytes else "capacity unknown"
            verdict = {True: "fits", False: "DOES NOT FIT", None: "?"}[d.fits]
            parts.append(f"{d.device} {d.planned_bytes / GiB:.3g} GiB of {cap} ({verdict}; {d.nodes} nodes, "
                         f"{d.computing} computing at once; resident {sum(d.resident.values()) / GiB:.3g} GiB)")
        return [f"memory plan (micro-batch {self.micro_batch}): " + "; ".join(parts)
                + f"; host {self.host_bytes / GiB:.3g} GiB"]


def _groups(cfg: Config) -> dict[str, list[int]]:
    """Device name -> the indices in `devices` that share its memory (a CUDA card; a simulated CPU device alone)."""
    groups: dict[str, list[int]] = {}
    for i, spec in enumerate(cfg.device_specs):
        key = card_of(spec.device) if spec.device.startswith("cuda") else f"cpu[{i}]"
        groups.setdefault(key, []).append(i)
    return groups


def _capacity(cfg: Config, key: str, members: list[int], capacity_gb: float | None) -> int:
    if key.startswith("cpu"):
        spec = cfg.device_specs[members[0]]
        return int((spec.memory_mb or cfg.device_memory_mb
                    or default_device_memory_mb(cfg.device_names.count("cpu"))) * MiB)
    if capacity_gb:
        return int(capacity_gb * GiB)
    if torch.cuda.is_available() and torch.device(key).index < torch.cuda.device_count():
        return torch.cuda.get_device_properties(torch.device(key)).total_memory
    return 0


def plan_memory(cfg: Config, sizes: ModelSizes, micro_batch: int, threads: bool, master_device: str,
                capacity_gb: float | None = None, statistics_sample_bytes: int = 0) -> MemoryPlan:
    """The plan of this config at `micro_batch` (a node's largest: accumulation adds no activations).
    statistics_sample_bytes: one gradient sample's bytes times the samples per node (0: no statistics)."""
    from trainers import TRAINERS

    synchronous = TRAINERS[cfg.distributed_algo].syncs_gradients
    # DDP / SNOO and Streaming DiLoCo pause every node mid-round (gradient averaging, fragment syncs): each node
    # stays on its device for the whole round, so every node counts as computing at once for what it holds
    whole_round = synchronous or cfg.streams
    state_bytes = sizes.weight_bytes + sizes.optimizer_bytes
    residual = sizes.gradient_bytes if run_plan.keeps_residual(cfg) else 0
    master = card_of(master_device) if master_device.startswith("cuda") else "cpu"
    masters = {"masters": cfg.num_init_trainers * sizes.weight_bytes,
               "outer_optimizer": cfg.num_init_trainers * sizes.gradient_bytes if cfg.outer_momentum else 0}
    # every round starts with a rollback snapshot (cluster/state.py), and every checkpoint copies the state again
    # while it is written: each node's optimizer state on the CPU, twice
    plans = []
    host = {"offloaded_nodes": 0, "masters": sum(masters.values()) if master == "cpu" else 0,
            "rollback_snapshot": cfg.total_nodes * sizes.optimizer_bytes,
            "checkpoint_copy": cfg.total_nodes * sizes.optimizer_bytes}
    for key, members in _groups(cfg).items():
        nodes = cfg.nodes_per_gpu * len(members)
        computing = min(nodes, computing_per_device(cfg, threads) * len(members)) if threads else 1
        holding = nodes if whole_round else computing  # nodes whose state is on the device during a round
        resident = {"node_weights": 0 if cfg.offload_idle_nodes else nodes * sizes.weight_bytes,
                    "node_optimizer": 0 if cfg.offload_idle_nodes else nodes * sizes.optimizer_bytes,
                    "residuals": nodes * residual,
                    "evaluator": sizes.weight_bytes if 0 in members else 0,
                    **(masters if key == master else {})}
        transient = {"moved_in": holding * state_bytes if cfg.offload_idle_nodes else 0,
                     "gradients": (nodes if synchronous else computing) * sizes.gradient_bytes,
                     "activations": computing * sizes.activation_bytes(micro_batch),
                     "statistics": nodes * statistics_sample_bytes}
        if cfg.node_execution == "stacked":  # a new stack holds its nodes' state twice, before any gradient exists:
            # the round's peak is the larger of the copy and the compute (distributed/stacked.py)
            transient["stacking_copy"] = max(0, nodes * state_bytes - sum(transient.values()))
        if cfg.offload_idle_nodes:
            host["offloaded_nodes"] += nodes * state_bytes
        plans.append(DevicePlan(key, nodes, computing, resident, transient,
                                _capacity(cfg, key, members, capacity_gb)))
    return MemoryPlan(plans, host, micro_batch)


def _plan(cfg: Config, meta: torch.nn.Module, micro_batch: int, master_device: str,
          capacity_gb: float | None) -> MemoryPlan:
    from trainers import TRAINERS

    sizes = model_sizes(meta, TRAINERS[cfg.distributed_algo].inner_optimizer_factory(cfg), cfg.seq_len, cfg.precision)
    return plan_memory(cfg, sizes, micro_batch, computing_together(cfg), master_device, capacity_gb,
                       run_plan.sample_bytes(cfg, sizes.trainable))


def plan_for_config(cfg: Config, micro_batch: int | None = None, capacity_gb: float | None = None) -> MemoryPlan:
    """The plan from the config alone (the model on the meta device), at `micro_batch` (default: max_batch_size,
    else 1, the least any run needs): what run.py checks before any work."""
    return _plan(cfg, meta_model(cfg), micro_batch or cfg.max_batch_size or 1,
                 master_device_of(cfg, cfg.device_names), capacity_gb)


def plan_of_run(cfg: Config, model: torch.nn.Module, micro_batch: int, master_device: str) -> MemoryPlan:
    """The plan of a built model (its own vocabulary) at the nodes' max batch, for the log and summary.json."""
    with torch.device("meta"):
        meta = type(model)(model.config).float()
    return _plan(cfg, meta, micro_batch, master_device, None)


def idle_state_bytes(model: torch.nn.Module, make_optimizer) -> int:
    """What a node that waits keeps on its device: its fp32 weights and its inner optimizer's state."""
    weights = sum(v.numel() * 4 for v in model.state_dict().values() if torch.is_floating_point(v))
    return weights + _optimizer_bytes(make_optimizer, [p for p in model.parameters() if p.requires_grad])


def keys_that_fit(cfg: Config, capacity_gb: float | None = None, micro_batch: int | None = None) -> str:
    """The overrides that would make a refused plan (at `micro_batch`, as plan_for_config) fit, the fewest first; a key
    the config already sets that way is not advice ("" if nothing it does not already do would make it fit)."""
    for changes in ({"offload_idle_nodes": True}, {"max_concurrent_nodes": 1},
                    {"offload_idle_nodes": True, "max_concurrent_nodes": 1}):
        new = {k: v for k, v in changes.items() if getattr(cfg, k) != v}
        if new and plan_for_config(cfg.replace(**changes), micro_batch, capacity_gb).fits:
            return " ".join(f"{k}={str(v).lower()}" for k, v in new.items())
    return ""


def refusal(plan: MemoryPlan, cfg: Config, capacity_gb: float | None = None) -> str:
    """The one line that refuses a plan that cannot fit, naming the keys that would make it fit."""
    worst = max((d for d in plan.devices if d.fits is False), key=lambda d: d.planned_bytes / d.capacity_bytes)
    fix = keys_that_fit(cfg, capacity_gb)
    advice = f"set {fix}" if fix else "lower nodes_per_gpu or seq_len, or use a smaller model"
    return (f"{worst.device} needs {worst.planned_bytes / GiB:.3g} GiB ({worst.nodes} nodes, {worst.computing} "
            f"computing at once), more than its {worst.capacity_bytes / GiB:.3g} GiB; {advice} "
            "(benchmarks.memory_plan shows the plan)")


def plan_json(plan: MemoryPlan) -> str:
    return json.dumps(plan.as_dict(), indent=2)


def check_memory_plan(cfg: Config) -> MemoryPlan | None:
    """Before any work (run.py): the plan at the least micro-batch; a plan that cannot fit is refused in one line
    (exit 2) naming the keys that would make it fit. None when the model's config is not on this machine (the plan is
    then left to the run's log, after the model is loaded)."""
    try:
        plan = plan_for_config(cfg)
    except UserError as exc:
        log.info("memory plan: not made before the run (%s)", exc)
        return None
    if not plan.fits:
        raise UserError(f"memory plan: {refusal(plan, cfg)}")
    import psutil

    short = host_shortfall(plan, psutil.virtual_memory().available)
    if short:
        raise UserError(f"memory plan: {short}")
    return plan


def host_shortfall(plan: MemoryPlan, available_bytes: int) -> str:
    """What the host cannot hold ("" if it can): the plan's host bytes and the simulated CPU devices' (the same RAM)
    against the memory available now."""
    cpu = sum(d.planned_bytes for d in plan.devices if d.device.startswith("cpu"))
    need = plan.host_bytes + cpu
    if need <= available_bytes:
        return ""
    parts = ", ".join(f"{k} {v / GiB:.3g}" for k, v in plan.host.items() if v)
    return (f"the host needs {need / GiB:.3g} GiB ({parts}" + (f", CPU devices {cpu / GiB:.3g}" if cpu else "")
            + f" GiB), more than the {available_bytes / GiB:.3g} GiB available; use fewer nodes or a machine with "
            "more memory")
