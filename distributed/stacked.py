"""node_execution: stacked. The nodes of a device whose inner steps have the same shape run as one model over
stacked weights: one forward and backward for the group (torch.func.vmap of a functional call of the node's
transformers model), each node with its own data, loss scale, clipping norm, AdamW state, step count and learning
rate (algorithms/stacked_adamw.py). The gain is a GPU's: small micro-batches leave most of a card idle, and a
group of N nodes at micro-batch b keeps it as busy as one node at N x b (benchmarks/stacked.py measures it).

Groups. Nodes join a group when they share a device, the shape of their round's micro-batches ([inner steps,
accumulation, micro-batch]) and the batch test's sampling (grad_chunks). Nodes of different shapes are not padded
into one group: a padded micro-batch changes no loss (padding carries no label) but an accumulation count does
(each node's mean is over its own micro-batches), and a node with more inner steps would hold the group; they run
as groups of their own. A node asked to fail by inject_fault (error, crash, hang) runs on its own, as in the
sequential loop, so its fault is its own; a NaN (inject_fault nan, or a diverging node) stays in its slice: every
operation here is per slice, so it faults that node only.

State. Each node owns its weights and AdamW state as today (checkpoints, merges, moves and the rollback read and
write them through the node; a stacked run resumes sequentially and back), but its tensors are views of its row of
the group's Stack: three [N, P] tensors (weights, the two moments), so AdamW, clipping and the batch test's samples
are one operation each. Everything that reads a node (a mid-round evaluation, the results) reads the stack, and
nothing is copied back. A stack stays from round to round while its group does (DiLoCo's constant batch: always);
a new group (a batch grew, a merge moved nodes) allocates its stack and copies its nodes in, the old stack freed
once no node points into it: for that moment a device holds its nodes' state twice, before any gradient or
activation exists (the memory plan counts the larger of the two).

The round drivers are the sequential loop's: `stacked_steps` hands evaluated_round and streamed_round each node's
round as Node.steps would (a facade over its group's one round, which advances once per pause), so faults, the
compressed outer sync's encoding, mid-round evaluations and Streaming DiLoCo's fragments are handled per node by the
same code.

What it refuses (utils/config_rules.py, one line each): BERT (bidirectional attention needs its padding mask, and
transformers' mask checks read values that vmap cannot batch; a causal model's packed sequences need none),
inner optimizers other than AdamW (LocalSGD), DDP / SNOO (their gradients are averaged per node between backward
and step), compile, fp16 (one loss scale per node), offload_idle_nodes (a stack holds its nodes at once). Under
torchrun each process holds one node: a group of one, the sequential loop.

Equality with the sequential loop: the same operations per slice, in another order of sums (vmap batches the
matmuls; the clipping norm is taken per slice): losses, weights and AdamW state agree within 1e-5 relative in
fp32 after a round (tests/test_stacked.py; compounding to 1e-4 over 3 rounds), and runs' batch decisions and merges
are the same; last digits can differ, so a stacked report says it ran stacked.
"""

from __future__ import annotations

import warnings
from collections.abc import Generator
from dataclasses import dataclass

import torch
from torch.func import functional_call, vmap

from algorithms.stacked_adamw import AdamWHyper, stacked_adamw_step
from node import Node, NodeJob, NodeResult, RoundAbandoned
from utils.model_state import float_state, load_float_state

# torch has no batching rule for the CPU's flash attention and loops over the nodes instead (it says so at each
# call); the numbers are right, and benchmarks/stacked.py measures what it costs
warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented the "
                        "batching rule for aten::_scaled_dot_product_flash_attention_for_cpu")
# a leaf's .grad is a view of the stack's gradient row by row (Stack.leaves), strided as the leaf itself: autograd
# accumulates into it in place all the same, and says so at each backward
warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")
ALONE = ("error", "crash", "hang")  # inject_fault kinds that run on their own node (the sequential loop)


def groups_of(nodes: list[Node], jobs: list[NodeJob]) -> list[list[NodeJob]]:
    """The round's jobs in groups that run as one stacked model (see the module's docstring), each in node-id
    order, the groups in the order of their first node."""
    groups: dict[tuple, list[NodeJob]] = {}
    for job in sorted(jobs, key=lambda j: j.node_id):
        alone = job.inject_fault in ALONE
        key = (job.node_id,) if alone else (nodes[job.node_id].device, tuple(job.sample_indices.shape),
                                            job.grad_chunks)
        groups.setdefault(key, []).append(job)
    return list(groups.values())


