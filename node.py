"""A node: one simulated worker. Its model replica on its device and its own inner optimizer, both built once.

Each round it copies its trainer's weights in (Streaming DiLoCo: only when it does not go on from its own) and takes
`num_inner_steps` optimizer steps (each over loader_batch x accumulation_steps sequences), pausing where a streamed
fragment is sent or lands, or (DDP / SNOO) where its trainer's nodes average their gradients. The trainers
(trainers.py) own the weights between rounds and the outer step; the backends (distributed/) run nodes' rounds.

Inner optimizer state: a node keeps its AdamW moments across rounds while it serves the same trainer. When it moves
to another trainer (re-assignment or merge) its state is reset, because the moments describe another model's
trajectory.

offload_idle_nodes: between its rounds a node's weights and inner optimizer state wait in host buffers (pinned on
CUDA, allocated once: `Offload`); `steps` moves them in first and the backend's `release` moves them out once the
round's result is taken. The tensors keep their identity (only `.data` moves), so the optimizer, the result's state
and every other holder see the same objects, and every value is copied exactly: no number depends on it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch
from tqdm import tqdm

from algorithms.buckets import bucket_for
from fabrics.dataset_loader import PackedData
from fabrics.precision import PRECISIONS, Precision
from utils.model_state import float_state, load_float_state


@dataclass
class NodeJob:
    """Everything a node needs for one round (built in the main thread, so no RNG is shared)."""

    node_id: int
    trainer_id: int
    master: dict[str, torch.Tensor]  # the trainer's weights to start from (read only)
    sample_indices: torch.Tensor  # [num_inner_steps, accumulation_steps, loader_batch]
    grad_chunks: int  # 0: no gradient samples; 1: the last step's gradient; k >= 2: k micro-batch gradients
    reset_optimizer: bool
    inject_fault: str = ""  # testing aid (config inject_fault): "nan", "error", "hang" or "crash"
    # Streaming DiLoCo: the node goes on from its own weights (it served this trainer version last round)
    # instead of loading `master`
    keep_local: bool = False
    # a compressed outer sync: `master` flattened once for the trainer's nodes (OuterSync.encode)
    flat_master: torch.Tensor | None = None
    # DDP / SNOO: the node pauses after each inner step's backward (yielding GRADIENTS) so its trainer's nodes
    # average their gradients before they step (distributed/synchronous.py)
    sync_gradients: bool = False


_nothing = contextlib.nullcontext  # no CUDA stream to copy on (a CPU node)

GRADIENTS = "gradients"  # what Node.steps yields where a synchronous trainer's gradients are averaged


class RoundAbandoned(Exception):
    """A stop was requested (SIGINT/SIGTERM): the node left its round between two inner steps."""


class InjectedFault(RuntimeError):
    """The fault that config inject_fault asked for."""


class InjectedCrash(RuntimeError):
    """inject_fault's crash: an error outside the node-fault policy, as a bug in the process's own code would be
    (under torchrun: one rank's own error, which ends the run)."""


@dataclass
class NodeResult:
    node_id: int
    trainer_id: int
    state: dict[str, torch.Tensor]  # the node's final weights (references into its replica)
    step_losses: list[float]  # mean loss of each optimizer step
    tokens: int
    grad_samples: torch.Tensor | None = None  # [k, P] fp32 (or [k, sketch dim] fp64), on the node's device
    sample_batches: torch.Tensor | None = None  # [k] sequences behind each gradient sample
    learning_rate: float = 0.0
    payload: torch.Tensor | None = None  # compressed outer sync: the encoded pseudo-gradient (uint8)


class Offload:
    """offload_idle_nodes: where a node's weights and optimizer state wait between its rounds. Off, nothing moves;
    on, they leave the device for host memory after a round and come back before the next. On CUDA the copies run
    on a stream of their own, into pinned host buffers kept from round to round, so other nodes' compute goes on
    meanwhile; on a CPU the same moves are plain copies. `tensors` (a callable: only called when something moves)
    gives what moves: the node's parameters, buffers and optimizer moments (Node._moving)."""

    def __init__(self, device: str, enabled: bool = False) -> None:
        self.device, self.enabled = device, enabled
        self.resident = True  # whether the state is on `device` now
        self._host: dict[int, torch.Tensor] = {}  # id(tensor) -> its host buffer (reused every round)
        self._copies: torch.cuda.Stream | None = None  # CUDA: the stream the copies run on

    @torch.no_grad()
    def leave(self, tensors: Callable[[], list[torch.Tensor]]) -> None:
        """The state to host memory, the device's copy freed (a no-op when off or already there)."""
        if not self.enabled or not self.resident:
            return
        if self._copies is None and self.device.startswith("cuda"):
            self._copies = torch.cuda.Stream(self.device)
        copies = self._copies
        if copies is not None:  # after the compute queued so far; other nodes' compute runs on meanwhile
            copies.wait_stream(torch.cuda.current_stream(self.device))
        kept, self._host = self._host, {}  # only the buffers of today's tensors (a reset optimizer has new ones)
        with torch.cuda.stream(copies) if copies is not None else _nothing():
            for t in tensors():
                host = kept.get(id(t))
                if host is None or host.shape != t.shape or host.dtype != t.dtype:
                    host = torch.empty_like(t, device="cpu", pin_memory=copies is not None)
                self._host[id(t)] = host
                host.copy_(t.data, non_blocking=copies is not None)
                if copies is not None:
                    t.data.record_stream(copies)  # the device block is not reused before its copy is done
                t.data = host
        if copies is not None:
            copies.synchronize()  # host readers (checkpoints, the trainer's mean) see the copied values
        self.resident = False

    @torch.no_grad()
    def enter(self, tensors: Callable[[], list[torch.Tensor]]) -> None:
        """The state back on the device (from the host buffers, which stay); a no-op when it is there."""
        if self.resident:
            return
        copies = self._copies
        compute = torch.cuda.current_stream(self.device) if copies is not None else None  # before the switch below
        with torch.cuda.stream(copies) if copies is not None else _nothing():
            for t in tensors():
                host = t.data
                on_device = torch.empty_like(host, device=self.device)
                on_device.copy_(host, non_blocking=copies is not None)
                if copies is not None:
                    on_device.record_stream(compute)  # made on the copy stream, used on the compute stream
                t.data = on_device
        if copies is not None:
            compute.wait_stream(copies)  # compute starts once the copies are done
        self.resident = True


class Node:
    def __init__(self, node_id: int, device: str, model: torch.nn.Module, make_optimizer, grad_clip: float,
                 data: PackedData, precision: Precision = PRECISIONS["fp32"], compile_model: bool = False,
                 compile_backend: str = "inductor") -> None:
        self.node_id, self.device, self.model = node_id, device, model  # model None: the node runs elsewhere
        self.pinned_copies = device.startswith("cuda")  # micro-batches reach the device through pinned memory
        self.make_optimizer, self.grad_clip, self.data = make_optimizer, grad_clip, data
        self.params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
        self.precision = precision
        # the context every forward pass runs in, made once: entered per micro-batch, never by two threads at once
        self.autocast = precision.autocast(device)
        # compiled once, here: the wrapper shares the replica's parameters, so weights still load into `model`
        # (one graph per shape: micro-batches come in buckets, each compiled before training by `warm_up`)
        self.forward = (torch.compile(model, backend=compile_backend, dynamic=False)
                        if compile_model and model is not None else model)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler: torch.amp.GradScaler | None = None  # fp16: this node's dynamic loss scale
        self.max_batch = 0
        self.show_progress = False  # an inner-step progress bar (config inner_progress)
        self.stop = threading.Event()  # set by a stop request: leave the round at the next inner step
        self.sketch = None  # statistics_comm sketch: the count sketch its gradient samples go through
        # compressed outer sync with error feedback: what compression dropped from this node's last
        # pseudo-gradients (fp32, flat). It stays with the node when it serves another trainer (a merge
        # made that trainer from this one's state) and is checkpointed with the node.
        self.residual: torch.Tensor | None = None
        self.round_losses: list[torch.Tensor] = []  # the losses of the round so far, at a pause
        self.masked = True  # whether this round's batches need an attention mask (PackedData.needs_mask)
        self.buckets: list[int] = []  # compile: the micro-batch sizes it runs (algorithms/buckets.py; set by build)
        self.offload = Offload(device)  # offload_idle_nodes (build switches it on)

    def _moving(self) -> list[torch.Tensor]:
        """What offloading moves: the replica's parameters and buffers, and the optimizer's per-parameter state
        (moments: the parameter's shape, where the parameter is; AdamW's step counters stay where torch keeps them)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        if self.optimizer is not None:
            for p, state in self.optimizer.state.items():
                tensors += [v for v in state.values()
                            if torch.is_tensor(v) and v.shape == p.shape and v.device == p.device]
        return tensors

    def release(self) -> None:
        """offload_idle_nodes: the weights and optimizer state to host memory, the device's copy freed (a no-op
        without offloading, or when already there)."""
        if self.model is not None:
            self.offload.leave(self._moving)

    def _load_in(self) -> None:
        """The weights and optimizer state back on the device (from their host buffers, which stay)."""
        self.offload.enter(self._moving)

    @contextlib.contextmanager
    def on_device(self, leave: bool = True):
        """offload_idle_nodes: the node's weights and optimizer state on its device for the block, and back in host
        memory when the block ends, by an error too (leave=False: they stay on the device). Without offloading
        nothing moves. A round (distributed/node_round.py: advance, run_node) moves the node in at its start
        (`steps`) and releases it at its end, once its result is encoded, and at the pauses where only its weights
        are read, moving it back in when it goes on."""
        self._load_in()
        try:
            yield
        finally:
            if leave:
                self.release()

    def optimizer_state(self) -> dict | None:
        """A copy of the inner optimizer's state (and fp16 loss scale) on the CPU; None before the first round."""
        if self.optimizer is None:
            return None
        state = self.optimizer.state_dict()
        return {"state": {i: {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v)
                              for k, v in s.items()} for i, s in state["state"].items()},
                "param_groups": state["param_groups"],
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_optimizer_state(self, state: dict | None) -> None:
        if state is None or self.model is None:
            self.optimizer, self.scaler = None, None
            return
        # made where it computes (fused AdamW on CUDA), as in a round
        with self.on_device(leave=not self.offload.resident):
            self._new_optimizer()
            self.optimizer.load_state_dict({k: v for k, v in state.items() if k != "scaler"})
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])

    def _new_optimizer(self) -> None:
        self.optimizer = self.make_optimizer(self.params)
        self.scaler = self.precision.scaler(self.device)

    def _forward_backward(self, idx: torch.Tensor, scale: float) -> torch.Tensor:
        """One micro-batch's forward and backward, its loss scaled by `scale`; the unscaled loss, still on the device
        (nothing here reads the device: tests/test_host_syncs.py)."""
        if self.buckets and self.data.labels is None:  # compiled: the micro-batch padded to its bucket, no mask
            (ids, labels), mask = self._bucketed(idx), None
        else:
            ids = self._to_device(self.data.input_ids[idx])
            if not self.masked:  # packed language-model sequences, none padded: causal attention, all labelled
                mask, labels = None, ids  # (the model shifts labels by one itself)
            else:
                mask = self._to_device(self.data.attention_mask[idx])
                if self.data.labels is not None:  # classification: one label per sequence
                    labels = self._to_device(self.data.labels[idx])
                else:  # language modelling: padding is excluded from the loss
                    labels = ids.masked_fill(mask == 0, -100)
        with self.autocast:
            loss = self.forward(input_ids=ids, attention_mask=mask, labels=labels).loss
        scaled = loss * scale
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return loss.detach().float()

    def _to_device(self, rows: torch.Tensor) -> torch.Tensor:
        """A micro-batch's rows (gathered in host memory) on the node's device: on CUDA through pinned memory, copied
        asynchronously (a copy from pageable memory makes the host wait); on a CPU, as they are."""
        if self.pinned_copies:
            rows = rows.pin_memory()
        return rows.to(self.device, non_blocking=True)

    def _bucketed(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A compiled node's micro-batch (algorithms/buckets.py): the sequences and their labels, padded with
        label-less rows up to the bucket, built in host memory. No attention mask: padding only ever ends a
        sequence, so under causal attention no real token sees it, and its positions carry no label; the loss is the
        mean over labelled tokens, so it and every gradient are the unpadded micro-batch's."""
        ids = self.data.input_ids[idx]
        labels = ids.masked_fill(self.data.attention_mask[idx] == 0, -100)
        rows = bucket_for(len(idx), self.buckets)
        if rows > len(idx):
            ids = torch.cat([ids, ids.new_zeros(rows - len(idx), ids.shape[1])])
            labels = torch.cat([labels, labels.new_full((rows - len(idx), labels.shape[1]), -100)])
        return self._to_device(ids), self._to_device(labels)

    def warm_up(self) -> int:
        """compile: every bucket's forward and backward compiled now, before training; the number of buckets. The
        weights do not change (no optimizer step; the gradients are dropped) and no RNG is drawn."""
        with self.on_device():
            self.model.train()
            length = self.data.input_ids.shape[1]
            for rows in self.buckets:
                ids = torch.zeros(rows, length, dtype=torch.long, device=self.device)
                labels = ids.clone()  # a tensor of its own, as in training (dynamo guards on aliasing)
                with self.autocast:  # the call training makes (the same kwargs: one graph)
                    loss = self.forward(input_ids=ids, attention_mask=None, labels=labels).loss
                loss.backward()
            for p in self.params:
                p.grad = None
        return len(self.buckets)

    def _flat_grad(self) -> torch.Tensor:
        """The accumulated gradient as one fp32 vector, without the fp16 loss scale."""
        flat = self.gradients()  # a new tensor: unscaled in place, one model-sized copy
        return flat.div_(self.scaler.get_scale()) if self.scaler is not None else flat

    def gradients(self) -> torch.Tensor:
        """The accumulated gradient as one fp32 vector, as it is (with the fp16 loss scale, which every node of a
        synchronous trainer shares)."""
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in self.params])

    @torch.no_grad()
    def load_gradients(self, flat: torch.Tensor) -> None:
        """Replace the accumulated gradient by `flat` (gradients' layout), e.g. the trainer's mean."""
        start = 0
        for p in self.params:
            value = flat[start:start + p.numel()].view(p.shape).to(p.device, p.dtype)
            if p.grad is None:
                p.grad = value.clone()
            else:
                p.grad.copy_(value)
            start += p.numel()

    def _last_step_with_samples(self, idx: torch.Tensor,
                                chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last step's batch in `chunks` pieces, recording each piece's gradient at the same point.

        Each piece's loss is weighted by its share of the batch, so the accumulated gradient is the
        same as in a normal step; piece i's own gradient is (acc_i - acc_{i-1}) / share_i. Pieces can
        differ in size by one sequence; each sample carries its own size.
        """
        flat = idx.reshape(-1)
        pieces = torch.tensor_split(flat, min(max(chunks, idx.shape[0]), len(flat)))
        samples, losses = [], []
        previous = torch.zeros(sum(p.numel() for p in self.params), device=self.device)
        for piece in pieces:
            share = len(piece) / len(flat)
            losses.append(self._forward_backward(piece, share) * share)
            current = self._flat_grad()
            samples.append((current - previous) / share)
            previous = current
        sizes = torch.tensor([len(piece) for piece in pieces], dtype=torch.float64)
        return torch.stack(losses).sum(), torch.stack(samples), sizes

    def run(self, job: NodeJob) -> NodeResult:
        """The whole round: `num_inner_steps` inner steps from the trainer's weights."""
        round_steps = self.steps(job)
        while True:
            try:
                next(round_steps)
            except StopIteration as done:
                return done.value

    def steps(self, job: NodeJob, pauses: list[int] = ()) -> Generator[int, None, NodeResult]:
        """The round as a generator: it pauses after each inner-step count in `pauses` (yielding it), so a
        Streaming DiLoCo round can send and land fragments between inner steps and a mid-round evaluation can read
        the trainer's nodes (distributed/mid_round.py), and returns the result."""
        pauses = set(pauses)
        if job.inject_fault == "error":
            raise InjectedFault(f"inject_fault: error on node {self.node_id}")
        if job.inject_fault == "crash":
            raise InjectedCrash(f"inject_fault: crash on node {self.node_id}")
        while job.inject_fault == "hang":  # a stuck node: only a stop (or torchrun's kill) ends it
            if self.stop.wait(0.1):
                raise RoundAbandoned(f"node {self.node_id} stopped while hanging (inject_fault)")
        self._load_in()  # offload_idle_nodes: the node's state comes in for its inner steps (run_node, advance: out)
        if job.reset_optimizer or self.optimizer is None:
            self._new_optimizer()
        if not job.keep_local:
            load_float_state(self.model, job.master)
        self.model.train()
        # what the round's batches are, read once at its start from host memory (never the device)
        self.masked = self.data.needs_mask(job.sample_indices)
        tokens = int(self.data.tokens_per_sequence[job.sample_indices.reshape(-1)].sum())
        steps, accumulation, _ = job.sample_indices.shape
        losses, grad_samples, sample_batches = [], None, None
        bar = tqdm(total=steps, desc=f"node {self.node_id}", leave=False, position=1) if self.show_progress else None
        for step in range(steps):
            if self.stop.is_set():
                raise RoundAbandoned(f"node {self.node_id} stopped before inner step {step}")
            idx = job.sample_indices[step]
            if step == steps - 1 and job.grad_chunks >= 2:
                loss, grad_samples, sample_batches = self._last_step_with_samples(idx, job.grad_chunks)
            else:
                loss = sum(self._forward_backward(micro, 1.0 / accumulation) for micro in idx) / accumulation
                if step == steps - 1 and job.grad_chunks == 1:
                    grad_samples = self._flat_grad()[None]
                    sample_batches = torch.tensor([float(idx.numel())], dtype=torch.float64)
            if job.inject_fault == "nan" and step == 0:
                for p in self.params:  # as a diverging step would: the weights turn NaN, the loss reports it
                    if p.grad is not None:
                        p.grad.fill_(float("nan"))
                loss = loss * float("nan")
            losses.append(loss)
            if job.sync_gradients:
                yield GRADIENTS  # the trainer's mean gradient replaces this node's (load_gradients)
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # clipping sees the true gradient
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            if self.scaler is not None:
                self.scaler.step(self.optimizer)  # skipped when the gradients overflowed; the scale shrinks
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if bar is not None:
                bar.update()
            if step + 1 in pauses:
                self.round_losses = losses
                yield step + 1
                self._load_in()  # offload_idle_nodes: released at a pause where only its weights were read
        if bar is not None:
            bar.close()
        if grad_samples is not None and self.sketch is not None:
            grad_samples = self.sketch(grad_samples)  # on this node, before anything travels
        step_losses = torch.stack(losses).float().cpu().tolist()  # one sync per round, not per step
        return NodeResult(job.node_id, job.trainer_id, float_state(self.model), step_losses, tokens, grad_samples,
                          sample_batches, self.optimizer.param_groups[0]["lr"])
