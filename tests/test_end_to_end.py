"""Whole runs on tiny configs: outputs, mechanisms, checkpoints, determinism."""

import csv
import json

import pytest
import torch
from transformers import LlamaForCausalLM

from fabrics.dataset_loader import load_corpus
from fabrics.eval_tool import Evaluator
from run import train
from utils.checkpoint import load_trainer_weights
from utils.errors import UserError


def rows_of(run_dir):
    with (run_dir / "model_training_report" / "training_log.csv").open() as f:
        return list(csv.DictReader(f))


def test_tiny_run_end_to_end(tiny_config):
    cfg = tiny_config("run_name=e2e", "num_outer_steps=4", "max_batch_size=2", "initial_batch_size=3",
                      "ETA=0.3", "max_requested_batch=8")
    run_dir, summary = train(cfg)
    for name in ("training_log.log", "config.yaml", "metrics.jsonl", "summary.json",
                 "model_training_report/training_log.csv", "model_training_report/merge_events.csv",
                 "model_training_report/val_perplexity_per_trainer.png",
                 "model_training_report/requested_batch_per_trainer.png", "model_training_report/trainers_alive.png",
                 "model_weights/outer_step_0002/trainer_0.safetensors", "model_weights/final/final_model/config.json"):
        assert (run_dir / name).is_file(), name
    rows = rows_of(run_dir)
    # one row per trainer per outer step (+ outer step 0), trainers drop after the merge at step 2
    assert [(r["outer_step"], r["trainer_id"]) for r in rows] == [
        ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1"), ("2", "0"), ("2", "1"), ("3", "0"), ("4", "0")]
    assert summary["merges"] == 1 and summary["batch_increases"] >= 1
    # requested 3 > max 2: the threshold mode runs one pass of 2, and accumulates above 4
    first = rows[2]
    assert (first["requested_batch"], first["loader_batch"], first["accumulation_steps"]) == ("3", "2", "1")
    assert summary["accumulation_used"]
    assert any(int(r["accumulation_steps"]) > 1 and int(r["loader_batch"]) <= 2 for r in rows[2:])
    assert summary["final_metric"] < summary["initial_metric"]
    assert int(rows[-1]["communications"]) == 2 + 2 + 1 + 1 + 1  # 5 outer syncs + 1 merge, counted before it
    # the final model opens with plain transformers and gives the logged perplexity
    model = LlamaForCausalLM.from_pretrained(run_dir / "model_weights" / "final" / "final_model")
    data = load_corpus(cfg)
    ppl = Evaluator(model, data.val, 8, "cpu").evaluate().perplexity
    assert ppl == pytest.approx(summary["final_metric"], rel=1e-5)
    final_dir = run_dir / "model_weights" / "final"
    state = load_trainer_weights(final_dir / f"trainer_{summary['final_trainer']}.safetensors")
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items() if k in state)


def test_same_seed_same_metrics_threads_or_not(tiny_config):
    def metrics(name, execution):
        run_dir, _ = train(tiny_config(f"run_name={name}", f"node_execution={execution}", "sampling_method=norm_test",
                                       "ETA=0.3"))
        return [{k: v for k, v in r.items() if k != "wall_time"} for r in rows_of(run_dir)]

    first = metrics("a", "sequential")
    assert first == metrics("b", "sequential")
    assert first == metrics("c", "threads")


def test_localsgd_merges_and_aipt_runs(tiny_config):
    run_dir, summary = train(tiny_config("run_name=lsgd", "distributed_algo=LocalSGD", "lr_inner=0.05",
                                         "sampling_method=augmented_inner_product_test",
                                         "variance_estimator=nodes", "num_init_trainers=1", "nodes_per_gpu=2"))
    rows = rows_of(run_dir)[1:]
    assert summary["final_metric"] < summary["initial_metric"]
    assert all(r["T_ip"] and r["T_ortho"] for r in rows)  # the nodes estimator has 2 samples per trainer
    run_dir, summary = train(tiny_config("run_name=lsgd2", "distributed_algo=LocalSGD", "lr_inner=0.05"))
    assert summary["merges"] == 1


def test_bad_checkpoint_and_existing_run_dir_are_user_errors(tiny_config, tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="not a readable safetensors"):
        load_trainer_weights(bad)
    cfg = tiny_config("run_name=taken")
    (tmp_path / "logs" / "taken").mkdir(parents=True)
    (tmp_path / "logs" / "taken" / "keep.txt").write_text("precious")
    with pytest.raises(UserError, match="already exists"):
        train(cfg)
    assert (tmp_path / "logs" / "taken" / "keep.txt").read_text() == "precious"


def test_summary_is_json(tiny_config):
    run_dir, summary = train(tiny_config("run_name=s", "num_outer_steps=1"))
    assert json.loads((run_dir / "summary.json").read_text())["final_trainer"] == summary["final_trainer"]
