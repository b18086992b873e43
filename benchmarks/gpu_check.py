"""One command that exercises every CUDA path on a GPU and records what it saw.

    python -m benchmarks.gpu_check [--minutes 8] [--out DIR] [--only STEP,...]

On the first CUDA device, within --minutes, each step runs as its own process (a crash in one is
recorded and the next still runs), timed, its result written to DIR/gpu_check.json and a short
DIR/gpu_check.md after every step (and printed at the end):

  facts        GPU name and memory, driver, torch and CUDA versions, which packages are missing
  cuda_tests   pytest -m cuda: the tests of the CUDA paths (tests/test_cuda.py)
  run_fp32     run.py end to end on cuda (merges, batch growth, accumulation), fp32
  run_bf16     the same in bf16 autocast, against fp32
  run_threads  the same with node_execution: threads, 4 nodes on one GPU, against the sequential run
  torchrun     torchrun --standalone --nproc-per-node 2 on one GPU with NCCL (gloo with CUDA nodes if NCCL
               refuses two processes on one device), against the simulated cluster on the same GPU
  torchrun_comm  the same with outer_compression int8, statistics_comm sketch and Streaming DiLoCo (2
               fragments, sync_delay 1: asynchronous collectives in flight during inner steps)
  memory       two short rounds of each paper reading (microllama-300m from its preset, 5 inner steps at micro-batch
               8, the probe skipped, so the plan and the round share their micro-batch): the measured peak
               (torch.cuda.max_memory_allocated, memory_log.csv) against the memory plan in summary.json, and the
               4-node reading with offload_idle_nodes against resident nodes, projected to the paper's H = 200 (a
               reading the plan refuses for this host's memory is recorded as refused)
  system       benchmarks.system --device cuda, microllama-300m at 32 x 512 tokens a step, fp32 / bf16 /
               bf16+compile: tokens/s, MFU, engine vs the strong plain loop, run.py rounds vs the node loop
  stacked      benchmarks.stacked: 16 microllama-tiny nodes at micro-batch 1, and the paper's 4 microllama-300m
               nodes at its starting batch 1 (bf16, seq_len 512), stacked against sequential: tokens/s, peak memory
  paper        the paper config (the 4-node reading, fp16, synced evaluations every 10 steps), 2 outer steps
  (the targets' steps run first, within 470 s of budgets set from the step times of the H200 of 2026-11-28;
  paper, run_*, torchrun* and curves after them, as far as --minutes lasts)

Targets (checked, and reported as met or not): the engine's node loop >= 0.95x the strong plain loop in fp32, bf16
and bf16 + compile, 300M MFU >= 40% in bf16 + compile at 16k tokens a step, run.py end to end >= 0.85x the node
loop, the measured peak within 10% of the memory plan, offloaded nodes >= 0.9x the tokens/s of resident ones,
stacked nodes >= 5x sequential ones (16 microllama-tiny) and >= 3x (the paper's 4 at batch 1); the
CUDA tests assert no sync in an inner step (set_sync_debug_mode "error") and no recompile after the warm-up.

Needs the packages of requirements.txt except clearml and tensorboard (tracking is off), and the
embedded corpus wheel in cache_dir or at ADLOCO_EXLLAMAV2_WHEEL: nothing is downloaded (the steps run
with pip and the Hugging Face Hub offline). Without CUDA it exits 2 with one line, before any work.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from benchmarks.launch import run_child
from benchmarks.tables import cell
from run_dir.reader import RunFiles
from training_logs.memory_monitor import device_peak_mib
from training_logs.records import TrainerRow

ROOT = Path(__file__).resolve().parents[1]

# run.py on a GPU: a tiny model, 4 trainers on 4 nodes of one GPU, merges every 2 steps, batches that grow
# past the max batch of 2 (accumulation): every mechanism inside one short run
RUN = ["devices=[cuda]", "nodes_per_gpu=4", "num_init_trainers=4", "num_outer_steps=6", "num_inner_steps=4",
       "seq_len=64", "val_size=8", "eval_batch_size=8", "initial_batch_size=3", "max_batch_size=2", "ETA=0.3",
       "max_requested_batch=8", "merge_frequency=2", "save_weights_every=0", "plot_every=6", "tokenizer=bpe",
       "tokenizer_vocab_size=512", "embedded_sources=[tiny]", "clearml_mode=off"]
TORCHRUN = [o for o in RUN if not o.startswith(("nodes_per_gpu", "num_init_trainers"))] + [
    "nodes_per_gpu=2", "num_init_trainers=2"]
# torchrun_comm: the compressed outer sync, the sketched statistics and Streaming DiLoCo's asynchronous
# fragment collectives (issue 22) on the GPU, against the simulated cluster
COMM = ["outer_compression=int8", "statistics_comm=sketch", "statistics_sketch_dim=256", "sync_fragments=2",
        "sync_delay=1", "merge_compression=int8"]
TARGETS = {  # name -> (what, threshold)
    "engine_speed_over_plain_fp32": ("engine node loop / strong plain loop tokens/s, fp32", 0.95),
    "engine_speed_over_plain_bf16": ("engine node loop / strong plain loop tokens/s, bf16", 0.95),
    "engine_speed_over_plain_bf16_compile": ("engine node loop / strong plain loop tokens/s, bf16 + compile", 0.95),
    "mfu_bf16_compile": ("microllama-300m MFU, bf16 + compile, 16k tokens a step (datasheet peak)", 0.40),
    "end_to_end_over_node_loop": ("run.py rounds / node loop tokens/s", 0.85),
    # 1 - |measured peak - plan| / plan, the worse of the two paper readings: >= 0.9 is "within 10%"
    "memory_plan_accuracy": ("1 - |peak - plan| / plan, worse paper reading", 0.9),
    "offloaded_over_resident": ("4-node reading, offload_idle_nodes / resident tokens/s at the paper's H = 200, "
                                "projected from the second 5-step round of each", 0.9),
    "stacked_16_tiny": ("16 microllama-tiny nodes at micro-batch 1, stacked / sequential tokens/s", 5.0),
    "stacked_paper_4": ("the paper's 4 microllama-300m nodes at its starting batch 1, stacked / sequential", 3.0),
}
# the stacked step (benchmarks.stacked, issue 60): each case's arguments; the paper's nodes in bf16 (stacked refuses
# fp16's per-node loss scale), at the paper's seq_len 512
STACKED = {"stacked_16_tiny": ["--preset", "microllama-tiny", "--nodes", "16", "--batches", "1", "--steps", "10",
                               "--seq-len", "128", "--repeats", "2"],
           "stacked_paper_4": ["--preset", "microllama-300m", "--nodes", "4", "--batches", "1", "--steps", "5",
                               "--seq-len", "512", "--precision", "bf16", "--repeats", "2"]}
# the system step: microllama-300m at 32 x 512 = 16384 tokens a step (the MFU target's "at least 16k tokens")
SYSTEM = ["--preset", "microllama-300m", "--seq-len", "512", "--batch", "32", "--steps", "5", "--inner-steps", "5",
          "--repeats", "2", "--variants", "fp32,bf16,bf16+compile"]
# the paper step: the paper's config (the 4-node reading, fp16, synced evaluations every 10 inner steps) for 2 outer
# steps of 50 inner steps, MicroLlama's architecture from its preset (no download)
PAPER = ["dataset=embedded", "hub_downloads=false", "model_config.pretrained=false",
         "model_config.name=microllama-300m", "tokenizer=bpe",
         "tokenizer_vocab_size=32000", "num_outer_steps=2", "num_inner_steps=50", "val_size=16",
         "save_weights_every=0", "plot_every=0", "clearml_mode=off"]
# the memory step: a paper reading's first round, short, with no download (MicroLlama's architecture from its preset)
PAPER_ROUND = ["dataset=embedded", "hub_downloads=false", "model_config.pretrained=false",
               "model_config.name=microllama-300m", "tokenizer=bpe", "tokenizer_vocab_size=32000",
               "num_outer_steps=2", "num_inner_steps=5", "eval_every_inner_steps=0", "val_size=16",
               "save_weights_every=0", "plot_every=0", "clearml_mode=off",
               # the round at the micro-batch the plan is made for: the plan prices the largest micro-batch, and a
               # round at the paper's batch 1 under a plan at the probed 24 compared 49 GiB with 99 GiB (2026-11-28)
               "max_batch_size=8", "initial_batch_size=8", "sampling_method=constant"]
READINGS = {"paper_4_nodes": ("configs/paper_microllama_c4.yaml", []),
            "paper_16_nodes": ("configs/paper_microllama_c4_16nodes.yaml", []),  # offloaded, 1 per device
            "paper_4_nodes_offloaded": ("configs/paper_microllama_c4.yaml", ["offload_idle_nodes=true"])}
REQUIRED = {"torch": "everything", "transformers": "models", "tokenizers": "tokenizers", "datasets": "data loading",
            "safetensors": "checkpoints", "yaml": "config", "matplotlib": "plots", "psutil": "memory monitor",
            "tqdm": "progress bars", "pytest": "cuda_tests", "clearml": "not needed (clearml_mode=off)",
            "tensorboard": "not needed (tensorboard: false)"}


@dataclass
class Step:
    name: str
    what: str
    max_s: float
    ok: bool | None = None  # None: not run
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)
    error: str = ""


def last_error_line(text: str) -> str:
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error:") or re.match(r"^\w+(Error|Exception)\b", x)]
    return (errors or lines or ["no output"])[-1][:400]


class Runner:
    """Runs the steps' processes within the budget; writes each one's output to DIR/logs/<name>.log."""

    def __init__(self, out: Path, deadline: float) -> None:
        self.out, self.deadline = out, deadline
        (out / "logs").mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PIP_NO_INDEX": "1", "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false"}

    def __call__(self, name: str, cmd: list[str], limit: float) -> tuple[int, str]:
        timeout = max(1.0, min(limit, self.deadline - time.time()))
        log = self.out / "logs" / f"{name}.log"
        code = run_child(cmd, log, env=self.env, timeout=timeout)  # benchmarks/launch.py: the one launcher
        if code == 124:
            with log.open("a") as f:
                f.write(f"\nerror: timed out after {timeout:.0f} s (budget)")
        return code, log.read_text(errors="replace")


def machine_facts() -> dict:
    import torch

    facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
             "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
             "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
             "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
             "host": platform.node(), "cpus": os.cpu_count()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        facts["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        facts["driver"] = None
    facts["missing_packages"] = {name: use for name, use in REQUIRED.items() if importlib.util.find_spec(name) is None}
    return facts


def summary_of(run_dir: Path) -> dict:
    summary = RunFiles(run_dir).summary()
    return {k: summary[k] for k in ("final_metric", "merges", "batch_increases", "accumulation_used", "wall_time_s",
                                    "tokens_seen")}


DECISIONS = ("outer_step", "trainer_id", "nodes", "requested_batch", "loader_batch", "accumulation_steps",
             "next_requested_batch")


def compare_runs(a: Path, b: Path, rel: float) -> dict:
    """Decisions identical? Largest relative difference of val_perplexity."""
    ra, rb = RunFiles(a).records(TrainerRow), RunFiles(b).records(TrainerRow)
    same = len(ra) == len(rb) and all(getattr(x, k) == getattr(y, k) for x, y in zip(ra, rb) for k in DECISIONS)
    worst = max((abs(x.val_perplexity - y.val_perplexity) / x.val_perplexity for x, y in zip(ra, rb)), default=0.0)
    return {"same_decisions": same, "max_rel_perplexity_difference": worst, "within": worst <= rel}


def run_step(step: Step, run, out: Path, python: str) -> None:
    runs = out / "runs"
    if step.name == "cuda_tests":
        code, text = run(step.name, [python, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                                     "--durations=0", "tests"], step.max_s)
        counts = re.findall(r"(\d+) (passed|failed|error|errors|deselected)", text)
        step.detail = {kind: int(n) for n, kind in counts}
        step.ok = code == 0 and step.detail.get("passed", 0) > 0
    elif step.name.startswith("run_"):
        precision = "bf16" if step.name == "run_bf16" else "fp32"
        extra = ["node_execution=threads"] if step.name == "run_threads" else ["node_execution=sequential"]
        code, text = run(step.name, [python, "run.py", *RUN, f"precision={precision}", *extra, f"log_dir={runs}",
                                     f"run_name={step.name}"], step.max_s)
        if code == 0:
            step.detail = summary_of(runs / step.name)
            every_mechanism = step.detail["merges"] >= 1 and step.detail["batch_increases"] >= 1 and \
                step.detail["accumulation_used"]
            step.ok = every_mechanism
            reference = runs / "run_fp32"
            if step.name != "run_fp32" and RunFiles(reference).finished:
                rel = 0.05 if precision == "bf16" else 1e-3
                step.detail["against_run_fp32"] = compare_runs(reference, runs / step.name, rel)
                step.ok = step.ok and step.detail["against_run_fp32"]["within"]
        else:
            step.ok = False
    elif step.name in ("torchrun", "torchrun_comm"):
        config = [*TORCHRUN, *(COMM if step.name == "torchrun_comm" else [])]
        tag = step.name.removeprefix("torchrun")  # "" or "_comm": each pair of runs in its own directories
        code, text = run(f"simulated_2_nodes{tag}", [python, "run.py", *config, f"log_dir={runs}",
                                                     f"run_name=simulated{tag}"], step.max_s / 3)
        launch = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "run.py", *config,
                  f"log_dir={runs}"]
        code, text = run(f"torchrun_nccl{tag}", [*launch, "dist_backend=nccl", f"run_name=torchrun_nccl{tag}"],
                         step.max_s / 3)
        step.detail["nccl"] = "ok" if code == 0 else last_error_line(text)
        backend = "nccl"
        if code != 0:  # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): gloo with CUDA nodes
            backend = "gloo"
            code, text = run(f"torchrun_gloo{tag}", [*launch, "dist_backend=gloo", f"run_name=torchrun_gloo{tag}"],
                             step.max_s / 3)
        step.detail["backend"] = backend
        if code == 0 and RunFiles(runs / f"simulated{tag}").finished:
            step.detail["against_simulated"] = compare_runs(runs / f"simulated{tag}", runs / f"torchrun_{backend}{tag}",
                                                            1e-3)
            step.ok = step.detail["against_simulated"]["same_decisions"] and step.detail["against_simulated"]["within"]
        else:
            step.ok = False
    elif step.name == "memory":
        step.detail, text = memory_checks(run, runs, python, step.max_s / len(READINGS))
        step.ok = all(isinstance(v, dict) for v in step.detail.values())
        if not step.ok:
            step.error = next(v for v in step.detail.values() if not isinstance(v, dict))
    elif step.name == "system":
        numbers = out / "system.json"
        code, text = run(step.name, [python, "-m", "benchmarks.system", "--device", "cuda", *SYSTEM, "--json",
                                     str(numbers), "--markdown", str(out / "system.md")], step.max_s)
        step.ok = code == 0 and numbers.is_file()
        if step.ok:
            step.detail = json.loads(numbers.read_text())
    elif step.name == "paper":
        code, text = run(step.name, [python, "run.py", "--config", "configs/paper_microllama_c4.yaml", *PAPER,
                                     f"log_dir={runs}", "run_name=paper"], step.max_s)
        step.ok = code == 0
        if step.ok:
            summary = RunFiles(runs / "paper").summary()
            step.detail = {**summary_of(runs / "paper"),
                           "tokens_per_s": summary["tokens_seen"] / summary["wall_time_s"]}
    elif step.name == "stacked":
        text = stacked_step(step, run, out, python)
    elif step.name == "curves":  # the simulated clock's throughput curves (docs/clock.md)
        text = curves_step(step, run, out, python)
    else:  # pragma: no cover - the plan names only the steps above
        raise ValueError(step.name)
    if step.ok is False and not step.error:
        step.error = last_error_line(text)


def stacked_step(step: Step, run, out: Path, python: str, device: str = "cuda", extra: tuple[str, ...] = ()
                 ) -> str:
    """benchmarks.stacked for each case of STACKED: its ratio of stacked to sequential tokens/s, and memory."""
    text = ""
    for name, arguments in STACKED.items():
        numbers = out / f"{name}.json"
        code, text = run(name, [python, "-m", "benchmarks.stacked", "--device", device, *arguments, *extra,
                                "--json", str(numbers), "--markdown", str(out / "stacked.md")], step.max_s / 2)
        if code != 0 or not numbers.is_file():
            step.ok, step.error = False, f"{name}: {last_error_line(text)}"
            return text
        (result,) = json.loads(numbers.read_text())["results"]
        step.detail[name] = {k: result[k] for k in ("speedup", "sequential_tokens_per_s", "stacked_tokens_per_s",
                                                    "sequential_peak_mib", "stacked_peak_mib")}
    step.ok = True
    return text


def curves_step(step: Step, run, out: Path, python: str) -> str:
    """The throughput curves of microllama-mini and -300m in bf16, each one's gain from micro-batch 1 recorded."""
    from algorithms.clock import ThroughputCurve

    text = ""
    for preset in ("microllama-mini", "microllama-300m"):
        path = out / f"curve_{preset}.json"
        code, text = run(f"curve_{preset}", [python, "-m", "benchmarks.system", "--device", "cuda", "--preset",
                                             preset, "--variants", "bf16", "--repeats", "2", "--curve", str(path)],
                         step.max_s / 2)
        if code != 0 or not path.is_file():
            step.ok = False
            return text
        curve = ThroughputCurve.load(path)
        largest = curve.largest_micro_batch
        step.detail[preset] = f"x{curve.tokens_per_s(largest) / curve.tokens_per_s(1):.2f} from 1 to {largest}"
    step.ok = True
    return text


