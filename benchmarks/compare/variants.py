"""The harness's variants as data: each a name, a family (what it is a variant of) and its run.py overrides."""

from __future__ import annotations

import dataclasses
import re
import shlex

from utils.config import Config

# AdLoCo and its ablations; the DiLoCo baselines; LocalSGD; synchronous data parallel (DDP, SNOO)
FAMILIES = ("adloco", "diloco", "localsgd", "synchronous")

# AdLoCo as the paper runs it, where our default departs (Appendix A.2 and section 3): one gradient per node
# (the nodes estimator), ETA 0.8, batches from 1, merges every 3 outer steps. The inner AdamW's betas and clipping
# are not stated in the paper (the authors' code uses torch's defaults); they stay the regime's.
PAPER = ("variance_estimator=nodes", "ETA=0.8", "initial_batch_size=1", "merge_frequency=3")
# DiLoCo's standard outer optimizer (Douillard et al. 2023): Nesterov SGD, lr 0.7, momentum 0.9
NESTEROV = ("lr_outer=0.7", "outer_momentum=0.9", "outer_nesterov=true")
# SNOO's outer step (Kallusky et al. 2025): the same Nesterov SGD on the H-step pseudo-gradient of DDP
SNOO = ("distributed_algo=SNOO", *NESTEROV)


@dataclasses.dataclass(frozen=True)
class Knob:
    """One tuned key of a variant's search space (benchmarks.tune): uniform between low and high, or log-uniform;
    relative: low and high are factors of the value the variant runs with (its own override, else the config's),
    so that one space serves a regime at lr 3e-3 and one at 1e-4. choices: a discrete knob (a batch size, a merge
    interval), one of these whole numbers (low and high unused). decides: the count in a run's summary.json of the
    decisions this knob governs, which a larger value never makes more often (ETA: the batch test's increases): a
    best point at the top of the range whose runs made none of them runs the same at every larger value, so that top
    is a plateau the range holds, not a bound (benchmarks.tune.best_point_ends)."""
    key: str
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    relative: bool = False
    choices: tuple[int, ...] = ()
    decides: str = ""

    def bounds(self, cfg: Config) -> tuple[float, float]:
        if self.choices:
            return min(self.choices), max(self.choices)
        scale = float(getattr(cfg, self.key)) if self.relative else 1.0
        return float(f"{self.low * scale:.4g}"), float(f"{self.high * scale:.4g}")


