"""Model factory: MicroLlama = LlamaForCausalLM (and BERT for IMDB), from a shipped preset or pretrained weights.

Presets live in fabrics/model_configs/<name>.json so every architecture builds offline. All trainers
and node replicas start from one initial state built once with the seed, as in the paper.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from pathlib import Path

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from utils.config import Config
from utils.errors import UserError
from utils.preflight import PRESETS_DIR, preset_names

log = logging.getLogger(__name__)

MICROLLAMA_HUB_ID = "keeeeenw/MicroLlama"
# model_type -> (model class, config class, the family's own tokenizer on the Hub)
MODEL_TYPES = {
    "microllama": (LlamaForCausalLM, LlamaConfig, MICROLLAMA_HUB_ID),
    "bert": (BertForSequenceClassification, BertConfig, "bert-base-uncased"),
}


def default_tokenizer_names(cfg: Config) -> list[str]:
    """Tokenizers `tokenizer: auto` tries locally: the pretrained model's own, then the family's."""
    names = [cfg.model_config.name] if cfg.model_config.pretrained else []
    return names + [MODEL_TYPES[cfg.model_type][2]]


def load_preset(name: str) -> PretrainedConfig:
    path = PRESETS_DIR / f"{name}.json"
    raw = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    config_class = {"llama": LlamaConfig, "bert": BertConfig}[raw.pop("model_type")]
    return config_class(**raw)


def build_model(cfg: Config, vocab_size: int, pad_token_id: int | None) -> PreTrainedModel:
    """The initial model on CPU in fp32: a seeded random init of a preset, or pretrained weights."""
    name = cfg.model_config.name
    model_class, config_class, _ = MODEL_TYPES[cfg.model_type]
    if cfg.model_config.pretrained:
        if cfg.hub_downloads and not Path(name).exists():
            from fabrics.c4_data import MODEL_LOCAL_ADVICE, check_hub_reachable

            check_hub_reachable("model_config.name", MODEL_LOCAL_ADVICE)
        try:
            model = model_class.from_pretrained(name, local_files_only=not cfg.hub_downloads, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            hint = ("" if cfg.hub_downloads else f"; download them first with `hf download {name}` or set "
                    "hub_downloads: true")
            raise UserError(f"model_config.name: cannot load pretrained weights '{name}' ({type(exc).__name__}){hint}, "
                            "or set model_config.pretrained: false") from None
        limit = getattr(model.config, "max_position_embeddings", None)
        if isinstance(limit, int) and cfg.seq_len > limit:
            raise UserError(f"seq_len: {cfg.seq_len} is above the {limit} positions of model '{name}'")
        if model.config.vocab_size < vocab_size:
            raise UserError(f"tokenizer: its vocabulary ({vocab_size}) is larger than the model's "
                            f"({model.config.vocab_size}); use the model's own tokenizer (tokenizer: auto or {name})")
        return model
    if name in preset_names():
        config = load_preset(name)
    elif (Path(name) / "config.json").is_file():
        config = config_class.from_pretrained(name)
    else:
        raise UserError(f"model_config.name: '{name}' is neither a preset ({', '.join(preset_names())}) nor a "
                        "local model directory; for Hub weights set model_config.pretrained: true")
    if not isinstance(config, config_class):
        raise UserError(f"model_config.name: '{name}' is a {type(config).__name__}, not a {cfg.model_type} model")
    config.vocab_size = vocab_size
    config.pad_token_id = pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.training_seed)
        model = model_class(config)
    return model.float()


def replicate(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """A copy of `model` on `device` (built once per node; rounds only copy weights into it)."""
    return copy.deepcopy(model).to(device)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


OUTPUT_LAYERS = ("lm_head", "classifier")  # LlamaForCausalLM's, BertForSequenceClassification's


def output_layer(model: torch.nn.Module) -> str:
    """The name of the model's output layer (a Linear called lm_head or classifier)."""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in OUTPUT_LAYERS and isinstance(module, torch.nn.Linear):
            if tied and name.endswith("lm_head"):
                raise UserError("need_to_reinit_output_layers: the model ties lm_head to its input embeddings, so "
                                "re-initializing it would replace them too; use a model without tied embeddings")
            return name
    raise UserError(f"need_to_reinit_output_layers: the model has no Linear output layer named "
                    f"{' or '.join(OUTPUT_LAYERS)}")


def output_layer_seed(training_seed: int, trainer_id: int) -> int:
    """Its own seed per trainer, apart from every other stream the seed drives (data order, shards)."""
    return int.from_bytes(hashlib.sha256(f"output_layer/{training_seed}/{trainer_id}".encode()).digest()[:8], "big")


@torch.no_grad()
def reinit_output_layer(weights: dict[str, torch.Tensor], layer: str, seed: int) -> None:
    """The authors' need_to_reinit_output_layers, in place on one trainer's weights: Xavier-uniform weight (drawn on
    the CPU from `seed`, the same on every process and device), zero bias."""
    weight = weights[f"{layer}.weight"]
    fresh = torch.empty(weight.shape, dtype=torch.float32)
    torch.nn.init.xavier_uniform_(fresh, generator=torch.Generator().manual_seed(seed))
    weight.copy_(fresh)
    if f"{layer}.bias" in weights:
        weights[f"{layer}.bias"].zero_()


def reinit_output_layers(model: torch.nn.Module, masters: dict[int, dict[str, torch.Tensor]],
                         training_seed: int) -> None:
    """need_to_reinit_output_layers at a run's start: every trainer's output layer drawn from its own seed."""
    layer = output_layer(model)
    for trainer_id, weights in masters.items():
        reinit_output_layer(weights, layer, output_layer_seed(training_seed, trainer_id))
    log.info("output layer %s re-initialized per trainer (Xavier-uniform, zero bias, seeded by trainer)", layer)
