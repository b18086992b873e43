"""Whole runs on tiny configs: outputs, mechanisms, checkpoints, determinism."""

import csv
import json

import pytest
import torch
import yaml
from transformers import LlamaForCausalLM

from fabrics.corpus import load_corpus
from fabrics.eval_tool import Evaluator
from run import train
from utils.checkpoint import load_trainer_weights
from utils.errors import UserError


def rows_of(run_dir):
    with (run_dir / "model_training_report" / "training_log.csv").open() as f:
        return list(csv.DictReader(f))


def test_tiny_run_end_to_end(tiny_config):
    cfg = tiny_config("run_name=e2e", "num_outer_steps=4", "max_batch_size=2", "initial_batch_size=3",
                      "ETA=0.3", "max_requested_batch=8", "plot_every=2")
    run_dir, summary = train(cfg)
    for name in ("training_log.log", "config.yaml", "metrics.jsonl", "summary.json",
                 "model_training_report/training_log.csv", "model_training_report/merge_events.csv",
                 "model_training_report/val_perplexity_per_trainer.png",
                 "model_training_report/requested_batch_per_trainer.png", "model_training_report/trainers_alive.png",
                 "model_weights/outer_step_0002/trainer_0.safetensors", "model_weights/final/final_model/config.json"):
        assert (run_dir / name).is_file(), name
    # the text log holds the whole config, as config.yaml records it
    log_text = (run_dir / "training_log.log").read_text()
    block = log_text.split("config (as config.yaml records it):\n", 1)[1].split("\n20", 1)[0]
    assert yaml.safe_load(block) == yaml.safe_load((run_dir / "config.yaml").read_text())
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
    # traffic: P = fp32 weights. Steps 1-2: two one-node trainers send nothing; the merge at step 2 moves
    # T1's weights (P); steps 3-4: one trainer on 2 nodes, a ring all-reduce of 2 (2-1) P each; at step 3
    # the node that served T1 receives the merged weights (P). Syncs: 1 merge + 2 all-reduces.
    final_dir = run_dir / "model_weights" / "final"
    p = sum(v.numel() * 4 for v in load_trainer_weights(final_dir / "trainer_0.safetensors").values())
    by_step = {r["outer_step"]: r for r in rows}
    assert [int(by_step[s]["syncs"]) for s in "01234"] == [0, 0, 1, 2, 3]
    assert [int(by_step[s]["rounds"]) for s in "01234"] == [0, 1, 2, 3, 4]
    last = rows[-1]
    assert (int(last["allreduce_bytes"]), int(last["merge_bytes"]), int(last["node_move_bytes"])) == (4 * p, p, p)
    assert int(last["weights_traffic_bytes"]) == summary["weights_traffic_bytes"] == 6 * p
    assert summary["syncs"] == 3 and summary["rounds"] == 4 and summary["node_moves"] == 1
    # the merged model is evaluated right after the merge: the step-2 checkpoint holds exactly it
    with (run_dir / "model_training_report" / "merge_events.csv").open() as f:
        (merge,) = list(csv.DictReader(f))
    merged = LlamaForCausalLM.from_pretrained(final_dir / "final_model")
    merged.load_state_dict(load_trainer_weights(run_dir / "model_weights" / "outer_step_0002" /
                                                f"trainer_{merge['survivor']}.safetensors"), strict=False)
    data = load_corpus(cfg)
    assert Evaluator(merged, data.val, 8, "cpu").evaluate().perplexity == pytest.approx(float(merge["metric_after"]),
                                                                                    rel=1e-5)
    before = {r["trainer_id"]: float(r["val_perplexity"]) for r in rows if r["outer_step"] == "2"}
    assert merge["metric_before"].split() == [f"{before[merge['survivor']]:.6g}", f"{before[merge['merged']]:.6g}"]
    assert merge["metric"] == "val_perplexity" and float(merge["bytes"]) == p
    # the CSV holds 6 significant digits, summary.json the full float: compare within the CSV's rounding
    assert summary["best_metric_seen"] <= min(float(r["val_perplexity"]) for r in rows[2:]) * (1 + 5e-6)
    # the final model opens with plain transformers and gives the logged perplexity
    model = LlamaForCausalLM.from_pretrained(run_dir / "model_weights" / "final" / "final_model")
    ppl = Evaluator(model, data.val, 8, "cpu").evaluate().perplexity
    assert ppl == pytest.approx(summary["final_metric"], rel=1e-5)
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


