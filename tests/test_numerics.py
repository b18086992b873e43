"""Inner step, outer step, label shift, padding and evaluation against direct computation."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from fabrics.dataset_loader import PackedData, ShardSampler, pack
from fabrics.eval_tool import Evaluator
from node import Node, NodeJob
from trainers import DiLoCoTrainer, LocalSGDTrainer
from utils.config import load_config
from utils.model_state import float_state


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).double()


def data(n=12, length=8, pad_last=0):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 50, (n, length), generator=gen)
    mask = torch.ones_like(ids)
    if pad_last:
        ids[-1, -pad_last:] = 0
        mask[-1, -pad_last:] = 0
    return PackedData(ids, mask)


def sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def run_one_step(indices, chunks=0):
    model = tiny_model()
    node = Node(0, "cpu", model, sgd, grad_clip=0.0, data=data())
    start = {k: v.clone() for k, v in float_state(model).items()}
    result = node.run(NodeJob(0, 0, start, indices, chunks, reset_optimizer=True))
    # SGD with lr 1: the update is exactly minus the gradient of the step
    return {k: start[k] - result.state[k] for k in start}, result


def test_accumulated_gradient_equals_full_batch_gradient():
    full, _ = run_one_step(torch.arange(6).view(1, 1, 6))
    accumulated, _ = run_one_step(torch.arange(6).view(1, 3, 2))  # 3 micro-batches of 2, loss / 3
    for name in full:
        torch.testing.assert_close(accumulated[name], full[name], rtol=1e-9, atol=1e-12)


def test_micro_batch_gradient_samples_average_to_step_gradient():
    grad, result = run_one_step(torch.arange(6).view(1, 1, 6), chunks=3)
    flat = torch.cat([grad[n].reshape(-1) for n, _ in tiny_model().named_parameters()])
    assert result.grad_samples.shape[0] == 3 and result.sample_batches.tolist() == [2.0, 2.0, 2.0]
    torch.testing.assert_close(result.grad_samples.double().mean(0), flat, rtol=1e-4, atol=1e-6)
    full, _ = run_one_step(torch.arange(6).view(1, 1, 6))
    for name in full:  # recording samples does not change the update
        torch.testing.assert_close(grad[name], full[name], rtol=1e-9, atol=1e-12)


def test_unequal_micro_batch_samples_carry_their_own_sizes():
    # 5 sequences in 3 chunks: 2, 2, 1; the size-weighted mean of the samples is the step's gradient
    grad, result = run_one_step(torch.arange(5).view(1, 1, 5), chunks=3)
    flat = torch.cat([grad[n].reshape(-1) for n, _ in tiny_model().named_parameters()])
    sizes = result.sample_batches
    assert sizes.tolist() == [2.0, 2.0, 1.0]
    weighted = (sizes[:, None] * result.grad_samples.double()).sum(0) / sizes.sum()
    torch.testing.assert_close(weighted, flat, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(result.grad_samples.double().mean(0), flat, rtol=1e-3, atol=1e-5)


def test_num_inner_steps_counts_optimizer_steps():
    _, result = run_one_step(torch.arange(12).view(3, 2, 2))  # 3 steps of 2 micro-batches
    assert len(result.step_losses) == 3
    assert result.tokens == 12 * 8


def test_loss_shifts_labels_once_and_masks_padding():
    model = tiny_model()
    d = data(pad_last=3)
    node = Node(0, "cpu", model, sgd, 0.0, d)
    idx = torch.tensor([10, 11])
    loss = node._forward_backward(idx, 1.0)
    logits = model(input_ids=d.input_ids[idx], attention_mask=d.attention_mask[idx]).logits
    targets = d.input_ids[idx][:, 1:].masked_fill(d.attention_mask[idx][:, 1:] == 0, -100)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 50), targets.reshape(-1), ignore_index=-100)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)  # HF computes the loss in fp32
    # a double shift (the authors' bug) would give a different number
    wrong = F.cross_entropy(logits[:, :-2].reshape(-1, 50), d.input_ids[idx][:, 2:].reshape(-1))
    assert abs(loss.item() - wrong.item()) > 1e-3


def test_perplexity_is_token_weighted_exactly():
    model = tiny_model()
    d = data(n=5, pad_last=5)
    result = Evaluator(model, d, batch_size=2, device="cpu").evaluate()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(5):  # one sequence at a time, only its real tokens
            n = int(d.attention_mask[i].sum())
            logits = model(input_ids=d.input_ids[i : i + 1, :n]).logits[0]
            total += F.cross_entropy(logits[:-1], d.input_ids[i, 1:n], reduction="sum").item()
            count += n - 1
    assert result.count == count
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-9)
    # the batches and their targets are made once: a second evaluation (other weights, then these again) reads them
    evaluator = Evaluator(model, d, batch_size=2, device="cpu")
    other = {k: v * 0.5 for k, v in model.state_dict().items()}
    assert evaluator.evaluate(other).perplexity != result.perplexity
    again = evaluator.evaluate({k: v * 2 for k, v in other.items()})
    assert (again.count, again.perplexity) == (result.count, result.perplexity)


def test_pack_masks_the_padded_tail():
    packed = pack([[5, 6, 7], [8]], eos_id=1, pad_id=0, seq_len=4)
    assert packed.input_ids.tolist() == [[5, 6, 7, 1], [8, 1, 0, 0]]
    assert packed.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


def test_shard_sampler_is_reproducible_and_covers_an_epoch():
    a, b = ShardSampler(10, seed=3), ShardSampler(10, seed=3)
    first = a.take(6)
    assert torch.equal(first, b.take(6))
    assert sorted(torch.cat([first, a.take(4)]).tolist()) == list(range(10))
    assert len(a.take(15)) == 15 and a.epoch == 2


def _trainers(cls, **overrides):
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    state = {"w": torch.tensor([1.0, 2.0])}
    return [cls(i, state, {"w"}, cfg, ShardSampler(4, i)) for i in range(2)]


@pytest.mark.parametrize("algorithm, momentum", [("DiLoCo", 0.0), ("DiLoCo", 0.9), ("LocalSGD", 0.0),
                                                ("DDP", 0.0), ("SNOO", 0.5)])
def test_a_trainers_moving_state_weighs_the_same_for_every_trainer_and_round(algorithm, momentum):
    """The round driver prices every node move and merge at one size, read once from the first trainer
    (RoundDriver.state_bytes): every trainer of a run moves the same bytes, before and after outer steps and a merge,
    and those are the bytes `transfer_tensors` sends (what a torchrun receiver allocates): weights 2 floats, plus
    the outer momentum's 2 where the algorithm keeps one (DiLoCo, SNOO)."""
    from trainers import TRAINERS

    cfg = load_config(None, [f"distributed_algo={algorithm}", f"outer_momentum={momentum}"])
    state = {"w": torch.tensor([1.0, 2.0])}
    trainers = [TRAINERS[algorithm](i, state, {"w"}, cfg, ShardSampler(4, i)) for i in range(3)]
    expected = 4 * (2 + (2 if momentum > 0 and algorithm in ("DiLoCo", "SNOO") else 0))

    def weighs() -> set[int]:
        sizes = {t.transfer_bytes() for t in trainers}
        sent = {sum(x.numel() * x.element_size() for x in t.transfer_tensors()) for t in trainers}
        assert sent == sizes
        return sizes

    assert weighs() == {expected}
    for i, t in enumerate(trainers):
        t.outer_step({"w": torch.tensor([0.5, 1.0 + i])})
    assert weighs() == {expected}
    trainers[0].absorb(trainers[1:], [0.5, 0.25, 0.25])
    assert weighs() == {expected}


