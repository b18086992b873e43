"""node_execution: stacked (issue 60): a device's nodes of one shape as one model over stacked weights.

By hand: AdamW over stacked tensors moves each slice as the node's own torch.optim.AdamW (its own step count and
learning rate), and a round of two tiny nodes (other weights, other optimizer histories, padded batches whose
padding token reaches the embedding, the batch test's samples) ends within 1e-5 of each node's own round. End to
end: the default config, a 4-node DiLoCo b4, 16 nano nodes and a streamed int8 run give the sequential run's batch
decisions and merges with node losses within 1e-4 after 3 rounds; a NaN faults its node only; a stacked run
resumes sequentially (and back) to the uninterrupted run; what it cannot run is refused in one line.
"""

import copy
import csv

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from algorithms.stacked_adamw import AdamWHyper, stacked_adamw_step
from distributed.stacked import StackedGroup, groups_of
from fabrics.dataset_loader import PackedData
from node import Node, NodeJob
from run import main, resume_config, train
from tests.conftest import ROOT, TINY
from utils.config import load_config
from utils.errors import ConfigError
from utils.model_state import float_state


def test_stacked_adamw_moves_each_slice_as_its_own_adamw_by_hand():
    # one scalar parameter, first step: exp_avg = 0.1 g, exp_avg_sq = 0.05 g^2, bias corrections 0.1 and 0.05, so
    # the update is lr g / (|g| + eps / sqrt 0.05 ...) = lr sign(g) (eps is negligible), after the decay 1 - lr wd:
    # node 0 (lr 0.01): 2 x (1 - 0.001) - 0.01 = 1.988; node 1 (lr 0.1, g < 0): 2 x (1 - 0.01) + 0.1 = 2.08
    param, grad = torch.tensor([2.0, 2.0]), torch.tensor([0.5, -3.0])
    exp_avg, exp_avg_sq, steps = torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.float64)
    stacked_adamw_step([param], [grad], [exp_avg], [exp_avg_sq], steps, torch.tensor([0.01, 0.1]),
                       AdamWHyper(0.9, 0.95, 1e-8, 0.1))
    assert param.tolist() == pytest.approx([1.988, 2.08], abs=1e-6) and steps.tolist() == [1.0, 1.0]
    assert exp_avg.tolist() == pytest.approx([0.05, -0.3]) and exp_avg_sq.tolist() == pytest.approx([0.0125, 0.45])

    # against torch.optim.AdamW: three nodes, other learning rates, one of them 4 steps ahead
    torch.manual_seed(0)
    shapes = [(5, 4), (7,)]
    own = [[torch.randn(s, requires_grad=True) for s in shapes] for _ in range(3)]
    lrs = [1e-3, 3e-3, 2e-2]
    optimizers = [torch.optim.AdamW(own[n], lr=lrs[n], betas=(0.9, 0.95), weight_decay=0.1) for n in range(3)]
    for _ in range(4):
        for p in own[1]:
            p.grad = torch.randn_like(p)
        optimizers[1].step()

    def state(n, i, key):
        return optimizers[n].state[own[n][i]][key] if own[n][i] in optimizers[n].state else torch.zeros(shapes[i])

    stacked = [torch.stack([own[n][i].detach() for n in range(3)]) for i in range(2)]
    exp_avgs = [torch.stack([state(n, i, "exp_avg") for n in range(3)]) for i in range(2)]
    exp_avg_sqs = [torch.stack([state(n, i, "exp_avg_sq") for n in range(3)]) for i in range(2)]
    steps = torch.tensor([0.0, 4.0, 0.0], dtype=torch.float64)
    for _ in range(5):
        grads = [torch.randn(3, *s) for s in shapes]
        for n in range(3):
            for i, p in enumerate(own[n]):
                p.grad = grads[i][n].clone()
            optimizers[n].step()
        stacked_adamw_step(stacked, grads, exp_avgs, exp_avg_sqs, steps, torch.tensor(lrs),
                           AdamWHyper.of(optimizers[0]))
    assert steps.tolist() == [5.0, 9.0, 5.0]
    for n in range(3):
        for i in range(2):
            torch.testing.assert_close(stacked[i][n], own[n][i].detach(), rtol=1e-6, atol=1e-8)
            torch.testing.assert_close(exp_avgs[i][n], state(n, i, "exp_avg"), rtol=1e-6, atol=0)
            torch.testing.assert_close(exp_avg_sqs[i][n], state(n, i, "exp_avg_sq"), rtol=1e-6, atol=0)


