"""compile: true with a growing batch (issue 59): micro-batches padded to a few buckets, each compiled in a warm-up
before training, so training compiles nothing; padded rows change no loss or gradient."""

import csv
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from algorithms.buckets import bucket_for, micro_batch_buckets
from fabrics.dataset_loader import PackedData
from node import Node
from run import train


def test_buckets_by_hand():
    assert micro_batch_buckets(16) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert micro_batch_buckets(5) == [1, 2, 3, 4, 5]
    assert micro_batch_buckets(1) == [1]
    assert micro_batch_buckets(20) == [1, 2, 3, 4, 6, 8, 12, 16, 20]
    buckets = micro_batch_buckets(16)
    assert [bucket_for(n, buckets) for n in (1, 3, 5, 7, 9, 13, 16)] == [1, 3, 6, 8, 12, 16, 16]
    # at most a quarter of a micro-batch is padding
    assert max((bucket_for(n, buckets) - n) / bucket_for(n, buckets) for n in range(1, 17)) == 0.25
    with pytest.raises(ValueError, match="larger than the largest bucket 16"):
        bucket_for(17, buckets)


def test_a_padded_micro_batch_has_the_unpadded_loss_and_gradients():
    """5 sequences (one of them padded at its end) run as a bucket of 6, without an attention mask: the loss and
    every gradient are those of the 5 with their mask, to fp64's last digits."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1)).double()
    ids = torch.randint(1, 64, (8, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[4, -5:], ids[4, -5:] = 0, 0  # sequence 4 ends in padding, as packing leaves the last one
    node = Node(0, "cpu", model, None, 0.0, PackedData(ids, mask))
    idx = torch.tensor([0, 2, 4, 5, 7])
    results = {}
    for name, buckets in (("masked", []), ("bucketed", micro_batch_buckets(8))):
        node.buckets, node.masked = buckets, True
        loss = node._forward_backward(idx, 1.0)
        results[name] = (loss, [p.grad.clone() for p in node.params])
        model.zero_grad(set_to_none=True)
    assert bucket_for(5, micro_batch_buckets(8)) == 6
    (loss_a, grads_a), (loss_b, grads_b) = results["masked"], results["bucketed"]
    assert float(loss_b) == pytest.approx(float(loss_a), rel=1e-12)
    for a, b in zip(grads_a, grads_b):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-13)


def _rows(run_dir, name):
    with (run_dir / "model_training_report" / name).open() as f:
        return list(csv.DictReader(f))


GROWING = ["num_init_trainers=1", "merge_frequency=0", "initial_batch_size=1", "variance_estimator=nodes",
           "ETA=0.6", "max_requested_batch=16", "max_batch_size=4", "num_outer_steps=6", "num_inner_steps=2",
           "compile_backend=aot_eager"]


def test_a_growing_batch_compiles_nothing_after_the_warm_up_and_matches_eager(tiny_config):
    compiled, summary = train(tiny_config("run_name=compiled", *GROWING, "compile=true"))
    eager, _ = train(tiny_config("run_name=eager", *GROWING, "compile=false"))
    sizes = {(r["micro_batch"], r["accumulation_steps"]) for r in _rows(compiled, "step_loss_log.csv")}
    assert len({r["requested_batch"] for r in _rows(compiled, "training_log.csv")} - {""}) >= 4, sizes
    assert len({m for m, _ in sizes}) >= 3 and max(int(a) for _, a in sizes) > 1  # micro-batches 1-4, accumulation
    record = summary["compile"]
    assert record["buckets"] == [1, 2, 3, 4] and record["warm_up_graphs"] >= 4
    assert record["graphs_after_warm_up"] == 0
    assert json.loads((compiled / "summary.json").read_text())["compile"] == record
    assert "warm-up compiled" in (compiled / "training_log.log").read_text()
    # the numbers: eager's, within fp32's tolerance (the padded rows change the order of some sums)
    for c, e in zip(_rows(compiled, "training_log.csv"), _rows(eager, "training_log.csv"), strict=True):
        assert (c["requested_batch"], c["loader_batch"], c["accumulation_steps"]) == (
            e["requested_batch"], e["loader_batch"], e["accumulation_steps"])
        for key in ("train_loss", "val_perplexity"):
            if e[key]:
                assert float(c[key]) == pytest.approx(float(e[key]), rel=1e-4), key


def test_without_the_buckets_a_growing_batch_recompiles_during_training(tiny_config, monkeypatch):
    """The counter the test above reads does catch recompiles: with the buckets off (each micro-batch its own shape,
    as before issue 59), new shapes compile during training."""
    import cluster.build

    monkeypatch.setattr(cluster.build, "micro_batch_buckets", lambda max_batch: [])
    _, summary = train(tiny_config("run_name=unbucketed", *GROWING, "compile=true"))
    assert summary["compile"]["warm_up_graphs"] == 0 and summary["compile"]["graphs_after_warm_up"] >= 3
