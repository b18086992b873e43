"""The CUDA paths, on a real GPU (marker cuda; deselected where there is none, see conftest.py).

Run by `python -m benchmarks.gpu_check` (or `python -m pytest -m cuda tests` on a GPU machine): bf16 and
fp16 train with falling loss and track fp32, the fp16 scaler skips an overflowing step, compile matches
eager, fused AdamW matches the reference AdamW, the batch-test statistics on the device equal the CPU
ones, the CUDA max-batch probe stays within its budget and leaves no memory behind, and offloaded nodes give the
resident run's numbers and leave the card while idle; stacked nodes make the sequential run's decisions.
"""

import csv

import pytest
import torch

from fabrics.precision import PRECISIONS
from node import Node, NodeJob
from run import train
from tests.conftest import ROOT, TINY
from utils.config import load_config

pytestmark = pytest.mark.cuda

LONGER = ["num_outer_steps=4", "num_inner_steps=4", "merge_frequency=0", "lr_inner=0.01", "sampling_method=constant",
          "devices=[cuda]"]


def step_losses(run_dir):
    with (run_dir / "model_training_report" / "step_loss_log.csv").open() as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def cuda_fp32_run(tmp_path_factory, cache_dir):
    log_dir = tmp_path_factory.mktemp("cuda_fp32")
    return train(load_config(ROOT / "config.yaml", [*TINY, *LONGER, f"cache_dir={cache_dir}", f"log_dir={log_dir}",
                                                     "run_name=fp32"]))


