"""Mid-round evaluations (eval_every_inner_steps) score the trainer's synced model: its outer step applied to a copy,
on the mean of its nodes at that inner step (distributed/mid_round.py). By hand on tiny models, and end to end."""

import csv

import pytest
import torch

from algorithms.comm_plan import CommPlan
from algorithms.streaming import StreamingPlan
from distributed.in_process import InProcessBackend
from distributed.mid_round import MidRoundPlan, evaluation_steps
from fabrics.dataset_loader import PackedData, ShardSampler
from node import Node, NodeJob
from run import train
from trainers import DDPTrainer, DiLoCoTrainer, LocalSGDTrainer
from utils.config import load_config
from utils.model_state import float_state


def _trainer(cls, state, **overrides):
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    return cls(0, state, set(state), cfg, ShardSampler(4, 0))


def test_the_synced_model_is_the_outer_step_on_a_copy_plain_sgd():
    trainer = _trainer(DiLoCoTrainer, {"w": torch.tensor([1.0, 2.0])}, lr_outer=0.5)
    synced = trainer.synced_model({"w": torch.tensor([0.5, 1.0])})  # pseudo-gradient (0.5, 1.0)
    assert synced["w"].tolist() == pytest.approx([0.75, 1.5])
    assert trainer.master["w"].tolist() == [1.0, 2.0]  # untouched
    assert not trainer.outer_optimizer.state.get(trainer.master["w"])


def test_the_synced_model_is_the_outer_step_on_a_copy_nesterov_with_momentum():
    trainer = _trainer(DiLoCoTrainer, {"w": torch.tensor([1.0])}, lr_outer=0.7, outer_momentum=0.9,
                       outer_nesterov="true")
    trainer.outer_step({"w": torch.tensor([0.0])})  # g = 1, buf = 1, update 1.9: w = 1 - 1.33 = -0.33
    assert trainer.master["w"].tolist() == pytest.approx([-0.33])
    synced = trainer.synced_model({"w": torch.tensor([-1.33])})
    # g = 1; buf = 0.9 * 1 + 1 = 1.9; update = g + 0.9 buf = 2.71; w = -0.33 - 0.7 * 2.71 = -2.227
    assert synced["w"].tolist() == pytest.approx([-2.227])
    buffer = trainer.outer_optimizer.state[trainer.master["w"]]["momentum_buffer"]
    assert trainer.master["w"].tolist() == pytest.approx([-0.33]) and buffer.tolist() == pytest.approx([1.0])
    trainer.outer_step({"w": torch.tensor([-1.33])})  # the real step from the same state: the same weights
    assert torch.equal(trainer.master["w"].detach(), synced["w"])


@pytest.mark.parametrize("cls", [LocalSGDTrainer, DDPTrainer])
def test_without_an_outer_optimizer_the_synced_model_is_the_mean(cls):
    trainer = _trainer(cls, {"w": torch.tensor([1.0, 2.0])})
    assert trainer.synced_model({"w": torch.tensor([0.5, 1.0])})["w"].tolist() == [0.5, 1.0]
    assert trainer.master["w"].tolist() == [1.0, 2.0]


