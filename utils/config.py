"""Typed run configuration: parsed from config.yaml once, validated, then read as attributes.

Key names follow the authors' repository (num_outer_steps, lr_inner, ETA, vartheta, ...), so their
users feel at home. Precedence: command-line `key=value` overrides > YAML file > defaults here.
Every field carries a `doc` and marks saying what the key is (see `_f`); `python -m utils.config --markdown` prints
the table of docs/configuration.md, `--update-docs` rewrites it there.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from utils.errors import ConfigError, UserError

# sampling methods that grow the batch from measured gradient variance (algorithms/calc_batch.py)
ADAPTIVE_TESTS = ("norm_test", "augmented_inner_product_test")


_SECTION = ["run and logs"]


def section(name: str) -> None:
    """In a config class body: the fields declared after this call belong to section `name`."""
    _SECTION[0] = name


def _f(default: Any, doc: str, choices: tuple[str, ...] | None = None, *, resume: bool = False,
       added_later: bool = False, per_machine: bool = False, cluster: bool = False, where: bool = False,
       **bounds: float) -> Any:
    """A dataclass field with documentation, optional choices, numeric bounds (min / max) and what the key is:
    resume: a resumed run may change it (it does not change what is computed, only how long the run goes, what
        is recorded and how faults are handled); everything else is fixed by the checkpoint (`meaning`);
    added_later: it changes the numbers but came after the first checkpoint format; at its default it does what
        the versions before it did, so it leaves the config hash (and --resume of older runs) unchanged;
    per_machine: under torchrun it may differ between machines (where files are; the CPU's kernels and threads);
    cluster: it describes the cluster (benchmarks.compare --cluster FILE takes it);
    where: it only says where files go, so the harness reuses a finished run across it."""
    meta = {"doc": doc, "choices": choices, "section": _SECTION[0], "resume": resume, "added_later": added_later,
            "per_machine": per_machine, "cluster": cluster, "where": where, **bounds}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: _copy(default), metadata=meta)
    return field(default=default, metadata=meta)


documented = _f  # the public name, for other tools' typed configs (gradient_analysis)


def _copy(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value)
    return type(value)(value)


@dataclass
class ModelConfig:
    section("model")
    name: str = _f("microllama-tiny", "Model preset (microllama-tiny, microllama-mini, microllama-300m, bert-tiny), "
                   "a local model directory, or a Hugging Face id such as keeeeenw/MicroLlama.")
    pretrained: bool = _f(False, "Load pretrained weights (local directory or HF cache, offline-safe) "
                          "instead of initialising from the config with training_seed.")


@dataclass
class DeviceSpec:
    section("cluster")
    device: str = _f("cpu", "cpu, cuda or cuda:N.")
    speed: float = _f(1.0, "How fast this device's nodes compute, relative to the throughput curve (0.25 = four "
                      "times slower); only the simulated clock reads it (and inner_steps_by_speed).")
    memory_mb: float = _f(0.0, "Memory of this simulated device for the max-batch probe, in MiB (0 = "
                          "device_memory_mb; on CUDA the real free memory).", min=0.0)


@dataclass
class Config:
    section("run and logs")
    project_name: str = _f("Multi instance training", "Project name for experiment trackers.", resume=True)
    task_name: str = _f("AdLoCo", "Task (run) name for experiment trackers.", resume=True)
    training_seed: int = _f(42, "Seed of every random choice: model init, data order, shards.", min=0)
    log_dir: str = _f("logs", "Root directory of run directories.", resume=True, per_machine=True, where=True)
    log_file: str = _f("training_log.log", "Name of the text log inside the run directory.", resume=True)
    run_name: str = _f("", "Run directory name; empty = <model>_<dataset>_<YYYY_MM_DD_HH_MM_SS>.",
                       resume=True, where=True)
    section("cluster")
    devices: list[str | DeviceSpec] = _f(["cpu", "cpu"], "Simulated devices, each hosting nodes_per_gpu nodes: "
                                         "cpu, cuda, cuda:0, ..., or {device: cpu, speed: 0.25, memory_mb: 80} "
                                         "(docs/clock.md).", cluster=True)
    nodes_per_gpu: int = _f(2, "Nodes (training streams) per simulated device.", min=1, cluster=True)
    node_execution: str = _f("auto", "How the nodes of a round run: threads (concurrent, as in the paper), "
                             "sequential, or auto (threads only when nodes sit on distinct CUDA devices). "
                             "Results do not depend on it.", choices=("auto", "threads", "sequential"), resume=True)
    precision: str = _f("fp32", "Precision of the nodes' forward/backward passes and of evaluation: fp32, tf32 "
                        "(CUDA TensorFloat-32 matmuls), bf16 (autocast; CUDA or CPU) or fp16 (autocast with a "
                        "per-node loss scaler, as the paper). Weights, masters and the outer step stay fp32.",
                        choices=("fp32", "tf32", "bf16", "fp16"))
    master_device: str = _f("auto", "Where the trainers' fp32 master weights and outer optimizer state live: cpu, "
                            "or auto (the nodes' GPU when every node of this process is on the same CUDA device, as in "
                            "the paper's one-GPU simulation and under torchrun; otherwise cpu).",
                            choices=("auto", "cpu"))
    cpu_capability: str = _f("auto", "CPU kernels torch uses (ATEN_CPU_CAPABILITY): auto (the best this CPU has; "
                             "config.yaml records which), or default, avx2, avx512. The last digits of a run depend on "
                             "it; the README's numbers were made with avx2.",
                             choices=("auto", "default", "avx2", "avx512"), resume=True, per_machine=True)
    cpu_threads: int = _f(0, "torch's intra-op threads on CPU (torch.set_num_threads); 0 = torch's default (one per "
                          "core). Recorded in the run log and summary.json.", min=0, resume=True, per_machine=True)
    compile: bool = _f(False, "torch.compile each node's model replica once (the first steps of a run, and of "
                       "each new batch shape, pay the compile time; needs sequential nodes in one process).")
    log_batch_statistics: bool = _f(True, "With a batch schedule that ignores them (constant, linear_rampup): still "
                                    "compute and log the batch tests' statistics; false skips the gradient "
                                    "samples entirely there.")
    padding_percentage: float = _f(0.9, "Fraction of a device's memory budget usable by its nodes "
                                   "(safety margin of the max-batch probe).", min=0.05, max=1.0)
    device_memory_mb: float = _f(0.0, "Memory of one simulated CPU device in MiB for the max-batch probe "
                                 "(0 = half the memory available at start, shared by the CPU devices, at most "
                                 "1024 MiB each). Ignored on CUDA, where the real free memory is used.",
                                 min=0.0, cluster=True)
    max_batch_size: int = _f(0, "Largest micro-batch per node; 0 = find it with the memory probe.", min=0)
    section("data")
    dataset: str = _f("embedded", "Training data. embedded = English text shipped in the exllamav2 wheel (no Hub "
                      "needed); c4 = C4 (Hub, local shards or tokenized); imdb = IMDB sentiment (for bert).",
                      choices=("embedded", "c4", "imdb"))
    embedded_sources: list[str] = _f(["wiki", "c4", "tiny"], "Parts of the embedded corpus: "
                                     "wiki, c4, tiny (TinyStories).")
    data_sample_size: int = _f(0, "Number of training sequences to use; 0 = all.", min=0)
    val_size: int = _f(64, "Number of held-out validation sequences.", min=1)
    seq_len: int = _f(128, "Tokens per packed training sequence.", min=8)
    tokenizer: str = _f("auto", "auto = MicroLlama's tokenizer if available locally, else a BPE trained on "
                        "the training split; bpe = always train; or a local directory / HF id.")
    tokenizer_vocab_size: int = _f(4096, "Vocabulary size of the trained BPE tokenizer.", min=300)
    cache_dir: str = _f("~/.cache/adloco", "Cache for the downloaded wheel, tokenizers and tokenized data.",
                        resume=True, per_machine=True, where=True)
    hub_downloads: bool = _f(False, "Allow downloads from the Hugging Face Hub (models, tokenizers). false = local "
                             "directories and the HF cache only (local_files_only), never a network wait.", resume=True)
    c4_language: str = _f("en", "C4 configuration (language), as in allenai/c4.")
    c4_streaming: bool = _f(True, "Hub C4: stream the first documents (true) or download split slices (false).")
    c4_local_path: str = _f("", "Directory of raw C4 shards (<dir>/<lang>/c4-train.*.json.gz, c4-validation.*); "
                            "used when set and c4_tokenized_path is empty.", per_machine=True)
    c4_tokenized_path: str = _f("", "Directory written by c4/tokenize_c4.py; takes precedence over the other C4 ways.",
                                per_machine=True)
    c4_num_documents: int = _f(1000, "C4 training documents to read (Hub or local shards); 0 = all local ones.",
                               min=0)
    imdb_local_path: str = _f("", "Directory with IMDB in its Hub layout (plain_text/train-*.parquet, "
                              "plain_text/test-*.parquet); empty = stanfordnlp/imdb from the Hub.", per_machine=True)
    section("model")
    model_type: str = _f("microllama", "Model family: microllama (LlamaForCausalLM, language modelling) or "
                         "bert (BertForSequenceClassification, with dataset: imdb).", choices=("microllama", "bert"))
    model_config: ModelConfig = _f(ModelConfig(), "Model name and weights (see model_config.* keys).")
    need_to_reinit_output_layers: bool = _f(False, "The authors' key: re-initialize each trainer's output layer "
                                            "(lm_head; bert: classifier) at the start, Xavier-uniform weights and "
                                            "zero bias, seeded per trainer (training_seed, trainer id), so trainers "
                                            "that share one checkpoint start independent (section 4.1); the "
                                            "authors' code seeded every trainer alike.", added_later=True)
    section("algorithm")
    distributed_algo: str = _f("DiLoCo", "DiLoCo (inner AdamW, outer SGD on the pseudo-gradient), LocalSGD (inner "
                               "SGD, outer = plain average), DDP (synchronous data parallel: gradients averaged "
                               "after every inner step, one AdamW, no outer step) or SNOO (DDP plus DiLoCo's outer "
                               "step on the H-step pseudo-gradient).",
                               choices=("DiLoCo", "LocalSGD", "DDP", "SNOO"))
    num_outer_steps: int = _f(12, "Outer steps (synchronisation rounds).", min=1, resume=True)
    max_tokens: int = _f(0, "Stop after the outer step at which all trainers together have seen this many "
                         "tokens (a token budget for fair comparisons); 0 = run all num_outer_steps.",
                         min=0, resume=True)
    num_inner_steps: int = _f(20, "Inner optimizer steps per node per round (not micro-batches).", min=1)
    lr_inner: float = _f(3e-3, "Inner learning rate (AdamW for DiLoCo, SGD for LocalSGD).", min=0.0)
    lr_outer: float = _f(0.5, "Outer SGD learning rate (DiLoCo). Paper: 0.5; DiLoCo paper: 0.7.", min=0.0)
    outer_momentum: float = _f(0.0, "Outer SGD momentum. Paper: 0 (plain SGD); DiLoCo paper: 0.9.",
                               min=0.0, max=0.999)
    outer_nesterov: bool = _f(False, "Nesterov outer momentum (DiLoCo paper: true; needs outer_momentum > 0).")
    inner_weight_decay: float = _f(0.1, "AdamW weight decay of the inner optimizer (paper: 0.1).", min=0.0)
    inner_betas: list[float] = _f([0.9, 0.95], "AdamW betas of the inner optimizer.")
    grad_clip: float = _f(1.0, "Inner gradient-norm clipping; 0 disables.", min=0.0)
    section("multi-instance training")
    num_init_trainers: int = _f(4, "Model instances (trainers) at the start.", min=1)
    merging_policy: str = _f("worst_with_worst", "Which trainers merge: worst_with_worst (paper: the two "
                             "smallest requested batches) or best_with_worst.",
                             choices=("worst_with_worst", "best_with_worst"))
    merge_frequency: int = _f(3, "Merge two trainers every this many outer steps; 0 disables merging.", min=0)
    section("adaptive batching")
    initial_batch_size: int = _f(2, "Requested batch per node at the start.", min=1)
    max_requested_batch: int = _f(4096, "Upper bound of the requested batch.", min=1)
    sampling_method: str = _f("norm_test", "How the requested batch evolves: norm_test, "
                              "augmented_inner_product_test, constant, or linear_rampup (a batch-size warmup "
                              "baseline: linear in tokens seen, initial_batch_size to max_requested_batch over "
                              "rampup_tokens).",
                              choices=("norm_test", "augmented_inner_product_test", "constant", "linear_rampup"))
    rampup_tokens: int = _f(0, "linear_rampup: tokens (all trainers) over which the batch ramps up; "
                            "0 = max_tokens (the whole run).", min=0)
    ETA: float = _f(0.8, "eta of the norm test (larger = smaller batches).", min=1e-6)
    vartheta: float = _f(0.01, "vartheta of the inner-product term of the augmented inner product test.",
                         min=1e-6)
    nu: float = _f(0.3, "nu of the orthogonality term of the augmented inner product test.", min=1e-6)
    variance_estimator: str = _f("micro_batches", "Gradient samples of the batch tests: micro_batches "
                                 "(chunks of each node's last step, same point; variance pooled within each "
                                 "node, so it measures sampling noise only; works with one node) or nodes "
                                 "(each node's last gradient, as in the paper; counts the drift between nodes "
                                 "too; needs >= 2 nodes per trainer).",
                                 choices=("micro_batches", "nodes"))
    variance_micro_batches: int = _f(4, "Chunks per node for the micro_batches estimator.", min=2)
    switch_mode: str = _f("threshold_switch_mode", "How a requested batch above max_batch is run: "
                          "threshold_switch_mode (accumulate only above 2x max_batch), "
                          "only_gradient_accumulation, only_data_loader.",
                          choices=("threshold_switch_mode", "only_gradient_accumulation", "only_data_loader"))
    section("communication")
    statistics_comm: str = _f("minimal", "How the batch tests' statistics travel: minimal (one fp32 vector and 6 fp64 "
                              "scalars per node: the fp64 decisions at the weights' bytes; docs/mechanisms.md), fp64 "
                              "(the exact two-vector reference every result before 2026-11-25 used), fp32 (that "
                              "reference's vectors in fp32; superseded by minimal) or sketch (each node count-sketches "
                              "its gradient samples to statistics_sketch_dim numbers first; estimates with relative "
                              "error about sqrt(2/k)).", choices=("minimal", "fp64", "fp32", "sketch"),
                              added_later=True)
    statistics_sketch_dim: int = _f(16384, "statistics_comm sketch: the sketch dimension k (every node builds the same "
                                    "seeded count sketch).", min=1, added_later=True)
    outer_compression: str = _f("none", "What each node's pseudo-gradient (trainer weights minus its own) becomes "
                                "before its trainer averages it: none (fp32), bf16, fp8 (e4m3 with a scale per chunk "
                                "of 1024), int8 (a scale per chunk of 1024) or topk (the topk_fraction largest "
                                "entries: int32 indices, int8 values with a scale per chunk of 1024). Masters, the "
                                "average and the outer optimizer stay fp32.",
                                choices=("none", "bf16", "fp8", "int8", "topk"), added_later=True)
    topk_fraction: float = _f(0.02, "outer_compression topk: the share of pseudo-gradient entries each node sends, "
                              "in (0, 1].", added_later=True)
    error_feedback: bool = _f(True, "With a lossy outer_compression: each node keeps what compression dropped "
                              "(its residual) and adds it to its next pseudo-gradient. The residual stays with the "
                              "node and is checkpointed.", added_later=True)
    merge_compression: str = _f("none", "What the absorbed trainers' states (weights, outer momentum) become when they "
                                "travel for a merge: none (fp32), bf16, fp8 or int8 (no error feedback: a merge is "
                                "one-off).", choices=("none", "bf16", "fp8", "int8"), added_later=True)
    sync_fragments: int = _f(1, "Streaming DiLoCo: the model in this many fragments (contiguous groups of layers, "
                             "balanced by size) whose outer syncs are staggered through the round: fragment f lands "
                             "after inner step (f+1) x num_inner_steps / sync_fragments. 1 = DiLoCo.",
                             min=1, added_later=True)
    sync_delay: int = _f(0, "Streaming DiLoCo: inner steps the nodes keep training while a fragment's reduction is in "
                         "flight (it is sent this many steps before it lands); below num_inner_steps / "
                         "sync_fragments.", min=0, added_later=True)
    fragment_alpha: float = _f(0.0, "Streaming DiLoCo: when a fragment lands, each node's fragment becomes alpha x its "
                               "own + (1 - alpha) x global, in [0, 1]: the weight of the local copy, as the paper's "
                               "alpha and torchft's fragment_update_alpha (0 takes the global one; the paper mixes "
                               "0.5 with a delay). Applied with sync_fragments 1 and sync_delay 0 too.",
                               added_later=True)
    fragment_alpha_weighs: str = _f("local", "Marks fragment_alpha's meaning since 2026-11-24 in a run's config.yaml; "
                                    "a run without it is read as utils.config.load_run_config says.",
                                    choices=("local",), added_later=True)
    section("the simulated clock")  # docs/clock.md
    network: str = _f("datacentre", "The simulated cluster's network: a preset (datacentre, cross-region, consumer) "
                      "or 'BANDWIDTH,LATENCY' per node link (e.g. '1Gbit/s,50ms'). Only the clock reads it.",
                      added_later=True, cluster=True)
    throughput: str = _f("flat", "Tokens/s of a speed-1 node against its micro-batch and accumulation: flat "
                         "(node_tokens_per_s at every batch), measured (measured once on the first device by "
                         "benchmarks.system's curve and cached in cache_dir), or a curve file "
                         "(python -m benchmarks.system --curve writes one).", added_later=True, cluster=True)
    node_tokens_per_s: float = _f(10000.0, "throughput flat: tokens/s of a speed-1 node.",
                                  min=1e-9, added_later=True, cluster=True)
    node_schedule: list[dict] = _f([], "Nodes that leave and come back or slow down: a list of {node: 3, leave: 4, "
                                   "return: 8} (away in outer steps 4 to 7) and {node: 1, slowdown: 4, from: 2, "
                                   "until: 6} (4x slower in outer steps 2 to 5); return / until 0 or absent: to the "
                                   "end.", added_later=True, cluster=True)
    inner_steps_by_speed: bool = _f(False, "Each node takes num_inner_steps x its throughput / its trainer's fastest "
                                    "node's inner steps (at least 1), so a trainer's nodes finish together (DyLU of "
                                    "Async Local-SGD); the trainer averages its nodes weighted by their tokens.",
                                    added_later=True)
    target_metric: float = _f(0.0, "summary.json's sim_time_to_target_s: the simulated time at which a trainer "
                              "first reached this metric value (0 = none).", min=0.0, resume=True)
    section("evaluation and outputs")
    eval_batch_size: int = _f(16, "Sequences per validation forward pass.", min=1)
    eval_every_inner_steps: int = _f(0, "Also evaluate within a round, every this many inner steps (the paper: every "
                                     "10 steps): each trainer's first node evaluates its own local weights, as they "
                                     "stand, on the validation set (no sync, nothing sent; one evaluation's compute on "
                                     "that node); model_training_report/inner_eval.csv. 0 = only after each outer "
                                     "step. Training numbers do not change.", min=0, resume=True)
    save_weights_every: int = _f(4, "Checkpoint every this many outer steps (and at the end); 0 = only at the end.",
                                 min=0, resume=True)
    keep_checkpoints: int = _f(3, "Keep the newest this many complete checkpoints in model_weights (final included; "
                               "0 = keep all). Older ones are deleted only after a newer one is written and verified; "
                               "final is never deleted.", min=0, resume=True)
    plot_every: int = _f(4, "Redraw the PNG plots every this many outer steps (and at the end).", min=1, resume=True)
    section("tracking")
    clearml_mode: str = _f("auto", "ClearML tracking: online, offline (a session zip to import later), auto "
                           "(online when ClearML credentials are configured, else offline) or off.",
                           choices=("auto", "online", "offline", "off"), resume=True)
    clearml_timeout_s: float = _f(5.0, "Seconds to wait for the ClearML server before falling back to offline.",
                                  min=0.1, resume=True)
    tensorboard: bool = _f(False, "Also write the scalars as TensorBoard event files (run_dir/tensorboard).",
                           resume=True)
    inner_progress: bool = _f(False, "Show a progress bar over each node's inner steps.", resume=True)
    memory_sample_interval_s: float = _f(0.05, "How often the memory monitor samples RSS during a round.",
                                         min=0.001, max=60.0, resume=True)
    dist_backend: str = _f("auto", "Under torchrun: the collectives' backend. auto = nccl for CUDA nodes, gloo for CPU "
                           "ones; gloo with CUDA nodes copies the collectives' tensors to the host (for several "
                           "processes on one GPU, which NCCL refuses).", choices=("auto", "nccl", "gloo"), resume=True)
    dist_timeout_s: float = _f(600.0, "Under torchrun: seconds a collective may wait for the other processes "
                               "before the run ends with one line naming the rank that did not arrive (hung or dead).",
                               min=1.0, resume=True)
    section("faults")
    on_node_fault: str = _f("stop", "What a node fault (non-finite loss or weights, or an exception in a node) "
                            "does: stop (checkpoint the last good state and exit with one line naming outer step, "
                            "trainer and node) or skip (drop that node's contribution for the round, log it in "
                            "fault_events.csv and go on).", choices=("stop", "skip"), resume=True)
    inject_fault: str = _f("", "Testing aid: faults to cause on purpose, '<outer_step>:<node_id>:<kind>' with kind "
                           "nan (the node's loss becomes NaN), error (the node raises: a node fault, on_node_fault "
                           "decides), hang (the node waits until the run is stopped: under torchrun the other ranks "
                           "end it after dist_timeout_s) or crash (the node's process raises outside the fault "
                           "policy, as a bug would: the run ends with an internal error), comma-separated; empty = "
                           "none.", resume=True)

    def __post_init__(self) -> None:
        for check in SECTION_CHECKS.values():  # the cross-key checks, one function per section (below)
            check(self)

    @property
    def device_specs(self) -> list[DeviceSpec]:
        """Each device as a DeviceSpec (a plain string is a speed-1 device)."""
        return [d if isinstance(d, DeviceSpec) else DeviceSpec(device=d) for d in self.devices]

    @property
    def device_names(self) -> list[str]:
        return [spec.device for spec in self.device_specs]

    @property
    def node_speeds(self) -> list[float]:
        """Each node's speed: its device's."""
        return [spec.speed for spec in self.device_specs for _ in range(self.nodes_per_gpu)]

    def injected_faults(self) -> dict[tuple[int, int], str]:
        """inject_fault parsed: (outer_step, node_id) -> kind."""
        faults: dict[tuple[int, int], str] = {}
        for item in filter(None, (part.strip() for part in self.inject_fault.split(","))):
            parts = item.split(":")
            try:
                step, node, kind = int(parts[0]), int(parts[1]), parts[2]
                if len(parts) != 3:
                    raise ValueError
            except (ValueError, IndexError):
                raise ConfigError("inject_fault", f"{item!r} is not '<outer_step>:<node_id>:<kind>' "
                                  "(e.g. '3:1:nan')") from None
            if kind not in FAULT_KINDS:
                raise ConfigError("inject_fault", f"kind {kind!r} in {item!r} is not one of {', '.join(FAULT_KINDS)}")
            if step < 1 or not 0 <= node < self.total_nodes:
                raise ConfigError("inject_fault", f"{item!r}: outer steps start at 1 and node ids run from 0 to "
                                  f"{self.total_nodes - 1}")
            faults[(step, node)] = kind
        return faults

    @property
    def streams(self) -> bool:
        """Whether rounds run as Streaming DiLoCo (fragments, a delay, or a local copy kept at the landing)."""
        return self.sync_fragments > 1 or self.sync_delay > 0 or self.fragment_alpha > 0

    def warnings(self) -> list[str]:
        """Valid settings that likely do not do what the user wants; run.py logs them before any work."""
        return [warning for check in CONFIG_WARNINGS for warning in check(self)]

    @property
    def total_nodes(self) -> int:
        return len(self.devices) * self.nodes_per_gpu

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def meaning(self, legacy: bool = False) -> dict[str, Any]:
        """The settings that decide a run's numbers: every key but those marked resume (max_tokens does
        decide linear_rampup's schedule when rampup_tokens is 0, so that schedule length counts too).
        legacy: as versions before 2026-11-24 computed it, counting a list-valued key marked added_later
        (node_schedule) even at its default."""
        fields = {f.name: f for f in dataclasses.fields(self)}

        def at_default(f: dataclasses.Field, value: Any) -> bool:
            if f.default_factory is not dataclasses.MISSING:
                return not legacy and value == f.default_factory()
            return value == HASH_DEFAULTS.get(f.name, f.default)

        # keys added after checkpoints were written count only when set: those checkpoints stay resumable
        meaning = {k: v for k, v in self.to_dict().items() if not fields[k].metadata["resume"]
                   and not (fields[k].metadata["added_later"] and at_default(fields[k], v))}
        if self.sampling_method == "linear_rampup":
            meaning["rampup_tokens"] = self.rampup_tokens or self.max_tokens
        if self.streams:  # fragment_alpha's meaning changed on 2026-11-24: no older streaming checkpoint matches
            meaning["fragment_alpha_weighs"] = self.fragment_alpha_weighs
        return meaning

    def meaning_hash(self, legacy: bool = False) -> str:
        """A checkpoint is resumable under a config with the same hash."""
        return hashlib.sha256(json.dumps(self.meaning(legacy), sort_keys=True).encode()).hexdigest()[:16]

    def meaning_hashes(self) -> tuple[str, ...]:
        """The hashes a resumable checkpoint of this config may carry: today's, then the one versions before
        2026-11-24 wrote (which counted node_schedule at its default: their checkpoints stay resumable)."""
        return tuple(dict.fromkeys((self.meaning_hash(), self.meaning_hash(legacy=True))))


# Keys whose default changed after checkpoints were written: the config hash leaves them out at the value those
# versions ran (and wrote no hash entry for), so those checkpoints stay resumable and today's default, which
# computes something else, gets a hash of its own. statistics_comm: fp64 until 2026-11-25, then minimal.
HASH_DEFAULTS = {"statistics_comm": "fp64"}
FAULT_KINDS = ("nan", "error", "hang", "crash")
# what a run directory holds besides its log file (docs/observing.md: "What a run shows and leaves")
RUN_DIR_ENTRIES = frozenset({"config.yaml", "metrics.jsonl", "summary.json", "model_weights", "model_training_report",
                             "memory_report", "tensorboard", "clearml_task.json", "run.lock", "status.json"})
MAX_NAME_BYTES = 200  # run_name / log_file: filesystems allow 255 bytes, suffixes need the rest


def keys_where(prop: str, schema: type | None = None) -> tuple[str, ...]:
    """The keys whose field says `prop` (see _f), in declaration order."""
    return tuple(f.name for f in dataclasses.fields(schema or Config) if f.metadata.get(prop))


# What each key is, read off its field (_f): resumable changes, keys added after the first checkpoint format,
# keys that may differ between torchrun machines, cluster-description keys, and keys that only place files.
RESUME_MAY_CHANGE = frozenset(keys_where("resume"))
ADDED_LATER = frozenset(keys_where("added_later"))
PER_MACHINE_KEYS = frozenset(keys_where("per_machine"))
CLUSTER_KEYS = keys_where("cluster")
WHERE_KEYS = frozenset(keys_where("where"))


# ----------------------------------------------------------------------------------------------
# Cross-key checks: one function per section, run in this order when a Config is made (a single key's type,
# choices and bounds are checked as it is read, by _coerce)


def check_run_and_logs(cfg: Config) -> None:
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


def check_faults(cfg: Config) -> None:
    cfg.injected_faults()  # validates the syntax


def check_algorithm(cfg: Config) -> None:
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


def check_cluster(cfg: Config) -> None:
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
    if cfg.compile and cfg.node_execution == "threads":
        raise ConfigError("compile", "torch.compile is not thread-safe: use node_execution: sequential or auto "
                          "(or torchrun, one node per process)")


def multi_instance_warnings(cfg: Config) -> list[str]:
    """Trainers whose batch cannot grow until a merge; merges that never happen."""
    from algorithms.assignment import node_counts

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


def clock_warnings(cfg: Config) -> list[str]:
    """A node_schedule event after the last outer step; a curve file that is not shaped like a throughput curve."""
    from algorithms.clock import NodeSchedule, ThroughputCurve

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


def sketch_warnings(cfg: Config) -> list[str]:
    """A sketch too small to measure what the batch test decides on."""
    k = cfg.statistics_sketch_dim
    if cfg.statistics_comm != "sketch" or k >= SKETCH_WARN_BELOW:
        return []
    return [f"statistics_sketch_dim {k}: the sketch's estimates err by about sqrt(2/k) = {(2 / k) ** 0.5:.0%} "
            f"each, and the batch test's ratio of two of them by about {2 / k ** 0.5:.0%}: more than half of "
            "what it measures, so its decisions follow the noise; use at least "
            f"{SKETCH_WARN_BELOW} (the default 16384 errs by 1.1%)"]


def alpha_warnings(cfg: Config) -> list[str]:
    """fragment_alpha 1 keeps every node's own copy: the trainers' weights never reach the nodes."""
    if cfg.fragment_alpha == 1.0:
        return ["fragment_alpha 1.0 keeps the nodes' own weights at every landing: they never take their trainer's "
                "(since 2026-11-24 alpha is the local copy's weight, as torchft's fragment_update_alpha; 0 takes "
                "the global weights, which is what 1.0 meant before)"]
    return []


CONFIG_WARNINGS = (multi_instance_warnings, clock_warnings, sketch_warnings, alpha_warnings)


def check_multi_instance(cfg: Config) -> None:
    if cfg.num_init_trainers > cfg.total_nodes:
        raise ConfigError("num_init_trainers", f"{cfg.num_init_trainers} trainers need at least as many "
                          f"nodes, but devices x nodes_per_gpu = {cfg.total_nodes}")


def check_clock(cfg: Config) -> None:
    """The cluster description (network, throughput, node_schedule, inner_steps_by_speed), before any work."""
    from algorithms.clock import NodeSchedule, ThroughputCurve
    from algorithms.network import parse_network

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


def check_adaptive_batching(cfg: Config) -> None:
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


def check_model(cfg: Config) -> None:
    if (cfg.model_type == "bert") != (cfg.dataset == "imdb"):
        raise ConfigError("model_type", f"'{cfg.model_type}' does not go with dataset '{cfg.dataset}': "
                          "bert trains on imdb, microllama on embedded or c4")


def check_communication(cfg: Config) -> None:
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


def check_data(cfg: Config) -> None:
    unknown = set(cfg.embedded_sources) - {"wiki", "c4", "tiny"}
    if unknown or not cfg.embedded_sources:
        raise ConfigError("embedded_sources", f"choose from wiki, c4, tiny (got {cfg.embedded_sources})")


# section -> its check, in the order they run (the order of the checks before they were split by section)
SECTION_CHECKS = {"run and logs": check_run_and_logs, "faults": check_faults, "algorithm": check_algorithm,
                  "cluster": check_cluster, "multi-instance training": check_multi_instance,
                  "the simulated clock": check_clock, "adaptive batching": check_adaptive_batching,
                  "model": check_model, "communication": check_communication, "data": check_data}


# ----------------------------------------------------------------------------------------------
# Parsing and validation


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any, meta: dict[str, Any]) -> Any:
    """Check `value` against the annotated type `tp`; numeric strings like "2e-5" become floats."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping of {', '.join(f.name for f in dataclasses.fields(tp))}")
        return build_dataclass(tp, value, prefix=f"{key}.")
    if origin in (list,):
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list of {_type_name(item_tp)}, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item_tp, {}) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        mapping = next((a for a in options if dataclasses.is_dataclass(a)), None)
        if mapping is not None and isinstance(value, dict):  # e.g. a device given as {device: cpu, speed: 0.5}
            return build_dataclass(mapping, value, prefix=f"{key}.")
        tp = options[0]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {value!r}")
    elif tp is float:
        # PyYAML reads 2e-5 (no dot) as a string, and the authors' config quotes its learning rates.
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(key, f"expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(key, f"expected a finite number, got {value}")
    elif tp is str:
        if isinstance(value, bool) and ("off" if not value else "on") in (meta.get("choices") or ()):
            value = "on" if value else "off"  # YAML 1.1 reads a bare off / on as a boolean
        elif isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # run_name=2024: a name, written as a number
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
    choices = meta.get("choices")
    if choices and value not in choices:
        hint = difflib.get_close_matches(str(value), choices, n=1)
        extra = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(key, f"'{value}' is not one of {', '.join(choices)}{extra}")
    if "min" in meta and value < meta["min"]:
        raise ConfigError(key, f"{value} is below the minimum {meta['min']}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(key, f"{value} is above the maximum {meta['max']}")
    return value


def build_dataclass(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            hint = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            extra = f"; did you mean '{prefix}{hint[0]}'?" if hint else ""
            raise ConfigError(f"{prefix}{key}", f"unknown key{extra}")
        kwargs[key] = _coerce(f"{prefix}{key}", value, hints[key], dict(fields[key].metadata))
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - every field has a default
        raise ConfigError(prefix.rstrip(".") or "config", str(exc)) from None


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`key=value` strings (values parsed as YAML, dotted keys for nested sections) into a nested dict."""
    result: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(item, "command-line overrides must look like key=value")
        try:
            value = yaml.load(text, Loader=_PlainLoader) if text else ""
        except yaml.YAMLError:
            value = text
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return result


def _deep_update(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
    return base


class DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: str, line: int) -> None:
        super().__init__(f"duplicate key {key}")
        self.key, self.line = key, line


class _PlainLoader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1's surprises for a config: no timestamps (run_name=2024-11-25 stays a string),
    no base-60 numbers (inject_fault=3:1 is not 181) and no leading-zero octals (007 stays a string)."""


_PlainLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:int",
                                                              "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_PlainLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(
    r"^(?:[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+|[-+]?0b[0-1_]+)$"), list("-+0123456789"))
_PlainLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
    r"|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


class _StrictLoader(_PlainLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML silently keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKeyError(str(key), key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, schema: type | None = None,
                section: str | None = None) -> Any:
    """Read a YAML file (optional), apply overrides, validate everything into `schema` (default Config).

    section: a top-level key whose mapping holds the settings, when present (the authors' gradient
    tool nests them under script_settings)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"--config: file not found: {path}")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(f"--config: {path} is not UTF-8 text (byte {exc.start}: "
                              f"{exc.object[exc.start:exc.start + 1]!r})") from None
        except OSError as exc:
            raise UserError(f"--config: cannot read {path} ({exc.strerror})") from None
        try:
            loaded = yaml.load(text, Loader=_StrictLoader)
        except DuplicateKeyError as exc:
            raise ConfigError(exc.key, f"appears twice in {path} (line {exc.line}); keep one") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise UserError(f"--config: {path} is not valid YAML{where}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise UserError(f"--config: {path} must hold a mapping of keys to values")
        raw = loaded or {}
        if section and isinstance(raw.get(section), dict):
            raw = raw[section]
    _deep_update(raw, parse_overrides(overrides or []))
    return build_dataclass(schema or Config, raw)


def load_run_config(path: str | Path, overrides: list[str] | None = None, *, resuming: bool = False) -> Config:
    """A run directory's config.yaml, read in today's meaning of fragment_alpha and statistics_comm.

    One written before 2026-11-24 (it names fragment_alpha but not fragment_alpha_weighs) meant by fragment_alpha
    the weight of the global copy. Without streaming that value did nothing: it reads as 0 (take the global
    copy, as the run did). With streaming a resume is refused, not reinterpreted; a reader (the harness, a
    benchmark) gets 1 - alpha, the same mix in today's terms."""
    cfg = load_config(path, overrides)
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if "statistics_comm" not in raw and not any(o.startswith("statistics_comm=") for o in overrides or []):
        cfg = cfg.replace(statistics_comm="fp64")  # written before the key: the run sent the fp64 reference
    if "fragment_alpha" not in raw or "fragment_alpha_weighs" in raw:
        return cfg
    old = float(raw["fragment_alpha"])
    if not (cfg.sync_fragments > 1 or cfg.sync_delay > 0):
        return cfg.replace(fragment_alpha=0.0)
    if resuming:
        raise ConfigError("fragment_alpha", f"{path} was written when fragment_alpha weighed the global copy "
                          f"({old} of the global weights); it now weighs the local copy (torchft's "
                          "fragment_update_alpha), so this streaming run cannot resume: start a new run with "
                          f"fragment_alpha={1 - old:g} for the same mix")
    return cfg.replace(fragment_alpha=1.0 - old)


def markdown_table() -> str:
    """docs/configuration.md's table: every key, its default, its section, whether --resume may change it, and
    its meaning."""
    rows = ["| key | default | section | on --resume | meaning |", "|---|---|---|---|---|"]

    def walk(cls: type, prefix: str = "") -> None:
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{f.name}.")
                continue
            choices = f.metadata.get("choices")
            doc = f.metadata["doc"] + (f" One of: {', '.join(choices)}." if choices else "")
            resume = ("given by RUN_DIR" if f.name in ("run_name", "log_dir", "log_file") else "may change") \
                if f.metadata["resume"] else "fixed"
            rows.append(f"| `{prefix}{f.name}` | `{default!r}` | {f.metadata['section']} | {resume} | {doc} |")

    walk(Config)
    return "\n".join(rows)


TABLE_START, TABLE_END = "<!-- config-table:start -->", "<!-- config-table:end -->"
CONFIG_DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def update_docs(page: Path = CONFIG_DOC) -> None:
    """Rewrite the table between the page's config-table markers."""
    text = page.read_text()
    head, rest = text.split(TABLE_START)
    _, tail = rest.split(TABLE_END)
    page.write_text(f"{head}{TABLE_START}\n{markdown_table()}\n{TABLE_END}{tail}")


if __name__ == "__main__":
    if "--markdown" in sys.argv:
        print(markdown_table())
    if "--update-docs" in sys.argv:
        update_docs()
