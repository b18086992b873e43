"""Data: the embedded English corpus, its tokenizer, packing into sequences, and per-node shards.

The embedded default needs no Hugging Face Hub: it is the calibration text that the PyPI wheel
exllamav2==0.3.2 carries (exllamav2/conversion/standard_cal_data/): wiki.utf8 (English Wikipedia,
CC BY-SA), c4.utf8 (118 C4 pages, ODC-BY), tiny.utf8 (TinyStories, CDLA-Sharing). The wheel is
fetched once with `pip download --no-deps`, checked against its sha256 and read as a zip; exllamav2
is never installed or imported. Set ADLOCO_EXLLAMAV2_WHEEL to a local copy of the wheel to skip pip.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from utils import cache
from utils.config import Config
from utils.errors import DataError

log = logging.getLogger(__name__)

WHEEL_SPEC = "exllamav2==0.3.2"
WHEEL_NAME = "exllamav2-0.3.2-py3-none-any.whl"
WHEEL_SHA256 = "7cd61ae4bf1d8d12034595ab9731f0f43bac415d6394fbb273d4383293d6079e"
CAL_DIR = "exllamav2/conversion/standard_cal_data"
SOURCES = {"wiki": "wiki.utf8", "c4": "c4.utf8", "tiny": "tiny.utf8"}
EOS, PAD, CLS = "<|endoftext|>", "<pad>", "<cls>"
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
        return target  # a complete entry is read even from a read-only cache
    # Downloaded outside the cache, then stored in it: a full or read-only cache costs the cache alone.
    fetched = Path(tempfile.mkdtemp(prefix="adloco-wheel-"))
    atexit.register(shutil.rmtree, fetched, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(fetched), WHEEL_SPEC]
    log.info("fetching the embedded corpus: %s", " ".join(cmd[2:]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DataError(f"dataset: `pip download {WHEEL_SPEC}` did not finish in {PIP_TIMEOUT_S}s; "
                        "set ADLOCO_EXLLAMAV2_WHEEL to a local copy of the wheel") from None
    got = fetched / WHEEL_NAME
    if proc.returncode != 0 or not got.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise DataError(f"dataset: could not download {WHEEL_SPEC} from the package index ({last}); "
                        "set ADLOCO_EXLLAMAV2_WHEEL to a local copy of the wheel")
    if _sha256(got) != WHEEL_SHA256:
        raise DataError(f"dataset: the downloaded {WHEEL_NAME} has the wrong sha256; refusing to use it")
    if cache.store(cache_dir, target, lambda tmp: shutil.copyfile(got, tmp), "the corpus wheel"):
        shutil.rmtree(fetched, ignore_errors=True)
        return target
    return got  # this run reads it from the temporary directory, removed when the process ends


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


def _train_bpe(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD, CLS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_pretrained_tokenizer(name: str, cfg: Config, key: str = "tokenizer") -> PreTrainedTokenizerBase:
    """A tokenizer from a local directory or the HF cache; from the Hub only with hub_downloads: true."""
    if cfg.hub_downloads and not Path(name).exists():
        from fabrics.c4_data import MODEL_LOCAL_ADVICE, check_hub_reachable

        check_hub_reachable(key, MODEL_LOCAL_ADVICE)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=not cfg.hub_downloads)
    except (OSError, ValueError):
        where = "a local directory or the HF cache" + (" or the Hub" if cfg.hub_downloads else "")
        raise DataError(f"{key}: cannot load tokenizer '{name}' from {where}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.sep_token
    return tokenizer


def build_tokenizer(cfg: Config, train_texts: list[str], cache_dir: Path, corpus: str) -> PreTrainedTokenizerBase:
    """auto: the model's own tokenizer when available locally, else a BPE trained on the training split."""
    from fabrics.models import default_tokenizer_names

    if cfg.tokenizer not in ("auto", "bpe"):
        return load_pretrained_tokenizer(cfg.tokenizer, cfg)
    if cfg.tokenizer == "auto":
        for name in default_tokenizer_names(cfg):
            try:
                return load_pretrained_tokenizer(name, cfg.replace(hub_downloads=False))
            except DataError:
                continue
    digest = hashlib.sha256(b"bpe-v2")
    for t in train_texts:
        digest.update(t.encode())
    key = f"bpe{cfg.tokenizer_vocab_size}-{digest.hexdigest()[:12]}"
    path = cache_dir / "tokenizers" / f"{key}.json"
    if path.is_file():
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOS, pad_token=PAD, cls_token=CLS)
    else:
        log.info("training a %d-token byte-level BPE tokenizer on the training split", cfg.tokenizer_vocab_size)
        trained = _train_bpe(train_texts, cfg.tokenizer_vocab_size)
        cache.store(cache_dir, path, lambda tmp: tmp.write_text(trained.to_str(), encoding="utf-8"), "the tokenizer")
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=trained, eos_token=EOS, pad_token=PAD, cls_token=CLS)
    tokenizer.name_or_path = f"{key} (byte-level BPE trained on the {corpus} training split)"
    return tokenizer


