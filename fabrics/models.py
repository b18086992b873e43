"""Model factory: MicroLlama = transformers LlamaForCausalLM, from a shipped preset or pretrained weights.

Presets live in fabrics/model_configs/<name>.json so every architecture builds offline. All trainers
and node replicas start from one initial state built once with the seed, as in the paper.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from utils.config import Config
from utils.errors import UserError

PRESETS_DIR = Path(__file__).parent / "model_configs"
MICROLLAMA_HUB_ID = "keeeeenw/MicroLlama"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def load_preset(name: str) -> LlamaConfig:
    path = PRESETS_DIR / f"{name}.json"
    raw = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    return LlamaConfig(**raw)


def build_model(cfg: Config, vocab_size: int, pad_token_id: int | None) -> PreTrainedModel:
    """The initial model on CPU in fp32: a seeded random init of a preset, or pretrained weights."""
    name = cfg.model_config.name
    if cfg.model_config.pretrained:
        try:
            model = LlamaForCausalLM.from_pretrained(name, local_files_only=True, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise UserError(f"model_config.name: cannot load pretrained weights '{name}' from a local directory "
                            f"or the Hugging Face cache ({type(exc).__name__}); download them first with "
                            f"`hf download {name}` or set model_config.pretrained: false") from None
        if model.config.vocab_size < vocab_size:
            raise UserError(f"tokenizer: its vocabulary ({vocab_size}) is larger than the model's "
                            f"({model.config.vocab_size}); use the model's own tokenizer (tokenizer: {name})")
        return model
    if name in preset_names():
        config = load_preset(name)
    elif (Path(name) / "config.json").is_file():
        config = LlamaConfig.from_pretrained(name)
    else:
        raise UserError(f"model_config.name: '{name}' is neither a preset ({', '.join(preset_names())}) nor a "
                        "local model directory; for Hub weights set model_config.pretrained: true")
    config.vocab_size = vocab_size
    config.pad_token_id = pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.training_seed)
        model = LlamaForCausalLM(config)
    return model.float()


def replicate(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """A copy of `model` on `device` (built once per node; rounds only copy weights into it)."""
    return copy.deepcopy(model).to(device)


def float_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """References to the floating-point tensors of the state dict (parameters and float buffers)."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if torch.is_floating_point(v)}


@torch.no_grad()
def load_float_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into the model's tensors in place (no re-allocation, any device)."""
    own = model.state_dict(keep_vars=True)
    for name, value in state.items():
        own[name].data.copy_(value, non_blocking=True)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