class Descent(torch.nn.Module):
    """One weight; the loss 2 x weight has gradient 2: under SGD with lr a, the weight after k steps is 1 - 2 a k."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))

    def forward(self, input_ids, attention_mask, labels):
        return type("Output", (), {"loss": 2 * self.weight.sum()})()


def _round(lrs, plan=None, concurrent=False, evaluate_every=1, steps=3, poison=None):
    """Nodes with SGD learning rates `lrs` serving one trainer (DiLoCo, lr_outer 0.5, no momentum) through one
    round of `steps` inner steps; each mid-round evaluation records the synced weight."""
    ids = torch.zeros(8, 2, dtype=torch.long)
    models = [Descent() for _ in lrs]
    nodes = [Node(i, "cpu", models[i], lambda p, lr=lr: torch.optim.SGD(p, lr=lr), 0.0, PackedData(ids, ids + 1))
             for i, lr in enumerate(lrs)]
    if poison is not None:
        nodes[poison].make_optimizer = lambda p: torch.optim.SGD(p, lr=float("inf"))
    trainer = _trainer(DiLoCoTrainer, float_state(models[0]), lr_outer=0.5)
    backend = InProcessBackend(nodes, concurrent=concurrent, plan=plan or CommPlan())
    jobs = [NodeJob(i, 0, trainer.master, torch.zeros(steps, 1, 1, dtype=torch.long), 0, reset_optimizer=True)
            for i in range(len(lrs))]
    scored = []

    def score(t, mean):
        scored.append(float(trainer.synced_model(mean)["weight"]))
        return {"val_loss": scored[-1]}

    mid_round = MidRoundPlan(evaluation_steps(evaluate_every, jobs), score)
    outcome = backend.run_round(jobs, {0: trainer}, mid_round)
    results, faults = outcome.results, outcome.faults
    return results, faults, scored


@pytest.mark.parametrize("concurrent", [False, True])
def test_the_trainers_nodes_are_averaged_at_each_evaluation_step_by_hand(concurrent):
    # node 0 (lr 0.5) after k steps: 1 - k; node 1 (lr 1): 1 - 2k; mean 1 - 1.5k; synced 1 - 0.5 (1.5k) = 1 - 0.75k
    results, faults, scored = _round([0.5, 1.0], concurrent=concurrent)
    assert not faults and scored == [0.25, -0.5]
    assert results[0].mid_round == [(1, [0, 1], {"val_loss": 0.25}), (2, [0, 1], {"val_loss": -0.5})]
    plain, _, _ = _round([0.5, 1.0], evaluate_every=0)  # evaluating changes no number of the round
    assert plain[0].mid_round == [] and results[0].node_mean["weight"].tolist() == plain[0].node_mean["weight"].tolist()
    assert results[0].node_step_losses == plain[0].node_step_losses


def test_a_node_whose_weights_are_not_finite_offers_nothing():
    results, faults, scored = _round([0.5, 1.0], poison=1)  # node 1 jumps to -inf at its first step
    assert scored == [0.5, 0.0]  # node 0 alone: 1 - 0.5 k
    assert [n for _, n, _ in results[0].mid_round] == [[0], [0]] and [f.node_id for f in faults] == [1]


def test_a_streamed_round_is_evaluated_before_that_steps_sync():
    names = ["weight"]
    plan = StreamingPlan.build(names, {"weight": 1}, 4, 1, 0, 0.0)  # one fragment, landing at step 4 (the end)
    _, faults, scored = _round([0.5, 1.0], plan=CommPlan(streaming=plan), steps=4)
    assert not faults and scored == [0.25, -0.5, -1.25]


def test_evaluation_steps_stop_short_of_the_round_and_its_shortest_node():
    job = lambda steps: NodeJob(0, 0, {}, torch.zeros(steps, 1, 1, dtype=torch.long), 0, reset_optimizer=False)  # noqa: E731
    assert evaluation_steps(2, [job(6)]) == [2, 4]
    assert evaluation_steps(2, [job(6), job(3)]) == [2]
    assert evaluation_steps(0, [job(6)]) == [] and evaluation_steps(1, []) == []


def test_a_mid_round_evaluation_is_what_the_trainer_would_score_had_its_round_ended_there(tiny_config):
    """Two one-node trainers, Nesterov outer steps: the evaluation after inner step 1 of a 2-step round is, digit
    for digit, the end-of-round evaluation of the same run with 1-step rounds."""
    common = ["num_outer_steps=1", "lr_outer=0.7", "outer_momentum=0.9", "outer_nesterov=true",
              "variance_estimator=nodes"]
    evaluated, _ = train(tiny_config("run_name=two", "num_inner_steps=2", "eval_every_inner_steps=1", *common))
    ended, _ = train(tiny_config("run_name=one", "num_inner_steps=1", *common))

    def rows(d, name):
        with (d / "model_training_report" / name).open() as f:
            return list(csv.DictReader(f))

    inner = {r["trainer_id"]: r for r in rows(evaluated, "inner_eval.csv")}
    log = {r["trainer_id"]: r for r in rows(ended, "training_log.csv") if r["outer_step"] == "1"}
    assert sorted(inner) == sorted(log) == ["0", "1"]
    for t in inner:
        assert inner[t]["nodes"] == log[t]["nodes"] and inner[t]["inner_step"] == "1"
        assert float(inner[t]["val_perplexity"]) == float(log[t]["val_perplexity"])


def test_offloaded_nodes_wait_for_an_evaluation_in_host_memory(tiny_config, monkeypatch):
    """offload_idle_nodes, max_concurrent_nodes 1, threads: a node paused for a mid-round evaluation moves out, so
    no more than one node of the device is ever on it; every number (evaluations included) is the resident run's."""
    import node as node_module

    made, peak = [], []
    real_init, real_load = node_module.Node.__init__, node_module.Node._load_in

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    def load_in(self):
        real_load(self)
        peak.append(sum(n.offload.resident for n in made if n.model is not None and n.offload.enabled))

    common = ["node_execution=threads", "eval_every_inner_steps=1", "num_init_trainers=1", "merge_frequency=0"]
    resident, _ = train(tiny_config("run_name=resident", *common))
    monkeypatch.setattr(node_module.Node, "__init__", init)
    monkeypatch.setattr(node_module.Node, "_load_in", load_in)
    offloaded, _ = train(tiny_config("run_name=offloaded", *common, "offload_idle_nodes=true",
                                     "max_concurrent_nodes=1"))

    def rows(d, name):
        with (d / "model_training_report" / name).open() as f:
            return [{k: v for k, v in r.items() if k != "wall_time"} for r in csv.DictReader(f)]

    for name in ("training_log.csv", "step_loss_log.csv", "inner_eval.csv"):
        assert rows(offloaded, name) == rows(resident, name), name
    assert any(len(r["nodes"].split()) == 2 for r in rows(offloaded, "inner_eval.csv"))  # both nodes averaged
    assert len(peak) >= 3 * 2 * 3 and max(peak) == 1  # every node at every pause came back in, one at a time


def test_a_node_that_fails_mid_round_leaves_the_synced_evaluations_of_its_round(tiny_config):
    """on_node_fault skip, node 1 diverging at its first step of round 2 (its weights NaN): that round's mid-round
    evaluations average node 0 alone; the other rounds average both."""
    run_dir, _ = train(tiny_config("run_name=skip", "num_init_trainers=1", "merge_frequency=0",
                                   "eval_every_inner_steps=1", "on_node_fault=skip", "inject_fault=2:1:nan"))
    inner = _rows_of(run_dir, "inner_eval.csv")
    assert {(r["outer_step"], r["nodes"]) for r in inner} == {("1", "0 1"), ("2", "0"), ("3", "0 1")}
    assert all(float(r["val_perplexity"]) > 1 for r in inner)  # finite: the NaN node was left out


def _rows_of(run_dir, name):
    with (run_dir / "model_training_report" / name).open() as f:
        return list(csv.DictReader(f))
