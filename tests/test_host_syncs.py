"""No inner step waits for the device (issue 59): nothing in a node's inner step reads a tensor's value on the host.

On a CPU every tensor is on the host, so a read cannot be caught by a device's sync; a TorchDispatchMode sees every
read at the dispatcher instead: `aten._local_scalar_dense` (`.item()`, `int()`, `float()`), `aten.is_nonzero`
(`bool()`) and `aten.nonzero` (a data-dependent shape). What stays on the host by design is told apart by identity:
a non-fused AdamW's step counters (torch keeps them on the host unless the optimizer is fused or capturable, as it is
on CUDA), recognised by the storage of `optimizer.state[p]["step"]`; the round's start reads two facts of its
batches from host memory (PackedData: whether one is padded, how many tokens they hold). Copies to the host cannot
be told apart from the CPU's own copies here: the GPU check (benchmarks/gpu_check.py) runs a round under
`torch.cuda.set_sync_debug_mode("error")` for them. The fp16 loss scaler's overflow check is the documented
exception (GradScaler reads it each step); the shapes tested here are fp32, as on a CPU.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from algorithms.streaming import StreamingPlan
from fabrics.dataset_loader import PackedData
from node import Node, NodeJob
from tests.conftest import ROOT
from trainers import TRAINERS
from utils.config import load_config
from utils.model_state import float_state

READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


class HostReads(TorchDispatchMode):
    """Every read of a tensor's value on the host while active, but those of the node's optimizer's step counters
    (looked up at the read, while both are alive: a freed tensor's storage may be reused by a later one)."""

    def __init__(self, node: Node) -> None:
        super().__init__()
        self.node, self.reads = node, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS or func._overloadpacket is torch.ops.aten.nonzero:
            optimizer = self.node.optimizer
            counters = {s["step"].untyped_storage().data_ptr()
                        for s in (optimizer.state.values() if optimizer is not None else ())}
            if args[0].untyped_storage().data_ptr() not in counters:
                self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _node(cfg, padded_rows=0):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(0, 512, (64, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[:padded_rows, -3:] = 0
    make = TRAINERS[cfg.distributed_algo].inner_optimizer_factory(cfg)
    return Node(0, "cpu", model, make, cfg.grad_clip, PackedData(ids, mask))


def _segments(node, job, pauses):
    """The round, one pause at a time: each segment's reads, the optimizer's step counters left out."""
    steps, segments = node.steps(job, pauses), []
    while True:
        with HostReads(node) as mode:
            try:
                next(steps)
                ended = False
            except StopIteration:
                ended = True
        segments.append(mode.reads)
        if ended:
            return segments


SHAPES = {
    # the default config: micro_batches estimator (the last step in 4 pieces), clipping, accumulation 2
    "default": (["config.yaml"], 2),
    # the paper config's shape on a CPU: the nodes estimator (one gradient sample), fp32, its clipping
    "paper": (["configs/paper_microllama_c4.yaml", "precision=fp32", "devices=[cpu]"], 1),
    # a compressed, streamed run: int8 pseudo-gradients with error feedback, 2 fragments, one step of delay
    "compressed_streamed": (["config.yaml", "outer_compression=int8", "sync_fragments=2", "sync_delay=1",
                             "num_inner_steps=6"], 1),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_an_inner_step_reads_nothing_on_the_host(shape):
    (path, *overrides), accumulation = SHAPES[shape]
    cfg = load_config(ROOT / path, overrides)
    node = _node(cfg)
    chunks = {"micro_batches": 4, "nodes": 1}[cfg.variance_estimator]
    steps = 6
    master = {k: v.clone() for k, v in float_state(node.model).items()}
    pauses = list(range(1, steps + 1))  # a pause after every step: each segment between two is one inner step
    if cfg.streams:
        plan = StreamingPlan.build(list(master), {k: v.numel() for k, v in master.items()}, steps,
                                   cfg.sync_fragments, cfg.sync_delay, cfg.fragment_alpha)
        assert set(plan.pauses) <= set(pauses)  # the streamed round's own pauses are among them
    for keep_local in (False, True):  # the first round, then (streaming) one going on from the node's own weights
        job = NodeJob(0, 0, master, torch.arange(steps * accumulation * 4).view(steps, accumulation, 4), chunks,
                      reset_optimizer=not keep_local, keep_local=keep_local and bool(cfg.streams))
        segments = _segments(node, job, pauses)
        assert len(segments) == steps + 1
        start, *inner_steps, _ = segments  # the end: the round's losses read once (.tolist(), a copy to the host)
        # the round's start, with its first step: two facts of its batches, from host memory (PackedData.needs_mask,
        # the tokens)
        assert start == ["aten._local_scalar_dense.default"] * 2, start
        for step, reads in enumerate(inner_steps, 2):  # steps 2 to 6, the last with its gradient samples
            assert reads == [], (shape, step, reads)


def test_a_padded_batch_keeps_its_mask_and_only_then_reads_the_mask_check():
    """A round whose batches hold a padded sequence passes the attention mask (transformers' mask code then reads
    it: a cost only such rounds pay); packed rounds pass none, with the same numbers as an all-ones mask."""
    cfg = load_config(ROOT / "config.yaml", [])
    padded, plain = _node(cfg, padded_rows=1), _node(cfg)
    job = NodeJob(0, 0, {k: v.clone() for k, v in float_state(plain.model).items()},
                  torch.arange(8).view(2, 1, 4), 0, reset_optimizer=True)
    second_step = _segments(padded, job, [1])[1]
    assert second_step  # transformers' mask code reads the padded round's mask
    assert padded.masked
    result = plain.run(job)
    assert not plain.masked
    # the same round with every sequence's mask passed (as before this change): the same losses, bit for bit
    masked = _node(cfg)
    masked.data.padded = torch.zeros_like(masked.data.padded)
    masked.data.needs_mask = lambda indices: True
    assert masked.run(job).step_losses == result.step_losses
