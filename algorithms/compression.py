"""What a pseudo-gradient (or a trainer state) becomes on the wire: a registry of compression schemes.

Each scheme turns a flat fp32 vector into one byte buffer (`encode`: what really travels, values, scales
and indices packed together) and back (`decode`: fp32). The buffer's length depends only on the vector's
length, so every process knows the size of every other's payload (all-gather needs it).

    none   fp32 (4 bytes per entry)
    bf16   bfloat16 (2 bytes)
    fp8    float8 e4m3 of x / s, s = max|x| / 448 per chunk of CHUNK entries (1 byte + 4 / CHUNK)
    int8   round(x / s) in [-127, 127], s = max|x| / 127 per chunk (1 byte + 4 / CHUNK); |error| <= s / 2
    topk   the ceil(f n) entries of largest magnitude: int32 indices, values int8 with a scale per chunk
           of CHUNK kept values (f n (5 + 4 / CHUNK) bytes); the rest are 0
"""

from __future__ import annotations

import math

import torch

CHUNK = 1024
_FP8 = getattr(torch, "float8_e4m3fn", None)


def _to_bytes(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in tensors])


def _as(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A byte slice as `dtype`. A slice of a received buffer (a ring's shard) can start at a byte offset the dtype
    cannot be viewed from (an int8 payload of an entry count not divisible by 4): that one is copied first."""
    if payload.storage_offset() % torch.empty((), dtype=dtype).element_size():
        payload = payload.clone()
    return payload.view(dtype)


def _chunked(x: torch.Tensor) -> torch.Tensor:
    """[n] -> [chunks, CHUNK], zero-padded."""
    chunks = math.ceil(x.numel() / CHUNK)
    padded = torch.zeros(chunks * CHUNK, dtype=x.dtype, device=x.device)
    padded[:x.numel()] = x
    return padded.view(chunks, CHUNK)


class Compressor:
    name = ""
    lossless = False
    reducible = False  # its payloads can be cut into CHUNK-aligned shards, reduced by shard owners (the ring)

    def payload_bytes(self, numel: int) -> int:
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 [n] -> uint8 [payload_bytes(n)]."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """uint8 [payload_bytes(n)] -> fp32 [n]."""
        raise NotImplementedError

    def shard(self, payload: torch.Tensor, numel: int, start: int, stop: int) -> torch.Tensor:
        """The encoding of entries [start, stop) cut out of a payload of `numel` entries, `start` a multiple of
        CHUNK and `stop` one or `numel`: byte for byte what encoding those entries alone gives."""
        raise NotImplementedError


class NoCompression(Compressor):
    name, lossless = "none", True

    def payload_bytes(self, numel):
        return 4 * numel

    def encode(self, x):
        return _to_bytes(x.float())

    def decode(self, payload, numel):
        return _as(payload, torch.float32).clone()


class BF16(Compressor):
    name, reducible = "bf16", True

    def shard(self, payload, numel, start, stop):
        return payload[2 * start:2 * stop]

    def payload_bytes(self, numel):
        return 2 * numel

    def encode(self, x):
        return _to_bytes(x.to(torch.bfloat16))

    def decode(self, payload, numel):
        return _as(payload, torch.bfloat16).float()


class ChunkScaled(Compressor):
    """One fp32 scale per chunk of CHUNK entries, one byte per entry."""

    levels = 127.0
    reducible = True

    def payload_bytes(self, numel):
        return numel + 4 * math.ceil(numel / CHUNK)

    def shard(self, payload, numel, start, stop):
        chunks = math.ceil(numel / CHUNK)
        scales = payload[4 * (start // CHUNK):4 * math.ceil(stop / CHUNK)]  # the shard's own chunks' scales
        return torch.cat([scales, payload[4 * chunks + start:4 * chunks + stop]])

    def scales(self, chunks: torch.Tensor) -> torch.Tensor:
        absmax = chunks.abs().amax(dim=1, keepdim=True)
        return torch.where(absmax > 0, absmax / self.levels, torch.ones_like(absmax))

    def quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def encode(self, x):
        chunks = _chunked(x.float())
        scales = self.scales(chunks)
        values = self.quantize(chunks / scales).reshape(-1)[:x.numel()]
        return _to_bytes(scales.reshape(-1), values)  # scales first: each part stays aligned for its view

    def decode(self, payload, numel):
        chunks = math.ceil(numel / CHUNK)
        scales = _as(payload[:4 * chunks], torch.float32)
        values = self.dequantize(payload[4 * chunks:])
        padded = torch.zeros(chunks * CHUNK, dtype=torch.float32, device=payload.device)
        padded[:numel] = values
        return (padded.view(chunks, CHUNK) * scales[:, None]).reshape(-1)[:numel]


class Int8(ChunkScaled):
    name = "int8"

    def quantize(self, scaled):
        return scaled.round().clamp_(-127, 127).to(torch.int8)

    def dequantize(self, values):
        return values.view(torch.int8).float()


class FP8(ChunkScaled):
    name = "fp8"
    levels = 448.0  # the largest finite e4m3 value

    def quantize(self, scaled):
        return scaled.to(_FP8)

    def dequantize(self, values):
        return values.view(_FP8).float()


class TopK(Compressor):
    name = "topk"

    def __init__(self, fraction: float) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"topk_fraction {fraction} is not in (0, 1]")
        self.fraction = fraction
        self._values = Int8()

    def kept(self, numel: int) -> int:
        return max(1, math.ceil(self.fraction * numel))

    def payload_bytes(self, numel):
        k = self.kept(numel)
        return 4 * k + self._values.payload_bytes(k)

    def encode(self, x):
        x = x.float()
        k = self.kept(x.numel())
        index = self.largest(x.abs(), k).to(torch.int32)
        return _to_bytes(index, self._values.encode(x[index.long()]))

    @staticmethod
    def largest(magnitude: torch.Tensor, k: int) -> torch.Tensor:
        """The indices (ascending) of the k largest entries, ties broken by the lower index: the entries a stable
        descending sort would put first, the same on every device and in every run. torch.topk finds the k-th
        value in O(P log k) (not a full sort); its own choice among ties is not specified, so entries equal to
        the k-th value are then taken in index order."""
        kth = torch.topk(magnitude, k, sorted=False).values.min()
        above = (magnitude > kth).nonzero().flatten()
        tied = (magnitude == kth).nonzero().flatten()[:k - above.numel()]
        return torch.cat([above, tied]).sort().values

    def decode(self, payload, numel):
        k = self.kept(numel)
        index = _as(payload[:4 * k], torch.int32).long()
        out = torch.zeros(numel, dtype=torch.float32, device=payload.device)
        out[index] = self._values.decode(payload[4 * k:], k)
        return out


COMPRESSORS = {cls.name: cls for cls in (NoCompression, BF16, FP8, Int8, TopK)}


def build_compressor(name: str, topk_fraction: float = 0.02) -> Compressor:
    if name not in COMPRESSORS:
        raise ValueError(f"unknown compression '{name}'; choose from {', '.join(COMPRESSORS)}")
    if name == "fp8" and _FP8 is None:
        raise ValueError("fp8 needs torch.float8_e4m3fn (torch >= 2.1)")
    return TopK(topk_fraction) if name == TopK.name else COMPRESSORS[name]()
