"""Does AdLoCo help? AdLoCo against DiLoCo baselines, LocalSGD and ablations, at matched budgets.

    python -m benchmarks.compare --config configs/compare_cpu.yaml --seeds 3 --out logs/compare

    # the paper's regime: one shared pretrained start, then every variant fine-tunes it with a small lr
    python -m benchmarks.compare --config configs/compare_warm_cpu.yaml --pretrain_config configs/pretrain_cpu.yaml \\
        --seeds 3 --out logs/compare_warm

Every variant trains on the same data, model and seeds, with the same token budget, as a separate `run.py`
process. The budget and --max_outer_steps: every run stops at the first outer step where it has seen
--max_tokens tokens, or at --max_outer_steps, whichever comes first. Without --max_tokens the budget is what
AdLoCo seed 0 sees in the config's num_outer_steps (or --max_outer_steps, if smaller): that run is trained
first and is itself the comparison's AdLoCo seed 0 (never trained twice); a --max_outer_steps below what a
slower-consuming variant needs cuts that variant short of the budget (its row says so). Variants are config
overrides of the base config:

  adloco              the base config (adaptive batching, merging, switch mode)
  adloco_no_adaptive  sampling_method: constant
  adloco_no_merge     merge_frequency: 0
  adloco_never_accumulate   switch_mode: only_data_loader (a request above max_batch runs max_batch, one pass)
  adloco_always_accumulate  switch_mode: only_gradient_accumulation (every request above max_batch accumulates;
                      when named, or with --variants switch: the four ablations of switch mode, ours and the
                      paper's; they replace adloco_no_switch and adloco_paper_no_switch, which meant opposite things)
  adloco_one_pass, adloco_paper_one_pass   switch mode's matched control: always_accumulate's effective batch (the
                      full request) in one pass, max_batch_size at the cap on a simulated device large enough; against
                      always_accumulate it isolates accumulation's cost (time only), against switch mode the batch's
                      effect (with --variants switch)
  adloco_paper        AdLoCo as the paper runs it where our default departs: variance_estimator nodes (one
                      gradient per node), ETA 0.8, initial_batch_size 1, merge_frequency 3
  adloco_paper_no_adaptive, adloco_paper_no_merge, adloco_paper_always_accumulate, adloco_paper_never_accumulate
                      the paper's three ablations (section 6.3) of adloco_paper: sampling_method constant
                      (its starting batch), merge_frequency 0, switch_mode only_gradient_accumulation
                      (accumulate as soon as the request exceeds max_batch: what section 4.2 says switch mode
                      replaces, and what the authors' code runs while several trainers are alive)
  diloco_bB           one trainer on all nodes, constant batch B (--diloco_batches, default 2,4,8,16),
                      run as it really is: loader batch x accumulation (only_gradient_accumulation)
  diloco_nesterov_bB  diloco_bB with DiLoCo's standard outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9)
                      instead of the AdLoCo paper's plain SGD at 0.5 (when named, or --variants nesterov)
  diloco_tuned_batch, diloco_nesterov_tuned_batch, ddp_tuned_batch, snoo_tuned_batch
                      the constant-batch methods with the batch a tuned knob over --diloco_batches (benchmarks.tune
                      searches it with the method's own knobs: "DiLoCo with its batch tuned", the primary
                      baseline); run when named or with --variants tuned_batch
  diloco_rampup       as diloco, with the batch ramped linearly from initial_batch_size to
                      max_requested_batch over the token budget (Megatron's rampup-batch-size)
  localsgd            as diloco_b<initial batch> with LocalSGD (inner SGD at --localsgd_lr, outer = average)
  ddp                 synchronous data parallel over the same nodes at the middle diloco_bB batch: gradients
                      averaged after every inner step (one all-reduce each), one AdamW, no outer step
  snoo                ddp plus an outer Nesterov step (lr 0.7, momentum 0.9) on the H-step pseudo-gradient
                      (SNOO, Kallusky et al. 2025)
  --add_variant NAME=[BASE:]KEY=VALUE ...   your own, e.g. 'paper_eta07=adloco_paper:ETA=0.7'
  communication (when named, or --variants communication; error feedback on):
  adloco_sketch       statistics_comm: sketch
  adloco_int8, adloco_fp8, adloco_topk    outer_compression int8 / fp8 / topk (2%)
  adloco_int8_sketch  both
  diloco_int8, diloco_topk                diloco_bB (B the middle --diloco_batches) compressed
  heterogeneous clusters (with --cluster FILE, included in all):
  diloco_by_speed     diloco_bB with inner_steps_by_speed (each node's inner steps in proportion to its
                      throughput, the mean weighted by tokens: DyLU of Async Local-SGD)
  adloco_by_speed     adloco with inner_steps_by_speed

--cluster FILE: a YAML mapping of the cluster keys (devices with speed / memory_mb, nodes_per_gpu, network,
throughput, node_tokens_per_s, node_schedule) applied to every run, whose own simulated clock
(docs/clock.md) then times it: the report gains time to target, utilisation and idle time under that
clock. --throughput_curve FILE prices the finished runs' rounds with a throughput curve instead of a flat
tokens/s (the network model's tables).

Warm start (two phases): `--pretrain_config CFG` trains one shared start with run.py (phase 1, into
<out>/pretrain, reused when finished; --pretrain_starts K trains K, the others into <out>/pretrain_start{i}
with the pretraining seed + i); `--init_from RUN_DIR[,RUN_DIR...]` uses existing runs' final models. Phase 2
starts every variant from that Hugging Face directory (model_weights/final/final_model, with its
tokenizer) on the --config data; with K starts, seed s from start s mod K, and every paired interval takes
the start as its unit (each start's mean difference over its seeds; t over the K starts).

Outputs in --out: comparison.md (every table), comparison.csv (one row per variant), runs.csv (one row per
variant and seed: the metric at the token budget, final, best seen, steps / tokens / simulated time to the
paper's three targets, bytes and their parts, largest requested batch, merges), budgets.csv (the metric at
matched budgets), merges.csv (every merge of every run), faults.csv (runs that stopped on a training fault,
such as a divergence: an outcome, listed apart and left out of every other table) and plots of the metric against
rounds, syncs, bytes, tokens and wall time. Reported per run: the real final model (summary.json's
final_metric, the model in model_weights/final) and, separately, the best metric seen during the run.

The command line is parsed once into frozen Options.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path

import yaml

from algorithms import network
from utils.config import CLUSTER_KEYS

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Options:
    config: str
    seeds: int
    max_tokens: int
    max_outer_steps: int
    variants: str
    diloco_batches: str
    target: float
    localsgd_lr: float
    pretrain_config: str
    pretrain_set: tuple[str, ...]
    init_from: str
    pretrain_starts: int
    out: str
    rerun: bool
    report_out: str
    network: tuple[str, ...]
    node_throughput: float
    time_target: float
    time_budget: float
    crossover_latency: str
    cluster: str
    throughput_curve: str
    no_statistics: bool
    add_variant: tuple[str, ...]  # NAME=[BASE:]KEY=VALUE ...: variants from the command line (variants.custom)
    reprice: str  # a report's folder: its replay bundle re-priced, nothing trained (bundle.py)
    model_params: float  # the network model's model size (parameters); 0: the runs' own
    overrides: tuple[str, ...]  # run.py overrides for every variant: --cluster's first, then the command line's
    workers: int = 1  # runs at once on this machine (runner.run_on_workers); benchmarks.tune: trials at once
    warm_from: str = ""  # the warm starts' model directories, as the report shows them

    @classmethod
    def parse(cls, argv: list[str] | None) -> Options:
        options = cls.from_parsed(vars(build_parser().parse_args(argv)))
        if options.seeds < 1 and not options.reprice:  # seeds to run (benchmarks.tune's 0 means no finalists)
            raise SystemExit(f"error: --seeds: {options.seeds}; give at least 1 (each variant runs on seeds 0..S-1)")
        if options.pretrain_starts < 1 or (options.pretrain_starts > 1 and not options.pretrain_config):
            raise SystemExit(f"error: --pretrain_starts: {options.pretrain_starts}; give at least 1, and more than 1 "
                             "only with --pretrain_config (phase 1 trains them)")
        if options.starts > 1 and 0 < options.seeds < options.starts and not options.reprice:
            raise SystemExit(f"error: --seeds: {options.seeds} seeds for {options.starts} warm starts; give at least "
                             "one seed per start (seed s starts from start s mod K)")
        return options

    def start_of(self, seed: int) -> dict:
        """A run's warm start as its result carries it ({} with one start: nothing to group by)."""
        return {"start": seed % self.starts} if self.starts > 1 else {}

    @property
    def starts(self) -> int:
        """How many warm starts the runs start from (1 from scratch)."""
        return self.pretrain_starts if self.pretrain_config else max(1, len([p for p in self.init_from.split(",")
                                                                              if p]))

    @classmethod
    def from_parsed(cls, args: dict) -> Options:
        """Options from build_parser's parsed values (another tool's parser may add keys of its own: pop them first)."""
        args = dict(args)
        for key in ("pretrain_set", "network", "overrides", "add_variant"):
            args[key] = tuple(args[key])
        if not all(b.strip().isdigit() and int(b) > 0 for b in args["diloco_batches"].split(",") if b):
            raise SystemExit(f"error: --diloco_batches: {args['diloco_batches']!r} is not a comma-separated list of "
                             "positive whole numbers (e.g. 2,4,8,16)")
        if args["model_params"] and not (args["throughput_curve"] or args["node_throughput"]):
            raise SystemExit("error: --model_params: give the throughput of that model too (--throughput_curve FILE or "
                             "--node_throughput TOKENS_S); the runs' own measured tokens/s is their model's")
        if not (math.isfinite(args["model_params"]) and args["model_params"] >= 0):
            raise SystemExit(f"error: --model_params: {args['model_params']} is not a number of parameters")
        if args["reprice"] and not args["report_out"]:
            raise SystemExit(f"error: --reprice {args['reprice']}: give --report_out, the folder of the re-priced "
                             "report (the report itself is never overwritten)")
        if args["seeds"] < 0:
            raise SystemExit(f"error: --seeds: {args['seeds']} is negative")
        if args.get("workers", 1) < 1:
            raise SystemExit(f"error: --workers: {args['workers']}; give at least 1 (runs at once on this machine)")
        for flag in ("out", "report_out"):
            if args[flag]:
                writable_folder(Path(args[flag]), f"--{flag}")
        if args["cluster"]:  # every run on the described cluster, before the command line's own overrides
            args["overrides"] = (*cluster_overrides(args["cluster"]), *args["overrides"])
        return cls(**args)

    @property
    def batches(self) -> list[int]:
        return [int(b) for b in self.diloco_batches.split(",") if b]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "config.yaml"))
    p.add_argument("--seeds", type=int, default=3, help="seeds per variant (training_seed 0..seeds-1)")
    p.add_argument("--max_tokens", type=int, default=0,
                   help="token budget per run; 0 = what AdLoCo seed 0 sees in the config's num_outer_steps (or "
                        "--max_outer_steps if smaller); that run is the comparison's own AdLoCo seed 0")
    p.add_argument("--max_outer_steps", type=int, default=200,
                   help="upper bound on outer steps per run: a run stops at the budget or here, whichever is first")
    p.add_argument("--variants", default="all", help="comma-separated variants and groups: all (the comparison "
                   "without the communication variants), paper (adloco_paper, its three ablations and the diloco_bB "
                   "sweep), communication (adloco, the middle diloco_bB and the compressed / sketched variants), "
                   "nesterov (diloco_nesterov_bB: DiLoCo with its standard outer Nesterov step at every batch)")
    p.add_argument("--diloco_batches", default="2,4,8,16", help="constant batches of the DiLoCo baselines")
    p.add_argument("--target", type=float, default=0.0,
                   help="target metric; 0 = the final mean of DiLoCo at the initial batch")
    p.add_argument("--localsgd_lr", type=float, default=0.3, help="inner SGD learning rate of the LocalSGD baseline")
    p.add_argument("--pretrain_config", default="", help="phase 1 of the warm start: run.py config of the shared start")
    p.add_argument("--pretrain_set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for phase 1 (repeatable)")
    p.add_argument("--init_from", default="", help="warm start from this finished run's final model (several, "
                   "comma-separated: one start each, seed s from start s mod K)")
    p.add_argument("--pretrain_starts", type=int, default=1, help="phase 1 pretrains this many starts (seeds "
                   "differing by 1); seed s starts from start s mod K, and with K > 1 the start is the unit of "
                   "every paired interval")
    p.add_argument("--out", default=str(ROOT / "logs" / "compare"),
                   help="runs and report (default logs/compare, outside the committed results; BENCHMARKS.md's "
                        "commands name benchmarks/results/... explicitly)")
    p.add_argument("--rerun", action="store_true", help="redo runs that already finished (or stopped on a training "
                   "fault)")
    p.add_argument("--report_out", default="",
                   help="write the tables and plots here instead of --out (the runs stay in --out/runs): another "
                        "view of finished runs, e.g. on other --network settings, without overwriting the report")
    p.add_argument("--network", action="append", default=[], metavar="[NAME=]BANDWIDTH,LATENCY",
                   help="a network to predict wall time on (repeatable): e.g. '10Gbit/s,1ms', 'lab=1Gbit/s,0.2ms' "
                        f"or a preset ({', '.join(network.PRESETS)}); default: the three presets")
    p.add_argument("--node_throughput", type=float, default=0.0,
                   help="tokens/s of one node for the network model; 0 = measured from the runs")
    p.add_argument("--time_target", type=float, default=0.0,
                   help="target metric of the clock's and the network model's tables; 0 = --target when given, "
                   "else the loosest value every run reached")
    p.add_argument("--time_budget", type=float, default=0.0,
                   help="seconds of predicted time; 0 = the shortest predicted run, per network")
    p.add_argument("--crossover_latency", default="10ms", help="latency of the crossover over bandwidths")
    p.add_argument("--cluster", default="", help="a cluster description (YAML: devices with speed, nodes_per_gpu, "
                   "network, throughput, node_schedule, ...) applied to every run; adds the by_speed variants and the "
                   "clock's report")
    p.add_argument("--throughput_curve", default="", help="network model: a throughput curve file (benchmarks.system "
                   "--curve) instead of a flat tokens/s")
    p.add_argument("--no_statistics", action="store_true",
                   help="network model: leave out the batch test's statistics (the weights traffic only)")
    p.add_argument("--add_variant", action="append", default=[], metavar="NAME=[BASE:]KEY=VALUE ...",
                   help="a variant of your own (repeatable), run beside --variants: BASE's overrides (an existing "
                   "variant; its family too) then these, whitespace-separated (a value may hold spaces: a word "
                   "that starts no KEY= joins the value before it); quote the whole option once, e.g. "
                   "'paper_eta07=adloco_paper:ETA=0.7' or 'churn=diloco_b2:node_schedule=[{node: 1, leave: 2}]'")
    p.add_argument("--reprice", default="", metavar="REPORT_DIR", help="re-price a finished report from its replay "
                   "bundle (REPORT_DIR/replay_bundle.tar.gz) on --network, --throughput_curve, --model_params ...: "
                   "nothing trains; every other option is the report's own; the tables go to --report_out")
    p.add_argument("--model_params", type=float, default=0.0, help="network model: price every run's traffic as if "
                   "the model had this many parameters (fp32, 4 bytes each): the weights' all-reduce, compressed "
                   "payloads, merges, node moves and full-size batch-test statistics scale with it; sketched "
                   "statistics, rounds, syncs and each run's trajectory (batches, merges) stay the run's; give that "
                   "model's --throughput_curve or --node_throughput")
    p.add_argument("--workers", type=int, default=1, help="runs (benchmarks.tune: trials, then the finalists' runs) "
                   "at once on this machine, each on cores / K threads "
                   "(cpu_threads) unless the overrides give cpu_threads; every run is made first, then the report "
                   "reuses them (a run made at another cpu_threads is another run: give cpu_threads to share runs "
                   "between calls with different --workers)")
    p.add_argument("overrides", nargs="*", help="run.py key=value overrides applied to every variant, after "
                   "--config (e.g. lr_inner=1e-3 num_inner_steps=10); each variant's own keys come after them")
    return p


