"""IMDB sentiment classification (the authors' second task, for model_type: bert).

Read from the Hub (stanfordnlp/imdb) or from a local directory in the Hub's own layout
(plain_text/train-00000-of-00001.parquet, plain_text/test-00000-of-00001.parquet; columns text and
label). Training examples come from the train split, validation examples (balanced between the two
classes) from the test split. Texts are truncated and padded to seq_len; the metric is accuracy.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import torch

from fabrics.dataset_loader import CorpusData, PackedData, build_tokenizer, cache_dir_of, finish_corpus
from utils.config import Config
from utils.errors import DataError

IMDB_HUB_ID = "stanfordnlp/imdb"


def _local_split(root: Path, split: str) -> datasets.Dataset:
    files = sorted((root / "plain_text").glob(f"{split}-*.parquet")) or sorted(root.glob(f"{split}-*.parquet"))
    if not files:
        raise DataError(f"imdb_local_path: no {split}-*.parquet in {root / 'plain_text'} or {root}")
    try:
        ds = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train")
    except Exception as exc:  # pyarrow raises several types for broken files
        raise DataError(f"imdb_local_path: {files[0].name} is not a readable parquet file ({type(exc).__name__})") \
            from None
    if not {"text", "label"} <= set(ds.column_names) or len(ds) == 0:
        raise DataError(f"imdb_local_path: {files[0].name} needs rows with 'text' and 'label' columns")
    return ds


def load_imdb_splits(cfg: Config) -> tuple[datasets.Dataset, datasets.Dataset]:
    if cfg.imdb_local_path:
        root = Path(cfg.imdb_local_path).expanduser()
        if not root.is_dir():
            raise DataError(f"imdb_local_path: directory not found: {root}")
        return _local_split(root, "train"), _local_split(root, "test")
    from fabrics.c4_data import IMDB_LOCAL_ADVICE, check_hub_reachable

    check_hub_reachable("imdb_local_path", IMDB_LOCAL_ADVICE)
    return (datasets.load_dataset(IMDB_HUB_ID, split="train"), datasets.load_dataset(IMDB_HUB_ID, split="test"))


def encode(ds: datasets.Dataset, tokenizer, seq_len: int) -> PackedData:
    texts, labels = list(ds["text"]), list(ds["label"])
    cls = tokenizer.cls_token_id
    enc = tokenizer(texts, truncation=True, max_length=seq_len - 1, add_special_tokens=True)["input_ids"]
    # A BPE has no post-processor: put the class token first ourselves (BERT's pooler reads position 0).
    rows = [ids if ids and ids[0] == cls else [cls, *ids] for ids in enc]
    ids = torch.full((len(rows), seq_len), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), seq_len, dtype=torch.long)
    for i, row in enumerate(rows):
        row = row[:seq_len]
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return PackedData(ids, mask, torch.tensor(labels, dtype=torch.long))


def load_imdb_corpus(cfg: Config) -> CorpusData:
    train_ds, test_ds = load_imdb_splits(cfg)
    train_ds = train_ds.shuffle(seed=cfg.training_seed)
    test_ds = test_ds.shuffle(seed=cfg.training_seed)
    per_class = [test_ds.filter(lambda ex, c=c: ex["label"] == c) for c in (0, 1)]
    n = min(cfg.val_size // 2 + cfg.val_size % 2, *(len(p) for p in per_class))
    val_ds = datasets.concatenate_datasets([p.select(range(n)) for p in per_class]).shuffle(seed=cfg.training_seed)
    tokenizer = build_tokenizer(cfg, train_ds["text"], cache_dir_of(cfg), "IMDB")
    train, val = encode(train_ds, tokenizer, cfg.seq_len), encode(val_ds, tokenizer, cfg.seq_len)
    return finish_corpus(cfg, train, val, tokenizer, f"IMDB: {len(train_ds)} train reviews, {len(val_ds)} balanced "
                         "test reviews for validation")
