"""The Trainer family: the outer optimisation. A trainer is one model instance: an fp32 master copy of the weights
("original_parameters" in torchft), the requested batch and, for DiLoCo, the outer optimizer. Its nodes (node.py) run
the inner steps; the trainer applies the outer step to what they return.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from algorithms.policies import weighted_average
from fabrics.dataset_loader import ShardSampler
from utils.config import Config


@dataclass
class TrainerStats:
    sync_number: int = 0  # outer steps taken
    optimizer_steps: int = 0  # inner optimizer steps over all nodes
    tokens_seen: int = 0


class Trainer:
    """One model instance. Subclasses define the inner optimizer and the outer step."""

    algorithm = ""
    syncs_gradients = False  # DDP / SNOO: the nodes average their gradients after every inner step

    def __init__(self, trainer_id: int, initial_state: dict[str, torch.Tensor], parameter_names: set[str],
                 cfg: Config, sampler: ShardSampler, device: str = "cpu") -> None:
        self.trainer_id = trainer_id
        # fp32 master copy: on the CPU (off the accelerators, as OpenDiLoCo, prime and torchft do), or on
        # the nodes' GPU when they all share one (config master_device): no host round trip per round
        self.master = {k: v.detach().to(device, torch.float32, copy=True) for k, v in initial_state.items()}
        self.parameter_names = parameter_names
        self.requested_batch = cfg.initial_batch_size
        self.sampler = sampler
        self.stats = TrainerStats()
        self.cfg = cfg
        self.weights_version = 0  # bumped by each merge: a node holding an older version must receive the weights

    @staticmethod
    def inner_optimizer_factory(cfg: Config):
        raise NotImplementedError

    def outer_step(self, node_mean: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def synced_model(self, node_mean: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights this trainer would hold if its round ended with its nodes at `node_mean`: its own outer step
        (the same code) applied to a shadow, a copy of its weights and outer state; the trainer is untouched.
        A mid-round evaluation scores this (distributed/mid_round.py)."""
        shadow = copy.copy(self)
        shadow.master = {k: v.detach().clone() for k, v in self.master.items()}
        shadow._shadow_outer_state(self)
        shadow.outer_step(node_mean)
        return {k: v.detach() for k, v in shadow.master.items()}

    def _shadow_outer_state(self, original: Trainer) -> None:
        """synced_model: this shadow's own copy of `original`'s outer state (none without an outer optimizer)."""

    def absorb(self, others: list[Trainer], weights: list[float]) -> None:
        """Become the batch-weighted average of self and `others` (weights[0] is self's)."""
        self.master = weighted_average([self.master] + [o.master for o in others], weights)
        self.weights_version += 1

    def transfer_tensors(self) -> list[torch.Tensor]:
        """What travels when this trainer's state moves to another node (fp32, in a fixed order): the
        weights, then (DiLoCo) the outer momentum. The receiver copies into its own tensors in place."""
        return [self.master[k] for k in sorted(self.master)]

    def transfer_bytes(self) -> int:
        """Bytes that move when this trainer's state travels to another node: fp32 weights (+ outer state)."""
        return sum(v.numel() * 4 for v in self.master.values())

    @torch.no_grad()
    def load_transfer(self, flat: torch.Tensor) -> None:
        """Take the state another process sent (`transfer_tensors` concatenated)."""
        start = 0
        for tensor in self.transfer_tensors():
            tensor.copy_(flat[start:start + tensor.numel()].view(tensor.shape))
            start += tensor.numel()

    def state_dict(self) -> dict:
        return {"trainer_id": self.trainer_id, "algorithm": self.algorithm, "requested_batch": self.requested_batch,
                "sampler": self.sampler.state_dict(), "stats": dict(vars(self.stats)),
                "weights_version": self.weights_version}

    @torch.no_grad()
    def load_state_dict(self, state: dict, weights: dict[str, torch.Tensor]) -> None:
        """Back to a checkpointed state: master weights copied in place, then the rest."""
        if state["algorithm"] != self.algorithm:
            raise ValueError(f"trainer {self.trainer_id} was a {state['algorithm']} trainer, not {self.algorithm}")
        if set(weights) != set(self.master):
            raise ValueError(f"trainer {self.trainer_id}: the checkpoint's tensors do not match the model")
        for name, value in weights.items():
            self.master[name].copy_(value)
        self.requested_batch = int(state["requested_batch"])
        self.sampler.load_state_dict(state["sampler"])
        self.stats = TrainerStats(**state["stats"])
        self.weights_version = int(state["weights_version"])


