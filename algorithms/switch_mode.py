"""Switch mode (paper section 4.2): how a requested batch is run given the largest micro-batch that fits.

decide(requested, max_batch) -> (loader_batch, accumulation_steps). The DataLoader micro-batch never
exceeds max_batch; with accumulation the micro-batches are as equal as possible, so each loss is
scaled by 1/accumulation_steps and the sum of gradients equals the gradient of the whole batch.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod


def _accumulate(requested: int, max_batch: int) -> tuple[int, int]:
    steps = math.ceil(requested / max_batch)
    return math.ceil(requested / steps), steps


class SwitchMode(ABC):
    name: str

    @abstractmethod
    def decide(self, requested: int, max_batch: int) -> tuple[int, int]:
        """(loader_batch, accumulation_steps) for one optimizer step."""


class ThresholdSwitchMode(SwitchMode):
    """<= max: one pass; (max, 2*max]: one pass of max_batch, no accumulation; > 2*max: accumulate."""

    name = "threshold_switch_mode"
    factor = 2  # the paper's threshold: accumulation only above 2 x max_batch

    def decide(self, requested: int, max_batch: int) -> tuple[int, int]:
        if requested <= max_batch:
            return requested, 1
        if requested <= self.factor * max_batch:
            return max_batch, 1
        return _accumulate(requested, max_batch)


class OnlyGradientAccumulation(SwitchMode):
    name = "only_gradient_accumulation"

    def decide(self, requested: int, max_batch: int) -> tuple[int, int]:
        return _accumulate(requested, max_batch) if requested > max_batch else (requested, 1)


class OnlyDataLoader(SwitchMode):
    """Never accumulate: the batch is truncated to what fits."""

    name = "only_data_loader"

    def decide(self, requested: int, max_batch: int) -> tuple[int, int]:
        return min(requested, max_batch), 1


SWITCH_MODES = {cls.name: cls for cls in (ThresholdSwitchMode, OnlyGradientAccumulation, OnlyDataLoader)}


def build_switch_mode(name: str) -> SwitchMode:
    if name not in SWITCH_MODES:
        raise ValueError(f"unknown switch_mode '{name}'; choose from {', '.join(SWITCH_MODES)}")
    return SWITCH_MODES[name]()
