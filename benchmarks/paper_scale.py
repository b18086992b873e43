"""The paper's experiment as one command, and what it costs, printed before it starts (issue 59, item 7).

    python -m benchmarks.paper_scale [--curve FILE] [--capacity_gb 80] [--seeds 3] [--max_tokens N]

The experiment (benchmarks/results/paper_scale/run.sh runs this first, then it): the harness (benchmarks.compare)
on configs/paper_microllama_c4.yaml (MicroLlama 300M, the 4-node reading of the paper's one-A100 cluster, fp16,
H = 200, 20 outer steps, the synced model evaluated every 10 inner steps): the paper's AdLoCo, DiLoCo at its
starting batch (b1) and a constant-batch sweep, the paper's three ablations (switch mode as its two readings), 3
seeds, every run to the same token budget. This prints the card it needs (the memory plan at the nodes' micro-batch,
cluster/memory_plan.py) and the GPU-hours, from a measured throughput curve of a card (tokens/s of one node by
micro-batch; the card's 4 nodes run one after another, so the card's rate is one node's).

How the hours are estimated (bounds, not a promise): a constant batch B runs at the curve's rate for its micro-batch
(accumulation above the largest that fits); an adaptive run lies between its starting batch's rate (slowest) and the
largest micro-batch's (fastest). A curve measured at another sequence length is read at equal tokens per
micro-batch (1 sequence of 512 tokens = 4 of 128), which ignores attention's share of the cost (small at 512
tokens for a 300M model). Evaluations: val_size sequences forward per evaluation, at 3x the training rate (no
backward), every eval_every_inner_steps and at each round's end, per trainer; at most as many rounds as the
starting batch takes to spend the budget.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from algorithms.clock import ThroughputCurve
from cluster.memory_plan import GiB, plan_for_config
from utils.config import load_config

ROOT = Path(__file__).resolve().parents[1]

CONFIG = "configs/paper_microllama_c4.yaml"
CURVE = "benchmarks/results/curves/h100_bf16_microllama-300m.json"
BATCHES = (1, 2, 4, 8, 16)
# (variant, trainers at the start, adaptive); the paper's AdLoCo and its three ablations, switch mode as both readings
ADAPTIVE = [("adloco_paper", True), ("adloco_paper_no_adaptive", False), ("adloco_paper_no_merge", True),
            ("adloco_paper_always_accumulate", True), ("adloco_paper_never_accumulate", True)]


def command(seeds: int, max_tokens: int, out: str = "logs/paper_scale") -> list[str]:
    """The harness's command line for the experiment."""
    variants = [v for v, _ in ADAPTIVE] + [f"diloco_b{b}" for b in BATCHES]
    return ["python", "-m", "benchmarks.compare", "--config", CONFIG, "--seeds", str(seeds), "--max_tokens",
            str(max_tokens), "--variants", ",".join(variants), "--diloco_batches", ",".join(map(str, BATCHES)),
            "--out", out]


