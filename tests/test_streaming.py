"""Streaming DiLoCo: fragments, schedule, mixing by hand, and a round against a direct implementation."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from algorithms.comm_plan import CommPlan
from algorithms.streaming import StreamingPlan, SyncEvent, fragment_names, layer_units, mix_fragment, sync_schedule
from distributed.in_process import InProcessBackend
from fabrics.dataset_loader import PackedData, ShardSampler
from node import Node, NodeJob
from trainers import DiLoCoTrainer
from utils.config import load_config
from utils.model_state import float_state

NAMES = ["model.embed_tokens.weight", "model.layers.0.a", "model.layers.0.b", "model.layers.1.a",
         "model.layers.2.a", "model.norm.weight", "lm_head.weight"]
NUMELS = dict(zip(NAMES, [10, 5, 5, 20, 10, 1, 9]))


def test_layer_units_attach_embeddings_and_head_to_their_neighbouring_blocks():
    assert layer_units(NAMES) == [NAMES[:3], [NAMES[3]], NAMES[4:]]
    assert layer_units(["w", "b"]) == [["w"], ["b"]]  # no numbered blocks: one unit per tensor


def test_fragments_are_contiguous_balanced_and_sorted_within():
    # units of 20, 20, 20: three fragments are the units; two cut at the boundary nearest 30 (a tie: the first)
    assert fragment_names(NAMES, NUMELS, 3) == [sorted(NAMES[:3]), [NAMES[3]], sorted(NAMES[4:])]
    assert fragment_names(NAMES, NUMELS, 2) == [sorted(NAMES[:3]), sorted(NAMES[3:])]
    heavy = {**NUMELS, "model.layers.1.a": 100, "model.layers.2.a": 30}  # 20, 100, 40: cumulative 20, 120 vs 80
    assert fragment_names(NAMES, heavy, 2) == [sorted(NAMES[:4]), sorted(NAMES[4:])]
    assert fragment_names(NAMES, NUMELS, 1) == [sorted(NAMES)]
    with pytest.raises(ValueError, match="the model has 3 layers"):
        fragment_names(NAMES, NUMELS, 4)


def test_fragments_of_a_real_llama_are_its_blocks():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                         num_attention_heads=2, num_key_value_heads=1))
    state = float_state(model)
    frags = fragment_names(list(state), {k: v.numel() for k, v in state.items()}, 4)
    assert [sorted({n.split(".")[2] for n in f if n.startswith("model.layers.")}) for f in frags] == \
        [["0"], ["1"], ["2"], ["3"]]
    assert "model.embed_tokens.weight" in frags[0] and "lm_head.weight" in frags[3]
    assert sorted(n for f in frags for n in f) == sorted(state)


def test_schedule_by_hand():
    # H = 6, F = 3, tau = 1: fragment f lands after step 2 (f + 1) and is sent one step earlier
    assert sync_schedule(6, 3, 1) == [SyncEvent(1, 0, False), SyncEvent(2, 0, True), SyncEvent(3, 1, False),
                                      SyncEvent(4, 1, True), SyncEvent(5, 2, False), SyncEvent(6, 2, True)]
    # tau = 0: sent and landed at the same step, the send first; F = 1, tau = 0 is DiLoCo's one sync after H
    assert sync_schedule(4, 2, 0) == [SyncEvent(2, 0, False), SyncEvent(2, 0, True), SyncEvent(4, 1, False),
                                      SyncEvent(4, 1, True)]
    assert sync_schedule(3, 1, 0) == [SyncEvent(3, 0, False), SyncEvent(3, 0, True)]
    assert [e.step for e in sync_schedule(5, 2, 1)] == [1, 2, 4, 5]  # lands after steps 2 and 5 (rounded down)
    with pytest.raises(ValueError, match="below the 2 inner steps"):
        sync_schedule(5, 2, 2)
    with pytest.raises(ValueError, match="between 1 and num_inner_steps"):
        sync_schedule(2, 3, 0)


def test_mixing_by_hand():
    local = {"a": torch.tensor([4.0, 8.0]), "b": torch.tensor([1.0])}
    mix_fragment(local, {"a": torch.tensor([0.0, 4.0]), "b": torch.tensor([9.0])}, ["a"], 0.75)
    assert local["a"].tolist() == [3.0, 7.0] and local["b"].tolist() == [1.0]  # only the fragment's tensors
    mix_fragment(local, {"a": torch.tensor([5.0, 5.0])}, ["a"], 1.0)
    assert local["a"].tolist() == [3.0, 7.0]  # alpha 1: the local copy is kept
    mix_fragment(local, {"a": torch.tensor([0.1, 0.2])}, ["a"], 0.0)
    assert torch.equal(local["a"], torch.tensor([0.1, 0.2]))  # alpha 0: exactly the global fragment


# --------------------------------------------------------------------------------------------------
# One streaming round of two nodes against a direct implementation of Streaming DiLoCo

def tiny_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))


def data():
    ids = torch.randint(2, 50, (16, 8), generator=torch.Generator().manual_seed(1))
    return PackedData(ids, torch.ones_like(ids))


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def direct_streaming(model, batches, fragments, events, alpha, lr_outer):
    """Two nodes, H inner SGD steps each; fragment f is sent (global - local) at its send, averaged, stepped by
    outer SGD and mixed into both nodes at its landing: the recipe of Douillard et al. 2025, written plainly."""
    master = {k: v.detach().clone() for k, v in float_state(model).items()}
    nodes = [{k: v.clone() for k, v in master.items()} for _ in batches]
    replica = tiny_model()
    sent = {}
    for step in range(len(batches[0])):
        for i, node in enumerate(nodes):
            replica.load_state_dict(node, strict=False)
            ids = batches[i][step]
            loss = replica(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
            grads = torch.autograd.grad(loss, [p for p in replica.parameters()])
            with torch.no_grad():
                for (name, p), g in zip(replica.named_parameters(), grads):
                    node[name] = p - 0.5 * g
        for event in [e for e in events if e.step == step + 1]:
            names = fragments[event.fragment]
            if not event.lands:
                sent[event.fragment] = [{n: node[n].clone() for n in names} for node in nodes]
                continue
            for n in names:
                mean = sum(s[n] for s in sent[event.fragment]) / len(nodes)
                master[n] = master[n] - lr_outer * (master[n] - mean)
                for node in nodes:
                    node[n] = (1 - alpha) * master[n] + alpha * node[n]
    return master, nodes


@pytest.mark.parametrize("fragments, delay, alpha", [(2, 0, 0.0), (2, 1, 0.5), (1, 1, 0.0), (2, 1, 0.25), (1, 0, 0.5)])
def test_a_streaming_round_equals_the_direct_implementation(fragments, delay, alpha):
    model, packed = tiny_model(), data()
    cfg = load_config(None, ["lr_outer=0.5", "outer_momentum=0.0", "num_inner_steps=4", f"sync_fragments={fragments}",
                             f"sync_delay={delay}", f"fragment_alpha={alpha}"])
    initial = float_state(model)
    trainer = DiLoCoTrainer(0, initial, {n for n, _ in model.named_parameters()}, cfg, ShardSampler(16, 0))
    plan = StreamingPlan.build(list(initial), {k: v.numel() for k, v in initial.items()}, 4, fragments, delay, alpha)
    nodes = [Node(i, "cpu", tiny_model(), sgd, grad_clip=0.0, data=packed) for i in range(2)]
    indices = [torch.arange(8 * i, 8 * i + 4).view(4, 1, 1) for i in range(2)]  # one sequence per inner step
    backend = InProcessBackend(nodes, concurrent=False, plan=CommPlan(streaming=plan))
    outcome = backend.run_round([NodeJob(i, 0, trainer.master, indices[i], 0, reset_optimizer=True)
                                 for i in range(2)], {0: trainer})
    results, faults = outcome.results, outcome.faults
    assert not faults and results[0].node_mean is None  # stepped fragment by fragment during the round
    master, direct_nodes = direct_streaming(model, [packed.input_ids[ix.view(4, 1)] for ix in indices],
                                            plan.fragments, plan.events, alpha, 0.5)
    for name in initial:
        assert torch.allclose(trainer.master[name], master[name], atol=1e-6), name
        for node, direct in zip(nodes, direct_nodes):
            assert torch.allclose(float_state(node.model)[name], direct[name], atol=1e-6), name
    # the nodes keep their own weights: only the last fragment (landed at the round's end, alpha 0) equals the master
    last = plan.fragments[-1]
    if alpha == 0.0:
        assert all(torch.equal(float_state(nodes[0].model)[n], trainer.master[n]) for n in last)
    if fragments > 1:
        assert not all(torch.equal(float_state(nodes[0].model)[n], trainer.master[n]) for n in plan.fragments[0])


def test_a_node_that_diverges_mid_round_leaves_before_its_fragment_travels():
    model, packed = tiny_model(), data()
    cfg = load_config(None, ["lr_outer=0.5", "num_inner_steps=4", "sync_fragments=2"])
    initial = float_state(model)
    trainer = DiLoCoTrainer(0, initial, {n for n, _ in model.named_parameters()}, cfg, ShardSampler(16, 0))
    plan = StreamingPlan.build(list(initial), {k: v.numel() for k, v in initial.items()}, 4, 2, 0, 0.0)
    nodes = [Node(i, "cpu", tiny_model(), sgd, grad_clip=0.0, data=packed) for i in range(2)]
    jobs = [NodeJob(i, 0, trainer.master, torch.arange(4).view(4, 1, 1), 0, reset_optimizer=True,
                    inject_fault="nan" if i == 1 else "") for i in range(2)]
    outcome = InProcessBackend(nodes, False, CommPlan(streaming=plan)).run_round(jobs, {0: trainer})
    results, faults = outcome.results, outcome.faults
    assert [(f.node_id, f.kind) for f in faults] == [(1, "nan")] and "before a fragment sync" in faults[0].message
    assert results[0].nodes == [0]
    assert all(bool(torch.isfinite(v).all()) for v in trainer.master.values())  # nothing non-finite travelled


# --------------------------------------------------------------------------------------------------
# torchft's Streaming DiLoCo regression setting (its diloco_regression_test), in closed form: a mock model whose
# weights start at 1 and whose gradient is always 2, inner SGD lr 1, outer SGD lr 2, 2 replicas, 2 fragments,
# sync_every 6. alpha is the local copy's weight, as torchft's fragment_update_alpha.

class MockModel(torch.nn.Module):
    """Two blocks of two weights; the loss 2 x sum(weights) has gradient 2 everywhere. Records the weights it
    sees at each forward (before each inner step)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 1, bias=False) for _ in range(2)])
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.fill_(1.0)
        self.seen = []

    def forward(self, input_ids, attention_mask, labels):
        self.seen.append([float(layer.weight[0, 0].detach()) for layer in self.layers])
        return type("Output", (), {"loss": 2 * sum(layer.weight.sum() for layer in self.layers)})()