def test_the_inner_adamw_on_cpu_takes_the_foreach_path_with_the_per_tensor_loops_numbers():
    """torch takes AdamW's foreach path by default only on CUDA; the inner optimizer asks for it on CPU, where it runs
    the per-tensor loop's operations in the same order: every weight equal to the last bit after steps with weight
    decay, on a float32 model's real gradients."""
    cfg = load_config(None, ["lr_inner=0.01", "inner_weight_decay=0.1"])
    batch = data().input_ids
    weights = []
    for implementation in ("factory", "per_tensor_loop"):
        model = tiny_model().float()
        if implementation == "factory":
            optimizer = DiLoCoTrainer.inner_optimizer_factory(cfg)(model.parameters())
            assert optimizer.defaults["foreach"] is True
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=tuple(cfg.inner_betas),
                                          weight_decay=0.1, foreach=False)
        for step in range(5):
            optimizer.zero_grad()
            model(input_ids=batch[2 * step:2 * step + 4], labels=batch[2 * step:2 * step + 4]).loss.backward()
            optimizer.step()
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))
    assert not all(torch.equal(a, b) for a, b in zip(weights[0], [p for p in tiny_model().float().parameters()]))


@pytest.mark.parametrize("momentum, nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_the_outer_sgd_on_cpu_takes_the_foreach_path_with_the_per_tensor_loops_numbers(momentum, nesterov):
    """The outer SGD asks for torch's foreach path on CPU masters (torch's default there is the per-tensor loop):
    the same masters to the last bit after 4 outer steps of a real trainer, the third stepping one fragment only
    (streaming: the other parameters have no pseudo-gradient), with plain SGD, momentum and Nesterov."""
    model = tiny_model().float()
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = set(state)
    cfg = load_config(None, ["lr_outer=0.7", f"outer_momentum={momentum}", f"outer_nesterov={nesterov}"])
    gen = torch.Generator().manual_seed(0)
    means = [{n: v + 0.01 * torch.randn(v.shape, generator=gen) for n, v in state.items()} for _ in range(4)]
    fragment = sorted(names)[:3]
    masters = []
    for implementation in ("outer_sgd", "per_tensor_loop"):
        trainer = DiLoCoTrainer(0, state, names, cfg, ShardSampler(4, 0))
        if implementation == "outer_sgd":
            assert trainer.outer_optimizer.defaults["foreach"] is True
        else:
            trainer.outer_optimizer = torch.optim.SGD([trainer.master[n] for n in sorted(names)], lr=0.7,
                                                      momentum=momentum, nesterov=nesterov, foreach=False)
        for i, mean in enumerate(means):
            trainer.outer_step({n: mean[n] for n in fragment} if i == 2 else mean)
        masters.append({n: trainer.master[n].detach().clone() for n in names})
    assert all(torch.equal(masters[0][n], masters[1][n]) for n in names)
    assert not all(torch.equal(masters[0][n], state[n]) for n in names)


def test_the_inner_optimizer_benchmark_times_both_ways_and_checks_they_agree(capsys):
    from benchmarks.inner_optimizer import main

    assert main(["--preset", "microllama-tiny", "--vocab", "64", "--steps", "2", "--repeats", "1"]) == 0
    said = capsys.readouterr().out
    assert "| inner optimizer (foreach) |" in said and "| per-tensor loop | " in said
    assert "same weights to the last bit after 4 steps: True" in said


def test_diloco_outer_step_plain_sgd():
    (t, _) = _trainers(DiLoCoTrainer, lr_outer=0.5)
    t.outer_step({"w": torch.tensor([0.5, 1.0])})  # pseudo-grad (0.5, 1.0)
    assert t.master["w"].tolist() == pytest.approx([0.75, 1.5])


def test_diloco_outer_step_nesterov():
    (t, _) = _trainers(DiLoCoTrainer, lr_outer=0.7, outer_momentum=0.9, outer_nesterov="true")
    t.outer_step({"w": torch.tensor([0.5, 1.0])})
    # buf = g; update = g + 0.9 * buf = 1.9 g; w -= 0.7 * 1.9 * g
    assert t.master["w"].tolist() == pytest.approx([1 - 0.665, 2 - 1.33])


def test_localsgd_outer_step_is_the_average():
    (t, _) = _trainers(LocalSGDTrainer)
    t.outer_step({"w": torch.tensor([0.5, 1.0])})
    assert t.master["w"].tolist() == [0.5, 1.0]


def test_merge_averages_weights_and_outer_momentum():
    a, b = _trainers(DiLoCoTrainer, lr_outer=1.0, outer_momentum=0.5)
    a.outer_step({"w": torch.tensor([0.0, 2.0])})  # g = (1, 0): w = (0, 2), buf = (1, 0)
    b.outer_step({"w": torch.tensor([1.0, 0.0])})  # g = (0, 2): w = (1, 0), buf = (0, 2)
    a.absorb([b], [0.25, 0.75])
    assert a.master["w"].tolist() == pytest.approx([0.75, 0.5])
    buf = a.outer_optimizer.state[a.master["w"]]["momentum_buffer"]
    assert buf.tolist() == pytest.approx([0.25, 1.5])
    a.outer_step({"w": torch.tensor([0.75, 0.5])})  # g = 0: the step is the averaged momentum
    assert a.master["w"].tolist() == pytest.approx([0.75 - 0.125, 0.5 - 0.75])