# ----------------------------------------------------------------------------------------------
# Packed sequences


@dataclass
class PackedData:
    """Sequences [N, seq_len] with attention_mask (padding = 0) and, for classification, labels [N]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.tokens_per_sequence = self.attention_mask.sum(dim=1)
        # which sequences hold padding (packing pads only each group's last one): a batch of none of them needs no
        # attention mask, whose checks in transformers read the device (node.py)
        self.padded = self.tokens_per_sequence < self.attention_mask.shape[1]

    def needs_mask(self, indices: torch.Tensor) -> bool:
        """Whether a batch of these sequences needs an attention mask: classification batches always (BERT pads
        every review), language-model batches when one of them is padded. Host memory only: no device is read."""
        return self.labels is not None or bool(self.padded[indices.reshape(-1)].any())

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def head(self, n: int) -> PackedData:
        return PackedData(self.input_ids[:n], self.attention_mask[:n], None if self.labels is None else self.labels[:n])


def pack_lists(token_lists: list[list[int]], eos_id: int, pad_id: int, seq_len: int
               ) -> tuple[list[list[int]], list[list[int]]]:
    """Concatenate documents (EOS after each) and cut into seq_len chunks; the last one is padded.

    Plain Python on purpose: it runs inside `datasets` worker processes, where torch's thread pool
    (inherited through fork) could deadlock.
    """
    flat = [t for ids in token_lists for t in (*ids, eos_id)]
    ids, masks = [], []
    for start in range(0, len(flat), seq_len):
        chunk = flat[start : start + seq_len]
        pad = seq_len - len(chunk)
        ids.append(chunk + [pad_id] * pad)
        masks.append([1] * len(chunk) + [0] * pad)
    return ids, masks


def pack(token_lists: list[list[int]], eos_id: int, pad_id: int, seq_len: int) -> PackedData:
    ids, masks = pack_lists(token_lists, eos_id, pad_id, seq_len)
    return PackedData(torch.tensor(ids, dtype=torch.long), torch.tensor(masks, dtype=torch.long))


PACK_BATCH_DOCS = 1000  # documents packed together; only the last sequence of each group is padded


def tokenize_and_pack(docs: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, seq_len: int,
                      num_proc: int | None = None, desc: str = "tokenizing") -> datasets.Dataset:
    """A dataset of packed sequences (input_ids, attention_mask) from a dataset with a text column."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def pack_batch(batch: dict) -> dict:
        ids, masks = pack_lists(tokenizer(batch["text"], add_special_tokens=False)["input_ids"], eos, pad, seq_len)
        return {"input_ids": ids, "attention_mask": masks}

    return docs.map(pack_batch, batched=True, batch_size=PACK_BATCH_DOCS, remove_columns=docs.column_names,
                    num_proc=num_proc, desc=desc)


def to_packed(ds: datasets.Dataset) -> PackedData:
    columns = ds.with_format("torch")[:]  # every row at once, as tensors
    labels = columns["label"].long() if "label" in columns else None
    return PackedData(columns["input_ids"].long(), columns["attention_mask"].long(), labels)