def estimate(cfg, curve: ThroughputCurve, curve_seq_len: int, max_tokens: int, fits_micro_batch: int) -> list[dict]:
    """Each variant's hours per run, as (low, high) bounds: training and evaluation."""
    scale = cfg.seq_len / curve_seq_len  # curve micro-batches per sequence of this config
    measured = curve.largest_micro_batch / scale  # a flat curve: every micro-batch
    largest = max(1, fits_micro_batch if math.isinf(measured) else min(fits_micro_batch, int(measured)))

    def rate(sequences: int) -> float:  # tokens/s of one node running `sequences` per step (accumulating above)
        micro = min(sequences, largest)
        accumulation = math.ceil(sequences / micro)
        return curve.tokens_per_s(micro * scale, accumulation)

    per_round = cfg.num_inner_steps * cfg.total_nodes * cfg.seq_len  # tokens a round takes per sequence of batch
    evals_per_round = (cfg.num_inner_steps // cfg.eval_every_inner_steps if cfg.eval_every_inner_steps else 1)
    eval_tokens = cfg.val_size * cfg.seq_len

    def eval_s(trainers: int, rounds: float) -> float:
        return trainers * math.ceil(rounds) * evals_per_round * eval_tokens / (3 * rate(largest))

    rows = []
    for batch in BATCHES:  # DiLoCo: one trainer on every node, a constant batch
        rounds = max_tokens / (per_round * batch)
        train = max_tokens / rate(batch)
        rows.append({"variant": f"diloco_b{batch}", "train_s": (train, train),
                     "eval_s": (eval_s(1, rounds), eval_s(1, rounds))})
    start = cfg.initial_batch_size
    for name, adaptive in ADAPTIVE:  # AdLoCo: num_init_trainers trainers sharing the nodes, merging
        trainers = cfg.num_init_trainers
        rounds = max_tokens / (per_round * start)
        low = max_tokens / rate(largest) if adaptive else max_tokens / rate(start)
        rows.append({"variant": name, "train_s": (low, max_tokens / rate(start)),
                     "eval_s": (eval_s(1, 1), eval_s(trainers, rounds))})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.paper_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--curve", default=CURVE, help="a measured throughput curve of the card (benchmarks.system "
                                                  "--curve; default: the H100's, bf16, of 2026-11-26)")
    p.add_argument("--capacity_gb", type=float, default=80.0, help="the card's memory (default: an 80 GB A100/H100)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--max_tokens", type=int, default=0, help="the token budget of every run (default: what DiLoCo at "
                   "the paper's starting batch takes in its 20 outer steps)")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be at least 1")
    cfg = load_config(ROOT / CONFIG, [])
    try:
        curve = ThroughputCurve.load(ROOT / args.curve if not Path(args.curve).is_absolute() else args.curve)
    except ValueError as exc:
        print(f"error: --curve: {exc}", file=sys.stderr)
        return 2
    import json

    meta = json.loads((ROOT / args.curve).read_text() if not Path(args.curve).is_absolute()
                      else Path(args.curve).read_text())
    max_tokens = args.max_tokens or (cfg.num_outer_steps * cfg.num_inner_steps * cfg.total_nodes
                                     * cfg.initial_batch_size * cfg.seq_len)
    # the largest micro-batch that fits the card (doubling, up to what the curve measured), and its plan
    scale = cfg.seq_len / int(meta.get("seq_len", cfg.seq_len))
    plan, micro = plan_for_config(cfg, 1, args.capacity_gb), 1
    while micro * 2 * scale <= curve.largest_micro_batch:
        bigger = plan_for_config(cfg, micro * 2, args.capacity_gb)
        if not bigger.fits:
            break
        plan, micro = bigger, micro * 2
    card = plan.devices[0]
    print(f"The paper's experiment: {CONFIG} ({cfg.total_nodes} nodes on one card, {cfg.precision}, H = "
          f"{cfg.num_inner_steps}, synced evaluations every {cfg.eval_every_inner_steps} inner steps), "
          f"{args.seeds} seeds, {max_tokens} tokens a run.")
    print(f"Card: {card.planned_bytes / GiB:.1f} GiB planned at micro-batch {plan.micro_batch} (the largest the "
          f"curve measured that fits) of {args.capacity_gb:g} GiB: {'fits' if card.fits else 'does NOT fit'}.")
    rows = estimate(cfg, curve, int(meta.get("seq_len", cfg.seq_len)), max_tokens, plan.micro_batch)
    total = [0.0, 0.0]
    print(f"Hours per run on the curve's card ({meta.get('device', '?')}, {meta.get('precision', '?')}, measured at "
          f"seq {meta.get('seq_len', '?')}), training + evaluation:")
    for row in rows:
        low, high = (row["train_s"][i] + row["eval_s"][i] for i in (0, 1))
        total[0] += low * args.seeds
        total[1] += high * args.seeds
        span = f"{low / 3600:.2f}" if abs(high - low) < 1 else f"{low / 3600:.2f} to {high / 3600:.2f}"
        print(f"  {row['variant']}: {span} h (evaluation {row['eval_s'][1] / 3600:.2f} h at most)")
    print(f"In all: {total[0] / 3600:.1f} to {total[1] / 3600:.1f} GPU-hours on one such card.")
    print("Command: " + " ".join(command(args.seeds, max_tokens)))
    return 0 if card.fits else 1


if __name__ == "__main__":
    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