def _tiny_nodes(grad_clip=1.0):
    """Two nodes of a tiny Llama (padding id 0) with other weights, over 32 sequences of which 8 are padded, and
    sequences that hold token 0 (the padding row must get no gradient, as nn.Embedding's backward gives)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0))
    ids = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[:8, -4:] = 0
    data = PackedData(ids.masked_fill(mask == 0, 0), mask)

    def adamw(lr):
        return lambda ps: torch.optim.AdamW(list(ps), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)

    nodes = [Node(i, "cpu", copy.deepcopy(model), adamw(lr), grad_clip, data) for i, lr in enumerate((3e-3, 1e-2))]
    masters = []
    for i in range(2):
        torch.manual_seed(10 + i)
        masters.append({k: v.detach() + 0.01 * torch.randn_like(v) for k, v in float_state(model).items()})
    return nodes, masters


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-5 relative, element by element, or of the tensor's largest value (an element near 0 after a
    cancellation carries the absolute error of its neighbours)."""
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def _jobs(masters, steps, accumulation, rows, chunks, seed, reset):
    g = torch.Generator().manual_seed(seed)
    return [NodeJob(i, i, masters[i], torch.randint(0, 32, (steps, accumulation, rows), generator=g), chunks,
                    reset_optimizer=reset[i]) for i in range(2)]


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_stacked_round_ends_where_each_nodes_own_round_does(chunks):
    """Two rounds: the first (2 steps) leaves node 0 with an AdamW history; the second (3 steps of 2 micro-batches
    of 2, padded sequences among them) resets node 1 only. Stacked, every loss, weight, AdamW moment, step count and
    gradient sample is each node's own round's within 1e-5 relative."""
    sequential, masters = _tiny_nodes()
    stacked, _ = _tiny_nodes()
    first = _jobs(masters, 2, 1, 2, 0, seed=5, reset=(True, True))
    second = _jobs(masters, 3, 2, 2, chunks, seed=6, reset=(False, True))
    assert [len(g) for g in groups_of(stacked, second)] == [2]
    stacks = {}  # as the backend keeps them: the second round finds the first's stack and copies nothing in
    for jobs in (first, second):
        expected = [node.run(job) for node, job in zip(sequential, jobs)]
        group = StackedGroup(stacked, jobs, stacks)
        rounds = group.steps()
        try:
            while True:
                next(rounds)
        except StopIteration as done:
            got = done.value
    assert bool(torch.isin(stacked[0].data.input_ids[second[0].sample_indices], torch.tensor([0])).any())
    for a, b, node_a, node_b in zip(expected, got, sequential, stacked):
        assert b.step_losses == pytest.approx(a.step_losses, rel=1e-5) and b.tokens == a.tokens
        for name in a.state:
            close(b.state[name], a.state[name])
        close(b.grad_samples, a.grad_samples)
        assert torch.equal(b.sample_batches, a.sample_batches) and b.learning_rate == a.learning_rate
        for p_a, p_b in zip(node_a.params, node_b.params):
            s_a, s_b = node_a.optimizer.state[p_a], node_b.optimizer.state[p_b]
            assert float(s_b["step"]) == float(s_a["step"])
            close(s_b["exp_avg"], s_a["exp_avg"])
            close(s_b["exp_avg_sq"], s_a["exp_avg_sq"])
    assert float(sequential[0].optimizer.state[sequential[0].params[0]]["step"]) == 5  # node 0 kept its history
    (stack,) = stacks.values()  # one stack; each node's tensors are views of its row
    for k, node in enumerate(stacked):
        assert node.params[0].data_ptr() == stack.weights[k].data_ptr()
        moment = node.optimizer.state[node.params[-1]]["exp_avg_sq"]
        assert moment.data_ptr() == stack.view(stack.exp_avg_sq, k)[-1].data_ptr()


