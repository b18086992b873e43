"""Checkpoints: per-trainer fp32 weights (safetensors) and state, plus the final model as a
Hugging Face directory that `LlamaForCausalLM.from_pretrained` opens directly.

Each checkpoint is written to a temporary directory and renamed at the end, so an interrupted save
never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fabrics.models import load_float_state
from utils.errors import UserError


def save_checkpoint(weights_dir: Path, label: str, trainers: dict, template: torch.nn.Module | None = None,
                    tokenizer=None, final_id: int | None = None) -> Path:
    target = weights_dir / label
    tmp = weights_dir / f".{label}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for t, trainer in trainers.items():
        save_file({k: v.detach().contiguous() for k, v in trainer.master.items()}, tmp / f"trainer_{t}.safetensors")
        torch.save(trainer.state_dict(), tmp / f"trainer_{t}_state.pt")
    meta = {"label": label, "trainers": sorted(trainers), "final_trainer": final_id}
    if final_id is not None and template is not None:
        load_float_state(template, trainers[final_id].master)
        template.save_pretrained(tmp / "final_model")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "final_model")
    (tmp / "metadata.json").write_text(json.dumps(meta, indent=2))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def load_trainer_weights(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint: file not found: {path}")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise UserError(f"checkpoint: {path} is not a readable safetensors file ({exc})") from None
