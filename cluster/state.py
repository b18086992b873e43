"""The cluster's state between rounds: who owns and holds what, the counters, the traffic, and the snapshot
a round rolls back to when it is abandoned or fails. With the trainers, it is what a checkpoint holds."""

from __future__ import annotations

import copy
import dataclasses
import random

import numpy as np
import torch

from algorithms.traffic import Traffic
from node import Node
from trainers import Trainer
from utils.model_state import float_state, load_float_state

STALE = (-1, -1)  # holds: a node away from the cluster keeps no current state (it receives one when it returns)


def rng_state(cuda: bool = False) -> dict:
    """Every global RNG (none decides anything today, but a model with dropout would use them).
    cuda: also the CUDA generators (only when the run uses CUDA: reading them initialises every device)."""
    return {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
            "python_version": random.getstate()[0], "numpy": np.random.get_state()[1].tolist(),
            "numpy_pos": int(np.random.get_state()[2]),
            "cuda": torch.cuda.get_rng_state_all() if cuda and torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), None))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class ClusterState:
    """owner: the trainer each node last trained (its inner optimizer state is that trainer's);
    holds: the (trainer, weights version) each node holds, None = the common initial weights;
    continues (streaming): the (trainer, weights version) whose round each node's own weights continue.
    trainers: the live trainers (shared with the controller; merges remove from it)."""

    def __init__(self, nodes: list[Node], trainers: dict[int, Trainer], streaming: bool, cuda: bool) -> None:
        self.nodes, self.trainers, self.streaming, self.cuda = nodes, trainers, streaming, cuda
        self.owner: dict[int, int | None] = {n.node_id: None for n in nodes}
        self.holds: dict[int, tuple[int, int] | None] = {n.node_id: None for n in nodes}
        self.continues: dict[int, tuple[int, int] | None] = {n.node_id: None for n in nodes}
        self.traffic = Traffic()  # rounds, syncs and bytes as a real cluster would send them
        self.tokens_total = 0
        self.last_outer_step = 0
        self.best_seen: float | None = None  # best metric of any model evaluated during the run
        self.initial_metric: float | None = None
        self.wall_before = 0.0  # seconds trained before a resume
        self.checkpointed_step: int | None = None  # the outer step of the last checkpoint written

    def holders(self, trainer_ids) -> dict[int, int]:
        """For each of these trainers, the lowest node holding its current state (under torchrun: a process that has
        it); no node yet: 0, since every process has it (the common initial weights, or a checkpoint all loaded).
        Answered at once: a round and a merge ask for all their trainers."""
        lowest: dict[tuple[int, int], int] = {}
        for n, held in sorted(self.holds.items(), reverse=True):
            if held is not None:
                lowest[held] = n
        return {t: lowest.get((t, self.trainers[t].weights_version), 0) for t in trainer_ids}

    # -------------------------------------------------------------------------------------------
    def snapshot(self, rollback: bool = True) -> dict:
        """What a round changes before its outer steps: restored when a round is abandoned or fails.
        rollback: only what a rollback needs, kept where it is (the residuals stay on their devices); else
        (a checkpoint's resume state) all of it, on the CPU."""
        return {"owner": dict(self.owner), "holds": dict(self.holds), "traffic": dataclasses.asdict(self.traffic),
                "samplers": {t: tr.sampler.state_dict() for t, tr in self.trainers.items()},
                "optimizers": [n.optimizer_state() for n in self.nodes],
                "residuals": [None if n.residual is None else
                              n.residual.detach().clone() if rollback else n.residual.detach().to("cpu", copy=True)
                              for n in self.nodes],
                "rng": rng_state(cuda=self.cuda),
                **(self._streaming_snapshot(rollback) if self.streaming else {})}

    def _streaming_snapshot(self, rollback: bool) -> dict:
        """Streaming rounds change more before the round ends: the trainers (each fragment's outer step lands
        mid-round) and the nodes' own weights, which go on from one round to the next. A rollback needs the
        weights of the nodes that go on from them only (the others start their next round from the master)."""
        return {"continues": dict(self.continues),
                "node_weights": [None if n.model is None or (rollback and self.continues.get(n.node_id) is None)
                                 else {k: v.detach().to("cpu", copy=True) for k, v in float_state(n.model).items()}
                                 for n in self.nodes],
                "trainer_states": {t: (copy.deepcopy(tr.state_dict()), {k: v.detach().clone()
                                                                         for k, v in tr.master.items()})
                                   for t, tr in self.trainers.items()}}

    def restore(self, state: dict) -> None:
        self.owner, self.holds = dict(state["owner"]), dict(state["holds"])
        self.traffic = Traffic(**state["traffic"])
        for t, sampler in state["samplers"].items():
            if t in self.trainers:
                self.trainers[t].sampler.load_state_dict(sampler)
        for node, optimizer in zip(self.nodes, state["optimizers"]):
            node.load_optimizer_state(optimizer)
        for node, residual in zip(self.nodes, state.get("residuals") or [None] * len(self.nodes)):
            if node.model is not None:  # under torchrun: this process's node only
                node.residual = None if residual is None else residual.to(node.device, copy=True)
        set_rng_state(state["rng"])
        if self.streaming:
            self.continues = dict(state.get("continues") or {n.node_id: None for n in self.nodes})
            for node, weights in zip(self.nodes, state.get("node_weights") or [None] * len(self.nodes)):
                if node.model is not None and weights is not None:
                    load_float_state(node.model, weights)
            for t, (trainer_state, weights) in (state.get("trainer_states") or {}).items():
                if t in self.trainers:
                    self.trainers[t].load_state_dict(trainer_state, weights)

    def state_dict(self, gather=None, rank: int | None = None) -> dict:
        """The snapshot and the counters. gather (torchrun): each process holds its own node's per-node state,
        collected from every rank (a collective: every rank calls it)."""
        state = self.snapshot(rollback=False)
        state.pop("trainer_states", None)  # the checkpoint holds the trainers themselves
        if gather is not None:
            for key in ("optimizers", "residuals", "node_weights"):
                if key in state:
                    state[key] = gather(state[key][rank])
        return {**state, "outer_step": self.last_outer_step, "tokens_total": self.tokens_total,
                "best_seen": self.best_seen, "initial_metric": self.initial_metric,
                "nodes": [{"max_batch": n.max_batch} for n in self.nodes]}

    def load_state_dict(self, state: dict) -> None:
        self.restore(state)
        self.last_outer_step, self.tokens_total = int(state["outer_step"]), int(state["tokens_total"])
        self.best_seen, self.initial_metric = state["best_seen"], state["initial_metric"]
        self.wall_before = float(state["wall_time"])