def test_a_stop_leaves_a_stacked_round_between_two_inner_steps():
    from node import RoundAbandoned

    nodes, masters = _tiny_nodes()
    rounds = StackedGroup(nodes, _jobs(masters, 3, 1, 2, 0, seed=5, reset=(True, True))).steps([1])
    assert next(rounds) == 1  # paused after inner step 1; a stop arrives
    nodes[0].stop.set()
    with pytest.raises(RoundAbandoned, match=r"nodes \[0, 1\] stopped before inner step 1"):
        next(rounds)


def test_nodes_of_other_shapes_or_asked_to_fail_run_in_groups_of_their_own():
    nodes, masters = _tiny_nodes()
    nodes.append(Node(2, "cpu", None, None, 0.0, nodes[0].data))
    nodes.append(Node(3, "cpu", None, None, 0.0, nodes[0].data))
    jobs = [NodeJob(i, 0, masters[0], torch.zeros(3, 1, 2 if i != 1 else 4, dtype=torch.long), 1, True)
            for i in range(4)]
    jobs[3].inject_fault = "error"
    assert [[j.node_id for j in g] for g in groups_of(nodes, jobs)] == [[0, 2], [1], [3]]


def _run(tmp_path, name, *extra):
    cfg = load_config(ROOT / "config.yaml", [*TINY, f"log_dir={tmp_path}", f"run_name={name}", "cpu_threads=1",
                                             *extra])
    return train(cfg)


def _rows(run_dir, name):
    with (run_dir / "model_training_report" / name).open() as f:
        return list(csv.DictReader(f))


def _agree(rows_a, rows_b, exact, close):
    """The same rows: the columns in `exact` equal, those in `close` within 1e-5 relative in the first round and
    1e-4 after it (a round's differences compound over a run's rounds)."""
    assert len(rows_a) == len(rows_b)
    for ra, rb in zip(rows_a, rows_b):
        assert {k: ra[k] for k in exact} == {k: rb[k] for k in exact}
        rel = 1e-5 if ra.get("outer_step") == "1" else 1e-4
        for k in close:
            assert ra[k] == rb[k] or float(rb[k]) == pytest.approx(float(ra[k]), rel=rel), k


DECISIONS = ("outer_step", "trainer_id", "nodes", "requested_batch", "loader_batch", "accumulation_steps",
             "next_requested_batch", "test_requested_batch", "tokens_seen", "total_traffic_bytes")


def _same_run(a, b):
    """The same batch decisions and merges; losses and metrics within 1e-4 relative."""
    merges = _rows(a, "merge_events.csv")
    _agree(merges, _rows(b, "merge_events.csv"), ("outer_step", "survivor", "merged", "weights", "requested_batches",
                                                  "bytes", "metric"), ("metric_weighted_before", "metric_after"))
    _agree(_rows(a, "training_log.csv"), _rows(b, "training_log.csv"), DECISIONS, ("train_loss", "val_loss"))
    _agree(_rows(a, "step_loss_log.csv"), _rows(b, "step_loss_log.csv"),
           ("outer_step", "trainer_id", "node_id", "inner_step", "micro_batch", "accumulation_steps"), ("loss",))
    return merges