def memory_checks(run, runs: Path, python: str, limit: float) -> tuple[dict, str]:
    """Each paper reading's two short rounds: planned bytes (summary.json's plan at its micro-batch) against the
    measured peak, tokens/s, and the second round's seconds (training_log.csv's wall_time: the first round of an
    offloaded node also allocates its pinned host buffers, which later rounds reuse); a reading that failed holds its
    error line, one its plan refused {"refused": line}."""
    detail, text = {}, ""
    for name, (config, extra) in READINGS.items():
        code, text = run(name, [python, "run.py", "--config", config, *PAPER_ROUND, *extra, f"log_dir={runs}",
                                f"run_name={name}"], limit)
        if code != 0:
            line = last_error_line(text)
            # the host too small for the reading (the 16-node one needs 127 GiB of host memory; the lent machines
            # have 128 GiB, 124 free): the plan's refusal is its answer, recorded, not a failed check
            detail[name] = {"refused": line} if line.startswith("error: memory plan:") else line
            continue
        summary = RunFiles(runs / name).summary()
        planned = summary["memory_plan"]["devices"][0]["planned_bytes"] / 2**20
        peak = device_peak_mib(runs / name)
        detail[name] = {"planned_mib": planned, "peak_mib": peak, "accuracy": 1 - abs(peak - planned) / planned,
                        "tokens_per_s": summary["tokens_seen"] / summary["wall_time_s"],
                        "round_s": second_round_s(runs / name),
                        "micro_batch": summary["memory_plan"]["micro_batch"]}
    return detail, text