@dataclass
class Stack:
    """A group's stacked state: each a [N, P] tensor, row k node k's tensors end to end in Node.params' order
    (`layout`: each parameter's name, first column, last column + 1, shape). Node k's parameters and AdamW moments
    are views of row k, so one row is one node's storage, and the group's weights, gradient and moments are three
    tensors: AdamW, clipping and the batch test's samples are one operation each, whatever the model's tensor count."""

    node_ids: tuple[int, ...]
    weights: torch.Tensor
    grad: torch.Tensor  # every node's accumulated gradient: the leaves' .grad are views of it
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    layout: list[tuple[str, int, int, torch.Size]]

    def leaves(self) -> list[torch.Tensor]:
        """What the functional model reads: each parameter of every node ([N, *shape]), an autograd leaf that is a
        view of `weights`, whose .grad is its view of `grad` (backward accumulates there in place). Leaves of their
        own, not autograd views of one [N, P] leaf, whose backward would add a zero-filled [N, P] per parameter."""
        leaves = []
        for weight, grad in zip(self.view(self.weights), self.view(self.grad)):
            leaf = weight.requires_grad_()
            leaf.grad = grad
            leaves.append(leaf)
        return leaves

    def view(self, flat: torch.Tensor, row: int | None = None) -> list[torch.Tensor]:
        """Each parameter of `flat`'s row `row` (None: every row, [N, *shape])."""
        if row is None:
            return [flat[:, a:b].view(flat.shape[0], *shape) for _, a, b, shape in self.layout]
        return [flat[row, a:b].view(shape) for _, a, b, shape in self.layout]