@pytest.mark.parametrize("config", [
    # the default config's mechanisms on the tiny shapes: two trainers, merges, adaptive batches, its estimator
    ["eval_every_inner_steps=1"],
    # DiLoCo b4 on 4 nodes of one device (one group of 4), the nodes estimator off, Nesterov outer steps
    ["num_init_trainers=1", "nodes_per_gpu=4", "sampling_method=constant", "initial_batch_size=4",
     "merge_frequency=0", "outer_momentum=0.9", "outer_nesterov=true"],
    # 16 microllama-nano nodes on one device, 4 trainers of 4 nodes
    ["model_config.name=microllama-nano", "nodes_per_gpu=16", "num_init_trainers=4", "num_outer_steps=2"],
    # Streaming DiLoCo's fragments (2, one step of delay) with int8 pseudo-gradients and error feedback
    ["sync_fragments=2", "sync_delay=1", "num_inner_steps=4", "outer_compression=int8"],
], ids=["default", "diloco_b4", "nano_16_nodes", "streamed_int8"])
def test_a_stacked_run_makes_the_sequential_runs_decisions(tmp_path, cache_dir, config, monkeypatch):
    extra = [f"cache_dir={cache_dir}", *config]
    sequential, _ = _run(tmp_path, "sequential", "node_execution=sequential", *extra)
    sizes = []  # the stacked groups the run made: it stacked, not merely ran its nodes one by one
    made = StackedGroup.__init__
    monkeypatch.setattr(StackedGroup, "__init__", lambda self, nodes, *a: (sizes.append(len(nodes)),
                                                                            made(self, nodes, *a))[1])
    stacked, _ = _run(tmp_path, "stacked", "node_execution=stacked", *extra)
    assert sizes and max(sizes) == (16 if "nodes_per_gpu=16" in config else 4 if "nodes_per_gpu=4" in config else 2)
    merges = _same_run(sequential, stacked)
    assert bool(merges) == ("merge_frequency=0" not in config)
    if "eval_every_inner_steps=1" in config:  # the synced model within a round, read from the stack
        _agree(_rows(sequential, "inner_eval.csv"), _rows(stacked, "inner_eval.csv"),
               ("outer_step", "trainer_id", "nodes", "inner_step"), ("val_loss",))


def test_a_nan_faults_its_node_only_and_a_stacked_run_resumes_sequentially_and_back(tmp_path, cache_dir):
    extra = [f"cache_dir={cache_dir}", "on_node_fault=skip", "inject_fault=2:1:nan"]
    sequential, _ = _run(tmp_path, "sequential", "node_execution=sequential", *extra)
    stacked, _ = _run(tmp_path, "stacked", "node_execution=stacked", *extra, "num_outer_steps=2")
    cfg, checkpoint = resume_config(stacked, ["num_outer_steps=3", "node_execution=sequential"], None)
    stacked, _ = train(cfg, (stacked, checkpoint))
    (fault,) = _rows(stacked, "fault_events.csv")
    assert (fault["outer_step"], fault["node_id"], fault["kind"]) == ("2", "1", "nan")
    assert _rows(stacked, "fault_events.csv") == _rows(sequential, "fault_events.csv")
    _same_run(sequential, stacked)
    # and back: a sequential run resumed stacked
    back, _ = _run(tmp_path, "back", "node_execution=sequential", *extra, "num_outer_steps=1")
    cfg, checkpoint = resume_config(back, ["num_outer_steps=3", "node_execution=stacked"], None)
    back, _ = train(cfg, (back, checkpoint))
    _same_run(sequential, back)


def test_the_memory_plan_counts_a_stack_at_once(tiny_config):
    """Stacked, every node of a device computes at once (their gradients and activations), and a new stack's copy
    of their state is counted where it exceeds that (before any gradient exists)."""
    from cluster.memory_plan import plan_for_config

    sequential, stacked = (plan_for_config(tiny_config("nodes_per_gpu=4", "num_init_trainers=1",
                                                       f"node_execution={way}")).devices[0]
                           for way in ("sequential", "stacked"))
    assert (sequential.computing, stacked.computing) == (1, 4)
    assert stacked.transient["gradients"] == 4 * sequential.transient["gradients"]
    assert stacked.transient["activations"] == 4 * sequential.transient["activations"]
    state = sum(stacked.resident[k] for k in ("node_weights", "node_optimizer"))
    compute = sum(v for k, v in stacked.transient.items() if k != "stacking_copy")
    assert stacked.transient["stacking_copy"] == max(0, state - compute)
    assert "stacking_copy" not in sequential.transient


@pytest.mark.parametrize("setting, key", [
    ("distributed_algo=DDP", "distributed_algo"), ("distributed_algo=LocalSGD", "distributed_algo"),
    ("model_type=bert", "model_type"), ("precision=fp16", "precision"),
    ("offload_idle_nodes=true", "offload_idle_nodes")])
def test_what_stacked_cannot_run_is_refused_in_one_line(tiny_config, capsys, setting, key):
    with pytest.raises(ConfigError, match=f"^config key '{key}': .*not with node_execution: stacked"):
        tiny_config("node_execution=stacked", setting)
    assert main(["--config", str(ROOT / "config.yaml"), *TINY, "node_execution=stacked", setting]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and "node_execution: stacked" in err
