"""The inner AdamW's step on CPU: the optimizer the inner optimizer factory makes (trainers.py: torch's foreach path)
against torch's per-tensor loop (what `torch.optim.AdamW` picks by default on CPU), on a preset's real parameters,
in the same process, alternated; and whether the two give the same weights to the last bit.

    python -m benchmarks.inner_optimizer [--preset microllama-nano] [--vocab 4096] [--steps 50] [--repeats 5]
                                         [--threads 1]
"""

from __future__ import annotations

import argparse
import platform

import torch
from transformers import LlamaForCausalLM

from benchmarks.system import alternated_medians, table
from fabrics.models import load_preset
from trainers import DiLoCoTrainer
from utils.config import load_config


def parameters(preset: str, vocab: int) -> list[torch.nn.Parameter]:
    config = load_preset(preset)
    config.vocab_size = vocab
    torch.manual_seed(0)
    return list(LlamaForCausalLM(config).parameters())


def stepper(params: list[torch.nn.Parameter], make, steps: int):
    """`steps` optimizer steps on fixed gradients (the same every call), from a fresh optimizer made by `make`."""
    optimizer = make(params)
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(params)]

    def run() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        for _ in range(steps):
            optimizer.step()

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="microllama-nano")
    ap.add_argument("--vocab", type=int, default=4096, help="the tokenizer's vocabulary (the embedded default's)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(None, [])
    factory = DiLoCoTrainer.inner_optimizer_factory(cfg)
    per_tensor = lambda ps: torch.optim.AdamW(ps, lr=cfg.lr_inner, betas=tuple(cfg.inner_betas),  # noqa: E731
                                              weight_decay=cfg.inner_weight_decay, foreach=False)
    ours, loop = parameters(args.preset, args.vocab), parameters(args.preset, args.vocab)
    ways = {"inner optimizer (foreach)": stepper(ours, factory, args.steps),
            "per-tensor loop": stepper(loop, per_tensor, args.steps)}
    for run in ways.values():  # warm-up, and the same number of steps on both before the comparison
        run()
    seconds = alternated_medians(ways, args.repeats, "cpu")
    same = all(torch.equal(a, b) for a, b in zip(ours, loop))
    base = seconds["per-tensor loop"]
    print(table(f"inner AdamW step on CPU: {args.preset} ({sum(p.numel() for p in ours):,} parameters in "
                f"{len(ours)} tensors), {args.threads} thread(s), {platform.processor() or platform.machine()}",
                ["way", "ms per step", "ratio to the per-tensor loop"],
                [[k, 1e3 * v / args.steps, v / base] for k, v in seconds.items()]))
    print(f"same weights to the last bit after {(args.repeats + 1) * args.steps} steps: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
