"""What can be checked from the config and the file system, checked before any heavy import or data work.

Each check raises the same one-line error the loader would raise later, only at once: a wrong preset,
a missing C4 or IMDB directory, a tokenized C4 dataset packed for another seq_len, or a run_name that
holds another run, used to surface after a minute of imports, corpus loading and tokenizer training,
and to leave a stub run directory behind.
"""

from __future__ import annotations

import json
from pathlib import Path

from utils.config import Config
from utils.errors import ConfigError, DataError, UserError

PRESETS_DIR = Path(__file__).resolve().parents[1] / "fabrics" / "model_configs"
C4_METADATA_FILE = "metadata.json"  # of a tokenized C4 dataset (here, not in fabrics.c4_data: that imports datasets)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def _looks_local(name: str) -> bool:
    """A path rather than a Hub id ('owner/name')."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).expanduser().exists()


def check_model(cfg: Config) -> None:
    """The preset or local model exists, and seq_len is within its positions (read from its JSON; no weights
    loaded). A Hub id is checked when the model is loaded."""
    name = cfg.model_config.name
    local = Path(name).expanduser() / "config.json"
    if name in preset_names() and not cfg.model_config.pretrained:
        config_file = PRESETS_DIR / f"{name}.json"
    elif local.is_file():
        config_file = local
    elif cfg.model_config.pretrained:
        if _looks_local(name):
            raise UserError(f"model_config.name: {name} is not a Hugging Face model directory (no config.json)")
        return
    else:
        raise UserError(f"model_config.name: '{name}' is neither a preset ({', '.join(preset_names())}) nor a "
                        "local model directory; for Hub weights set model_config.pretrained: true")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        raise UserError(f"model_config.name: {config_file} is not valid JSON") from None
    limit = config.get("max_position_embeddings") if isinstance(config, dict) else None
    if isinstance(limit, int) and cfg.seq_len > limit:
        raise ConfigError("seq_len", f"{cfg.seq_len} is above the {limit} positions of model '{name}'")
    layers = config.get("num_hidden_layers") if isinstance(config, dict) else None
    from utils import run_plan  # here, not at the top: run.py reads this module before torch may load (utils/openmp)

    fragments = run_plan.fragments(cfg)
    if isinstance(layers, int) and fragments > layers:  # the real model is checked again when built
        raise ConfigError("sync_fragments", f"{fragments} fragments, but model '{name}' has {layers} layers: "
                          "at most one fragment per layer")


def read_tokenized_metadata(path: Path) -> dict:
    """The metadata.json of a dataset written by c4/tokenize_c4.py (also read by fabrics.c4_data)."""
    if not path.is_dir():
        raise DataError(f"c4_tokenized_path: directory not found: {path}")
    meta_file = path / C4_METADATA_FILE
    if not meta_file.is_file():
        raise DataError(f"c4_tokenized_path: {path} has no {C4_METADATA_FILE}; write it with c4/tokenize_c4.py")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"c4_tokenized_path: {meta_file} is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(meta, dict):
        raise DataError(f"c4_tokenized_path: {meta_file} is not a metadata mapping")
    return meta


def check_tokenized_seq_len(meta: dict, seq_len: int, path: Path) -> None:
    if meta.get("seq_len") != seq_len:
        raise DataError(f"c4_tokenized_path: {path} was packed with seq_len {meta.get('seq_len')}, the config asks "
                        f"for seq_len {seq_len}; set seq_len: {meta.get('seq_len')} or re-run tokenize_c4.py")


def check_data(cfg: Config) -> None:
    if cfg.dataset == "c4" and cfg.c4_tokenized_path:
        path = Path(cfg.c4_tokenized_path).expanduser()
        check_tokenized_seq_len(read_tokenized_metadata(path), cfg.seq_len, path)
    elif cfg.dataset == "c4" and cfg.c4_local_path:
        path = Path(cfg.c4_local_path).expanduser()
        if not path.is_dir():
            raise DataError(f"c4_local_path: directory not found: {path}")
    if cfg.dataset == "imdb" and cfg.imdb_local_path:
        path = Path(cfg.imdb_local_path).expanduser()
        if not path.is_dir():
            raise DataError(f"imdb_local_path: directory not found: {path}")


SKETCH_BYTES_PER_DIM = 2 * 8  # per node: its two gradient samples sketched, fp64 (algorithms/sketch.py)


def _free_bytes(device: str) -> int:
    """Memory free for new buffers on `device` now: the GPU's free memory, or the machine's available RAM."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.mem_get_info(torch.device(device))[0]
    import psutil

    return psutil.virtual_memory().available


def check_statistics_memory(cfg: Config) -> None:
    """statistics_comm sketch: the nodes' sketches must fit their devices, or every round (and every resume) would
    fail allocating them: refused now, before any work."""
    from utils import run_plan  # here, not at the top: run.py reads this module before torch may load (utils/openmp)

    dim = run_plan.sketch_dim(cfg)
    if not dim:
        return
    per_node = SKETCH_BYTES_PER_DIM * dim
    nodes_on: dict[str, int] = {}
    for device in cfg.device_names:
        where = "cpu" if device == "cpu" else (device if ":" in device else "cuda:0")
        nodes_on[where] = nodes_on.get(where, 0) + cfg.nodes_per_gpu
    for device, nodes in nodes_on.items():
        need, free = per_node * nodes, _free_bytes(device)
        if need > free:
            raise ConfigError("statistics_sketch_dim", f"{dim}: each node's sketch of its "
                              f"gradient samples needs {per_node / 2**30:.3g} GiB, {need / 2**30:.3g} GiB for the "
                              f"{nodes} nodes on {device}, which has {free / 2**30:.3g} GiB free; a sketch is meant "
                              "to be small (default 16384, relative error about sqrt(2/k))")


def check_before_work(cfg: Config) -> None:
    """The model, the data paths and the statistics' memory, before any data work (run_dir/claim.py checks
    run_name)."""
    check_model(cfg)
    check_data(cfg)
    check_statistics_memory(cfg)
