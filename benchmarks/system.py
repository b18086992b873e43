"""System benchmarks: does the engine waste anything?

    python -m benchmarks.system [--device cpu|cuda] [--variants fp32,bf16,bf16+compile] [--preset microllama-tiny]
                                [--batch 8] [--steps 20] [--inner-steps 20] [--repeats 3] [--markdown FILE]

(a) inner-step throughput of one node inside the engine (node.py: Node.run) against a plain PyTorch
    loop of the same model, optimizer, clipping, batches, steps, precision and compile setting, in the
    same process: a ratio, per variant (precision, +compile);
(b) a real ClusterController's rounds (first variant) split: node rounds (their gradient statistics
    apart), outer steps, evaluation, merges, the rest (assignment, logging); end-to-end tokens/s of the
    rounds against the bare node loop of (a);
(c) memory: RSS growth while building nodes and trainers and running the rounds, against the run's own memory plan
    (cluster/memory_plan.py: what each device and the host should hold at the nodes' micro-batch; CPU);
(d) achieved training FLOP/s of (a) against the device's matmul peak measured in the variant's dtype
    (and, on a known GPU, its datasheet peak): the model FLOP utilisation.
Each prints a table; --markdown FILE appends them (with date and machine) to FILE.

    python -m benchmarks.system --curve FILE [--device cuda] [--preset microllama-mini] [--variants bf16]
                                [--curve-max-batch N] [--seq-len 256]

measures instead the throughput curve the simulated clock reads (config `throughput: FILE`;
docs/clock.md): tokens/s of one node for micro-batches 1, 2, 4, ... up to the largest that fits (the
memory probe, or --curve-max-batch), each with accumulation 1, 2 and 4, in the first variant's precision.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil
import torch

from benchmarks.tables import cell
from cluster.placement import master_device_of
from fabrics.corpus import load_corpus
from fabrics.models import build_model, count_parameters
from fabrics.precision import PRECISIONS, build_precision
from node import Node, NodeJob
from trainers import TRAINERS
from utils.config import load_config
from utils.model_state import float_state

ROOT = Path(__file__).resolve().parents[1]

MiB = 2**20


def table(title: str, header: list[str], rows: list[list]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def alternated_medians(ways: dict, repeats: int, device: str) -> dict[str, float]:
    """Each way's median seconds over `repeats`, the ways alternated so that drifts of the machine hit every way
    alike (warm-ups are the caller's)."""
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(repeats):
        for k, run in ways.items():
            sync(device)
            t = time.perf_counter()
            run()
            sync(device)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def textbook_loop(model, forward, data, indices, cfg, device: str, precision, scaler) -> None:
    """The textbook (mixed-precision) PyTorch loop over the same batches: each batch gathered and copied in the
    step, its attention mask passed, the optimizer made in the call. Kept beside the strong loop, so that what each
    change gave shows."""
    opt = TRAINERS[cfg.distributed_algo].inner_optimizer_factory(cfg)(list(model.parameters()))
    model.train()
    for step in indices:
        for micro in step:
            ids, mask = data.input_ids[micro].to(device), data.attention_mask[micro].to(device)
            with precision.autocast(device):
                loss = forward(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
            loss = loss / len(step)
            (scaler.scale(loss) if scaler else loss).backward()
        optimizer_step(opt, model, scaler, cfg.grad_clip)


def optimizer_step(opt, model, scaler, grad_clip: float) -> None:
    """Both loops' step: unscale (fp16), clip, step, zero the gradients."""
    if scaler:
        scaler.unscale_(opt)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)


def staged_batches(data, indices: torch.Tensor, device: str) -> tuple[torch.Tensor, bool]:
    """The strong loop's batches, gathered once before it runs: [steps, accumulation, batch, seq_len] token ids in
    pinned host memory (CUDA: each step's copy is asynchronous), and whether any of them is padded (then the
    attention mask goes too)."""
    ids = data.input_ids[indices]
    if device.startswith("cuda"):
        ids = ids.pin_memory()
    return ids, data.needs_mask(indices)


def plain_loop(model, forward, data, indices, cfg, device: str, precision, scaler, staged=None) -> list[float]:
    """The baseline: the best loop a practitioner writes for this model and data (nanoGPT's and nanochat's habits).
    Batches staged in pinned memory before the loop and copied asynchronously; packed sequences with nothing
    padded go without an attention mask (transformers builds the causal mask; its own mask checks read the device);
    fused AdamW on CUDA (the inner optimizer factory's); clipping's foreach kernels; the losses kept on the device
    and read once, at the end. Returns the losses."""
    ids_all, masked = staged if staged is not None else staged_batches(data, indices, device)
    opt = TRAINERS[cfg.distributed_algo].inner_optimizer_factory(cfg)(list(model.parameters()))
    model.train()
    losses = []
    for s, step in enumerate(indices):
        total = None
        for m, micro in enumerate(step):
            ids = ids_all[s, m].to(device, non_blocking=True)
            if masked:
                mask = data.attention_mask[micro].to(device, non_blocking=True)
                labels = ids.masked_fill(mask == 0, -100)
            else:
                mask, labels = None, ids
            with precision.autocast(device):
                loss = forward(input_ids=ids, attention_mask=mask, labels=labels).loss / len(step)
            (scaler.scale(loss) if scaler else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        losses.append(total)
        optimizer_step(opt, model, scaler, cfg.grad_clip)
    return torch.stack(losses).float().cpu().tolist()  # the one read of the device


def parse_variant(variant: str) -> tuple[str, bool]:
    """'bf16+compile' -> ('bf16', True)."""
    name, _, extra = variant.partition("+")
    if name not in PRECISIONS or extra not in ("", "compile"):
        sys.exit(f"error: --variants: '{variant}' is not one of {', '.join(PRECISIONS)}, optionally +compile")
    return name, extra == "compile"


def bench_inner(cfg, model, data, batch: int, steps: int, repeats: int, device: str, variant: str) -> dict:
    """(a): the engine's node (Node.run) against the strong plain loop, and the textbook loop beside them (eager
    variants only), on the same batches, precision and compile setting; each after a warm-up, alternated, median of
    `repeats`."""
    name, compiled = parse_variant(variant)
    precision = build_precision(name)
    gen = torch.Generator().manual_seed(0)
    indices = torch.randint(0, len(data.train), (steps, 1, batch), generator=gen)
    # the round's start weights where the run keeps its trainers' masters (master_device: auto puts them on the
    # nodes' GPU): a master in host memory would add a pageable copy of every weight to each round (on the H200 of
    # 2026-11-28, 0.15 s per round of a 247M model), which the run does not pay
    master = master_device_of(cfg, [device])
    start_state = {k: v.detach().to(master, copy=True) for k, v in float_state(model).items()}
    make_optimizer = TRAINERS[cfg.distributed_algo].inner_optimizer_factory(cfg)
    node = Node(0, device, copy.deepcopy(model).to(device), make_optimizer, cfg.grad_clip, data.train, precision,
                compiled)
    baseline = copy.deepcopy(model).to(device)
    forward = torch.compile(baseline) if compiled else baseline
    job = NodeJob(0, 0, start_state, indices, 0, reset_optimizer=True)
    staged = staged_batches(data.train, indices, device)  # the plain loop's batches, staged once as it would
    loops = {
        "engine": lambda: node.run(job),  # ends with one host sync (the losses)
        "plain": lambda: plain_loop(baseline, forward, data.train, indices, cfg, device, precision,
                                    precision.scaler(device), staged),
    }
    if not compiled:  # the textbook loop runs eager only: a third compile (half a minute on a GPU) for a reference row
        textbook = copy.deepcopy(model).to(device)
        loops["textbook"] = lambda: textbook_loop(textbook, textbook, data.train, indices, cfg, device, precision,
                                                  precision.scaler(device))
    for run in loops.values():  # warm-up (and compilation) outside the timings
        run()
    times = alternated_medians(loops, repeats, device)
    tokens = int(data.train.tokens_per_sequence[indices.reshape(-1)].sum())
    e, p, tb = times["engine"], times["plain"], times.get("textbook")
    # one line per variant as soon as it is measured: a run cut short (a GPU lease's end) keeps what it measured
    print(f"(a) {variant}: engine {e:.4f} s, plain {p:.4f} s, textbook {cell(tb, 4)} s; engine speed / plain "
          f"{p / e:.3f}, engine {tokens / e:.0f} tokens/s", flush=True)
    return {"engine_s": e, "plain_s": p, "textbook_s": tb, "ratio": e / p, "tokens": tokens}


def matmul_peak(device: str, dtype: torch.dtype, n: int = 1024, repeats: int = 10) -> float:
    if device.startswith("cuda"):
        n, repeats = 8192, 50
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - t)


# dense datasheet peaks (FLOP/s) of GPUs we have measured on: bf16/fp16, tf32, fp32
DATASHEET = {"H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
             "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12}}


def datasheet_peak(device: str, precision: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peaks[precision] for gpu, peaks in DATASHEET.items() if gpu in name), None)


def training_flops(model, tokens: int, seq_len: int) -> float:
    """6 N per token for the weights (forward + backward) + 12 L d T per token for attention (PaLM, App. B)."""
    c = model.config
    n = count_parameters(model) - model.get_input_embeddings().weight.numel()  # lookups are not matmuls
    return tokens * (6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq_len)


def bench_round(cfg_path: str, overrides: list[str]) -> tuple[dict, dict]:
    """One real cluster: the pieces of its rounds timed (each step's record: RoundRecord.seconds, MergeRecord.seconds)
    and its memory against the run's own memory plan (cluster/memory_plan.py)."""
    from cluster import ClusterController
    from training_logs.memory_monitor import MemoryMonitor
    from training_logs.trackers import TrackerGroup
    from training_logs.training_monitoring import TrainingLogger

    cfg = load_config(cfg_path, overrides)
    data = load_corpus(cfg)
    model = build_model(cfg, len(data.tokenizer), data.tokenizer.pad_token_id)
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    with tempfile.TemporaryDirectory() as tmp:
        logger = TrainingLogger(Path(tmp) / "r", TrackerGroup([]), MemoryMonitor(Path(tmp) / "m", cfg.device_names))
        cluster = ClusterController.build(cfg, model, data, logger, Path(tmp) / "w")
        times = {"round": 0.0, "statistics": 0.0, "outer": 0.0, "merge": 0.0, "eval": 0.0, "total": 0.0}
        for step in range(1, cfg.num_outer_steps + 1):
            start = time.perf_counter()
            record, _ = cluster.run_outer_step(step)  # the step with its merge
            times["total"] += time.perf_counter() - start
            merged = record.merge  # the merged model's evaluation counts under evaluation
            for part in (record.seconds, merged.seconds if merged is not None else {}):
                for key, seconds in part.items():
                    times[key] += seconds
        times["tokens"] = cluster.tokens_total
        peak = max(r["process_rss_mib"] for r in logger.memory.rows) * MiB if logger.memory.rows else 0
        rss1 = max(proc.memory_info().rss, peak)
        plan = cluster.memory_plan
        cluster.backend.close()
        logger.close()
    parts: dict[str, int] = {}  # the plan's parts, every device's together (on the CPU all of them are this process)
    for device in plan.devices:
        for key, nbytes in (*device.resident.items(), *device.transient.items()):
            parts[key] = parts.get(key, 0) + nbytes
    for key, nbytes in plan.host.items():
        parts[f"host: {key}"] = nbytes
    parts = {k: v for k, v in parts.items() if v}
    return times, {"measured": rss1 - rss0, "expected": sum(parts.values()), "parts": parts,
                   "params": count_parameters(model), "nodes": cfg.total_nodes}


def write_curve(args, cfg, model, device: str, variant: str) -> int:
    """--curve: the throughput curve of `model` on `device`, written where the clock reads it."""
    from cluster.max_batch_calculator import NodeShare, find_max_batch_size
    from cluster.throughput import device_kind, measure_curve
    from trainers import TRAINERS

    name, _ = parse_variant(variant)
    precision = build_precision(name)
    make_optimizer = TRAINERS[cfg.distributed_algo].inner_optimizer_factory(cfg)
    # device_memory_mb sizes a simulated CPU device; a GPU's curve runs up to what its free memory holds
    share = NodeShare(cfg.padding_percentage, 1, memory_mb=0.0 if device.startswith("cuda") else cfg.device_memory_mb)
    largest = args.curve_max_batch or find_max_batch_size(model, make_optimizer, device, cfg.seq_len, share,
                                                          upper=cfg.max_requested_batch)
    curve = measure_curve(model, make_optimizer, device, cfg.seq_len, largest, repeats=args.repeats,
                          autocast=lambda: precision.autocast(device))
    about = {"device": device_kind(device), "model": args.preset, "seq_len": cfg.seq_len, "precision": name,
             "torch": torch.__version__, "measured": f"{datetime.now():%Y-%m-%d %H:%M}",
             "source": f"benchmarks.system --curve on {device_kind(device)}"}
    Path(args.curve).parent.mkdir(parents=True, exist_ok=True)
    Path(args.curve).write_text(json.dumps(curve.to_dict(**about), indent=1))
    print(table(f"Throughput curve: {args.preset} on {about['device']}, seq_len {cfg.seq_len}, {name} -> {args.curve}",
                ["micro_batch", "accumulation", "tokens/s", "vs micro-batch 1"],
                [[b, a, v, v / curve.tokens_per_s(1, a)] for b, a, v in curve.points]))
    return 0


def flops_table(inner: dict, model, seq_len: int, device: str, numbers: dict) -> str:
    """(d): each variant's achieved training FLOP/s against the matmul peak (numbers["inner"] gains them)."""
    rows = []
    for v, r in inner.items():
        name, _ = parse_variant(v)
        dtype = PRECISIONS[name].autocast_dtype or torch.float32
        build_precision(name)  # the variant's matmul mode: tf32 switches TensorFloat-32 on, the others off
        peak = matmul_peak(device, dtype)
        achieved = training_flops(model, r["tokens"], seq_len) / r["engine_s"]
        sheet = datasheet_peak(device, name)
        rows.append([v, str(dtype).replace("torch.", ""), peak / 1e9, achieved / 1e9, achieved / peak,
                     f"{achieved / sheet:.3f}" if sheet else "-"])
        numbers["inner"][v].update(achieved_flops=achieved, measured_peak_flops=peak,
                                   mfu_datasheet=achieved / sheet if sheet else None)
    return table("(d) Achieved training FLOP/s of (a) vs the matmul peak measured in the variant's dtype "
                     "(and the datasheet's dense peak, where known)",
                     ["variant", "matmul dtype", "matmul peak GFLOP/s", "engine GFLOP/s", "fraction of measured peak",
                      "MFU (datasheet)"], rows)


def inner_record(r: dict) -> dict:
    """One variant of (a) in --json: the times, the engine's tokens/s, and its speed over the plain loop's (above 1:
    faster; a time ratio read as a speed ratio once reported an engine at 0.74x the plain loop as meeting 0.9x)."""
    return {"engine_s": r["engine_s"], "plain_s": r["plain_s"], "textbook_s": r["textbook_s"],
            "engine_speed_over_plain": r["plain_s"] / r["engine_s"],
            "strong_over_textbook": r["textbook_s"] / r["plain_s"] if r["textbook_s"] else None,
            "tokens_per_s": r["tokens"] / r["engine_s"]}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "config.yaml"))
    ap.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    ap.add_argument("--variants", help="comma-separated precision[+compile] (default: cpu fp32,bf16; "
                                       "cuda fp32,tf32,bf16,bf16+compile)")
    ap.add_argument("--preset", default="microllama-tiny")
    ap.add_argument("--seq-len", type=int, help="default: the config's")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="inner steps of (a)")
    ap.add_argument("--inner-steps", type=int, default=20, help="H of the cluster rounds of (b)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", help="append the tables to this file")
    ap.add_argument("--json", help="write the numbers to this file (as benchmarks.gpu_check reads them)")
    ap.add_argument("--curve", help="measure the throughput curve only and write it to this file")
    ap.add_argument("--curve-max-batch", type=int, default=0,
                    help="--curve: the largest micro-batch (default: the memory probe's, one node per device)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device cuda: no CUDA device here")
    default_variants = "fp32,tf32,bf16,bf16+compile" if device.startswith("cuda") else "fp32,bf16"
    variants = (args.variants or default_variants).split(",")
    for variant in variants:
        parse_variant(variant)
    torch.manual_seed(0)
    base = ["clearml_mode=off", f"model_config.name={args.preset}", f"devices=[{device}]", "nodes_per_gpu=2",
            "num_init_trainers=2"]
    if args.seq_len:
        base.append(f"seq_len={args.seq_len}")
    cfg = load_config(args.config, base)
    data = load_corpus(cfg)
    model = build_model(cfg, len(data.tokenizer), data.tokenizer.pad_token_id)
    if args.curve:
        return write_curve(args, cfg, model, device, variants[0])
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else \
        f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} CPUs, {torch.get_num_threads()} threads"
    out = [f"## System benchmarks ({datetime.now():%Y-%m-%d %H:%M}, {where}, "
           f"{psutil.virtual_memory().total / 2**30:.0f} GiB, torch {torch.__version__}; model {args.preset}, "
           f"{count_parameters(model) / 1e6:.2f}M parameters, seq_len {cfg.seq_len})", ""]
    inner = {v: bench_inner(cfg, model, data, args.batch, args.steps, args.repeats, device, v) for v in variants}
    out.append(table("(a) Inner loop: engine node vs the strong plain PyTorch loop (staged pinned batches, no mask "
                     "on packed sequences, fused AdamW on CUDA, the losses read once), and the textbook loop beside "
                     "them (eager variants); same precision and compile (median of repeats, after a warm-up)",
                     ["variant", "batch x steps", "engine s", "plain s", "textbook s", "engine speed / plain",
                      "plain speed / textbook", "tokens/s engine"],
                     [[v, f"{args.batch} x {args.steps}", r["engine_s"], r["plain_s"], cell(r["textbook_s"]),
                       r["plain_s"] / r["engine_s"], cell(r["textbook_s"] and r["textbook_s"] / r["plain_s"]),
                       r["tokens"] / r["engine_s"]]
                      for v, r in inner.items()]))
    first = variants[0]
    precision, compiled = parse_variant(first)
    times, memory = bench_round(args.config, [*base, "num_outer_steps=3", "merge_frequency=1",
                                              f"num_inner_steps={args.inner_steps}", f"max_batch_size={args.batch}",
                                              f"initial_batch_size={args.batch}", "sampling_method=constant",
                                              f"max_requested_batch={max(args.batch, 1)}",
                                              f"precision={precision}", f"compile={str(compiled).lower()}"])
    e2e = times["tokens"] / times["total"]
    loop = inner[first]["tokens"] / inner[first]["engine_s"]
    numbers = {"device": where, "preset": args.preset, "seq_len": cfg.seq_len, "batch": args.batch,
               "parameters": count_parameters(model),
               "inner": {v: inner_record(r) for v, r in inner.items()},
               "end_to_end": {"variant": first, "tokens_per_s": e2e, "over_node_loop": e2e / loop}}
    rest = times["total"] - times["round"] - times["outer"] - times["merge"] - times["eval"]
    out.append(table(f"(b) Cluster rounds ({first}, 2 nodes, H = {args.inner_steps}, 3 outer steps, a merge after "
                     "each): where the time goes, and end-to-end tokens/s against the bare node loop",
                     ["node steps s", "gradient statistics s", "outer steps s", "evaluation s", "merges s",
                      "rest s", "end-to-end tokens/s", "/ node loop tokens/s"],
                     [[times["round"] - times["statistics"], times["statistics"], times["outer"], times["eval"],
                       times["merge"], rest, e2e, e2e / loop]]))
    if not device.startswith("cuda"):
        rows = [[k, v / MiB] for k, v in memory["parts"].items()]
        rows += [["expected total", memory["expected"] / MiB],
                 ["measured RSS growth (peak)", memory["measured"] / MiB],
                 ["measured / expected", memory["measured"] / memory["expected"]]]
        out.append(table(f"(c) Memory of a cluster of {memory['nodes']} nodes ({memory['params'] / 1e6:.2f}M "
                         "parameters) against its memory plan", ["part (cluster/memory_plan.py)", "MiB"], rows))
    out.append(flops_table(inner, model, cfg.seq_len, device, numbers))
    text = "\n".join(out)
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(numbers, indent=2))
    return 0


if __name__ == "__main__":
    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