class LocalSGDTrainer(Trainer):
    """Inner SGD; the outer step replaces the weights by the nodes' plain average (Stich 2019)."""

    algorithm = "LocalSGD"

    @staticmethod
    def inner_optimizer_factory(cfg: Config):
        return lambda params: torch.optim.SGD(params, lr=cfg.lr_inner)

    @torch.no_grad()
    def outer_step(self, node_mean):
        for name, value in node_mean.items():
            self.master[name].copy_(value)


OUTER_HYPERPARAMETERS = ("lr", "momentum", "nesterov", "dampening", "weight_decay")  # an outer SGD's, carried over


def outer_sgd(params: list[torch.Tensor], **hyper) -> torch.optim.SGD:
    """The outer optimizer on a trainer's fp32 masters. On CPU it asks for torch's foreach path, which torch takes by
    default only on CUDA: the same per-tensor operations in the same order (the same numbers to the last bit,
    tests/test_numerics.py), without a Python loop over the tensors."""
    on_cpu = bool(params) and all(p.device.type == "cpu" for p in params)
    return torch.optim.SGD(params, **hyper, **({"foreach": True} if on_cpu else {}))


class DiLoCoTrainer(Trainer):
    """Inner AdamW; outer SGD (optionally Nesterov) on the averaged pseudo-gradient (Douillard et al. 2024).

    pseudo_grad = master - mean(node weights) is set as .grad of the fp32 master parameters and a real
    torch.optim.SGD steps them (paper: plain SGD, lr 0.5; DiLoCo: Nesterov 0.9, lr 0.7).
    Merge rule for the outer state: momentum buffers are averaged with the same batch weights as the
    weights themselves (a trainer without a buffer counts as zero momentum).
    """

    algorithm = "DiLoCo"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        for name in self.parameter_names:
            self.master[name].requires_grad_(True)
        self.outer_optimizer = outer_sgd([self.master[n] for n in sorted(self.parameter_names)],
                                         lr=cfg.lr_outer, momentum=cfg.outer_momentum, nesterov=cfg.outer_nesterov)

    @staticmethod
    def inner_optimizer_factory(cfg: Config):
        def make(params):
            params = list(params)  # a generator (model.parameters()) would be half-consumed by the check below
            # CUDA: the fused kernel (one launch for all parameters). CPU: the foreach path, which torch takes by
            # default only on CUDA; on CPU it runs the same per-tensor operations in the same order (the same
            # numbers to the last bit, tests/test_numerics.py), faster (benchmarks/inner_optimizer.py)
            if params and all(p.is_cuda for p in params):
                implementation = {"fused": True}
            elif params and all(p.device.type == "cpu" for p in params):
                implementation = {"foreach": True}
            else:
                implementation = {}
            return torch.optim.AdamW(params, lr=cfg.lr_inner, betas=tuple(cfg.inner_betas),
                                     weight_decay=cfg.inner_weight_decay, **implementation)

        return make

    @torch.no_grad()
    def outer_step(self, node_mean):
        for name, value in node_mean.items():
            master = self.master[name]
            if name in self.parameter_names:
                master.grad = master - value.to(master.device, master.dtype)  # pseudo-gradient: away from the nodes
            else:
                master.copy_(value)  # floating buffers follow the nodes' average
        stepped = [n for n in node_mean if n in self.parameter_names]  # all of them, or one fragment's (streaming)
        if not all(torch.isfinite(self.master[n].grad).all() for n in stepped):
            raise FloatingPointError(f"trainer {self.trainer_id}: non-finite pseudo-gradient; lower lr_inner")
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)

    def _shadow_outer_state(self, original: Trainer) -> None:
        params = [self.master[n].requires_grad_(True) for n in sorted(self.parameter_names)]
        group = original.outer_optimizer.param_groups[0]
        self.outer_optimizer = outer_sgd(params, **{k: group[k] for k in OUTER_HYPERPARAMETERS})
        for name, param in zip(sorted(self.parameter_names), params):
            buffer = original.outer_optimizer.state.get(original.master[name], {}).get("momentum_buffer")
            if buffer is not None:
                self.outer_optimizer.state[param]["momentum_buffer"] = buffer.clone()

    @torch.no_grad()
    def absorb(self, others, weights):
        members = [self] + others
        momenta = []
        for name in sorted(self.parameter_names):
            bufs = [m.outer_optimizer.state.get(m.master[name], {}).get("momentum_buffer") for m in members]
            momenta.append(bufs)
        super().absorb(others, weights)
        for name in self.parameter_names:
            self.master[name].requires_grad_(True)
        params = [self.master[n] for n in sorted(self.parameter_names)]
        group = self.outer_optimizer.param_groups[0]
        self.outer_optimizer = outer_sgd(params, **{k: group[k] for k in OUTER_HYPERPARAMETERS})
        for param, bufs in zip(params, momenta):
            if any(b is not None for b in bufs):
                avg = sum(w * (b if b is not None else torch.zeros_like(param)) for w, b in zip(weights, bufs))
                self.outer_optimizer.state[param]["momentum_buffer"] = avg

    def transfer_tensors(self):
        tensors = super().transfer_tensors()
        if self.cfg.outer_momentum > 0:
            for name in sorted(self.parameter_names):
                # Before the first outer step there is no buffer yet: a zero one steps identically
                # (dampening 0: buf = 0 * momentum + grad), and the receiver's layout is known in advance.
                state = self.outer_optimizer.state[self.master[name]]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(self.master[name], memory_format=torch.preserve_format)
                tensors.append(state["momentum_buffer"])
        return tensors

    def transfer_bytes(self) -> int:
        momentum = sum(self.master[n].numel() * 4 for n in self.parameter_names) if self.cfg.outer_momentum > 0 else 0
        return super().transfer_bytes() + momentum

    def state_dict(self) -> dict:
        return {**super().state_dict(), "outer_optimizer": self.outer_optimizer.state_dict()}

    def load_state_dict(self, state, weights):
        super().load_state_dict(state, weights)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])


class DDPTrainer(Trainer):
    """Synchronous data parallel (the field's reference): the nodes average their gradients after every inner
    step (one all-reduce each) and step the same inner AdamW, so they end the round with the same weights. There
    is no outer step: the master takes them, and nothing travels at the round's end."""

    algorithm = "DDP"
    syncs_gradients = True
    inner_optimizer_factory = staticmethod(DiLoCoTrainer.inner_optimizer_factory)

    @torch.no_grad()
    def outer_step(self, node_mean):
        for name, value in node_mean.items():
            self.master[name].copy_(value)


class SNOOTrainer(DiLoCoTrainer):
    """SNOO (Kallusky et al. 2025): DDP inside the round, then DiLoCo's outer step (Nesterov SGD in the paper's
    setting: outer_momentum, outer_nesterov) on the H-step pseudo-gradient master - the nodes' common weights."""

    algorithm = "SNOO"
    syncs_gradients = True


TRAINERS = {cls.algorithm: cls for cls in (LocalSGDTrainer, DiLoCoTrainer, DDPTrainer, SNOOTrainer)}