def second_round_s(run_dir: Path) -> float:
    """The wall seconds of a run's last outer step (its round, outer step and evaluation), from training_log.csv's
    cumulative wall_time; the whole run's when it has one step."""
    walls: dict[int, float] = {}
    for row in RunFiles(run_dir).records(TrainerRow):
        walls[row.outer_step] = max(walls.get(row.outer_step, 0.0), row.wall_time or 0.0)
    last = max(walls)
    return walls[last] - walls.get(last - 1, 0.0)


def offloaded_at_paper_h(resident_s: float, offloaded_s: float, steps: int = 5, paper_h: int = 200) -> float:
    """Offloaded over resident speed at the paper's H, from one round of `steps` inner steps of each: a round's
    compute grows with H, its moves (each node's state in and out once) do not. At H = 5 the moves dominate (on the
    H200 of 2026-11-28, a first round: 8.9 s against 3.4 s, 0.38x), which says nothing of a 200-step round."""
    compute = resident_s * paper_h / steps
    return compute / (compute + max(0.0, offloaded_s - resident_s))


def targets_of(steps: list[Step]) -> dict:
    """Each target: measured value (None when its step did not run or failed) and whether it is met."""
    system = next((s.detail for s in steps if s.name == "system" and s.ok), None)
    measured = {name: None for name in TARGETS}
    if system:
        inner = system.get("inner", {})
        for variant in ("fp32", "bf16", "bf16+compile"):
            key = f"engine_speed_over_plain_{variant.replace('+', '_')}"
            measured[key] = inner.get(variant, {}).get("engine_speed_over_plain")
        measured["mfu_bf16_compile"] = inner.get("bf16+compile", {}).get("mfu_datasheet")
        measured["end_to_end_over_node_loop"] = system.get("end_to_end", {}).get("over_node_loop")
    memory = next((s.detail for s in steps if s.name == "memory" and s.ok), None)
    if memory:
        readings = [memory[r]["accuracy"] for r in ("paper_4_nodes", "paper_16_nodes") if "accuracy" in memory[r]]
        measured["memory_plan_accuracy"] = min(readings, default=None)
        resident, offloaded = memory["paper_4_nodes"], memory["paper_4_nodes_offloaded"]
        if "round_s" in resident and "round_s" in offloaded:
            measured["offloaded_over_resident"] = offloaded_at_paper_h(resident["round_s"], offloaded["round_s"])
    stacked = next((s.detail for s in steps if s.name == "stacked" and s.ok), None)
    if stacked:
        for name in STACKED:
            measured[name] = stacked[name]["speedup"]
    return {name: {"what": what, "target": threshold, "measured": measured[name],
                   "met": None if measured[name] is None else measured[name] >= threshold}
            for name, (what, threshold) in TARGETS.items()}


