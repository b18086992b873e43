"""DDP and SNOO (distributed/synchronous.py): gradients averaged after every inner step, by hand and end to end."""

import pytest
import torch

from distributed.in_process import InProcessBackend
from fabrics.dataset_loader import PackedData, ShardSampler
from node import Node, NodeJob
from run import train
from tests.test_streaming import tiny_model
from trainers import DDPTrainer, DiLoCoTrainer, SNOOTrainer
from utils.config import load_config
from utils.errors import ConfigError
from utils.model_state import float_state


def data():
    ids = torch.randint(2, 50, (64, 8), generator=torch.Generator().manual_seed(1))
    return PackedData(ids, torch.ones_like(ids))


def ddp_round(num_nodes, batch, cfg, indices, trainer_class=DDPTrainer):
    """One round of a trainer with `num_nodes` nodes of `batch` sequences per step; indices[step] holds the
    round's num_nodes x batch sequences of that step, node i taking the i-th slice."""
    model, packed = tiny_model(), data()
    initial = float_state(model)
    trainer = trainer_class(0, initial, {n for n, _ in model.named_parameters()}, cfg, ShardSampler(64, 0))
    make = trainer.inner_optimizer_factory(cfg)
    nodes = [Node(i, "cpu", tiny_model(), make, grad_clip=1.0, data=packed) for i in range(num_nodes)]
    jobs = [NodeJob(i, 0, trainer.master, indices[:, i * batch:(i + 1) * batch].reshape(-1, 1, batch), 0,
                    reset_optimizer=True, sync_gradients=trainer.syncs_gradients) for i in range(num_nodes)]
    outcome = InProcessBackend(nodes, concurrent=num_nodes > 1).run_round(jobs, {0: trainer})
    results, faults = outcome.results, outcome.faults
    assert not faults
    trainer.outer_step(results[0].node_mean)
    return trainer, nodes, results[0]


CFG = ["lr_inner=0.01", "lr_outer=1.0", "outer_momentum=0.0", "num_inner_steps=4"]


@pytest.mark.parametrize("num_nodes", [2, 4])
def test_ddp_of_n_nodes_of_batch_b_equals_one_node_of_batch_n_b(num_nodes):
    cfg = load_config(None, [*CFG, "distributed_algo=DDP"])
    batch, steps = 2, 4
    indices = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:steps * num_nodes * batch]
    indices = indices.view(steps, num_nodes * batch)
    many, nodes, result = ddp_round(num_nodes, batch, cfg, indices)
    one, _, _ = ddp_round(1, num_nodes * batch, cfg, indices)
    # fp32 rounding: the mean of n means against one mean, which AdamW's division by sqrt(v) enlarges where a
    # gradient is nearly zero (rare tokens' embedding rows): 1e-5 against weights that moved about 4e-2
    for name, value in one.master.items():
        assert torch.allclose(many.master[name], value, rtol=0, atol=1e-5), name
    # the nodes end the round with the same weights (one AdamW in lockstep), and the master takes them
    states = [float_state(n.model) for n in nodes]
    assert all(torch.equal(s[name], states[0][name]) for s in states for name in states[0])
    assert all(torch.equal(many.master[name], states[0][name].float()) for name in states[0])
    assert result.optimizer_steps == num_nodes * steps
    # without the averaging the nodes drift apart: the test can fail
    cfg_local = load_config(None, [*CFG, "distributed_algo=DiLoCo"])
    _, drifted, _ = ddp_round(num_nodes, batch, cfg_local, indices, DiLoCoTrainer)
    first = [float_state(n.model) for n in drifted]
    assert not all(torch.equal(s[name], first[0][name]) for s in first for name in first[0])


def test_snoo_with_outer_lr_1_and_no_momentum_equals_ddp():
    indices = torch.arange(16).view(4, 4)
    ddp, _, _ = ddp_round(2, 2, load_config(None, [*CFG, "distributed_algo=DDP"]), indices)
    snoo, _, _ = ddp_round(2, 2, load_config(None, [*CFG, "distributed_algo=SNOO"]), indices, SNOOTrainer)
    for name, value in ddp.master.items():
        assert torch.allclose(snoo.master[name], value, rtol=0, atol=1e-6), name
    # an outer step that does something (lr 0.5): halfway between the start and DDP's weights
    half, _, _ = ddp_round(2, 2, load_config(None, [*CFG, "distributed_algo=SNOO", "lr_outer=0.5"]), indices,
                           SNOOTrainer)
    start = float_state(tiny_model())
    for name in ddp.master:
        assert torch.allclose(half.master[name], (start[name] + ddp.master[name]) / 2, atol=1e-6), name