# The search spaces (the same for every method where the methods share a key): every method tunes its inner
# learning rate over 2.7 decades around the regime's, 0.1x to 50x (the first design's 0.1x-10x put the best
# points of the warm and nano regimes on its top edge; 50x takes the warm regime's 1e-4 to 5e-3); the Nesterov
# outer steps (diloco_nesterov, snoo) their outer lr and momentum; the adaptive AdLoCos their norm test's ETA,
# log-uniform from 0.3 to 10 (above 1 the test tolerates a noise larger than the gradient; towards 10 a batch
# hardly grows, so the top of the range holds the constant-batch end of AdLoCo; ETA is a ratio's tolerance, hence
# log). Nano's best point sat on the top edge three times: 0.99 of 0.4-1.0, 1.44 of 0.3-1.5 (adloco@5f968074d9),
# 2.86 of 0.3-3.0 (adloco@32b8807bf1, with 182.6 at ETA 1.46 and 183.4 at 1.66 within 2% of it), and 8.33 of
# 0.3-10 (adloco@aeac77a97d), each time the same objective to the last digit: no batch grew on either tuning seed
# (nor in any trial of the last study at ETA 1.19 or above), so there the objective no longer depends on ETA and the
# range is not widened again; such a top is a plateau (Knob.decides), not an edge.
LR_INNER = Knob("lr_inner", 0.1, 50.0, log=True, relative=True)
# SNOO's reaches lower: its outer Nesterov step on DDP's pseudo-gradient multiplies the inner step (by about
# lr_outer / (1 - momentum) once momentum builds, 20x at 1.0 and 0.95), so its best inner lr sits below the other
# methods'. Nano's snoo_tuned_batch@3f6a5e12f2 had its best (167.0 after 15 of 28 trials: lr 3.2e-4, 0.106x; outer
# lr 0.80, momentum 0.65) on the bottom edge of 0.1x-50x. 0.035x is the lowest end, in steps of 0.005x, at which 28
# trials still meet 3 values of every other knob near each lr (tests/test_tune.py; at 0.03x the batch has 2 values
# near 0.74x); the top stays, so the range only grows.
SNOO_LR_INNER = Knob("lr_inner", 0.035, 50.0, log=True, relative=True)
OUTER = (Knob("lr_outer", 0.2, 1.0, log=True), Knob("outer_momentum", 0.5, 0.95))
ETA = Knob("ETA", 0.3, 10.0, log=True, decides="batch_increases")  # the norm test asks for less as ETA grows
# AdLoCo's own batch knobs, searched jointly with its lr and ETA (issue 58): how often trainers merge, and the batch
# it starts from (the micro_batches estimator splits a node's step, so it needs 2 or more; the paper's nodes
# estimator starts from 1); nano's best first point sat on the largest of both (6, 8). The paper's choices reach 16
# too: 13 trials into adloco_paper@f812afd8dd its best (178.2) started at 8, the largest of 1-8. Its merge interval
# reaches 24 rounds: adloco_paper@020ccaeedd's best (178.45) merged every 12, the largest of 1-12 (ours, best at 6,
# keeps 1-12 and its finished study adloco@aeac77a97d). With 1-24, adloco_paper@cf738dcf91's best (183.6: lr 7.1e-3,
# ETA 2.39, merge every 6, no batch grew) started at 16, the largest of 1-16: the paper's starting batch reaches 32.
MERGE_EVERY = Knob("merge_frequency", choices=(1, 2, 3, 4, 6, 8, 12))
PAPER_MERGE_EVERY = Knob("merge_frequency", choices=(1, 2, 3, 4, 6, 8, 12, 16, 24))
START_BATCH = Knob("initial_batch_size", choices=(2, 4, 8, 16))
PAPER_START_BATCH = Knob("initial_batch_size", choices=(1, 2, 4, 8, 16, 32))
ADAPTIVE_SPACE = (LR_INNER, ETA, MERGE_EVERY, START_BATCH)
PAPER_SPACE = (LR_INNER, ETA, PAPER_MERGE_EVERY, PAPER_START_BATCH)


def without_merge(space: tuple[Knob, ...]) -> tuple[Knob, ...]:
    """A search space less its merge interval (the no-merge ablations fix it at 0)."""
    return tuple(k for k in space if k.key != "merge_frequency")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    family: str  # one of FAMILIES: plots draw adloco solid, the rest dashed; crossover compares against diloco
    overrides: tuple[str, ...]
    group: str = "core"  # core (in --variants all), paper (the paper's ablations: --variants paper or named),
    # communication (when named), cluster (with --cluster), custom
    constant_batch: int = 0  # the constant-batch sweep (diloco_bB): its batch B
    search: tuple[Knob, ...] = (LR_INNER,)  # what benchmarks.tune tunes, and over what
    # an ablation: the variants it is with one component changed (its method; for switch mode's matched control also
    # always_accumulate, of which it is the accumulation removed): the report compares it with each
    ablates: tuple[str, ...] = ()


# compressed outer sync, sketched statistics and streaming; diloco_* use the middle --diloco_batches batch (8 by
# default)
STREAMING = ["sync_fragments=4", "sync_delay=1", "fragment_alpha=0.5"]
COMMUNICATION = {  # name -> (family, the scheme's overrides)
    "adloco_sketch": ("adloco", ["statistics_comm=sketch"]),
    "adloco_int8": ("adloco", ["outer_compression=int8"]),
    "adloco_int8_sketch": ("adloco", ["outer_compression=int8", "statistics_comm=sketch"]),
    "adloco_fp8": ("adloco", ["outer_compression=fp8"]),
    "adloco_topk": ("adloco", ["outer_compression=topk"]),
    "diloco_int8": ("diloco", ["outer_compression=int8"]),
    "diloco_topk": ("diloco", ["outer_compression=topk"]),
    # Streaming DiLoCo: 4 fragments (one per block of microllama-tiny), each overlapping one inner step, mixed
    # half and half when it lands (Douillard et al. 2025's alpha with overlap)
    "adloco_streaming": ("adloco", STREAMING),
    "adloco_streaming_int8": ("adloco", [*STREAMING, "outer_compression=int8"]),
    "diloco_streaming": ("diloco", STREAMING),
}
COMMUNICATION_VARIANTS = {name: scheme for name, (_, scheme) in COMMUNICATION.items()}
# heterogeneous clusters (issue 23): the field's speed-aware baseline, DyLU (Async Local-SGD), and AdLoCo with it
CLUSTER = {"diloco_by_speed": ("diloco", ["inner_steps_by_speed=true"]),
           "adloco_by_speed": ("adloco", ["inner_steps_by_speed=true"])}