@dataclass
class CorpusData:
    train: PackedData
    val: PackedData
    tokenizer: PreTrainedTokenizerBase
    description: str

    def fingerprint(self) -> dict[str, str | int]:
        """What must be the same on every machine of a torchrun job: the tokenizer, the number of
        sequences, and a hash of every token of each split (and of the labels, for classification)."""
        from fabrics.c4_data import vocab_hash

        out: dict[str, str | int] = {"tokenizer": vocab_hash(self.tokenizer)}
        for split, packed in (("train", self.train), ("val", self.val)):
            digest = hashlib.sha256(packed.input_ids.contiguous().numpy().tobytes())
            digest.update(packed.attention_mask.contiguous().numpy().tobytes())
            if packed.labels is not None:
                digest.update(packed.labels.contiguous().numpy().tobytes())
            out[f"{split}_sequences"] = len(packed.input_ids)
            out[f"{split}_corpus_sha256"] = digest.hexdigest()[:16]
        return out


def hold_out(docs: datasets.Dataset, cfg: Config) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, validation) by whole documents: about 8 characters per token of the val_size sequences.

    Validation may take at most half the documents: a val_size the data cannot give is refused here,
    before a tokenizer is trained on what would be left."""
    need_chars = cfg.val_size * cfg.seq_len * 8
    most = len(docs) // 2
    n_val, chars = 0, 0
    for text in docs["text"]:
        if chars >= need_chars or n_val >= most:
            break
        chars += len(text)
        n_val += 1
    if chars < need_chars and n_val >= most:
        total = sum(len(t) for t in docs["text"])
        raise DataError(f"val_size: {cfg.val_size} validation sequences of {cfg.seq_len} tokens need about "
                        f"{need_chars:,} characters of held-out text, but the {len(docs)} documents hold {total:,} "
                        f"in all and at most half go to validation; lower val_size (or seq_len)")
    return docs.select(range(n_val, len(docs))), docs.select(range(n_val))


def finish_corpus(cfg: Config, train: PackedData, val: PackedData, tokenizer, description: str) -> CorpusData:
    if len(val) < cfg.val_size:
        raise DataError(f"val_size: only {len(val)} validation sequences could be made; lower val_size")
    if cfg.data_sample_size:
        if cfg.data_sample_size > len(train):
            raise DataError(f"data_sample_size: {cfg.data_sample_size} requested, the data has {len(train)} "
                            "training sequences")
        train = train.head(cfg.data_sample_size)
    val = val.head(cfg.val_size)
    return CorpusData(train, val, tokenizer, f"{description} -> {len(train)} train, {len(val)} validation "
                      f"sequences of {train.input_ids.shape[1]} tokens; tokenizer {tokenizer.name_or_path}")


def _from_documents(cfg: Config, train_docs: datasets.Dataset, val_docs: datasets.Dataset | None,
                    corpus: str) -> CorpusData:
    if val_docs is None:
        train_docs, val_docs = hold_out(train_docs, cfg)
        val_origin = "held-out documents"
    else:
        val_origin = "validation split"
    train_texts = train_docs["text"]
    tokenizer = build_tokenizer(cfg, train_texts, cache_dir_of(cfg), corpus)
    cache_path = packed_cache_path(cfg, tokenizer, corpus, train_texts, val_docs["text"])
    cached = load_packed(cache_path)
    if cached is not None:
        train, val = cached
        log.info("data: the tokenized, packed corpus came from the cache (%s)", cache_path)
    else:
        train = to_packed(tokenize_and_pack(train_docs, tokenizer, cfg.seq_len))
        val = to_packed(tokenize_and_pack(val_docs, tokenizer, cfg.seq_len))
        if save_packed(cache_dir_of(cfg), cache_path, train, val):
            log.info("data: tokenized and packed; cached for the next run in %s", cache_path)
    return finish_corpus(cfg, train, val, tokenizer, f"{corpus}: {len(train_docs)} train documents, "
                         f"{len(val_docs)} validation documents ({val_origin})")


PACKED_CACHE_VERSION = 1  # bump when packing changes: older cache entries are then never read


def packed_cache_path(cfg: Config, tokenizer: PreTrainedTokenizerBase, corpus: str, train_texts: list[str],
                      val_texts: list[str]) -> Path:
    """cache_dir/packed/<key>.pt, the key covering everything that defines the packed sequences: the
    documents of each split (their texts, in order), the tokenizer (its vocabulary and special tokens),
    seq_len, the source, and the packing code's version."""
    from fabrics.c4_data import vocab_hash

    digest = hashlib.sha256()
    for part in (str(PACKED_CACHE_VERSION), corpus, str(cfg.seq_len), vocab_hash(tokenizer),
                 str(tokenizer.eos_token_id), str(tokenizer.pad_token_id)):
        digest.update(part.encode() + b"\x00")
    for split, texts in (("train", train_texts), ("val", val_texts)):
        digest.update(f"{split}:{len(texts)}".encode() + b"\x00")
        for text in texts:
            digest.update(text.encode() + b"\x00")
    return cache_dir_of(cfg) / "packed" / f"{digest.hexdigest()[:24]}.pt"


