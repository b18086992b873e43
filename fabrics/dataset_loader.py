"""Data: the embedded English corpus, its tokenizer, packing into sequences, and per-node shards.

The embedded default needs no Hugging Face Hub: it is the calibration text that the PyPI wheel
exllamav2==0.3.2 carries (exllamav2/conversion/standard_cal_data/): wiki.utf8 (English Wikipedia,
CC BY-SA), c4.utf8 (118 C4 pages, ODC-BY), tiny.utf8 (TinyStories, CDLA-Sharing). The wheel is
fetched once with `pip download --no-deps`, checked against its sha256 and read as a zip; exllamav2
is never installed or imported. Set ADLOCO_EXLLAMAV2_WHEEL to a local copy of the wheel to skip pip.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from utils.config import Config
from utils.errors import DataError

log = logging.getLogger(__name__)

WHEEL_SPEC = "exllamav2==0.3.2"
WHEEL_NAME = "exllamav2-0.3.2-py3-none-any.whl"
WHEEL_SHA256 = "7cd61ae4bf1d8d12034595ab9731f0f43bac415d6394fbb273d4383293d6079e"
CAL_DIR = "exllamav2/conversion/standard_cal_data"
SOURCES = {"wiki": "wiki.utf8", "c4": "c4.utf8", "tiny": "tiny.utf8"}
EOS, PAD = "<|endoftext|>", "<pad>"
PIP_TIMEOUT_S = 180


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch_wheel(cache_dir: Path) -> Path:
    """The verified exllamav2 wheel, downloaded once into cache_dir (or ADLOCO_EXLLAMAV2_WHEEL)."""
    override = os.environ.get("ADLOCO_EXLLAMAV2_WHEEL")
    if override:
        path = Path(override)
        if not path.is_file():
            raise DataError(f"ADLOCO_EXLLAMAV2_WHEEL: file not found: {path}")
        if _sha256(path) != WHEEL_SHA256:
            raise DataError(f"ADLOCO_EXLLAMAV2_WHEEL: {path} does not have the sha256 of {WHEEL_NAME}")
        return path
    target = cache_dir / "wheels" / WHEEL_NAME
    if target.is_file() and _sha256(target) == WHEEL_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, WHEEL_SPEC]
        log.info("fetching the embedded corpus: %s", " ".join(cmd[2:]))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise DataError(f"dataset: `pip download {WHEEL_SPEC}` did not finish in {PIP_TIMEOUT_S}s; "
                            "set ADLOCO_EXLLAMAV2_WHEEL to a local copy of the wheel") from None
        got = Path(tmp) / WHEEL_NAME
        if proc.returncode != 0 or not got.is_file():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise DataError(f"dataset: could not download {WHEEL_SPEC} from the package index ({last}); "
                            "set ADLOCO_EXLLAMAV2_WHEEL to a local copy of the wheel")
        if _sha256(got) != WHEEL_SHA256:
            raise DataError(f"dataset: the downloaded {WHEEL_NAME} has the wrong sha256; refusing to use it")
        os.replace(got, target)  # atomic: a half-written wheel never sits in the cache
    return target


def parse_documents(source: str, text: str) -> list[str]:
    """Split one calibration file into documents, in the file's own convention."""
    if source == "wiki":
        docs = re.findall(r"<doc[^>]*>(.*?)</doc>", text, flags=re.S)
    elif source == "tiny":
        docs = text.split(EOS)
    else:
        docs = text.splitlines()
    return [d.strip() for d in docs if d.strip()]


def load_embedded_documents(cache_dir: Path, sources: list[str]) -> datasets.Dataset:
    """The embedded corpus as a `datasets.Dataset` with columns text and source."""
    wheel = fetch_wheel(cache_dir)
    texts, origin = [], []
    with zipfile.ZipFile(wheel) as zf:
        for source in sources:
            docs = parse_documents(source, zf.read(f"{CAL_DIR}/{SOURCES[source]}").decode("utf-8"))
            texts += docs
            origin += [source] * len(docs)
    return datasets.Dataset.from_dict({"text": texts, "source": origin})


# ----------------------------------------------------------------------------------------------
# Tokenizer


def _train_bpe(texts: list[str], vocab_size: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)


def build_tokenizer(cfg: Config, train_texts: list[str], cache_dir: Path) -> PreTrainedTokenizerBase:
    """MicroLlama's tokenizer when it is local (auto), a named one, or a BPE trained on the training split."""
    choice = cfg.tokenizer
    if choice not in ("auto", "bpe"):
        try:
            tokenizer = AutoTokenizer.from_pretrained(choice, local_files_only=True)
        except (OSError, ValueError):
            raise DataError(f"tokenizer: '{choice}' is neither a local directory nor in the HF cache") from None
    elif choice == "auto" and (local := _local_microllama_tokenizer()) is not None:
        tokenizer = local
    else:
        digest = hashlib.sha256()
        for t in train_texts:
            digest.update(t.encode())
        key = f"bpe{cfg.tokenizer_vocab_size}-{digest.hexdigest()[:12]}"
        path = cache_dir / "tokenizers" / f"{key}.json"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            log.info("training a %d-token byte-level BPE tokenizer on the training split", cfg.tokenizer_vocab_size)
            _train_bpe(train_texts, cfg.tokenizer_vocab_size, path)
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOS, pad_token=PAD)
        tokenizer.name_or_path = f"{key} (byte-level BPE trained on the embedded training split)"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _local_microllama_tokenizer() -> PreTrainedTokenizerBase | None:
    from fabrics.models import MICROLLAMA_HUB_ID

    try:
        return AutoTokenizer.from_pretrained(MICROLLAMA_HUB_ID, local_files_only=True)
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------
# Packed sequences


