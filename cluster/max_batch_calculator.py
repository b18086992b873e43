"""Largest micro-batch per node that fits its share of a device's memory (paper: max_batch).

CUDA: a binary search with real forward/backward/optimizer steps, measuring the allocator's peak and
treating an out-of-memory error as "does not fit", within padding_percentage of the free memory
divided among the device's nodes (as in the paper).
CPU: the same binary search against a configured budget per simulated device (the paper simulated
4 GPUs of fixed size on one card). Peak = parameters + gradients + optimizer states (measured after
one real step) + the activations saved for backward (summed with saved_tensors_hooks in a real
forward pass at the candidate batch).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from utils.errors import UserError

log = logging.getLogger(__name__)
MiB = 1 << 20


def _batch(model: torch.nn.Module, seq_len: int, batch: int, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen).to(device)
    classifier = type(model).__name__.endswith("ForSequenceClassification")
    labels = torch.zeros(batch, dtype=torch.long, device=device) if classifier else ids
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _binary_search(fits: Callable[[int], bool], upper: int) -> int:
    """Largest b in [1, upper] with fits(b), assuming monotonicity; 0 if even 1 does not fit."""
    lo, hi = 0, 1
    while hi <= upper and fits(hi):  # exponential growth first: cheap probes while small
        lo, hi = hi, hi * 2
    hi = min(hi, upper + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _static_bytes(model: torch.nn.Module, make_optimizer: Callable, seq_len: int) -> int:
    """Parameters + gradients + optimizer state, measured after one real step on a copy."""
    probe = copy.deepcopy(model)
    opt = make_optimizer(probe.parameters())
    probe(**_batch(probe, seq_len, 1, "cpu")).loss.backward()
    opt.step()
    tensors = [p for p in probe.parameters()] + [p.grad for p in probe.parameters() if p.grad is not None]
    tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def saved_bytes(forward: Callable[[], object], skip: frozenset[int] = frozenset()) -> int:
    """Bytes of the storages autograd saves for backward while `forward()` runs (each storage once; `skip`: storages,
    by their `_cdata`, not to count), plus its output's logits (their gradient, during backward). Keyed by storage,
    not address, so that it counts meta tensors too (cluster/memory_plan.py)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in skip:
            seen[storage._cdata] = storage.nbytes()
        # detached: a hook that returns a saved output itself ties it to its own grad_fn in a cycle that no
        # collector frees (each probe pass at the budget leaked the whole budget)
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    logits_bytes = out.logits.numel() * out.logits.element_size()
    del out
    return sum(seen.values()) + logits_bytes


def weight_storages(model: torch.nn.Module) -> frozenset[int]:
    """The parameters' storages, as `saved_bytes` skips them: a layer saves its weight for backward, which is the
    parameter itself, counted already with the weights."""
    return frozenset(p.untyped_storage()._cdata for p in model.parameters())


def _activation_bytes(model: torch.nn.Module, seq_len: int, batch: int) -> int:
    """Bytes saved for backward at `batch` on the CPU, the weights a layer saves not counted again (they are in the
    static bytes: the memory plan's rule for fp32 weights)."""
    return saved_bytes(lambda: model(**_batch(model, seq_len, batch, "cpu")), weight_storages(model))


def cpu_max_batch(model: torch.nn.Module, make_optimizer: Callable, seq_len: int, budget_bytes: float,
                  upper: int) -> int:
    """Binary search that never allocates more than its budget.

    Activations grow linearly with the batch, so sizes 1 and 2 give a line; a candidate the line puts
    over the budget is rejected without running it (a real forward pass at twice the budget is what
    once got the probe OOM-killed). Candidates under the line are measured for real.
    """
    static = _static_bytes(model, make_optimizer, seq_len)
    model.train()
    one = _activation_bytes(model, seq_len, 1)
    if static + one > budget_bytes:
        return 0
    per_sequence = max(_activation_bytes(model, seq_len, 2) - one, 1) if static + 2 * one <= budget_bytes else one

    def predicted(b: int) -> float:
        return static + one + per_sequence * (b - 1)

    def fits(b: int) -> bool:
        if predicted(b) > budget_bytes:
            return False
        return static + _activation_bytes(model, seq_len, b) <= budget_bytes

    return _binary_search(fits, upper)


# device_memory_mb 0 on CPU: a laptop-safe size. Each node's batches grow up to what its share allows, so a
# budget sized from a big machine's free memory would let a run with no config keys take tens of GB.
DEFAULT_CPU_DEVICE_MB = 1024.0


def default_device_memory_mb(num_cpu_devices: int) -> float:
    """device_memory_mb 0: half the memory available now, shared by the simulated CPU devices, and at most
    DEFAULT_CPU_DEVICE_MB per device."""
    return min(0.5 * psutil.virtual_memory().available / MiB / max(num_cpu_devices, 1), DEFAULT_CPU_DEVICE_MB)