def closed_form(steps, fragments, sync_every, delay, alpha, lr_inner=1.0, lr_outer=2.0, grad=2.0):
    """Each fragment's weight before every inner step, and the global weights at the end, for replicas that all
    see the same gradient (so the average of their pseudo-gradients is any one's)."""
    local, master, sent, seen = [1.0] * fragments, [1.0] * fragments, {}, []
    lands = [(f + 1) * sync_every // fragments for f in range(fragments)]
    for step in range(1, steps + 1):
        seen.append(list(local))
        local = [w - lr_inner * grad for w in local]
        in_round = (step - 1) % sync_every + 1
        for f, land in enumerate(lands):
            if in_round == land - delay:
                sent[f] = local[f]  # the pseudo-gradient master - local travels from here
        for f, land in enumerate(lands):
            if in_round == land:
                master[f] = master[f] - lr_outer * (master[f] - sent[f])
                local[f] = alpha * local[f] + (1 - alpha) * master[f]
    return seen, master


@pytest.mark.parametrize("delay", [0, 1])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_torchft_regression_closed_form_step_by_step(delay, alpha):
    cfg = load_config(None, ["lr_outer=2.0", "outer_momentum=0.0", "num_inner_steps=6", "sync_fragments=2",
                             f"sync_delay={delay}", f"fragment_alpha={alpha}"])
    models = [MockModel() for _ in range(2)]
    initial = float_state(models[0])
    trainer = DiLoCoTrainer(0, initial, set(initial), cfg, ShardSampler(16, 0))
    plan = StreamingPlan.build(list(initial), {k: v.numel() for k, v in initial.items()}, 6, 2, delay, alpha)
    assert plan.fragments == [["layers.0.weight"], ["layers.1.weight"]]
    nodes = [Node(i, "cpu", models[i], lambda p: torch.optim.SGD(p, lr=1.0), grad_clip=0.0, data=data())
             for i in range(2)]
    backend = InProcessBackend(nodes, concurrent=False, plan=CommPlan(streaming=plan))
    for round_ in range(3):  # the nodes go on from their own weights across rounds, as the controller has them
        jobs = [NodeJob(i, 0, trainer.master, torch.arange(6).view(6, 1, 1), 0, reset_optimizer=round_ == 0,
                        keep_local=round_ > 0) for i in range(2)]
        assert not backend.run_round(jobs, {0: trainer}).faults
    seen, master = closed_form(18, 2, 6, delay, alpha)
    for model in models:
        assert model.seen == seen  # every inner step of every replica, exactly (small integers and halves)
    assert [float(trainer.master[f"layers.{f}.weight"][0, 0]) for f in range(2)] == master


def test_closed_form_by_hand():
    # delay 0, alpha 0: 1, -1, -3 before steps 1-3; fragment 0 sent at -5 lands at 1 - 2 (1 + 5) = -11
    seen, _ = closed_form(4, 2, 6, 0, 0.0)
    assert [s[0] for s in seen] == [1.0, -1.0, -3.0, -11.0] and [s[1] for s in seen] == [1.0, -1.0, -3.0, -5.0]
    # alpha 1 keeps the local copy: the replicas never see the global weights
    seen, master = closed_form(6, 2, 6, 1, 1.0)
    assert [s[0] for s in seen] == [1.0, -1.0, -3.0, -5.0, -7.0, -9.0] and master[0] == 1 - 2 * (1 + 3)
