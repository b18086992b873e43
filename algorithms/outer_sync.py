"""The outer sync: what each node sends its trainer at the end of a round, and how the trainer averages it.

Both backends use this one object: the simulated cluster (distributed/node_round.py `combine`) and the torchrun backend
(distributed/torchrun_backend.py, which sends the encoded shards and payloads) compute the same values in the same
order, so they give the same numbers.

Exact (outer_compression: none): the trainer's nodes send their fp32 weights and the mean is taken of
those, as before (an all-reduce under torchrun).

Compressed: node i sends its pseudo-gradient delta_i = master - w_i, plus its error-feedback residual
e_i, encoded: payload_i = encode(delta_i + e_i); with error feedback the node keeps
e_i <- delta_i + e_i - decode(payload_i), what compression dropped, and adds it next round (Seide et
al. 2014; Karimireddy et al. 2019), so nothing is lost for good, only delayed.

How the payloads travel and are averaged, for a trainer of n > 1 nodes:
- bf16, fp8, int8 (reducible): a ring of quantized shards, as torchft's quantized all-reduce and prime's int8
  ring do. The payload is cut into n CHUNK-aligned shards (`ring_spans`; shard j is exactly the encoding of
  entries j alone, with its own chunks' scales); shard j goes to node j (a reduce-scatter of encoded
  shards), which decodes every node's shard j, sums them in fp32 in node-id order, divides, and re-encodes
  the mean with per-chunk scales of its own (`reduce_shard`); the reduced shards are then all-gathered and
  decoded (`ring_mean`). Each node sends about 2 (n-1)/n of the payload, 2 (n-1) C in all: the bytes fall
  with the compression at any n. The owner's re-quantization error is not fed back: error feedback stays
  on each node's own encoding (torchft and prime do the same); it is one more rounding of the mean, of the
  size of one node's, and does not accumulate (the next round's mean is quantized afresh).
- top-k (sparse payloads do not reduce shard by shard): each node's payload is all-gathered, n (n-1) C
  in all, and every node takes master - mean_i decode(payload_i), in fp32, in node-id order.
A one-node trainer sends nothing and takes its own decoded payload. Either way the outer step then runs as
usual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from algorithms.compression import CHUNK, Compressor, build_compressor
from algorithms.streaming import FLAG_BYTES


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
        # facts of the compression, fixed here (read per node and per trainer every round):
        # exact: the nodes' fp32 weights are averaged directly (no pseudo-gradients on the wire);
        # ring: the payloads travel as a ring of quantized shards (reducible compression), not all-gathered
        self.exact: bool = self.compressor.lossless
        self.ring: bool = not self.exact and self.compressor.reducible

    @staticmethod
    def ring_spans(numel: int, num_shards: int) -> list[tuple[int, int]]:
        """The entries of each node's shard: contiguous, a whole number of CHUNKs each (the last may be short,
        trailing ones empty), so a shard's scales are its own."""
        per = math.ceil(math.ceil(numel / CHUNK) / num_shards) * CHUNK
        return [(min(j * per, numel), min((j + 1) * per, numel)) for j in range(num_shards)]

    def shards(self, payload: torch.Tensor, numel: int, num_shards: int) -> list[torch.Tensor]:
        """A node's payload cut into the shards of `ring_spans` (the bytes it sends to each owner)."""
        return [self.compressor.shard(payload, numel, a, b) if b > a else payload[:0]
                for a, b in self.ring_spans(numel, num_shards)]

    @torch.no_grad()
    def reduce_shard(self, parts: list[torch.Tensor], length: int, shares: list[float] | None = None,
                     device: torch.device | str = "cpu") -> torch.Tensor:
        """An owner's shard: the good nodes' shards decoded and summed in fp32 in the order given (node-id order),
        divided by their number (or weighted by `shares`), re-encoded with its own scales."""
        total = torch.zeros(length, dtype=torch.float32, device=device)
        for i, part in enumerate(parts):
            decoded = self.compressor.decode(part.to(device), length)
            total += decoded if shares is None else decoded * shares[i]
        return self.compressor.encode(total / len(parts) if shares is None else total)

    @torch.no_grad()
    def ring_mean(self, master: dict[str, torch.Tensor], reduced: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """master - the mean pseudo-gradient from the owners' reduced shards (in shard order)."""
        names = sorted(master)
        device = next(iter(master.values())).device
        numel = sum(master[n].numel() for n in names)
        spans = self.ring_spans(numel, len(reduced))
        mean = torch.cat([self.compressor.decode(r.to(device), b - a) for r, (a, b) in zip(reduced, spans)])
        return unflatten(flatten(master, names, device) - mean, master, names)

    def ring_node_mean(self, master: dict[str, torch.Tensor], payloads: list[torch.Tensor], num_shards: int,
                       shares: list[float] | None = None) -> dict[str, torch.Tensor]:
        """The ring computed in one process: the good nodes' `payloads` (node-id order) among `num_shards` owners
        (the trainer's nodes, failed ones included): what every node of a real ring ends with."""
        numel = sum(v.numel() for v in master.values())
        device = next(iter(master.values())).device
        cut = [self.shards(p, numel, num_shards) for p in payloads]
        reduced = [self.reduce_shard([c[j] for c in cut], b - a, shares, device)
                   for j, (a, b) in enumerate(self.ring_spans(numel, num_shards))]
        return self.ring_mean(master, reduced)

    def mean_of(self, master: dict[str, torch.Tensor], payloads: list[torch.Tensor], num_nodes: int,
                shares: list[float] | None = None) -> dict[str, torch.Tensor]:
        """What a trainer of `num_nodes` nodes averages from its good nodes' `payloads`: the ring for a reducible
        compression among several nodes, else every payload decoded (node_mean)."""
        if self.ring and num_nodes > 1:
            return self.ring_node_mean(master, payloads, num_nodes, shares)
        return self.node_mean(master, payloads, shares)

    def payload_bytes(self, numel: int) -> int:
        return self.compressor.payload_bytes(numel)

    @torch.no_grad()
    def encode(self, master: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
               residual: torch.Tensor | None, flat_master: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One node's payload (uint8) and its next residual (None without error feedback); flat_master: `master`
        flattened already (once per trainer, shared by its nodes)."""
        names = sorted(master)
        device = next(iter(weights.values())).device
        base = flatten(master, names, device) if flat_master is None else flat_master.to(device)
        delta = base - flatten(weights, names, device)
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


# ---------------------------------------------------------------------------------------------------
# A fragment on the wire (Streaming DiLoCo): both backends build and average fragments with these

def wire_size(sync: OuterSync, numel: int) -> int:
    """Elements of one node's fragment payload: fp32 weights + a count (exact), or encoded bytes + 4 flag bytes."""
    return numel + 1 if sync.exact else sync.payload_bytes(numel) + FLAG_BYTES


@torch.no_grad()
def fragment_wire(sync: OuterSync, master: dict[str, torch.Tensor], local: dict[str, torch.Tensor],
                  names: list[str], residual: torch.Tensor | None, device: torch.device | str
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What one node sends for a fragment (names sorted), and its next residual for the fragment.
    exact: its fp32 fragment weights and a 1 (an all-reduce sums both: the weights' sum and the nodes counted);
    compressed: the encoded pseudo-gradient (master - local + residual) and 4 flag bytes [1, 0, 0, 0]."""
    if sync.exact:
        flat = flatten(local, names, device)
        return torch.cat([flat, torch.ones(1, dtype=torch.float32, device=device)]), None
    payload, residual = sync.encode({n: master[n] for n in names}, {n: local[n] for n in names}, residual)
    flag = torch.tensor([1, 0, 0, 0], dtype=torch.uint8, device=payload.device)
    return torch.cat([payload, flag]), residual


def empty_wire(sync: OuterSync, numel: int, device: torch.device | str) -> torch.Tensor:
    """The payload of a node that contributes nothing (it failed or left the round): zeros, count/flag 0."""
    return torch.zeros(wire_size(sync, numel), dtype=torch.float32 if sync.exact else torch.uint8, device=device)


@dataclass
class RingArrival:
    """A fragment's ring as a member ends it: every owner's reduced shard, in shard order, and whether any node
    contributed (a shard's flag)."""

    reduced: list[torch.Tensor]
    contributed: bool


@torch.no_grad()
def fragment_average(sync: OuterSync, master: dict[str, torch.Tensor], names: list[str],
                     wires: list[torch.Tensor] | torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The nodes' mean fragment (fp32, on the master's device) from what arrived: the summed exact wires, every
    member's compressed wire in node-id order (averaged as a ring of quantized shards, or decoded one by one for
    top-k: OuterSync.mean_of), or torchrun's finished ring; None when no node contributed."""
    fragment = {n: master[n] for n in names}
    device = master[names[0]].device
    if sync.exact:
        summed = wires.to(device)
        count = float(summed[-1])
        return unflatten(summed[:-1] / count, fragment, names) if count > 0 else None
    if isinstance(wires, RingArrival):  # torchrun's ring: the owners' reduced shards
        return sync.ring_mean(fragment, wires.reduced) if wires.contributed else None
    good = [w[:-FLAG_BYTES] for w in wires if int(w[-FLAG_BYTES]) == 1]
    return sync.mean_of(fragment, good, len(wires)) if good else None


def sum_wires(wires: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The exact wires summed in fp32 in the order given (node-id order): what the all-reduce computes."""
    total = torch.zeros_like(wires[0], device=device)
    for wire in wires:
        total += wire.to(device)
    return total