class StackedGroup:
    """One round of a group of nodes (same device, same shapes) as one functional model over a Stack.

    stacks: the backend's stacks of earlier rounds, by the nodes they hold. A group of the same nodes as an earlier
    round's finds its nodes' tensors still views of that stack and copies nothing; a new group allocates its stack
    and copies its nodes in (the memory plan counts the copy: cluster/memory_plan.py)."""

    def __init__(self, nodes: list[Node], jobs: list[NodeJob], stacks: dict | None = None) -> None:
        self.nodes, self.jobs, self.stacks = nodes, jobs, stacks
        self.n = len(nodes)
        self.base = nodes[0].model  # its module structure runs every node's weights (functional_call)
        self.device, self.data = nodes[0].device, nodes[0].data
        self.autocast = nodes[0].precision.autocast(self.device)  # the stack's own (the nodes' dtype)
        self.names = [name for name, p in self.base.named_parameters() if p.requires_grad]  # Node.params' order
        self.buffers = dict(self.base.named_buffers())  # shared (rotary frequencies): the same in every replica
        self.padding_rows = [(self.names.index(f"{name}.weight"), module.padding_idx)
                             for name, module in self.base.named_modules()
                             if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None
                             and f"{name}.weight" in self.names]

    def _stack(self) -> None:
        """The group's Stack (the one of an earlier round of the same nodes, or a new one), each node's parameters
        and AdamW moments views of its row; a tensor that is not yet (a reset optimizer's new moments, weights
        loaded elsewhere) is copied into its row first."""
        node_ids = tuple(node.node_id for node in self.nodes)
        stack = self.stacks.get(node_ids) if self.stacks is not None else None
        if stack is None:
            layout, start = [], 0
            for name, p in zip(self.names, self.nodes[0].params):
                layout.append((name, start, start + p.numel(), p.shape))
                start += p.numel()
            like = self.nodes[0].params[0]

            def empty() -> torch.Tensor:
                return torch.empty(self.n, start, dtype=like.dtype, device=like.device)

            stack = Stack(node_ids, empty(), empty(), empty(), empty(), layout)
            if self.stacks is not None:  # a stack holding any of these nodes is theirs no more
                for key in [k for k in self.stacks if set(k) & set(node_ids)]:
                    del self.stacks[key]
                self.stacks[node_ids] = stack
        states = [[self._adamw_state(node, p) for p in node.params] for node in self.nodes]
        with torch.no_grad():
            for k, node in enumerate(self.nodes):
                for tensors, flat in ((node.params, stack.weights),
                                      ([s["exp_avg"] for s in states[k]], stack.exp_avg),
                                      ([s["exp_avg_sq"] for s in states[k]], stack.exp_avg_sq)):
                    for tensor, row in zip(tensors, stack.view(flat, k)):
                        if tensor.data_ptr() != row.data_ptr():
                            row.copy_(tensor.data)
                            tensor.data = row
        self.stack, self.states, self.leaves = stack, states, stack.leaves()
        # each node's step count (one read per round) and learning rate; what they share, from the first
        self.steps = torch.tensor([float(s[0]["step"]) for s in states], dtype=torch.float64)
        self.lrs = torch.tensor([node.optimizer.param_groups[0]["lr"] for node in self.nodes], dtype=torch.float64)
        self.hyper = AdamWHyper.of(self.nodes[0].optimizer)
        if any(AdamWHyper.of(node.optimizer) != self.hyper or len(node.optimizer.param_groups) != 1
               for node in self.nodes):
            raise ValueError("node_execution stacked: the group's nodes differ in AdamW betas, eps or weight decay")

    @staticmethod
    def _adamw_state(node: Node, p: torch.Tensor) -> dict:
        """The node's AdamW state of parameter p, made as torch.optim.AdamW makes it at its first step if absent."""
        state = node.optimizer.state[p]
        if not state:
            fused = node.optimizer.defaults.get("fused")
            state["step"] = torch.zeros((), dtype=torch.get_default_dtype(), device=p.device if fused else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _loss(self, params: dict, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return functional_call(self.base, ({**params, **self.buffers},), (),
                               {"input_ids": ids, "attention_mask": None, "labels": labels}).loss

    def _forward_backward(self, idx: torch.Tensor, scale: float) -> torch.Tensor:
        """One micro-batch of every node (idx: [N, rows] sequence indices), its losses scaled by `scale`, backward
        into the stack's gradient; the unscaled losses [N], on the device."""
        to_device = self.nodes[0]._to_device
        ids = to_device(self.data.input_ids[idx])
        # no attention mask, ever: transformers' mask checks read the mask's values, which vmap cannot batch. Packing
        # pads only the end of a sequence, so under causal attention no real token sees padding, and padding carries
        # no label: every loss and gradient is the masked one's (as a compiled node's buckets, node.py)
        labels = to_device(self.data.input_ids[idx].masked_fill(self.data.attention_mask[idx] == 0, -100)
                           ) if self.masked else ids
        params = dict(zip(self.names, self.leaves))
        with self.autocast:
            # randomness: a model with dropout draws each node's masks apart (not as the sequential loop would)
            losses = vmap(self._loss, in_dims=(0, 0, 0), randomness="different")(params, ids, labels)
        (losses * scale).sum().backward()  # node n's loss reaches only its row of the stack
        with torch.no_grad():
            grads = self.stack.view(self.stack.grad)
            for i, row in self.padding_rows:  # as nn.Embedding's own backward: no gradient for the padding row
                grads[i][:, row] = 0  # (vmap's batched embedding backward leaves it in)
        return losses.detach().float()

    def _flat_grads(self) -> torch.Tensor:
        """Each node's accumulated gradient as one fp32 vector, a copy: [N, P], Node.params' order."""
        return self.stack.grad.float().clone()

    def _last_step_with_samples(self, idx: torch.Tensor, chunks: int):
        """Node._last_step_with_samples for every node at once (idx: [N, accumulation, micro-batch])."""
        flat = idx.reshape(self.n, -1)
        count = min(max(chunks, idx.shape[1]), flat.shape[1])
        pieces = torch.tensor_split(flat, count, dim=1)
        samples, losses = [], []
        previous = torch.zeros(self.stack.grad.shape, device=self.device)
        for piece in pieces:
            share = piece.shape[1] / flat.shape[1]
            losses.append(self._forward_backward(piece, share) * share)
            current = self._flat_grads()
            samples.append((current - previous) / share)
            previous = current
        sizes = torch.tensor([piece.shape[1] for piece in pieces], dtype=torch.float64)
        return torch.stack(losses).sum(0), torch.stack(samples, dim=1), sizes  # [N], [N, k, P], [k]

    @torch.no_grad()
    def _clip(self, max_norm: float) -> None:
        """torch.nn.utils.clip_grad_norm_ per node: the norm of its row, its own coefficient."""
        grad = self.stack.grad
        coefficient = (max_norm / (torch.linalg.vector_norm(grad, dim=1) + 1e-6)).clamp(max=1.0)
        grad.mul_(coefficient.to(grad.dtype)[:, None])

    def steps(self, pauses: list[int] = ()) -> Generator[int, None, list[NodeResult]]:
        """The group's round, as Node.steps: it pauses after each inner-step count in `pauses` (yielding it) and
        returns each node's result (in the group's order)."""
        pauses = set(pauses)
        for node, job in zip(self.nodes, self.jobs):
            if job.reset_optimizer or node.optimizer is None:
                node._new_optimizer()
            if not job.keep_local:
                load_float_state(node.model, job.master)
            node.model.train()
        self._stack()
        indices = torch.stack([job.sample_indices for job in self.jobs])  # [N, steps, accumulation, micro-batch]
        self.masked = any(self.data.needs_mask(job.sample_indices) for job in self.jobs)
        tokens = [int(self.data.tokens_per_sequence[job.sample_indices.reshape(-1)].sum()) for job in self.jobs]
        steps, accumulation = indices.shape[1], indices.shape[2]
        chunks = self.jobs[0].grad_chunks
        nan = torch.tensor([job.inject_fault == "nan" for job in self.jobs])
        losses, grad_samples, sample_batches = [], None, None
        for step in range(steps):
            if any(node.stop.is_set() for node in self.nodes):
                raise RoundAbandoned(f"nodes {[j.node_id for j in self.jobs]} stopped before inner step {step}")
            idx = indices[:, step]
            self.stack.grad.zero_()  # what backward accumulates into (a node's zero_grad)
            if step == steps - 1 and chunks >= 2:
                loss, grad_samples, sample_batches = self._last_step_with_samples(idx, chunks)
            else:
                loss = sum(self._forward_backward(idx[:, m], 1.0 / accumulation)
                           for m in range(accumulation)) / accumulation
                if step == steps - 1 and chunks == 1:
                    grad_samples = self._flat_grads()[:, None]  # [N, 1, P]
                    sample_batches = torch.tensor([float(idx[0].numel())], dtype=torch.float64)
            stack = self.stack
            with torch.no_grad():
                if step == 0 and bool(nan.any()):  # inject_fault nan: as a diverging step would, on that node only
                    stack.grad[nan.to(stack.grad.device)] = float("nan")
                    loss = torch.where(nan.to(loss.device), float("nan"), loss)
            losses.append(loss)
            if self.nodes[0].grad_clip > 0:
                self._clip(self.nodes[0].grad_clip)
            stacked_adamw_step([stack.weights], [stack.grad], [stack.exp_avg], [stack.exp_avg_sq], self.steps,
                               self.lrs, self.hyper)
            if step + 1 in pauses:
                for node, node_losses in zip(self.nodes, torch.stack(losses).unbind(1)):
                    node.round_losses = list(node_losses)
                yield step + 1
        with torch.no_grad():
            for node_steps, per_param in zip(self.steps.tolist(), self.states):
                for state in per_param:
                    state["step"].fill_(node_steps)
        per_node_losses = torch.stack(losses).cpu().T.tolist()  # one sync per round, not per step
        results = []
        for k, (node, job) in enumerate(zip(self.nodes, self.jobs)):
            samples = None if grad_samples is None else grad_samples[k]
            if samples is not None and node.sketch is not None:
                samples = node.sketch(samples)
            results.append(NodeResult(job.node_id, job.trainer_id, float_state(node.model), per_node_losses[k],
                                      tokens[k], samples, sample_batches, float(self.lrs[k])))
        return results


class _Shared:
    """One group's round (StackedGroup.steps), advanced by whichever member's facade asks first: its pauses so far,
    then its results, or the exception that ended it (every member's)."""

    def __init__(self, round_steps: Generator) -> None:
        self.round_steps, self.pauses = round_steps, []
        self.results: list[NodeResult] | None = None
        self.error: BaseException | None = None

    def reach(self, count: int) -> None:
        """Advance the group until it has passed `count` + 1 pauses, or ended."""
        while len(self.pauses) <= count and self.results is None and self.error is None:
            try:
                self.pauses.append(next(self.round_steps))
            except StopIteration as done:
                self.results = done.value
            except BaseException as exc:  # noqa: BLE001 - each member's facade raises it, where the node's would
                self.error = exc


def _facade(shared: _Shared, k: int) -> Generator[int, None, NodeResult]:
    """Member k's round as Node.steps gives it: the group's pauses, then member k's result. The backends' round
    drivers (evaluated_round, streamed_round) advance every live node of a group to the same pause, so the group
    advances once per pause; a member left out (a fault before a fragment) is simply not asked."""
    count = 0
    while True:
        shared.reach(count)
        if count < len(shared.pauses):
            yield shared.pauses[count]
            count += 1
            continue
        if shared.error is not None:
            raise shared.error
        return shared.results[k]


def stacked_steps(nodes: list[Node], jobs: list[NodeJob], pauses: list[int], stacks: dict | None = None
                  ) -> dict[int, Generator]:
    """Each job's round as Node.steps gives it (pausing at `pauses`, returning its NodeResult), its group run as
    one StackedGroup (a group of one: the node's own Node.steps). The backends' round drivers take these in place of
    the nodes' own rounds, so faults, compression, evaluations and fragments are handled per node as in the
    sequential loop. stacks: the Stacks of earlier rounds (StackedGroup), kept by the caller."""
    round_steps = {}
    for group in groups_of(nodes, jobs):
        members = [nodes[j.node_id] for j in group]
        if len(group) == 1:
            round_steps[group[0].node_id] = members[0].steps(group[0], pauses)
            continue
        shared = _Shared(StackedGroup(members, group, stacks).steps(pauses))
        for k, job in enumerate(group):
            round_steps[job.node_id] = _facade(shared, k)
    return round_steps
