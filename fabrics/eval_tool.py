"""Validation perplexity, token-weighted exactly: exp(total NLL of predicted tokens / their number)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fabrics.dataset_loader import PackedData
from fabrics.models import load_float_state


@dataclass
class EvalResult:
    perplexity: float
    nll: float  # mean NLL per predicted token
    tokens: int  # predicted tokens


class Evaluator:
    """Evaluates weight states on one shared model replica (trainers hold states, not modules)."""

    def __init__(self, model: torch.nn.Module, val: PackedData, batch_size: int, device: str) -> None:
        self.model, self.val, self.batch_size, self.device = model, val, batch_size, device

    @torch.no_grad()
    def evaluate(self, state: dict[str, torch.Tensor] | None = None) -> EvalResult:
        if state is not None:
            load_float_state(self.model, state)
        self.model.eval()
        total_nll = torch.zeros((), dtype=torch.float64, device=self.device)
        total_tokens = 0
        for start in range(0, len(self.val), self.batch_size):
            ids = self.val.input_ids[start : start + self.batch_size].to(self.device)
            mask = self.val.attention_mask[start : start + self.batch_size].to(self.device)
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            # Token t predicts token t+1: one shift, padding excluded from the targets.
            targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            logits = logits[:, :-1].flatten(0, 1)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp16/bf16 -> fp32
            nll = F.cross_entropy(logits, targets.flatten(), reduction="sum", ignore_index=-100)
            total_nll += nll.double()
            total_tokens += int((targets != -100).sum())
        mean = float(total_nll) / max(total_tokens, 1)
        return EvalResult(math.exp(mean) if total_tokens else float("inf"), mean, total_tokens)