def render_markdown(result: dict) -> str:
    """The short record: machine facts, one row per step, the targets."""
    facts = result["facts"]
    missing = ", ".join(f"{k} ({v})" for k, v in facts.get("missing_packages", {}).items()) or "none"
    lines = [f"# GPU check ({result['started']}, {facts.get('gpu')}, {facts.get('gpu_memory_gib')} GiB, driver "
             f"{facts.get('driver')}, torch {facts.get('torch')}, CUDA {facts.get('cuda')})", "",
             f"Budget {result['budget_s'] / 60:.0f} min, used {result['used_s'] / 60:.1f} min. "
             f"Missing packages: {missing}.",
             "", "| step | what | result | seconds | detail |", "|---|---|---|---|---|"]
    for step in result["steps"]:
        state = {True: "ok", False: "FAILED", None: "not run"}[step["ok"]]
        detail = step["error"] or ", ".join(f"{k} {cell(v, 3)}" for k, v in step["detail"].items()
                                             if not isinstance(v, dict))
        for key, value in step["detail"].items():
            if isinstance(value, dict) and "same_decisions" in value:
                detail += f"; {key}: same decisions {value['same_decisions']}, max rel. perplexity difference " \
                          f"{value['max_rel_perplexity_difference']:.2g}"
        lines.append(f"| {step['name']} | {step['what']} | {state} | {step['seconds']:.0f} | "
                     f"{detail.replace('|', '/')} |")
    lines += ["", "| target | measured | needed | met |", "|---|---|---|---|"]
    for target in result["targets"].values():
        met = {True: "yes", False: "NO", None: "not measured"}[target["met"]]
        lines.append(f"| {target['what']} | {cell(target['measured'], 3)} | >= {target['target']} | {met} |")
    system = next((s for s in result["steps"] if s["name"] == "system" and s["ok"]), None)
    if system:
        lines += ["", f"| variant ({system['detail'].get('preset')}, seq {system['detail'].get('seq_len')}) | "
                  "tokens/s | engine / plain tokens/s | MFU (datasheet) |", "|---|---|---|---|"]
        for variant, r in system["detail"].get("inner", {}).items():
            lines.append(f"| {variant} | {r['tokens_per_s']:.0f} | {r['engine_speed_over_plain']:.3f} | "
                         f"{cell(r.get('mfu_datasheet'), 3)} |")
    return "\n".join(lines) + "\n"