def test_a_node_whose_gradient_is_not_finite_offers_nothing_and_is_a_fault():
    cfg = load_config(None, [*CFG, "distributed_algo=DDP"])
    model, packed = tiny_model(), data()
    trainer = DDPTrainer(0, float_state(model), {n for n, _ in model.named_parameters()}, cfg, ShardSampler(64, 0))
    nodes = [Node(i, "cpu", tiny_model(), trainer.inner_optimizer_factory(cfg), 1.0, packed) for i in range(3)]
    jobs = [NodeJob(i, 0, trainer.master, torch.arange(4 * i, 4 * i + 4).view(4, 1, 1), 0, reset_optimizer=True,
                    sync_gradients=True, inject_fault="nan" if i == 1 else "") for i in range(3)]
    outcome = InProcessBackend(nodes, False).run_round(jobs, {0: trainer})
    results, faults = outcome.results, outcome.faults
    assert [(f.node_id, f.kind) for f in faults] == [(1, "nan")]
    assert results[0].nodes == [0, 2]
    assert all(bool(torch.isfinite(v).all()) for v in results[0].node_mean.values())  # nothing non-finite spread


BASE = ["num_outer_steps=2", "num_inner_steps=3", "num_init_trainers=1", "nodes_per_gpu=2", "devices=[cpu,cpu]",
        "seq_len=32", "val_size=8", "eval_batch_size=8", "max_batch_size=4", "tokenizer=bpe",
        "tokenizer_vocab_size=512", "embedded_sources=[tiny]", "clearml_mode=off", "sampling_method=constant",
        "initial_batch_size=2", "merge_frequency=0"]


def test_ddp_sends_h_times_dilocos_weights_bytes_per_token_and_snoo_the_same(tmp_path, cache_dir):
    """At the same nodes and batch: DiLoCo one all-reduce of the weights per round, DDP one of the gradients (and a
    4-byte count) per inner step, so H times the bytes per token; SNOO's bytes are DDP's. The clock and the
    network model price them alike."""
    from algorithms.network import parse_network
    from benchmarks.replay import accounted_bytes, read_rounds, timeline

    common = [*BASE, f"cache_dir={cache_dir}", f"log_dir={tmp_path}", "network=consumer"]
    runs = {}
    for algo in ("DiLoCo", "DDP", "SNOO"):
        run_dir, summary = train(load_config(None, [*common, f"distributed_algo={algo}", f"run_name={algo}"]))
        runs[algo] = (run_dir, summary)
    diloco, ddp, snoo = (runs[a][1] for a in ("DiLoCo", "DDP", "SNOO"))
    assert ddp["tokens_seen"] == diloco["tokens_seen"] == snoo["tokens_seen"]
    weight_bytes, gradient_bytes = diloco["weight_bytes"], ddp["gradient_bytes"]
    assert gradient_bytes == 4 * (weight_bytes // 4 + 1)  # every floating tensor of microllama trains, and a count
    # 4 nodes in one trainer: a ring all-reduce is 2 (n-1) x payload; 2 rounds
    assert diloco["weights_traffic_bytes"] == 2 * 2 * 3 * weight_bytes
    assert ddp["weights_traffic_bytes"] == snoo["weights_traffic_bytes"] == 2 * 3 * 2 * 3 * gradient_bytes
    assert ddp["syncs"] == 2 * 3 and diloco["syncs"] == 2
    # the network model reads the same bytes back and prices the run as its live clock did
    for algo in ("DDP", "DiLoCo"):
        run_dir, summary = runs[algo]
        rounds, weights, communicated = read_rounds(run_dir)
        assert accounted_bytes(rounds, weights) == communicated == summary["weights_traffic_bytes"]
        times, _ = timeline(rounds, parse_network("consumer"), load_config(None).node_tokens_per_s, weights)
        assert times[max(times)] == pytest.approx(summary["sim_time_s"], rel=1e-9)
    assert ddp["sim_time_s"] > diloco["sim_time_s"]  # H all-reduces of the same size on a consumer link


@pytest.mark.parametrize("override, key", [("outer_compression=int8", "outer_compression"),
                                           ("sync_fragments=2", "sync_fragments"),
                                           ("fragment_alpha=0.5", "fragment_alpha")])
def test_ddp_refuses_what_does_not_apply(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'.*does not apply to distributed_algo DDP"):
        load_config(None, ["distributed_algo=DDP", override])


def test_after_a_merge_every_node_of_a_ddp_trainer_starts_afresh_so_they_stay_identical(tiny_config, monkeypatch):
    """A merge brings the absorbed trainer's nodes to the survivor with a new AdamW; the survivor's own nodes start
    one too (one optimizer in lockstep), or the same mean gradient would move the nodes apart."""
    import distributed.in_process as in_process

    real, groups = in_process.combine, []

    def checked(results, *args, identical=False, **kwargs):
        if identical:
            by_trainer = {}
            for r in results:
                by_trainer.setdefault(r.trainer_id, []).append(r)
            for group in by_trainer.values():
                groups.append(len(group))
                assert all(torch.equal(r.state[name], group[0].state[name]) for r in group for name in r.state)
        return real(results, *args, identical=identical, **kwargs)

    monkeypatch.setattr(in_process, "combine", checked)
    train(tiny_config("distributed_algo=DDP", "num_init_trainers=2", "devices=[cpu,cpu]", "merge_frequency=1",
                      "num_outer_steps=2", "sampling_method=constant", "run_name=merged"))
    assert groups == [2, 2, 4]  # two trainers of two nodes, then the merged one of four