def writable_folder(path: Path, flag: str) -> None:
    """A folder the tool can create or write into, or one line saying why not (nothing is created here: the tool
    creates it once the rest of its input is known good)."""
    if path.exists() and not path.is_dir():
        raise SystemExit(f"error: {flag} {path}: a file, not a folder")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise SystemExit(f"error: {flag} {path}: cannot be created: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SystemExit(f"error: {flag} {path}: cannot be " + ("written into" if existing == path else
                         f"created: {existing} is not writable"))


def made(path: Path, flag: str) -> Path:
    """mkdir -p, or one line naming the folder and why (a read-only file system, a full disk, ...)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"error: {flag}: cannot create {path} ({exc.strerror or exc})") from None
    return path


def cluster_overrides(path: str) -> list[str]:
    """--cluster FILE as run.py overrides; a one-line error for what is not a cluster description."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"error: --cluster: cannot read {path} ({exc})") from None
    if not isinstance(raw, dict) or not raw:
        raise SystemExit(f"error: --cluster: {path} must hold a mapping of cluster keys ({', '.join(CLUSTER_KEYS)})")
    unknown = sorted(str(k) for k in set(raw) - set(CLUSTER_KEYS))  # 2: x beside devices: ...: a number as a key
    if unknown:
        raise SystemExit(f"error: --cluster: {path}: '{unknown[0]}' is not a cluster key ({', '.join(CLUSTER_KEYS)})")
    return [f"{k}={json.dumps(v)}" for k, v in raw.items()]


def parse_networks(args: Options) -> tuple[list[network.Network], float]:
    """--network and --crossover_latency, checked before any run starts."""
    try:
        nets = [network.parse_network(s) for s in (args.network or list(network.PRESETS))]
        return nets, network.parse_latency(args.crossover_latency)
    except ValueError as e:
        raise SystemExit(f"error: --network / --crossover_latency: {e}") from None


