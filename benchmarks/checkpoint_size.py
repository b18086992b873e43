"""Checkpoint sizes: measured on real run directories, and predicted for any preset from the same formula.

    python -m benchmarks.checkpoint_size RUN_DIR [RUN_DIR ...] [--predict microllama-300m:4:4]

For each run directory: every complete checkpoint's size on disk next to what
`utils.checkpoint.expected_checkpoint_bytes` predicts from the run's config (trainers alive in that
checkpoint, nodes, outer momentum). --predict MODEL:TRAINERS:NODES[:VOCAB] gives the size of a
checkpoint that would take more memory to write than this machine has (parameters counted on the
meta device, no weights allocated).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from run_dir.reader import RunFiles
from utils.checkpoint import MANIFEST, expected_checkpoint_bytes
from utils.errors import UserError, exit_code_of


def preset_parameters(name: str, vocab_size: int | None = None) -> int:
    """Parameters of a model preset, counted without allocating them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from utils.preflight import PRESETS_DIR

    config = AutoConfig.from_pretrained(PRESETS_DIR / f"{name}.json")
    if vocab_size:
        config.vocab_size = vocab_size
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def measure(run_dir: Path) -> list[dict]:
    run = RunFiles(run_dir)
    if not run.finished:
        raise UserError(f"{run_dir}: no summary.json (not a finished run directory)")
    cfg = run.config()
    params = run.summary()["weight_bytes"] // 4
    rows = []
    for ckpt in sorted(run.weights.glob(f"*/{MANIFEST}")):
        manifest = json.loads(ckpt.read_text())
        on_disk = sum(f["bytes"] for f in manifest["files"].values())
        final = ckpt.parent.name == "final"
        expected = expected_checkpoint_bytes(params, len(manifest["trainers"]), cfg.total_nodes,
                                             cfg.outer_momentum > 0, final)
        rows.append({"run": run_dir.name, "checkpoint": ckpt.parent.name, "model": cfg.model_config.name,
                     "params": params, "trainers": len(manifest["trainers"]), "nodes": cfg.total_nodes,
                     "bytes": on_disk, "formula_bytes": expected, "ratio": on_disk / expected})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", type=Path, help="finished run directories to measure")
    p.add_argument("--predict", action="append", default=[], metavar="MODEL:TRAINERS:NODES[:VOCAB]")
    args = p.parse_args(argv)
    return exit_code_of(lambda: report(args))


def report(args) -> None:
    print("| run | checkpoint | model | parameters | trainers | nodes | on disk | formula | on disk / formula |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run_dir in args.runs:
        for r in measure(run_dir):
            print(f"| {r['run']} | {r['checkpoint']} | {r['model']} | {r['params'] / 1e6:.2f}M | {r['trainers']} | "
                  f"{r['nodes']} | {r['bytes'] / 1e6:.1f} MB | {r['formula_bytes'] / 1e6:.1f} MB | {r['ratio']:.4f} |")
    for spec in args.predict:
        name, trainers, nodes, *vocab = spec.split(":")
        params = preset_parameters(name, int(vocab[0]) if vocab else None)
        size = expected_checkpoint_bytes(params, int(trainers), int(nodes), outer_momentum=False)
        print(f"| (predicted) | outer_step_NNNN | {name} | {params / 1e6:.2f}M | {trainers} | {nodes} | "
              f"{size / 1e9:.2f} GB | {size / 1e9:.2f} GB | formula |")


if __name__ == "__main__":
    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
