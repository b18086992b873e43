"""AdamW over stacked tensors: one update for a group of nodes whose parameters are stacked along dim 0
(node_execution: stacked, distributed/stacked.py).

AdamW is elementwise, so node n's slice of each tensor moves exactly as its own torch.optim.AdamW would move its
parameter, given node n's own step count and learning rate (each a tensor of one value per node, broadcast over
the slice). The operations are torch's single-tensor AdamW's (torch/optim/adamw.py, the path a CPU parameter
takes), in its order: the decoupled weight decay, the moments, the bias corrections in float64 per node, then
param -= lr / bias_correction1 * exp_avg / (sqrt(exp_avg_sq) / sqrt(bias_correction2) + eps), the step size
folded into the denominator (one temporary per tensor, as torch's own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamWHyper:
    """What every node of a group shares (the config's): betas, eps and weight decay. The learning rate may differ
    per node (`lrs` of stacked_adamw_step)."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> AdamWHyper:
        group = optimizer.param_groups[0]
        return cls(group["betas"][0], group["betas"][1], group["eps"], group["weight_decay"])


def _per_node(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[N] values as a tensor that broadcasts over each node's slice of `like` ([N, ...]), in its dtype."""
    return values.to(like.device, like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


@torch.no_grad()
def stacked_adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                       exp_avg_sqs: list[torch.Tensor], steps: torch.Tensor, lrs: torch.Tensor,
                       hyper: AdamWHyper) -> None:
    """One AdamW step of every node, in place. params, grads, exp_avgs, exp_avg_sqs: [N, ...] tensors (node n's
    slice is its tensor); steps: [N] float64, each node's step count BEFORE this step (incremented here); lrs: [N]
    learning rates."""
    steps += 1
    bias_correction1 = 1 - hyper.beta1 ** steps  # float64, per node, as torch computes them in Python floats
    bias_correction2 = 1 - hyper.beta2 ** steps
    step_size = lrs.double() / bias_correction1
    bias_correction2_sqrt = bias_correction2.sqrt()
    decay = 1 - lrs.double() * hyper.weight_decay
    for param, grad, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs):
        if hyper.weight_decay != 0:
            param.mul_(_per_node(decay, param))
        exp_avg.lerp_(grad, 1 - hyper.beta1)
        exp_avg_sq.mul_(hyper.beta2).addcmul_(grad, grad, value=1 - hyper.beta2)
        denom = exp_avg_sq.sqrt().div_(_per_node(bias_correction2_sqrt, param)).add_(hyper.eps)
        # step_size x exp_avg / denom as exp_avg / (denom / step_size): in place, no second temporary
        param.addcdiv_(exp_avg, denom.div_(_per_node(step_size, param)), value=-1.0)
