"""The outer sync: what each node sends its trainer at the end of a round, and how the trainer averages it.

Both backends use this one object: the simulated cluster (rounds.py `combine`) and the torchrun backend
(distributed/backend.py, which all-gathers the encoded payloads) compute the same values in the same
order, so they give the same numbers.

Exact (outer_compression: none): the trainer's nodes send their fp32 weights and the mean is taken of
those, as before (an all-reduce under torchrun).

Compressed: node i sends its pseudo-gradient delta_i = master - w_i, plus its error-feedback residual
e_i, encoded: payload_i = encode(delta_i + e_i); with error feedback the node keeps
e_i <- delta_i + e_i - decode(payload_i), what compression dropped, and adds it next round (Seide et
al. 2014; Karimireddy et al. 2019), so nothing is lost for good, only delayed. The trainer's node mean is
master - mean_i decode(payload_i), in fp32, summed in node-id order; its outer step then runs as usual.
"""

from __future__ import annotations

import torch

from algorithms.compression import Compressor, build_compressor


def flatten(state: dict[str, torch.Tensor], names: list[str], device: torch.device | str) -> torch.Tensor:
    return torch.cat([state[n].detach().to(device, torch.float32).reshape(-1) for n in names])


def unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for name in names:
        n = like[name].numel()
        out[name] = flat[start:start + n].view(like[name].shape)
        start += n
    return out


class OuterSync:
    def __init__(self, compression: str = "none", error_feedback: bool = True, topk_fraction: float = 0.02) -> None:
        self.compressor: Compressor = build_compressor(compression, topk_fraction)
        self.error_feedback = error_feedback and not self.compressor.lossless

    @property
    def exact(self) -> bool:
        """The nodes' fp32 weights are averaged directly (no pseudo-gradients on the wire)."""
        return self.compressor.lossless

    def payload_bytes(self, numel: int) -> int:
        return self.compressor.payload_bytes(numel)

    @torch.no_grad()
    def encode(self, master: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
               residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One node's payload (uint8) and its next residual (None without error feedback)."""
        names = sorted(master)
        device = next(iter(weights.values())).device
        delta = flatten(master, names, device) - flatten(weights, names, device)
        if residual is not None:
            delta = delta + residual.to(device)
        payload = self.compressor.encode(delta)
        if not self.error_feedback:
            return payload, None
        return payload, delta - self.compressor.decode(payload, delta.numel())

    @torch.no_grad()
    def node_mean(self, master: dict[str, torch.Tensor], payloads: list[torch.Tensor],
                  shares: list[float] | None = None) -> dict[str, torch.Tensor]:
        """master - the mean of the decoded pseudo-gradients (fp32, on the master's device, in the given order);
        shares: a weighted mean instead (inner_steps_by_speed: each node's share of the tokens)."""
        names = sorted(master)
        device = next(iter(master.values())).device
        numel = sum(master[n].numel() for n in names)
        total = torch.zeros(numel, dtype=torch.float32, device=device)
        for i, payload in enumerate(payloads):
            decoded = self.compressor.decode(payload.to(device), numel)
            total += decoded if shares is None else decoded * shares[i]
        mean = total / len(payloads) if shares is None else total
        return unflatten(flatten(master, names, device) - mean, master, names)

    @torch.no_grad()
    def round_trip(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The fp32 concatenation of `tensors` as a receiver decodes it (merge_compression)."""
        flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
        return self.compressor.decode(self.compressor.encode(flat), flat.numel())