@pytest.mark.parametrize("precision, median_tolerance", [("bf16", 0.01), ("fp16", 0.005), ("tf32", 0.005)])
def test_mixed_precision_trains_with_falling_loss_and_tracks_fp32(cuda_fp32_run, tiny_config, precision,
                                                                  median_tolerance):
    """Tolerances: bf16 keeps 8 mantissa bits (about 0.4% per rounding), fp16 and tf32 10 bits; the median
    per-step relative loss difference over 16 steps stays within a few roundings of fp32."""
    run_dir, summary = train(tiny_config(*LONGER, f"precision={precision}", f"run_name={precision}"))
    fp32_dir, fp32_summary = cuda_fp32_run
    assert summary["final_metric"] < summary["initial_metric"]
    ours, reference = step_losses(run_dir), step_losses(fp32_dir)
    assert len(ours) == len(reference) and ours[-1] < ours[0]
    differences = sorted(abs(a - b) / b for a, b in zip(ours, reference))
    assert differences[len(differences) // 2] < median_tolerance
    assert summary["final_metric"] == pytest.approx(fp32_summary["final_metric"], rel=0.05)


def _node(tiny_config, precision: str, make=None):
    from fabrics.corpus import load_corpus
    from fabrics.models import build_model
    from utils.model_state import float_state

    cfg = tiny_config("devices=[cuda]", f"precision={precision}")
    data = load_corpus(cfg)
    model = build_model(cfg, len(data.tokenizer), data.tokenizer.pad_token_id).to("cuda")
    make = make or (lambda params: torch.optim.SGD(params, lr=0.1))
    node = Node(0, "cuda", model, make, 0.0, data.train, PRECISIONS[precision])
    master = {k: v.detach().clone() for k, v in float_state(model).items()}
    return node, master


def test_fp16_scaler_skips_an_overflowing_step(tiny_config):
    node, master = _node(tiny_config, "fp16")
    indices = torch.arange(4).view(1, 1, 4)
    node.run(NodeJob(0, 0, master, indices, 0, True))
    scale = node.scaler.get_scale()
    node.params[0].register_hook(lambda g: g * float("inf"))
    after = node.run(NodeJob(0, 0, master, indices, 0, False))
    name = "model.embed_tokens.weight"
    assert torch.equal(after.state[name].cpu(), master[name].cpu())  # the step was skipped
    assert node.scaler.get_scale() == scale / 2
    assert torch.cuda.memory_allocated() > 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_inner_steps_never_wait_for_the_gpu(tiny_config, precision):
    """Issue 59: a round's inner steps under torch.cuda.set_sync_debug_mode("error") (any synchronising call raises),
    fused AdamW and clipping included; only the round's start and end may read the device (tests/test_host_syncs.py
    counts the reads on CPU; this catches copies to the host as well)."""
    from trainers import DiLoCoTrainer

    cfg = tiny_config("devices=[cuda]", f"precision={precision}")
    node, master = _node(tiny_config, precision, DiLoCoTrainer.inner_optimizer_factory(cfg))
    node.grad_clip = 1.0
    job = NodeJob(0, 0, master, torch.arange(16).view(4, 1, 4), 0, True)
    steps = node.steps(job, [1, 2, 3, 4])
    next(steps)  # the round's start and its first step (the optimizer is made there)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # inner steps 2 to 4
            next(steps)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(StopIteration):
        next(steps)  # the end: the losses, read once


def test_a_growing_batch_compiles_nothing_after_the_warm_up_on_cuda(tiny_config):
    """Issue 59, item 3, with inductor on the GPU: the batch grows through 4 sizes, every micro-batch is padded to a
    bucket compiled in the warm-up, and training compiles no graph (tests/test_compile_buckets.py: the same on CPU
    with aot_eager, and eager's numbers)."""
    from tests.test_compile_buckets import GROWING

    config = [o for o in GROWING if not o.startswith("compile_backend")]
    _, summary = train(tiny_config("devices=[cuda]", *config, "compile=true", "run_name=compiled_growing"))
    assert summary["compile"]["warm_up_graphs"] >= 4 and summary["compile"]["graphs_after_warm_up"] == 0


def test_compile_matches_eager_on_cuda(cuda_fp32_run, tiny_config):
    """fp32 both. The first GPU check (H100, 2026-11-26) failed this at one step in 32 (0.9%): the compiled run
    came after the tf32 test in the same process and inherited its TensorFloat-32 switch; every precision now
    sets the switch (tests/test_precision.py checks it on CPU)."""
    run_dir, _ = train(tiny_config(*LONGER, "compile=true", "run_name=compiled"))
    compiled, eager = step_losses(run_dir), step_losses(cuda_fp32_run[0])
    differences = [abs(a - b) / b for a, b in zip(compiled, eager)]
    assert len(compiled) == len(eager) and max(differences) <= 1e-3, ", ".join(f"{d:.1e}" for d in differences)


def test_fused_adamw_matches_the_reference_adamw(tiny_config):
    """The factory picks the fused kernel on CUDA; after 5 steps on the same gradients it equals
    torch's for-each AdamW to 1e-6 (fp32 rounding of a different summation order)."""
    from trainers import TRAINERS

    cfg = tiny_config("devices=[cuda]")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(64, 32), (32,), (4096, 64)]
    fused_params = [torch.randn(s, device="cuda", generator=gen, requires_grad=True) for s in shapes]
    reference_params = [p.detach().clone().requires_grad_(True) for p in fused_params]
    fused = TRAINERS["DiLoCo"].inner_optimizer_factory(cfg)(fused_params)
    assert fused.defaults["fused"] is True
    reference = torch.optim.AdamW(reference_params, lr=cfg.lr_inner, betas=tuple(cfg.inner_betas),
                                  weight_decay=cfg.inner_weight_decay, foreach=True)
    for _ in range(5):
        grads = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
        for p, q, g in zip(fused_params, reference_params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        reference.step()
    for p, q in zip(fused_params, reference_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("within_node", [True, False])
def test_batch_statistics_on_the_device_equal_the_cpu_ones(within_node):
    from algorithms.calc_batch import STATISTICS_WIRE, NodeGradientSums

    gen = torch.Generator().manual_seed(3)
    grads = torch.randn(6, 5000, generator=gen, dtype=torch.float64)
    sizes = torch.tensor([1.0, 2.0, 3.0, 1.0, 2.0, 4.0], dtype=torch.float64)
    for wire in STATISTICS_WIRE.values():
        on_cpu = NodeGradientSums.of(grads, sizes, within_node, wire)
        on_gpu = NodeGradientSums.of(grads.cuda(), sizes.cuda(), within_node, wire)
        cpu_buffer, gpu_buffer = on_cpu.vectors(), on_gpu.vectors()
        assert gpu_buffer.is_cuda
        torch.testing.assert_close(gpu_buffer.cpu(), cpu_buffer, rtol=1e-6, atol=1e-9)
        mean = wire.reduced_mean(cpu_buffer, within_node)
        scalars_cpu, scalars_gpu = on_cpu.scalars(mean), on_gpu.scalars(mean.cuda())
        torch.testing.assert_close(scalars_gpu.cpu(), scalars_cpu, rtol=1e-6, atol=1e-9)
        a = wire.statistics(cpu_buffer, scalars_cpu, within_node)
        b = wire.statistics(gpu_buffer.cpu(), scalars_gpu.cpu(), within_node)
        for key, value in vars(a).items():
            if isinstance(value, float):
                assert getattr(b, key) == pytest.approx(value, rel=1e-6), key


def test_the_cuda_probe_stays_within_its_budget_and_leaves_nothing(tiny_config, monkeypatch):
    from cluster.max_batch_calculator import NodeShare, find_max_batch_size
    from fabrics.corpus import load_corpus
    from fabrics.models import build_model
    from trainers import TRAINERS

    cfg = tiny_config("devices=[cuda]", "nodes_per_gpu=4")
    data = load_corpus(cfg)
    model = build_model(cfg, len(data.tokenizer), data.tokenizer.pad_token_id)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    free, _ = torch.cuda.mem_get_info()
    # the probe resets the peak before each candidate: keep the highest peak of all of them
    peaks, reset = [], torch.cuda.reset_peak_memory_stats
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda *a: (peaks.append(torch.cuda.max_memory_allocated()), reset(*a)))
    reset()
    padding = 4 * (64 << 20) / free  # 64 MiB per node: the search has to stop at the budget, not at `upper`
    budget = padding * free / 4
    found = find_max_batch_size(model, TRAINERS["DiLoCo"].inner_optimizer_factory(cfg), "cuda", cfg.seq_len,
                                NodeShare(padding, 4), upper=4096)
    peaks.append(torch.cuda.max_memory_allocated())
    monkeypatch.undo()
    assert 1 <= found < 4096
    # the model replica and its optimizer are part of what the budget covers
    assert max(peaks) - before <= budget * 1.05  # 5%: the line through batches 1 and 2 is a prediction
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before  # no tensor of the probe (nor of an OOM) left behind


def test_offloaded_nodes_on_the_gpu_give_the_same_run_and_leave_the_card(tmp_path, cache_dir):
    """offload_idle_nodes on CUDA (pinned host buffers, a copy stream per node), 4 nodes as threads taking turns one at
    a time: every CSV equals the resident run's, and after a round an idle node holds no device memory."""
    from tests.test_resume_and_faults import assert_same_run

    runs = {}
    for name, extra in (("resident", []), ("offloaded", ["offload_idle_nodes=true", "max_concurrent_nodes=1"])):
        runs[name], _ = train(load_config(ROOT / "config.yaml", [
            *TINY, "devices=[cuda]", "nodes_per_gpu=4", "num_init_trainers=2", "node_execution=threads",
            "num_outer_steps=4", f"cache_dir={cache_dir}", f"log_dir={tmp_path}", f"run_name={name}", *extra]))
    assert_same_run(runs["resident"], runs["offloaded"])
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).cuda()
    node = Node(0, "cuda:0", model, lambda ps: torch.optim.AdamW(list(ps)), 0.0, None)
    node.offload.enabled = True
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    node.release()
    assert torch.cuda.memory_allocated() <= before - 4 * 1024 * 1024  # the 4 MiB weight matrix left the card
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
    node._load_in()
    assert all(p.is_cuda for p in model.parameters())


def test_stacked_nodes_on_the_gpu_make_the_sequential_runs_decisions(tmp_path, cache_dir):
    """node_execution: stacked on one GPU (4 nodes, 2 trainers, fp32 without TF32): the sequential run's batch
    decisions and merges, step losses within 1e-3 (cuBLAS's batched kernels sum in another order than its own
    per-node ones)."""
    def run(way):
        return train(load_config(ROOT / "config.yaml", [*TINY, "devices=[cuda]", "nodes_per_gpu=4",
                                                         f"cache_dir={cache_dir}", f"log_dir={tmp_path}",
                                                         f"run_name={way}", f"node_execution={way}"]))[0]

    sequential, stacked = run("sequential"), run("stacked")
    for name in ("merge_events.csv", "training_log.csv"):
        with (sequential / "model_training_report" / name).open() as a, \
                (stacked / "model_training_report" / name).open() as b:
            keys = ("outer_step", "trainer_id", "requested_batch", "next_requested_batch", "survivor", "merged")
            assert [{k: r[k] for k in keys if k in r} for r in csv.DictReader(a)] == \
                [{k: r[k] for k in keys if k in r} for r in csv.DictReader(b)]
    assert step_losses(stacked) == pytest.approx(step_losses(sequential), rel=1e-3)

