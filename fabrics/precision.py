"""Numeric precision of the nodes' forward and backward passes (config `precision`).

fp32   no autocast (the default; bit-reproducible on CPU).
tf32   fp32 tensors, TensorFloat-32 matmuls and convolutions on CUDA (Ampere and later).
bf16   autocast to bfloat16 (CUDA, and CPU): no loss scaling needed.
fp16   autocast to float16 with a dynamic loss scale per node (torch.amp.GradScaler), as the paper
       trained; steps whose gradients overflow are skipped and the scale shrinks.

Whatever the choice, the weights the optimizers step, the trainers' masters, the pseudo-gradients and
the outer step stay fp32: autocast only lowers the precision of the operations inside the model.
Evaluation runs under the same autocast as training.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    name: str
    autocast_dtype: torch.dtype | None  # None: no autocast
    loss_scaling: bool = False

    def autocast(self, device: str):
        """The context a forward pass runs in on `device`."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.autocast_dtype)

    def scaler(self, device: str) -> torch.amp.GradScaler | None:
        """A loss scaler for one node (fp16 only): its scale adapts to that node's gradients."""
        return torch.amp.GradScaler(torch.device(device).type) if self.loss_scaling else None


PRECISIONS = {
    "fp32": Precision("fp32", None),
    "tf32": Precision("tf32", None),
    "bf16": Precision("bf16", torch.bfloat16),
    "fp16": Precision("fp16", torch.float16, loss_scaling=True),
}


def build_precision(name: str) -> Precision:
    """The precision `name`; tf32 switches CUDA matmuls and cuDNN convolutions to TensorFloat-32, and every other
    precision switches them back. The switches are global to the process: one run or benchmark variant in tf32
    once left them on for every later fp32 run in the same process (the first GPU check, 2026-11-26, compared a
    compiled fp32 run against eager fp32 that way, and timed benchmarks.system's fp32 rounds in tf32)."""
    torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
    torch.backends.cudnn.allow_tf32 = name == "tf32"
    return PRECISIONS[name]
