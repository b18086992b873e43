"""precision, compile and the gradient statistics' cost (issue 12), on CPU."""

import csv
import math

import pytest
import torch

from cluster import master_device_of
from fabrics.precision import PRECISIONS
from node import Node, NodeJob
from run import train
from tests.conftest import ROOT, TINY
from utils.config import load_config
from utils.errors import ConfigError


def rows(run_dir, name="training_log.csv"):
    with (run_dir / "model_training_report" / name).open() as f:
        return list(csv.DictReader(f))


def step_losses(run_dir):
    return [float(r["loss"]) for r in rows(run_dir, "step_loss_log.csv")]


LONGER = ["num_outer_steps=4", "num_inner_steps=4", "merge_frequency=0", "lr_inner=0.01", "sampling_method=constant"]


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory, cache_dir):
    log_dir = tmp_path_factory.mktemp("fp32")
    run_dir, summary = train(load_config(ROOT / "config.yaml", [*TINY, *LONGER, f"cache_dir={cache_dir}",
                                                                f"log_dir={log_dir}", "run_name=fp32"]))
    return run_dir, summary


def test_bf16_on_cpu_trains_with_falling_loss_close_to_fp32(fp32_run, tiny_config):
    run_dir, summary = train(tiny_config(*LONGER, "precision=bf16", "run_name=bf16"))
    fp32_dir, fp32_summary = fp32_run
    ppl = [float(r["val_perplexity"]) for r in rows(run_dir) if r["trainer_id"] == "0"]
    assert ppl[-1] < ppl[0] and summary["final_metric"] < summary["initial_metric"]
    bf16, fp32 = step_losses(run_dir), step_losses(fp32_dir)
    assert bf16 != fp32  # autocast really ran: bf16 matmuls round differently
    # ...and train the same model: step by step the losses agree closely (single spikes aside)
    differences = sorted(abs(a - b) / b for a, b in zip(bf16, fp32))
    assert len(bf16) == len(fp32) and differences[len(differences) // 2] < 0.005 and sum(differences) / len(
        differences) < 0.02
    assert summary["final_metric"] == pytest.approx(fp32_summary["final_metric"], rel=0.05)


def test_fp16_with_a_loss_scaler_per_node_trains_and_checkpoints_the_scale(tiny_config):
    run_dir, summary = train(tiny_config(*LONGER, "precision=fp16", "run_name=fp16"))
    assert summary["final_metric"] < summary["initial_metric"]
    assert all(math.isfinite(x) for x in step_losses(run_dir))
    state = torch.load(run_dir / "model_weights" / "final" / "resume_state.pt", weights_only=False)
    scalers = [o["scaler"] for o in state["optimizers"] if o is not None]
    assert scalers and all(s["scale"] > 0 for s in scalers)


def test_fp16_node_step_unscales_gradients_and_skips_an_overflow(tiny_config):
    """The scaled backward, unscale before clipping, a skipped step when a gradient overflows."""
    from fabrics.corpus import load_corpus
    from fabrics.models import build_model
    from utils.model_state import float_state

    cfg = tiny_config("precision=fp16")
    data = load_corpus(cfg)
    model = build_model(cfg, len(data.tokenizer), data.tokenizer.pad_token_id)
    make = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    node = Node(0, "cpu", model, make, 0.0, data.train, PRECISIONS["fp16"])
    master = {k: v.detach().clone() for k, v in float_state(model).items()}
    indices = torch.arange(4).view(1, 1, 4)
    result = node.run(NodeJob(0, 0, master, indices, 1, True))
    # the sample is the true gradient: the scaler's 65536 is divided out
    assert node.scaler is not None and node.scaler.get_scale() == 65536.0
    assert 1e-4 < float(result.grad_samples.norm()) < 1e3
    assert not torch.equal(result.state["model.embed_tokens.weight"], master["model.embed_tokens.weight"])
    # an overflowing gradient: the step is skipped (weights unchanged) and the scale halves
    node.params[0].register_hook(lambda g: g * float("inf"))
    after = node.run(NodeJob(0, 0, master, indices, 0, False))
    assert torch.equal(after.state["model.embed_tokens.weight"], master["model.embed_tokens.weight"])
    assert node.scaler.get_scale() == 32768.0