CLUSTER_VARIANTS = {name: scheme for name, (_, scheme) in CLUSTER.items()}


def catalogue(base: Config, diloco_batches: list[int], localsgd_lr: float) -> dict[str, Variant]:
    """Every variant the harness knows, in report order."""
    single = ["num_init_trainers=1", "merge_frequency=0"]
    real_batch = "switch_mode=only_gradient_accumulation"  # a constant batch B really runs B sequences per step
    chosen = [Variant("adloco", "adloco", (), search=ADAPTIVE_SPACE),
              Variant("adloco_paper", "adloco", PAPER, search=PAPER_SPACE),
              Variant("adloco_no_adaptive", "adloco", ("sampling_method=constant",), ablates=("adloco",)),
              Variant("adloco_no_merge", "adloco", ("merge_frequency=0",), search=without_merge(ADAPTIVE_SPACE),
                      ablates=("adloco",)),
              # switch mode's ablations, one name per meaning (issue 58): never accumulate (a request above max_batch
              # runs max_batch in one pass) and always accumulate (every request above max_batch accumulates to it)
              Variant("adloco_never_accumulate", "adloco", ("switch_mode=only_data_loader",), search=ADAPTIVE_SPACE,
                      ablates=("adloco",)),
              Variant("adloco_always_accumulate", "adloco", ("switch_mode=only_gradient_accumulation",), "switch",
                      search=ADAPTIVE_SPACE, ablates=("adloco",))]
    # the paper's three ablations (section 6.3) of the paper's own variant. Switch mode off is what section 4.2
    # says it replaces, "gradient accumulation once the requested batch size exceeds max_batch", which is also what
    # the authors' code runs while more than one trainer is alive (OnlyGradientAccumulationStrategy)
    chosen += [Variant("adloco_paper_no_adaptive", "adloco", (*PAPER, "sampling_method=constant"), "paper",
                       ablates=("adloco_paper",)),
               Variant("adloco_paper_no_merge", "adloco", (*PAPER, "merge_frequency=0"), "paper",
                       search=without_merge(PAPER_SPACE), ablates=("adloco_paper",)),
               Variant("adloco_paper_always_accumulate", "adloco", (*PAPER, "switch_mode=only_gradient_accumulation"),
                       "paper", search=PAPER_SPACE, ablates=("adloco_paper",)),
               Variant("adloco_paper_never_accumulate", "adloco", (*PAPER, "switch_mode=only_data_loader"), "paper",
                       search=PAPER_SPACE, ablates=("adloco_paper",))]
    # switch mode's matched control (issue 58): always_accumulate's effective batch (every request in full) in one
    # pass, on a simulated device large enough that nothing accumulates. Against always_accumulate it isolates what
    # accumulation costs (time only: the same sequences per step); against switch mode, what the larger batch does
    # (switch mode's own effective batch matched by a control is switch mode itself: it runs max_batch in one pass)
    one_pass = (f"max_batch_size={base.max_requested_batch}", "device_memory_mb=65536")
    chosen += [Variant("adloco_one_pass", "adloco", one_pass, "switch", search=ADAPTIVE_SPACE,
                       ablates=("adloco", "adloco_always_accumulate")),
               Variant("adloco_paper_one_pass", "adloco", (*PAPER, *one_pass), "switch", search=PAPER_SPACE,
                       ablates=("adloco_paper", "adloco_paper_always_accumulate"))]
    diloco_at = {}
    for b in diloco_batches:
        diloco_at[b] = [*single, "sampling_method=constant", f"initial_batch_size={b}",
                        f"max_requested_batch={max(b, base.max_requested_batch)}", real_batch]
        chosen.append(Variant(f"diloco_b{b}", "diloco", tuple(diloco_at[b]), constant_batch=b))
    # DiLoCo with its own paper's outer optimizer (Nesterov 0.7 / 0.9) beside the AdLoCo paper's plain SGD at 0.5,
    # at every batch of the sweep: run when named or with --variants nesterov
    for b in diloco_batches:
        chosen.append(Variant(f"diloco_nesterov_b{b}", "diloco", (*diloco_at[b], *NESTEROV), "nesterov",
                              constant_batch=b, search=(LR_INNER, *OUTER)))
    chosen.append(Variant("diloco_rampup", "diloco", (*single, "sampling_method=linear_rampup", "rampup_tokens=0",
                                                      real_batch)))
    chosen.append(Variant("localsgd", "localsgd", (*single, "sampling_method=constant", "distributed_algo=LocalSGD",
                                                   f"lr_inner={localsgd_lr}")))
    reference_batch = diloco_batches[len(diloco_batches) // 2] if diloco_batches else base.initial_batch_size
    diloco = diloco_at.get(reference_batch) or [*single, "sampling_method=constant", real_batch]
    # the field's references on the same nodes, at the middle DiLoCo batch (the same tokens per step): DDP
    # (gradients averaged every inner step, one AdamW, no outer step) and SNOO (DDP + an outer Nesterov step)
    chosen.append(Variant("ddp", "synchronous", (*diloco, "distributed_algo=DDP")))
    chosen.append(Variant("snoo", "synchronous", (*diloco, *SNOO), search=(SNOO_LR_INNER, *OUTER)))
    # the constant-batch methods with their batch tuned inside the same trial budget (issue 58): a discrete knob over
    # the sweep's batches, searched jointly with the method's own knobs; the primary baseline, not a per-batch pick
    if diloco_batches:
        sweep = Knob("initial_batch_size", choices=tuple(sorted(set(diloco_batches))))
        any_batch = [*single, "sampling_method=constant",
                     f"max_requested_batch={max(max(diloco_batches), base.max_requested_batch)}", real_batch]
        chosen += [Variant("diloco_tuned_batch", "diloco", tuple(any_batch), "tuned_batch", search=(LR_INNER, sweep)),
                   Variant("diloco_nesterov_tuned_batch", "diloco", (*any_batch, *NESTEROV), "tuned_batch",
                           search=(LR_INNER, *OUTER, sweep)),
                   Variant("ddp_tuned_batch", "synchronous", (*any_batch, "distributed_algo=DDP"), "tuned_batch",
                           search=(LR_INNER, sweep)),
                   Variant("snoo_tuned_batch", "synchronous", (*any_batch, *SNOO), "tuned_batch",
                           search=(SNOO_LR_INNER, *OUTER, sweep))]
    # communication (issue 22), run when named or with --variants communication: error feedback on throughout
    for group, table in (("communication", COMMUNICATION), ("cluster", CLUSTER)):
        for name, (family, scheme) in table.items():
            chosen.append(Variant(name, family, (*(diloco if family == "diloco" else []), *scheme), group))
    return {v.name: v for v in chosen}


# switch mode's ablations before issue 58: "no_switch" meant never accumulating for ours and always accumulating for
# the paper's variant
RENAMED = {"adloco_no_switch": "adloco_never_accumulate (switch_mode only_data_loader)",
           "adloco_paper_no_switch": "adloco_paper_always_accumulate (switch_mode only_gradient_accumulation)"}


# what the harness sets on every run itself (runner.run_variant): a variant cannot choose them
HARNESS_KEYS = ("training_seed", "log_dir", "run_name", "clearml_mode", "max_tokens", "num_outer_steps",
                "save_weights_every")


OVERRIDE_START = re.compile(r"[A-Za-z_][\w.]*=")


def split_overrides(text: str) -> list[str]:
    """An --add_variant's KEY=VALUE list: split at whitespace, shell-like (quotes group), but a word that does not
    start a KEY= belongs to the value before it, so values with spaces need no quotes of their own
    (node_schedule=[{node: 1, leave: 2}] is one override)."""
    words: list[str] = []
    for word in shlex.split(text):
        if words and not OVERRIDE_START.match(word):
            words[-1] += f" {word}"
        else:
            words.append(word)
    return words


def custom(specs: tuple[str, ...], known: dict[str, Variant]) -> dict[str, Variant]:
    """--add_variant NAME=[BASE:]KEY=VALUE ...: a variant from the command line, the overrides of an existing variant
    BASE (its family too) first, then its own (whitespace-separated); without BASE, AdLoCo's family."""
    added: dict[str, Variant] = {}
    for spec in specs:
        name, _, rest = spec.partition("=")
        base, _, own = rest.partition(":") if ":" in rest.split("=", 1)[0] else ("", "", rest)
        try:
            own_overrides = split_overrides(own)
        except ValueError as exc:
            raise SystemExit(f"error: --add_variant {spec!r}: {exc}") from None
        owned = [o.split("=", 1)[0] for o in own_overrides if o.split("=", 1)[0] in HARNESS_KEYS]
        if owned:
            raise SystemExit(f"error: --add_variant {name}: {owned[0]} is set by the harness for every run (the token "
                             "budget, --max_outer_steps, the seeds, where runs go); change it with the harness's own "
                             "options")
        if not name.isidentifier() or not own_overrides:
            raise SystemExit(f"error: --add_variant {spec!r}: expected NAME=[BASE:]KEY=VALUE ..., e.g. "
                             "'paper_eta07=adloco_paper:ETA=0.7'")
        if name in known or name in added:
            raise SystemExit(f"error: --add_variant: {name} is already a variant")
        pool = {**known, **added}  # an earlier --add_variant can be a base too
        if base and base not in pool:
            raise SystemExit(f"error: --add_variant {name}: unknown base {base}; choose from {', '.join(pool)}")
        parent = pool[base] if base else Variant(name, "adloco", ())
        # its base's batch too: a tuned diloco_b4 is batch 4 of its own sweep (batches.series_of)
        added[name] = Variant(name, parent.family, (*parent.overrides, *own_overrides), "custom",
                              constant_batch=parent.constant_batch, search=parent.search)
    return added


def variants(base: Config, diloco_batches: list[int], localsgd_lr: float) -> dict[str, list[str]]:
    """Each variant's run.py overrides, by name."""
    return {name: list(v.overrides) for name, v in catalogue(base, diloco_batches, localsgd_lr).items()}


def select(catalogue: dict[str, Variant], wanted: str, diloco_batches: str, cluster: bool) -> dict[str, Variant]:
    """--variants: names and groups, comma-separated: all (the core comparison, with the cluster variants under
    --cluster), paper (adloco_paper, its three ablations and the diloco_bB sweep), communication (adloco, the middle
    diloco_bB and the communication variants), nesterov (diloco_nesterov_bB at every batch of the sweep), tuned_batch
    (DiLoCo, Nesterov DiLoCo, DDP and SNOO with their batch a tuned knob over the sweep's batches), switch (switch
    mode's four ablations: ours and the paper's, never and always accumulating)."""
    batches = diloco_batches.split(",")
    groups = {
        "all": lambda k, v: v.group == "core" or (cluster and v.group == "cluster"),
        # the paper's variant, its ablations and the constant-batch sweep (its starting batch's DiLoCo included)
        "paper": lambda k, v: k == "adloco_paper" or v.group == "paper"
        or (v.group == "core" and bool(v.constant_batch)),
        "communication": lambda k, v: k in ("adloco", f"diloco_b{batches[len(batches) // 2]}")
        or v.group == "communication",
        "nesterov": lambda k, v: v.group == "nesterov",
        "tuned_batch": lambda k, v: v.group == "tuned_batch",
        "switch": lambda k, v: k.endswith(("_always_accumulate", "_never_accumulate", "_one_pass"))}
    names = [n for n in wanted.split(",") if n]  # none: only --add_variant's (benchmarks.tune's tuned finalists)
    renamed = [n for n in names if n in RENAMED]
    if renamed:
        raise SystemExit(f"error: --variants: {renamed[0]} had two meanings across the paper's variant and ours and "
                         f"was renamed: {RENAMED[renamed[0]]} (committed reports keep the old name)")
    unknown = set(names) - set(catalogue) - set(groups)
    if unknown:
        raise SystemExit(f"error: --variants: unknown {', '.join(sorted(unknown))}; choose from "
                         f"{', '.join([*groups, *catalogue])}")
    return {k: v for k, v in catalogue.items() if k in names or any(groups[g](k, v) for g in names if g in groups)}
