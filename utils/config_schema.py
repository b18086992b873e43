"""The run configuration's keys: every field with its type, default, documentation and marks (see `_f`).

`utils/config.py` is the face: `Config` (these keys, checked by `utils/config_rules.py` when made) and `load_config`.
This module holds only the schema, so that the rules, the typed-YAML loader and the docs generator can read it
without importing each other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from utils.errors import ConfigError

# sampling methods that grow the batch from measured gradient variance (algorithms/calc_batch.py)
ADAPTIVE_TESTS = ("norm_test", "augmented_inner_product_test")


_SECTION = ["run and logs"]


def section(name: str) -> None:
    """In a config class body: the fields declared after this call belong to section `name`."""
    _SECTION[0] = name


MARKS = ("resume", "added_later", "per_machine", "cluster", "where")
BOUNDS = ("min", "max")


def _f(default: Any, doc: str, choices: tuple[str, ...] | None = None, **marks: Any) -> Any:
    """A dataclass field with documentation, optional choices, numeric bounds (`min=`, `max=`) and what the key is
    (each mark False unless given True):
    resume: a resumed run may change it (it does not change what is computed, only how long the run goes, what
        is recorded and how faults are handled); everything else is fixed by the checkpoint (`meaning`);
    added_later: it changes the numbers but came after the first checkpoint format; at its default it does what
        the versions before it did, so it leaves the config hash (and --resume of older runs) unchanged;
    per_machine: under torchrun it may differ between machines (where files are; the CPU's kernels and threads);
    cluster: it describes the cluster (benchmarks.compare --cluster FILE takes it);
    where: it only says where files go, so the harness reuses a finished run across it."""
    unknown = set(marks) - set(MARKS) - set(BOUNDS)
    if unknown:  # a misspelt mark would otherwise be a silent no-op
        raise TypeError(f"_f: unknown marks {sorted(unknown)}; the marks are {MARKS} and the bounds {BOUNDS}")
    meta = {"doc": doc, "choices": choices, "section": _SECTION[0], **{m: bool(marks.get(m)) for m in MARKS},
            **{b: marks[b] for b in BOUNDS if b in marks}}
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
    name: str = _f("microllama-tiny", "Model preset (microllama-nano, microllama-tiny, microllama-mini, "
                   "microllama-300m, bert-tiny), a local model directory, or a Hugging Face id such as "
                   "keeeeenw/MicroLlama.")
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
class ConfigFields:
    """Every key of a run (config.yaml), by section; `utils.config.Config` adds the checks and the hash."""
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
                             "sequential, stacked (a device's nodes of one batch shape as one model over stacked "
                             "weights, torch.func.vmap: for small batches on a GPU; docs/running.md), or auto "
                             "(threads only when nodes sit on distinct CUDA devices; never stacked). Results do not "
                             "depend on it (stacked: last digits).", choices=("auto", "threads", "sequential",
                                                                              "stacked"), resume=True)
    max_concurrent_nodes: int = _f(0, "At most this many nodes of a simulated device run their inner steps at once "
                                   "(node_execution threads); the others wait their turn. 0 = all. The max-batch "
                                   "probe shares a device's memory among the nodes that compute at once, so a probed "
                                   "max batch can grow with it; nothing else depends on it (docs/running.md).",
                                   min=0, resume=True)
    offload_idle_nodes: bool = _f(False, "Keep each node's weights and inner optimizer state in host memory (pinned "
                                  "on CUDA) while it waits, moving them to its device for its inner steps and back "
                                  "after. Results do not depend on it (docs/running.md).", resume=True)
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
    compile: bool = _f(False, "torch.compile each node's model replica once, one graph per micro-batch shape "
                       "(dynamic=False): language-model micro-batches are padded with label-less rows to a few "
                       "buckets (1, 2, 3, 4, 6, 8, 12, ... up to the node's max batch), each compiled in a warm-up "
                       "before training, so a growing batch never recompiles; needs sequential nodes in one "
                       "process.")
    compile_backend: str = _f("inductor", "compile only: torch.compile's backend (inductor: generated kernels; "
                              "aot_eager: the same graphs run by eager kernels, which compiles in seconds: tests).",
                              choices=("inductor", "aot_eager", "eager"), added_later=True)
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
                                    "a run without it is read as run_dir.run_config.load_run_config says.",
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
                                     "10 steps): each trainer's synced model, its outer step applied to a copy on "
                                     "the mean of its nodes' weights at that step (the model it would hold if the "
                                     "round ended there; the same rule for every method), on the validation set; "
                                     "the nodes pause there; nothing of it is counted as the method's traffic or "
                                     "time; model_training_report/inner_eval.csv. 0 = only after each outer step. "
                                     "Training numbers do not change.", min=0, resume=True)
    save_weights_every: int = _f(4, "Checkpoint every this many outer steps (and at the end); 0 = only at the end.",
                                 min=0, resume=True)
    keep_checkpoints: int = _f(3, "Keep the newest this many complete checkpoints in model_weights (final included; "
                               "0 = keep all). Older ones are deleted only after a newer one is written and verified; "
                               "final is never deleted.", min=0, resume=True)
    plot_every: int = _f(4, "Redraw the PNG plots every this many outer steps (and at the end); 0: no PNG plots "
                         "(sweeps and tests, where each plot costs more than the run's steps).", min=0, resume=True)
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
        """Here so that the generated __init__ calls it: Config overrides it with the cross-key checks."""

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
    @property
    def total_nodes(self) -> int:
        return len(self.devices) * self.nodes_per_gpu


FAULT_KINDS = ("nan", "error", "hang", "crash")
# what a run directory holds besides its log file (docs/observing.md: "What a run shows and leaves")
RUN_DIR_ENTRIES = frozenset({"config.yaml", "metrics.jsonl", "summary.json", "model_weights", "model_training_report",
                             "memory_report", "tensorboard", "clearml_task.json", "run.lock", "status.json"})
MAX_NAME_BYTES = 200  # run_name / log_file: filesystems allow 255 bytes, suffixes need the rest


def keys_where(prop: str, schema: type | None = None) -> tuple[str, ...]:
    """The keys whose field says `prop` (see _f), in declaration order."""
    return tuple(f.name for f in dataclasses.fields(schema or ConfigFields) if f.metadata.get(prop))

# What each key is, read off its field (_f): resumable changes, keys added after the first checkpoint format,
# keys that may differ between torchrun machines, cluster-description keys, and keys that only place files.
RESUME_MAY_CHANGE = frozenset(keys_where("resume"))
ADDED_LATER = frozenset(keys_where("added_later"))
PER_MACHINE_KEYS = frozenset(keys_where("per_machine"))
CLUSTER_KEYS = keys_where("cluster")
WHERE_KEYS = frozenset(keys_where("where"))
