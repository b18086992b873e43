"""System benchmarks: does the engine waste anything?

    python -m benchmarks.system [--preset microllama-tiny] [--batch 8] [--steps 20] [--repeats 3]

(a) inner-step throughput of one node inside the engine (trainers.Node.run) against a plain PyTorch
    loop of the same model, optimizer, clipping, batches and steps, in the same process: a ratio;
(b) outer step + merge time as a share of a round (a real ClusterController round);
(c) memory: RSS growth while building nodes and trainers and running one round, against what the
    replicas, gradients, AdamW states, fp32 master copies and the evaluation replica should need;
(d) achieved training FLOP/s of (a) against the measured fp32 matmul peak of this machine.
Each prints a table; --markdown FILE appends them (with date and machine) to FILE.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fabrics.dataset_loader import load_corpus  # noqa: E402
from fabrics.models import build_model, count_parameters, float_state  # noqa: E402
from trainers import TRAINERS, Node, NodeJob  # noqa: E402
from utils.config import load_config  # noqa: E402

MiB = 2**20


def table(title: str, header: list[str], rows: list[list]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plain_loop(model, data, indices, cfg) -> None:
    """The baseline: the textbook PyTorch loop over the same batches."""
    opt = TRAINERS[cfg.distributed_algo].inner_optimizer_factory(cfg)(list(model.parameters()))
    model.train()
    for step in indices:
        for micro in step:
            ids, mask = data.input_ids[micro], data.attention_mask[micro]
            loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
            (loss / len(step)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)


def bench_inner(cfg, model, data, batch: int, steps: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    indices = torch.randint(0, len(data.train), (steps, 1, batch), generator=gen)
    start_state = {k: v.clone() for k, v in float_state(model).items()}
    node = Node(0, "cpu", copy.deepcopy(model), TRAINERS[cfg.distributed_algo].inner_optimizer_factory(cfg),
                cfg.grad_clip, data.train)
    engine_t, plain_t = [], []
    for _ in range(repeats):  # alternate, so drifts of the machine hit both equally
        t = time.perf_counter()
        node.run(NodeJob(0, 0, start_state, indices, 0, reset_optimizer=True))
        engine_t.append(time.perf_counter() - t)
        baseline = copy.deepcopy(model)
        t = time.perf_counter()
        plain_loop(baseline, data.train, indices, cfg)
        plain_t.append(time.perf_counter() - t)
    tokens = int(data.train.tokens_per_sequence[indices.reshape(-1)].sum())
    e, p = statistics.median(engine_t), statistics.median(plain_t)
    return {"engine_s": e, "plain_s": p, "ratio": e / p, "tokens": tokens}


def matmul_peak(n: int = 1024, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - t)


def training_flops(model, tokens: int, seq_len: int) -> float:
    """6 N per token for the weights (forward + backward) + 12 L d T per token for attention (PaLM, App. B)."""
    c = model.config
    n = count_parameters(model) - model.get_input_embeddings().weight.numel()  # lookups are not matmuls
    return tokens * (6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq_len)


def bench_round(cfg_path: str, overrides: list[str]) -> tuple[dict, dict]:
    """One real cluster: time the pieces of its rounds and its memory against the expected bytes."""
    from cluster import ClusterController
    from training_logs.memory_monitor import MemoryMonitor
    from training_logs.trackers import TrackerGroup
    from training_logs.training_monitoring import TrainingLogger

    cfg = load_config(cfg_path, overrides)
    data = load_corpus(cfg)
    model = build_model(cfg, len(data.tokenizer), data.tokenizer.pad_token_id)
    p_bytes = count_parameters(model) * 4
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    with tempfile.TemporaryDirectory() as tmp:
        logger = TrainingLogger(Path(tmp) / "r", TrackerGroup([]), MemoryMonitor(Path(tmp) / "m", cfg.devices,
                                                                                  TrackerGroup([])))
        cluster = ClusterController(cfg, model, data, logger, Path(tmp) / "w")
        times = {"round": 0.0, "outer": 0.0, "merge": 0.0, "eval": 0.0}
        run_round, evaluate = cluster.backend.run_round, cluster.evaluator.evaluate

        def timed(key, fn):
            def wrapper(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    times[key] += time.perf_counter() - t
            return wrapper

        cluster.backend.run_round = timed("round", run_round)
        cluster.evaluator.evaluate = timed("eval", evaluate)
        for trainer in cluster.trainers.values():
            trainer.outer_step = timed("outer", trainer.outer_step)
        for step in range(1, cfg.num_outer_steps + 1):
            cluster.run_outer_step(step)
            t = time.perf_counter()
            cluster.merge(step)
            times["merge"] += time.perf_counter() - t
        peak = max(r["process_rss_mib"] for r in logger.memory.rows) * MiB if logger.memory.rows else 0
        rss1 = max(proc.memory_info().rss, peak)
        cluster.backend.close()
        logger.close()
    nodes, trainers = cfg.total_nodes, cfg.num_init_trainers
    adam = 2 if cfg.distributed_algo == "DiLoCo" else 0
    expected = {"node replicas": nodes * p_bytes, "node gradients": nodes * p_bytes,
                "inner optimizer states": nodes * adam * p_bytes, "trainer fp32 masters": trainers * p_bytes,
                "outer momentum": trainers * p_bytes if cfg.outer_momentum else 0, "evaluation replica": p_bytes}
    return times, {"measured": rss1 - rss0, "expected": sum(expected.values()), "parts": expected,
                   "params": p_bytes // 4, "nodes": nodes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "config.yaml"))
    ap.add_argument("--preset", default="microllama-tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", help="append the tables to this file")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    base = ["clearml_mode=off", f"model_config.name={args.preset}"]
    cfg = load_config(args.config, base)
    data = load_corpus(cfg)
    model = build_model(cfg, len(data.tokenizer), data.tokenizer.pad_token_id)
    out = [f"## System benchmarks ({datetime.now():%Y-%m-%d %H:%M}, {platform.processor() or platform.machine()}, "
           f"{psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB, torch {torch.__version__}, "
           f"{torch.get_num_threads()} threads; model {args.preset}, {count_parameters(model) / 1e6:.2f}M parameters)",
           ""]
    inner = bench_inner(cfg, model, data, args.batch, args.steps, args.repeats)
    out.append(table("(a) Inner loop: engine node vs plain PyTorch loop (same batches, median of repeats)",
                     ["batch x steps", "engine s", "plain s", "engine / plain", "tokens/s engine"],
                     [[f"{args.batch} x {args.steps}", inner["engine_s"], inner["plain_s"], inner["ratio"],
                       inner["tokens"] / inner["engine_s"]]]))
    times, memory = bench_round(args.config, [*base, "num_outer_steps=3", "merge_frequency=1",
                                              f"max_batch_size={args.batch}", "initial_batch_size=8",
                                              "sampling_method=constant"])
    total = times["round"] + times["outer"] + times["merge"]
    out.append(table("(b) Outer step + merge as a share of the round (3 outer steps, a merge after each)",
                     ["node rounds s", "outer steps s", "merges s", "outer + merge share", "evaluation s"],
                     [[times["round"], times["outer"], times["merge"], (times["outer"] + times["merge"]) / total,
                       times["eval"]]]))
    rows = [[k, v / MiB] for k, v in memory["parts"].items()]
    rows += [["expected total", memory["expected"] / MiB], ["measured RSS growth (peak)", memory["measured"] / MiB],
             ["measured / expected", memory["measured"] / memory["expected"]]]
    out.append(table(f"(c) Memory of a cluster of {memory['nodes']} nodes ({memory['params'] / 1e6:.2f}M parameters)",
                     ["part", "MiB"], rows))
    peak = matmul_peak()
    achieved = training_flops(model, inner["tokens"], cfg.seq_len) / inner["engine_s"]
    out.append(table("(d) Achieved training FLOP/s vs measured fp32 matmul peak",
                     ["matmul peak GFLOP/s", "engine GFLOP/s", "fraction of peak"],
                     [[peak / 1e9, achieved / 1e9, achieved / peak]]))
    text = "\n".join(out)
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