@dataclass(frozen=True)
class NodeShare:
    """How much of its device one node may use: padding_percentage of the device's memory, shared by the device's
    nodes_per_gpu nodes. memory_mb: a CPU device's simulated memory (0: default_device_memory_mb, shared by
    num_cpu_devices devices); on CUDA a cap on the simulated device (0: none). nodes_on_card (CUDA): every node of
    the simulated devices on the same card, which share its free memory (0: nodes_per_gpu)."""
    padding_percentage: float
    nodes_per_gpu: int
    memory_mb: float = 0.0
    num_cpu_devices: int = 1
    nodes_on_card: int = 0
    # max_concurrent_nodes: the nodes of this device (and of the card) that compute at once (0: all of them); the
    # others keep only idle_bytes each on the device (their weights and optimizer state; 0 when offloaded)
    computing: int = 0
    computing_on_card: int = 0
    idle_bytes: float = 0.0

    def cpu_device_bytes(self) -> float:
        return (self.memory_mb or default_device_memory_mb(self.num_cpu_devices)) * MiB

    def _share(self, usable: float, nodes: int, computing: int) -> float:
        """What one computing node may use of `usable` bytes, the idle nodes' state set aside."""
        computing = computing or nodes
        return (usable - (nodes - computing) * self.idle_bytes) / computing

    def cpu_bytes(self) -> float:
        """Bytes one computing node of a simulated CPU device may use."""
        return self._share(self.cpu_device_bytes() * self.padding_percentage, self.nodes_per_gpu, self.computing)

    def cuda_bytes(self, free_bytes: int) -> float:
        """Bytes one computing node of a simulated CUDA device may use: its share of the card's free memory among
        every node on the card that computes at once (several simulated devices may share one card, as the paper's 4
        on one A100), and at most its share of the simulated device's own memory_mb when that is given."""
        budget = self._share(free_bytes * self.padding_percentage, self.nodes_on_card or self.nodes_per_gpu,
                             self.computing_on_card or self.computing)
        if self.memory_mb:
            budget = min(budget, self._share(self.memory_mb * MiB * self.padding_percentage, self.nodes_per_gpu,
                                             self.computing))
        return budget


def extrapolated_peak(peaks: dict[int, float], batch: int) -> float:
    """A CUDA candidate's peak, predicted from the peaks measured at smaller batches: the line through the two
    largest (0, i.e. run it, before two are known). A step's peak is the larger of a part that does not grow
    with the batch (the optimizer step, the gradients) and the activations, which grow linearly; so the peak is
    convex in the batch, and the line through the two largest batches is the steepest seen so far. The line
    through batches 1 and 2 can be flat while the fixed part dominates and let the search run a candidate at
    twice its budget (the first GPU check, H100, 2026-11-26: 1.9x)."""
    below = sorted(b for b in peaks if b < batch)[-2:]
    if len(below) < 2:
        return 0.0
    smaller, larger = below
    return peaks[larger] + (peaks[larger] - peaks[smaller]) / (larger - smaller) * (batch - larger)


def cuda_max_batch(model: torch.nn.Module, make_optimizer: Callable, seq_len: int, device: str, share: NodeShare,
                   upper: int) -> int:
    dev = torch.device(device)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(dev).total_memory
    free, _ = torch.cuda.mem_get_info(dev)
    budget = share.cuda_bytes(free)
    base = torch.cuda.memory_allocated(dev)
    probe = copy.deepcopy(model).to(dev)
    opt = make_optimizer(probe.parameters())
    log.info("%s: %.1f GiB total, %.1f GiB free, budget per node %.2f GiB", device, total / 2**30, free / 2**30,
             budget / 2**30)

    peaks: dict[int, int] = {}  # batch -> measured peak above base

    def fits(b: int) -> bool:
        if extrapolated_peak(peaks, b) > budget:  # never run what the line puts over the budget (as on CPU)
            return False
        try:
            torch.cuda.reset_peak_memory_stats(dev)
            probe(**_batch(probe, seq_len, b, device)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            peaks[b] = torch.cuda.max_memory_allocated(dev) - base
            return peaks[b] <= budget
        except torch.cuda.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            return False
        finally:
            torch.cuda.empty_cache()

    return _binary_search(fits, upper)  # the probe replica is freed when this frame ends


def find_max_batch_size(model: torch.nn.Module, make_optimizer: Callable, device: str, seq_len: int,
                        share: NodeShare, upper: int) -> int:
    """Largest micro-batch (at most `upper`) for one node of `device` given its share of the device's memory; a
    UserError when not even one sequence fits."""
    log.info("%s: probing the largest micro-batch per node (up to %d sequences)", device, upper)
    if device.startswith("cuda"):
        found = cuda_max_batch(model, make_optimizer, seq_len, device, share, upper)
        torch.cuda.empty_cache()
    else:
        budget = share.cpu_bytes()
        found = cpu_max_batch(model, make_optimizer, seq_len, budget, upper)
        log.info("%s: simulated device of %.0f MiB, budget per node %.1f MiB -> max batch %d", device,
                 share.cpu_device_bytes() / MiB, budget / MiB, found)
    if found == 0:
        raise UserError(f"device_memory_mb: not even one sequence fits a node of {device}; raise device_memory_mb "
                        "(CPU) or padding_percentage, or lower nodes_per_gpu or seq_len")
    return found
