"""Train AdLoCo: `python run.py [--config config.yaml] [key=value ...]`.

Reads the config (validated once), prepares data and the initial model, builds the simulated
cluster, runs the outer loop and leaves everything in logs/<model>_<dataset>_<date>/.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import yaml

from utils.config import Config, load_config
from utils.errors import UserError, exit_code_of

log = logging.getLogger("run")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="config.yaml", help="YAML config (default: config.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. num_outer_steps=5 lr_outer=0.7")
    return parser.parse_args(argv)


def build_tracker(cfg: Config, run_dir: Path):
    """metrics.jsonl always; ClearML unless clearml_mode: off; TensorBoard when asked."""
    from training_logs.trackers import JsonlTracker, TensorBoardTracker, TrackerGroup

    trackers = [JsonlTracker(run_dir / "metrics.jsonl")]
    if cfg.clearml_mode != "off":
        from training_logs.clearml_tracker import ClearMLTracker

        trackers.append(ClearMLTracker(cfg.project_name, cfg.task_name, cfg.to_dict(), cfg.clearml_mode,
                                       cfg.clearml_timeout_s))
    if cfg.tensorboard:
        trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
    return TrackerGroup(trackers)


def train(cfg: Config) -> tuple[Path, dict]:
    # Heavy imports after validation, so config errors come back instantly.
    from cluster import ClusterController
    from fabrics.dataset_loader import load_corpus
    from fabrics.models import build_model, count_parameters
    from training_logs.memory_monitor import MemoryMonitor
    from training_logs.training_monitoring import TrainingLogger
    from utils.utils import make_run_dir, set_seeds, setup_logging

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        run_dir = make_run_dir(cfg.log_dir, cfg.run_name, cfg.model_config.name, cfg.dataset)
    except FileExistsError as exc:
        raise UserError(f"run_name: {exc}") from None
    setup_logging(run_dir / cfg.log_file)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    log.info("run directory: %s", run_dir)
    for warning in cfg.warnings():
        log.warning("config: %s", warning)
    set_seeds(cfg.training_seed)
    data = load_corpus(cfg)
    log.info("data: %s", data.description)
    model = build_model(cfg, len(data.tokenizer), data.tokenizer.pad_token_id)
    log.info("model: %s (%s), %.2fM parameters", cfg.model_config.name, type(model).__name__,
             count_parameters(model) / 1e6)
    report_dir = run_dir / "model_training_report"
    tracker = build_tracker(cfg, run_dir)
    classification = data.val.labels is not None
    memory = MemoryMonitor(run_dir / "memory_report", cfg.devices, tracker, cfg.memory_sample_interval_s)
    logger = TrainingLogger(report_dir, tracker, memory, "val_accuracy" if classification else "val_perplexity",
                            classification)
    try:
        cluster = ClusterController(cfg, model, data, logger, run_dir / "model_weights")
        summary = cluster.train()
        logger.finish(summary)
    finally:
        logger.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("final model: trainer %d, %s %.4g (start %.4g); %d merges, %d batch increases, "
             "accumulation used: %s; %d rounds, %d syncs, %.1f MB communicated; %.0f s", summary["final_trainer"],
             summary["metric"], summary["final_metric"], summary["initial_metric"], summary["merges"],
             summary["batch_increases"], summary["accumulation_used"], summary["rounds"], summary["syncs"],
             summary["bytes_communicated"] / 1e6, summary["wall_time_s"])
    log.info("outputs in %s", run_dir)
    return run_dir, summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return exit_code_of(lambda: train(load_config(args.config, args.overrides)))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
