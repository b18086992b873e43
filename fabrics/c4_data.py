"""C4 (allenai/c4) in three ways: streaming from the Hub, local raw shards, or a pre-tokenized dataset.

Local shards keep C4's own layout and format: <dir>/<lang>/c4-train.XXXXX-of-01024.json.gz and
c4-validation.XXXXX-of-00008.json.gz (JSON lines with text, timestamp, url); files directly in <dir>
are found too. Everything is read through `datasets`. The Hub is checked for reachability with a short
socket timeout first, so an offline machine gets a clear error in seconds instead of minutes of retries.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import socket
import zlib
from pathlib import Path
from urllib.parse import urlparse

import datasets
from datasets.exceptions import DatasetGenerationError

from utils.errors import DataError
from utils.preflight import C4_METADATA_FILE, check_tokenized_seq_len, read_tokenized_metadata

log = logging.getLogger(__name__)

C4_HUB_ID = "allenai/c4"
HUB_CHECK_TIMEOUT_S = 5.0
METADATA_FILE = C4_METADATA_FILE


C4_LOCAL_ADVICE = "use local shards (c4_local_path) or a tokenized dataset (c4_tokenized_path)"
IMDB_LOCAL_ADVICE = ("set imdb_local_path to a copy of stanfordnlp/imdb in its Hub layout "
                     "(<dir>/plain_text/train-*.parquet and test-*.parquet)")
MODEL_LOCAL_ADVICE = "give a local model directory, or fetch it once with `hf download <id>`"


def check_hub_reachable(what: str, advice: str = C4_LOCAL_ADVICE) -> None:
    """Fail fast (seconds) when the Hugging Face Hub cannot be reached or offline mode is on; advice: what
    to use instead, in the caller's terms."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise DataError(f"{what}: HF_HUB_OFFLINE is set, so the Hub cannot be used; {advice}")
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname, port), timeout=HUB_CHECK_TIMEOUT_S):
            pass
    except OSError as exc:
        raise DataError(f"{what}: the Hugging Face Hub ({endpoint.hostname}:{port}) is unreachable ({exc}); "
                        f"{advice}") from None


def find_shards(root: Path, language: str, split: str) -> list[Path]:
    if not root.is_dir():
        raise DataError(f"c4_local_path: directory not found: {root}")
    pattern = f"c4-{split}.*.json.gz"
    files = sorted((root / language).glob(pattern)) or sorted(root.glob(pattern))
    return files


def _check_shard(path: Path) -> None:
    """The whole shard decompresses (a truncated .gz fails only at its end) and holds a line."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            has_line = False
            for line in f:
                has_line = has_line or bool(line.strip())
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:
        raise DataError(f"c4_local_path: {path} is not a complete gzip text file ({type(exc).__name__}: "
                        f"{exc}); download it again") from None
    if not has_line:
        raise DataError(f"c4_local_path: {path.name} holds no documents")


def _read_json_shards(files: list[Path], limit: int) -> datasets.Dataset:
    for f in files:
        _check_shard(f)
    try:
        ds = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train")
    except (DatasetGenerationError, ValueError, OSError, EOFError) as exc:
        cause = exc.__cause__ or exc
        raise DataError(f"c4_local_path: {', '.join(f.name for f in files)} is not valid C4 JSON lines "
                        f"({type(cause).__name__}: {str(cause).splitlines()[0][:160] if str(cause) else ''})") from None
    if "text" not in ds.column_names:
        raise DataError(f"c4_local_path: {files[0].name} has no 'text' field; is it a C4 shard?")
    ds = ds.select_columns(["text"])
    usable = ds.filter(lambda text: isinstance(text, str) and bool(text.strip()), input_columns="text")
    if len(usable) < len(ds):
        log.warning("c4_local_path: %d of %d documents have no text (null or empty); skipped", len(ds) - len(usable),
                    len(ds))
    if len(usable) == 0:
        raise DataError(f"c4_local_path: {', '.join(f.name for f in files)} holds no documents with text")
    return usable.select(range(min(limit, len(usable)))) if limit else usable


def load_local_c4(root: Path, language: str, num_documents: int) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """(train documents, validation documents or None) from local shards in C4's layout."""
    train_files = find_shards(root, language, "train")
    if not train_files:
        raise DataError(f"c4_local_path: no c4-train.*.json.gz shards in {root} or {root / language}")
    train = _read_json_shards(train_files, num_documents)
    val_files = find_shards(root, language, "validation")
    val = _read_json_shards(val_files, 0) if val_files else None
    log.info("C4 from local shards: %d train files (%d documents), %s", len(train_files), len(train),
             f"{len(val_files)} validation files" if val_files else "no validation shards (held-out documents)")
    return train, val


def stream_hub_c4(language: str, num_documents: int, val_documents: int, streaming: bool = True,
                  what: str = "c4_streaming", advice: str = C4_LOCAL_ADVICE,
                  ) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The first documents of allenai/c4 (train and validation splits) from the Hub. what / advice: how an
    unreachable Hub is reported (the config key, or the tool's flag, and the local alternative)."""
    check_hub_reachable(what, advice)
    try:
        if not streaming:
            train = datasets.load_dataset(C4_HUB_ID, language, split=f"train[:{num_documents}]")
            val = datasets.load_dataset(C4_HUB_ID, language, split=f"validation[:{val_documents}]")
            return train.select_columns(["text"]), val.select_columns(["text"])
        out = []
        for split, n in (("train", num_documents), ("validation", val_documents)):
            stream = datasets.load_dataset(C4_HUB_ID, language, split=split, streaming=True)
            out.append(datasets.Dataset.from_list([{"text": ex["text"]} for ex in stream.take(n)]))
    except (ConnectionError, OSError) as exc:
        raise DataError(f"c4_streaming: could not read {C4_HUB_ID}/{language} from the Hub ({exc})") from None
    log.info("C4 streamed from the Hub: %d train, %d validation documents", len(out[0]), len(out[1]))
    return out[0], out[1]


# ----------------------------------------------------------------------------------------------
# Pre-tokenized datasets (written by c4/tokenize_c4.py)


def vocab_hash(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def load_tokenized(path: Path) -> tuple[dict, datasets.Dataset, datasets.Dataset]:
    """(metadata, train, eval) of a dataset written by tokenize_c4.py."""
    meta = read_tokenized_metadata(path)
    try:
        train = datasets.load_from_disk(str(path / "train"))
        evaluation = datasets.load_from_disk(str(path / "eval"))
    except (ValueError, OSError, FileNotFoundError) as exc:
        raise DataError(f"c4_tokenized_path: {path} is not a complete tokenized dataset ({exc})") from None
    for split, ds in (("train", train), ("eval", evaluation)):
        if not {"input_ids", "attention_mask"} <= set(ds.column_names) or len(ds) == 0:
            raise DataError(f"c4_tokenized_path: the {split} split of {path} has no input_ids/attention_mask rows")
    return meta, train, evaluation


def check_tokenized_matches(meta: dict, tokenizer, seq_len: int, path: Path) -> None:
    check_tokenized_seq_len(meta, seq_len, path)
    if meta.get("vocab_hash") != vocab_hash(tokenizer):
        raise DataError(f"c4_tokenized_path: {path} was tokenized with '{meta.get('tokenizer')}', not with the "
                        f"configured tokenizer '{tokenizer.name_or_path}' (vocabulary hashes differ)")
