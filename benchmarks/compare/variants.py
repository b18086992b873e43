"""The harness's variants as data: each a name, a family (what it is a variant of) and its run.py overrides."""

from __future__ import annotations

import dataclasses

from utils.config import Config

FAMILIES = ("adloco", "diloco", "localsgd")  # AdLoCo and its ablations; the DiLoCo baselines; LocalSGD


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    family: str  # one of FAMILIES: plots draw adloco solid, the rest dashed; crossover compares against diloco
    overrides: tuple[str, ...]
    group: str = "core"  # core (in --variants all), communication (when named), cluster (with --cluster)


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
    chosen = [Variant("adloco", "adloco", ()),
              Variant("adloco_no_adaptive", "adloco", ("sampling_method=constant",)),
              Variant("adloco_no_merge", "adloco", ("merge_frequency=0",)),
              Variant("adloco_no_switch", "adloco", ("switch_mode=only_data_loader",))]
    diloco_at = {}
    for b in diloco_batches:
        diloco_at[b] = [*single, "sampling_method=constant", f"initial_batch_size={b}",
                        f"max_requested_batch={max(b, base.max_requested_batch)}", real_batch]
        chosen.append(Variant(f"diloco_b{b}", "diloco", tuple(diloco_at[b])))
    chosen.append(Variant("diloco_rampup", "diloco", (*single, "sampling_method=linear_rampup", "rampup_tokens=0",
                                                      real_batch)))
    chosen.append(Variant("localsgd", "localsgd", (*single, "sampling_method=constant", "distributed_algo=LocalSGD",
                                                   f"lr_inner={localsgd_lr}")))
    # communication (issue 22), run when named or with --variants communication: error feedback on throughout
    reference_batch = diloco_batches[len(diloco_batches) // 2] if diloco_batches else base.initial_batch_size
    diloco = diloco_at.get(reference_batch) or [*single, "sampling_method=constant", real_batch]
    for group, table in (("communication", COMMUNICATION), ("cluster", CLUSTER)):
        for name, (family, scheme) in table.items():
            chosen.append(Variant(name, family, (*(diloco if family == "diloco" else []), *scheme), group))
    return {v.name: v for v in chosen}


def variants(base: Config, diloco_batches: list[int], localsgd_lr: float) -> dict[str, list[str]]:
    """Each variant's run.py overrides, by name."""
    return {name: list(v.overrides) for name, v in catalogue(base, diloco_batches, localsgd_lr).items()}


def select(catalogue: dict[str, Variant], wanted: str, diloco_batches: str, cluster: bool) -> dict[str, Variant]:
    """--variants: all (the core comparison, with the cluster variants under --cluster), communication (adloco,
    the middle diloco_bB and the communication variants), or names."""
    if wanted == "all":
        return {k: v for k, v in catalogue.items() if v.group == "core" or (cluster and v.group == "cluster")}
    if wanted == "communication":
        batches = diloco_batches.split(",")
        middle = f"diloco_b{batches[len(batches) // 2]}"
        return {k: v for k, v in catalogue.items() if k in ("adloco", middle) or v.group == "communication"}
    names = wanted.split(",")
    unknown = set(names) - set(catalogue)
    if unknown:
        raise SystemExit(f"error: --variants: unknown {', '.join(sorted(unknown))}; choose from {', '.join(catalogue)}")
    return {k: v for k, v in catalogue.items() if k in names}
