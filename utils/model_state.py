"""A model's floating-point state as named tensors: what trainers, nodes and checkpoints exchange."""

from __future__ import annotations

import torch


def float_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """References to the floating-point tensors of the state dict (parameters and float buffers)."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if torch.is_floating_point(v)}


@torch.no_grad()
def load_float_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into the model's tensors in place (no re-allocation, any device)."""
    own = model.state_dict(keep_vars=True)
    for name, value in state.items():
        own[name].data.copy_(value, non_blocking=True)
