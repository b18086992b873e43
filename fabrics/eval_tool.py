"""Evaluation: validation perplexity for language models, accuracy for classifiers.

Perplexity is token-weighted exactly: exp(total NLL of predicted tokens / number of predicted tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fabrics.dataset_loader import PackedData
from fabrics.precision import PRECISIONS, Precision
from utils.model_state import load_float_state


@dataclass
class EvalResult:
    name: str  # the primary metric's column: val_perplexity or val_accuracy
    value: float
    higher_is_better: bool
    metrics: dict[str, float]  # every number, by column name
    count: int  # predicted tokens (language model) or examples (classifier)

    @property
    def perplexity(self) -> float:
        return self.metrics["val_perplexity"]


class Evaluator:
    """Evaluates weight states on one shared model replica (trainers hold states, not modules)."""

    def __init__(self, model: torch.nn.Module, val: PackedData, batch_size: int, device: str,
                 precision: Precision = PRECISIONS["fp32"]) -> None:
        self.model, self.device = model, device
        # the nodes' autocast (a model is judged in the precision it trains in), made once: one replica, never two
        # evaluations at once
        self.autocast = precision.autocast(device)
        self.classification = val.labels is not None
        self.metric = "val_accuracy" if self.classification else "val_perplexity"
        self.higher_is_better = self.classification
        # the validation batches with their targets, sliced and on the device once: every evaluation reads the same
        # ones, and the count of what they predict is known without a read from the device
        self.batches = list(self._batches(val, batch_size))
        # a language model's logits at every position but the last, which predicts nothing: never computed (nor a
        # copy of them sliced), the same numbers
        self.predicting = {} if self.classification else {
            "logits_to_keep": torch.arange(val.input_ids.shape[1] - 1, device=device)}
        self.count = sum(len(targets) if self.classification else int((targets != -100).sum())
                         for _, _, targets in self.batches)  # examples, or predicted tokens

    def _batches(self, val: PackedData, batch_size: int):
        for start in range(0, len(val), batch_size):
            end = start + batch_size
            ids = val.input_ids[start:end].to(self.device)
            mask = val.attention_mask[start:end].to(self.device)
            if self.classification:
                yield ids, mask, val.labels[start:end].to(self.device)
            else:  # token t predicts token t+1: one shift, padding excluded from the targets
                yield ids, mask, ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)

    @torch.no_grad()
    def evaluate(self, state: dict[str, torch.Tensor] | None = None) -> EvalResult:
        if state is not None:
            load_float_state(self.model, state)
        self.model.eval()
        total_nll = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = 0
        for ids, mask, targets in self.batches:
            with self.autocast:
                logits = self.model(input_ids=ids, attention_mask=mask, **self.predicting).logits
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp16/bf16 -> fp32
            if self.classification:
                total_nll += F.cross_entropy(logits, targets, reduction="sum").double()
                correct += int((logits.argmax(-1) == targets).sum())
                continue
            total_nll += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum",
                                         ignore_index=-100).double()
        loss = float(total_nll) / max(self.count, 1)
        if self.classification:
            accuracy = correct / max(self.count, 1)
            return EvalResult(self.metric, accuracy, True, {"val_accuracy": accuracy, "val_loss": loss}, self.count)
        ppl = math.exp(loss) if self.count else float("inf")
        return EvalResult(self.metric, ppl, False, {"val_perplexity": ppl, "val_loss": loss}, self.count)