def test_summary_is_json_and_plot_every_0_draws_no_plots(tiny_config):
    run_dir, summary = train(tiny_config("run_name=s", "num_outer_steps=1", "plot_every=0"))
    assert json.loads((run_dir / "summary.json").read_text())["final_trainer"] == summary["final_trainer"]
    assert (run_dir / "model_training_report" / "training_log.csv").is_file() and not list(run_dir.rglob("*.png"))


def test_a_batch_test_capped_by_max_requested_batch_says_so(tiny_config, tmp_path):
    """The augmented inner product test at the paper's vartheta asks for far more than max_requested_batch:
    the CSV keeps what it asked, the log says so once per trainer, the summary and the last lines count it."""
    from pathlib import Path

    from run import main
    from tests.conftest import ROOT, TINY

    cfg = tiny_config()
    code = main(["--config", str(ROOT / "config.yaml"), *TINY, f"cache_dir={cfg.cache_dir}", f"log_dir={cfg.log_dir}",
                 "run_name=capped", "sampling_method=augmented_inner_product_test", "vartheta=0.01",
                 "max_requested_batch=4", "merge_frequency=0"])
    assert code == 0
    run_dir = Path(cfg.log_dir) / "capped"
    with (run_dir / "model_training_report" / "training_log.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["test_requested_batch"]]
    capped = [r for r in rows if int(r["test_requested_batch"]) > int(r["next_requested_batch"])]
    assert capped and all(r["next_requested_batch"] == "4" for r in capped)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["capped_requests"] == len(capped)
    assert summary["largest_capped_request"] == max(int(r["test_requested_batch"]) for r in capped)
    log = (run_dir / "training_log.log").read_text()
    warned = [line for line in log.splitlines() if "batch test: trainer" in line]
    assert len(warned) == len({r["trainer_id"] for r in capped}) and "max_requested_batch caps it at 4" in warned[0]
    assert f"the batch test was capped by max_requested_batch 4 in {len(capped)} decision" in log


PAPER_ON_CPU = ["model_config.name=microllama-tiny", "model_config.pretrained=false", "dataset=embedded",
                "embedded_sources=[tiny]", "hub_downloads=false", "tokenizer=bpe", "tokenizer_vocab_size=512",
                "seq_len=64", "val_size=8", "num_outer_steps=1", "num_inner_steps=12", "clearml_mode=off"]


@pytest.mark.parametrize("reading, devices, nodes_per_trainer", [
    ("paper_microllama_c4", "[cpu]", 1), ("paper_microllama_c4_16nodes", "[cpu,cpu,cpu,cpu]", 4)])
def test_both_readings_of_the_papers_cluster_run_their_first_round_on_cpu(tmp_path, cache_dir, reading, devices,
                                                                         nodes_per_trainer):
    """configs/paper_microllama_c4.yaml: the authors' reading, 4 nodes on one card, one per trainer; the 16-node
    reading, 4 simulated devices of 4 nodes. Both as the paper: fp16 with loss scaling, the nodes estimator, output
    layers re-initialized per trainer, an evaluation every 10 inner steps. Their first round on a CPU, with only what
    a CPU needs changed (devices, a tiny model, the embedded corpus)."""
    from tests.conftest import ROOT
    from utils.config import load_config

    cfg = load_config(ROOT / "configs" / f"{reading}.yaml", [
        f"devices={devices}", *PAPER_ON_CPU, f"cache_dir={cache_dir}", f"log_dir={tmp_path}", "run_name=paper"])
    assert (cfg.total_nodes, cfg.num_init_trainers, cfg.variance_estimator, cfg.ETA) == (4 * nodes_per_trainer, 4,
                                                                                          "nodes", 0.8)
    assert (cfg.precision, cfg.need_to_reinit_output_layers, cfg.eval_every_inner_steps) == ("fp16", True, 10)
    assert (cfg.merge_frequency, cfg.initial_batch_size, cfg.inner_weight_decay) == (3, 1, 0.1)
    # one node per trainer: the nodes estimator has no variance until a merge, and says so
    assert any("one node" in w for w in cfg.warnings()) == (nodes_per_trainer == 1)
    run_dir, summary = train(cfg)
    report = run_dir / "model_training_report"
    with (report / "training_log.csv").open() as f:
        first = [r for r in csv.DictReader(f) if r["outer_step"] == "1"]
    assert [r["trainer_id"] for r in first] == ["0", "1", "2", "3"]
    assert all(r["num_nodes"] == str(nodes_per_trainer) and r["requested_batch"] == "1" for r in first)
    if nodes_per_trainer == 4:  # the norm test decided from the 4 nodes' gradients of each trainer
        assert all(float(r["grad_sq_norm"]) > 0 and int(r["next_requested_batch"]) >= 1 for r in first)
        assert summary["statistics_bytes"] > 0
        # 16 nodes that fit one card only offloaded (its config), one per simulated device computing at once
        assert cfg.offload_idle_nodes and cfg.max_concurrent_nodes == 1
        assert [(d["nodes"], d["computing_at_once"], d["resident"]["node_weights"])
                for d in summary["memory_plan"]["devices"]] == [(4, 1, 0)] * 4
    else:  # one gradient per trainer: no variance, the batch stays, nothing is sent
        assert all(r["next_requested_batch"] == "1" for r in first) and summary["statistics_bytes"] == 0
    log = (run_dir / "training_log.log").read_text()
    assert "output layer lm_head re-initialized per trainer" in log and "each trainer has its own output layer" in log
    # the paper's cadence: each trainer's synced model evaluated at inner step 10 of 12, on the tokens seen by then
    with (report / "inner_eval.csv").open() as f:
        inner = list(csv.DictReader(f))
    assert [(r["trainer_id"], r["inner_step"]) for r in inner] == [(str(t), "10") for t in range(4)]
    assert all(0 < int(r["global_tokens"]) < int(first[-1]["global_tokens"]) and float(r["val_perplexity"]) > 1
               for r in inner)
    assert summary["outer_steps"] == 1


def test_evaluations_within_a_round_change_no_training_number(tiny_config):
    """eval_every_inner_steps: each trainer's synced model (all its nodes averaged) evaluated at inner steps 1 and 2
    of 3 (not 3: the trainer is evaluated after its outer step), every round, with the tokens seen by then; every
    training number and decision is what the same run without them gives."""
    plain_dir, _ = train(tiny_config("run_name=plain"))
    run_dir, _ = train(tiny_config("run_name=evaluated", "eval_every_inner_steps=1"))

    def rows(d, name):
        with (d / "model_training_report" / name).open() as f:
            return [{k: v for k, v in r.items() if k != "wall_time"} for r in csv.DictReader(f)]

    for name in ("training_log.csv", "step_loss_log.csv", "merge_events.csv"):
        assert rows(run_dir, name) == rows(plain_dir, name), name
    assert rows(plain_dir, "inner_eval.csv") == []
    inner, log = rows(run_dir, "inner_eval.csv"), rows(run_dir, "training_log.csv")
    steps = {r["outer_step"] for r in log} - {"0"}
    expected = [(s, r["trainer_id"], r["nodes"], str(j)) for s in sorted(steps, key=int)
                for r in log if r["outer_step"] == s for j in (1, 2)]
    assert [(r["outer_step"], r["trainer_id"], r["nodes"], r["inner_step"]) for r in inner] == expected
    for r in inner:  # between the tokens before the round and after it
        end = int(next(x["global_tokens"] for x in log if x["outer_step"] == r["outer_step"]))
        before = max((int(x["global_tokens"]) for x in log if int(x["outer_step"]) == int(r["outer_step"]) - 1),
                     default=0)
        assert before < int(r["global_tokens"]) < end and float(r["val_perplexity"]) > 1


def test_output_layers_are_reinitialized_per_trainer_as_the_authors_key_says():
    from fabrics.models import output_layer, output_layer_seed, reinit_output_layer

    model = LlamaForCausalLM(LlamaConfigForTest())
    assert output_layer(model) == "lm_head"
    states = {t: {k: v.detach().clone() for k, v in model.state_dict().items()} for t in (0, 1)}
    for t, state in states.items():
        reinit_output_layer(state, "lm_head", output_layer_seed(42, t))
    weight = states[0]["lm_head.weight"]
    fan_out, fan_in = weight.shape
    bound = (6 / (fan_in + fan_out)) ** 0.5  # Xavier-uniform
    assert weight.abs().max() <= bound and weight.abs().max() > 0.9 * bound
    assert not torch.equal(states[0]["lm_head.weight"], states[1]["lm_head.weight"])  # independent trainers
    again = {k: v.clone() for k, v in model.state_dict().items()}
    reinit_output_layer(again, "lm_head", output_layer_seed(42, 0))
    assert torch.equal(again["lm_head.weight"], weight)  # seeded: the same on every process
    assert torch.equal(states[0]["model.norm.weight"], model.state_dict()["model.norm.weight"])  # nothing else
    tied = LlamaForCausalLM(LlamaConfigForTest(tie_word_embeddings=True))
    with pytest.raises(UserError, match="ties lm_head to its input embeddings"):
        output_layer(tied)


def LlamaConfigForTest(**kw):  # noqa: N802 - a config factory
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, **kw)