def load_packed(path: Path) -> tuple[PackedData, PackedData] | None:
    if not path.is_file():
        return None
    try:
        stored = torch.load(path, weights_only=True)
        return PackedData(*stored["train"]), PackedData(*stored["val"])
    except Exception as exc:  # a damaged entry is rebuilt, never trusted
        log.warning("data: ignoring the damaged cache entry %s (%s)", path, type(exc).__name__)
        return None


def save_packed(cache_dir: Path, path: Path, train: PackedData, val: PackedData) -> bool:
    """A full or read-only cache costs the next run its speed, not this run."""
    from utils.safe_write import torch_save

    entry = {"train": (train.input_ids, train.attention_mask), "val": (val.input_ids, val.attention_mask)}
    return cache.store(cache_dir, path, lambda tmp: torch_save(entry, tmp), "the packed corpus")


def load_embedded(cfg: Config) -> CorpusData:
    docs = load_embedded_documents(cache_dir_of(cfg), cfg.embedded_sources).shuffle(seed=cfg.training_seed)
    return _from_documents(cfg, docs, None, f"embedded corpus ({'+'.join(cfg.embedded_sources)})")


def load_c4(cfg: Config) -> CorpusData:
    from fabrics import c4_data

    if cfg.c4_tokenized_path:
        path = Path(cfg.c4_tokenized_path).expanduser()
        meta, train_ds, eval_ds = c4_data.load_tokenized(path)
        if cfg.tokenizer == "auto":  # the tokenizer saved beside the data by tokenize_c4.py
            tokenizer = load_pretrained_tokenizer(str(path / "tokenizer"), cfg.replace(hub_downloads=False))
        elif cfg.tokenizer == "bpe":
            raise DataError("tokenizer: 'bpe' would train a new tokenizer, which cannot match a tokenized dataset; "
                            "use tokenizer: auto (the dataset's own) or name the tokenizer it was made with")
        else:
            tokenizer = load_pretrained_tokenizer(cfg.tokenizer, cfg)
        c4_data.check_tokenized_matches(meta, tokenizer, cfg.seq_len, path)
        log.info("C4 from the tokenized dataset %s (%s)", path, meta.get("source"))
        return finish_corpus(cfg, to_packed(train_ds), to_packed(eval_ds), tokenizer,
                             f"C4 tokenized at {path} ({meta.get('source')}, {meta.get('num_documents')} documents)")
    if cfg.c4_local_path:
        train_docs, val_docs = c4_data.load_local_c4(Path(cfg.c4_local_path).expanduser(), cfg.c4_language,
                                                     cfg.c4_num_documents)
        source = f"C4 {cfg.c4_language} local shards"
    else:
        val_docs_needed = max(100, cfg.val_size * cfg.seq_len // 200)
        train_docs, val_docs = c4_data.stream_hub_c4(cfg.c4_language, cfg.c4_num_documents, val_docs_needed,
                                                     cfg.c4_streaming)
        source = f"C4 {cfg.c4_language} from the Hub ({'streaming' if cfg.c4_streaming else 'download'})"
    log.info("dataset: %s", source)
    return _from_documents(cfg, train_docs, val_docs, source)


def cache_dir_of(cfg: Config) -> Path:
    return Path(cfg.cache_dir).expanduser()


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