@dataclass
class PackedData:
    """Fixed-length sequences: input_ids and attention_mask [N, seq_len]; padding has mask 0."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    def __post_init__(self) -> None:
        self.tokens_per_sequence = self.attention_mask.sum(dim=1)

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def pack(token_lists: list[list[int]], eos_id: int, pad_id: int, seq_len: int) -> PackedData:
    """Concatenate documents (EOS after each) and cut into seq_len chunks; the last one is padded."""
    flat = [t for ids in token_lists for t in (*ids, eos_id)]
    n = -(-len(flat) // seq_len)
    ids = torch.full((n * seq_len,), pad_id, dtype=torch.long)
    mask = torch.zeros(n * seq_len, dtype=torch.long)
    ids[: len(flat)] = torch.tensor(flat, dtype=torch.long)
    mask[: len(flat)] = 1
    return PackedData(ids.view(n, seq_len), mask.view(n, seq_len))


@dataclass
class CorpusData:
    train: PackedData
    val: PackedData
    tokenizer: PreTrainedTokenizerBase
    description: str


def _tokenize(ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    out = ds.map(lambda b: {"ids": tokenizer(b["text"], add_special_tokens=False)["input_ids"]},
                 batched=True, remove_columns=ds.column_names, desc="tokenizing", keep_in_memory=True)
    return out["ids"]


def load_corpus(cfg: Config) -> CorpusData:
    """Training and validation sequences; validation documents are held out before anything is fit."""
    cache_dir = Path(cfg.cache_dir).expanduser()
    docs = load_embedded_documents(cache_dir, cfg.embedded_sources).shuffle(seed=cfg.training_seed)
    # Hold out whole documents for validation: generously ~8 characters per token.
    need_chars = cfg.val_size * cfg.seq_len * 8
    lengths = [len(t) for t in docs["text"]]
    n_val, chars = 0, 0
    while chars < need_chars and n_val < len(lengths) - 1:
        chars += lengths[n_val]
        n_val += 1
    val_docs, train_docs = docs.select(range(n_val)), docs.select(range(n_val, len(docs)))
    tokenizer = build_tokenizer(cfg, train_docs["text"], cache_dir)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    train = pack(_tokenize(train_docs, tokenizer), eos, pad, cfg.seq_len)
    val = pack(_tokenize(val_docs, tokenizer), eos, pad, cfg.seq_len)
    if len(val) < cfg.val_size:
        raise DataError(f"val_size: only {len(val)} validation sequences could be made; lower val_size")
    val = PackedData(val.input_ids[: cfg.val_size], val.attention_mask[: cfg.val_size])
    if cfg.data_sample_size:
        if cfg.data_sample_size > len(train):
            raise DataError(f"data_sample_size: {cfg.data_sample_size} requested, the corpus has {len(train)} "
                            f"training sequences of {cfg.seq_len} tokens")
        train = PackedData(train.input_ids[: cfg.data_sample_size], train.attention_mask[: cfg.data_sample_size])
    description = (f"embedded corpus ({'+'.join(cfg.embedded_sources)}): {len(train_docs)} train / {n_val} "
                   f"validation documents -> {len(train)} x {cfg.seq_len} train, {len(val)} validation sequences; "
                   f"tokenizer {tokenizer.name_or_path}")
    return CorpusData(train, val, tokenizer, description)


# ----------------------------------------------------------------------------------------------
# Shards


class ShardSampler:
    """A trainer's own reproducible stream over the training set: a fresh permutation per epoch.

    Each round, the trainer's nodes take consecutive slices, so their shards are disjoint within
    the trainer; trainers draw independently (random, possibly intersecting subsets, as in the paper).
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples, self.seed = num_samples, seed
        self.epoch, self.position = 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_samples, generator=gen)

    def take(self, n: int) -> torch.Tensor:
        parts = []
        while n > 0:
            if self.position == self.num_samples:
                self.epoch, self.position = self.epoch + 1, 0
                self._perm = self._permutation()
            k = min(n, self.num_samples - self.position)
            parts.append(self._perm[self.position : self.position + k])
            self.position += k
            n -= k
        return torch.cat(parts)

    def state_dict(self) -> dict[str, int]:
        return {"num_samples": self.num_samples, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.num_samples, self.seed, self.epoch, self.position = (
            state["num_samples"], state["seed"], state["epoch"], state["position"])
        self._perm = self._permutation()