def write_report(result: dict, out: Path) -> tuple[Path, Path]:
    """DIR/gpu_check.json (every number) and DIR/gpu_check.md (the short record), each replaced whole."""
    from utils.safe_write import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    paths = out / "gpu_check.json", out / "gpu_check.md"
    for path, text in zip(paths, (json.dumps(result, indent=2), render_markdown(result))):
        write_atomic(path, text)
    return paths


# the targets' steps first, then the rest while the budget lasts. Each budget is what the step took on the H200 of
# 2026-11-28 (benchmarks/results/gpu_check/2026-11-28_h200) with a margin: the 14 CUDA tests about 110 s, the system
# step about 160 s once its textbook loop stopped compiling, a paper reading's short round about 35 s (the 16-node
# reading is refused in seconds on a 128 GiB host), the paper config's 50-step rounds 13 s each after a 20 s start
STEPS = [("cuda_tests", "pytest -m cuda (tests/test_cuda.py): no sync in an inner step, no recompile, TF32", 130),
         ("system", "benchmarks.system, microllama-300m, 16k tokens a step: engine vs strong plain loop, MFU", 170),
         ("memory", "the paper readings' first rounds at micro-batch 8: peak against the memory plan, offloading", 110),
         ("stacked", "benchmarks.stacked: 16 tiny nodes, and the paper's 4 at batch 1, stacked vs sequential", 60),
         ("paper", "the paper config (4 nodes, fp16) for 2 outer steps of 50 inner steps", 80),
         ("run_fp32", "run.py on cuda, fp32", 30), ("run_bf16", "run.py on cuda, bf16 autocast", 30),
         ("run_threads", "run.py, 4 nodes as threads on one GPU", 30),
         ("torchrun", "torchrun, 2 processes on one GPU, vs the simulated cluster", 60),
         ("torchrun_comm", "the same with int8 + error feedback, sketched statistics, 2 streamed fragments", 60),
         ("curves", "throughput curves (benchmarks.system --curve) of microllama-mini and -300m, bf16", 60)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=8.0, help="time budget for all steps")
    p.add_argument("--out", default="", help="where the record goes (default: logs/gpu_check_<date>)")
    p.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(n for n, _, _ in STEPS)}")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"error: gpu_check needs a CUDA device, and this torch {torch.__version__} (CUDA build: "
              f"{torch.version.cuda or 'none'}) sees none here; run it on a GPU machine", file=sys.stderr)
        return 2
    chosen = [s for s in args.only.split(",") if s]
    unknown = set(chosen) - {n for n, _, _ in STEPS}
    if unknown:
        print(f"error: --only: unknown steps {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    start = time.time()
    out = Path(args.out) if args.out else ROOT / "logs" / f"gpu_check_{datetime.now():%Y_%m_%d_%H_%M_%S}"
    run = Runner(out, start + args.minutes * 60)
    steps = [Step(n, what, max_s) for n, what, max_s in STEPS if not chosen or n in chosen]
    result = {"started": f"{datetime.now():%Y-%m-%d %H:%M}", "budget_s": args.minutes * 60, "used_s": 0.0,
              "facts": machine_facts(), "steps": [], "targets": {}}
    for step in steps:
        if run.deadline - time.time() < 10:
            step.error = "not run: the time budget was used up"
        else:
            began = time.time()
            try:
                run_step(step, run, out, sys.executable)
            except Exception as exc:  # a broken step is recorded; the next one still runs
                step.ok, step.error = False, f"{type(exc).__name__}: {str(exc)[:300]}"
            step.seconds = time.time() - began
        print(f"{step.name}: {'ok' if step.ok else 'FAILED' if step.ok is False else 'not run'} "
              f"({step.seconds:.0f} s){': ' + step.error if step.error else ''}", flush=True)
        result["steps"] = [vars(s) for s in steps]
        result["used_s"] = time.time() - start
        result["targets"] = targets_of(steps)
        write_report(result, out)  # after every step: a check cut short still leaves its record
    print(render_markdown(result))
    print(f"record: {out / 'gpu_check.json'}, {out / 'gpu_check.md'}")
    return 0 if all(s.ok for s in steps) else 1


if __name__ == "__main__":
    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