def test_every_precision_sets_the_tf32_switches_so_none_leaks_into_a_later_run():
    """The switches are global to a process; a tf32 run (or benchmark variant) once left them on for the fp32 runs
    after it in the same process, as the first GPU check found. Flags only: this holds on CPU too."""
    from fabrics.precision import build_precision

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for name, expected in [("tf32", True), ("fp32", False), ("tf32", True), ("bf16", False), ("fp16", False)]:
            assert build_precision(name) is PRECISIONS[name]
            assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (expected, expected)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_compile_gives_the_eager_losses(fp32_run, tiny_config):
    """The compiled run at the eager run's constant batch 2, with inductor's generated kernels. Its max_batch 1 (the
    eager run's is 4) runs each request of 2 as 1x2 (always accumulated) against the eager 2x1, the same loss up to
    the order of a sum, and compiles one bucket instead of 4: inductor's compile is most of this test's time
    (test_compile_buckets.py grows a batch across several buckets)."""
    run_dir, summary = train(tiny_config(*LONGER, "compile=true", "max_batch_size=1",
                                         "switch_mode=only_gradient_accumulation", "run_name=compiled"))
    assert summary["compile"]["buckets"] == [1]
    assert {r["accumulation_steps"] for r in rows(run_dir, "step_loss_log.csv")} == {"2"}
    eager = step_losses(fp32_run[0])
    compiled = step_losses(run_dir)
    assert len(compiled) == len(eager)
    assert all(abs(a - b) <= 1e-3 * b for a, b in zip(compiled, eager))


def test_constant_batch_without_statistics_computes_no_gradient_samples(tiny_config, monkeypatch):
    taken = []
    original = Node._last_step_with_samples
    monkeypatch.setattr(Node, "_last_step_with_samples", lambda self, *a: taken.append(1) or original(self, *a))
    run_dir, _ = train(tiny_config("sampling_method=constant", "log_batch_statistics=false", "run_name=nostats"))
    trained = lambda d: [r for r in rows(d) if r["outer_step"] != "0"]  # noqa: E731  (step 0: the initial row)
    assert not taken
    assert all(r["variance"] == "" for r in trained(run_dir))
    # the default still logs them for a constant batch
    run_dir, _ = train(tiny_config("sampling_method=constant", "run_name=stats"))
    assert taken and all(r["variance"] != "" for r in trained(run_dir))


@pytest.mark.parametrize("overrides, key, words", [
    (["precision=tf32"], "precision", "tf32 is a CUDA matmul mode"),
    (["compile=true", "node_execution=threads"], "compile", "not thread-safe"),
    (["precision=fp8"], "precision", "fp8"),
])
def test_precision_and_compile_config_errors(tiny_config, overrides, key, words):
    with pytest.raises(ConfigError) as err:
        tiny_config(*overrides)
    assert err.value.key == key and words in str(err.value)


@pytest.mark.parametrize("setting, devices, expected", [
    ("auto", ["cpu", "cpu"], "cpu"),
    ("auto", ["cuda", "cuda:0"], "cuda:0"),  # one GPU shared by every node: the masters join it
    ("auto", ["cuda:0", "cuda:1"], "cpu"),  # several GPUs: one place for the masters is the host
    ("auto", ["cuda:0", "cpu"], "cpu"),
    ("cpu", ["cuda:0", "cuda:0"], "cpu"),
])
def test_master_device_rule(tiny_config, setting, devices, expected):
    assert master_device_of(tiny_config(f"master_device={setting}"), devices) == expected


def test_a_nodes_autocast_context_is_made_once_and_works_each_time_it_is_entered():
    """The node enters one context per micro-batch (made once): each entry switches bf16 autocast on, each exit
    restores what was there before, on the tenth entry as on the first."""
    model = torch.nn.Linear(4, 4)
    node = Node(0, "cpu", model, lambda p: torch.optim.AdamW(p), 0.0, None, PRECISIONS["bf16"])
    x = torch.randn(2, 4)
    for _ in range(10):
        assert not torch.is_autocast_enabled("cpu")
        with node.autocast:
            assert torch.is_autocast_enabled("cpu") and model(x).dtype == torch.bfloat16
    assert model(x).dtype == torch.float32
    with PRECISIONS["fp32"].autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")
