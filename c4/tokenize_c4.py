"""Pre-tokenize C4 once, then train from disk with `c4_tokenized_path`.

    python -m c4.tokenize_c4 --local_path ../shared/data/c4 --num_documents 900 --output_dir data/c4_tok
    python -m c4.tokenize_c4 --hub --num_documents 100000 --tokenizer keeeeenw/MicroLlama --num_proc 8 \
        --output_dir data/c4_en_100k

Reads C4 (Hub streaming or local raw shards), tokenizes with the configured tokenizer and PACKS the
documents (EOS after each) into fixed-length sequences; only the last sequence of each group of 1000
documents is padded, and its padding has attention_mask 0 (masked out of the loss). Writes
<output_dir>/train and <output_dir>/eval (`datasets` save_to_disk), <output_dir>/tokenizer and
<output_dir>/metadata.json (source, documents, tokenizer name and vocabulary hash, seq_len).
Evaluation documents come from C4's validation split when available, otherwise from documents held
out of the training documents. Everything is written to a temporary directory and renamed at the end,
so an interrupted run leaves nothing half-written; an existing output needs --overwrite.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # allow `python c4/tokenize_c4.py` as well as `python -m c4.tokenize_c4`
    sys.path.insert(0, str(ROOT))

from fabrics import c4_data  # noqa: E402
from fabrics.dataset_loader import build_tokenizer, tokenize_and_pack  # noqa: E402
from utils.config import load_config  # noqa: E402
from utils.errors import UserError, exit_code_of  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--local_path", help="directory of raw C4 shards (<dir>/<lang>/c4-train.*.json.gz)")
    src.add_argument("--hub", action="store_true", help="stream allenai/c4 from the Hugging Face Hub")
    p.add_argument("--language", default="en", help="C4 configuration (default: en)")
    p.add_argument("--num_documents", type=int, default=1000, help="training documents to read (0 = all local)")
    p.add_argument("--eval_documents", type=int, default=100,
                   help="evaluation documents (from the validation split, else held out of the training documents)")
    p.add_argument("--seq_len", type=int, default=512, help="tokens per packed sequence (default: 512)")
    p.add_argument("--tokenizer", default="auto",
                   help="auto (MicroLlama's if cached, else a trained BPE), bpe, or a local directory / HF id")
    p.add_argument("--vocab_size", type=int, default=4096, help="vocabulary of a trained BPE (default: 4096)")
    p.add_argument("--cache_dir", default="~/.cache/adloco", help="tokenizer cache (default: ~/.cache/adloco)")
    p.add_argument("--num_proc", type=int, default=1, help="processes for tokenization (default: 1)")
    p.add_argument("--output_dir", required=True, help="where to write the tokenized dataset")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output_dir")
    return p.parse_args(argv)


def tokenize_c4(args: argparse.Namespace) -> Path:
    out = Path(args.output_dir).expanduser()
    if out.exists() and not args.overwrite:
        raise UserError(f"--output_dir: {out} already exists; pass --overwrite to replace it")
    if args.num_documents < 0 or args.eval_documents < 1 or args.seq_len < 8 or args.num_proc < 1:
        raise UserError("--num_documents must be >= 0, --eval_documents >= 1, --seq_len >= 8, --num_proc >= 1")
    # The same tokenizer logic as training, through the same config object.
    cfg = load_config(None, [f"tokenizer={args.tokenizer}", f"tokenizer_vocab_size={args.vocab_size}",
                             f"cache_dir={args.cache_dir}", f"seq_len={args.seq_len}", "dataset=c4"])
    if args.hub:
        train_docs, eval_docs = c4_data.stream_hub_c4(
            args.language, args.num_documents or 1000, args.eval_documents, what="--hub",
            advice="use local shards instead: --local_path DIR (C4's c4-train.*.json.gz files)")
        source = f"allenai/c4 {args.language} (Hub, streaming)"
    else:
        train_docs, eval_docs = c4_data.load_local_c4(Path(args.local_path).expanduser(), args.language,
                                                      args.num_documents)
        source = f"local shards {Path(args.local_path).expanduser().resolve()} ({args.language})"
    if eval_docs is None:
        eval_docs = train_docs.select(range(len(train_docs) - args.eval_documents, len(train_docs)))
        train_docs = train_docs.select(range(len(train_docs) - args.eval_documents))
        eval_origin = "held-out training documents"
    else:
        eval_docs = eval_docs.select(range(min(args.eval_documents, len(eval_docs))))
        eval_origin = "validation split"
    if len(train_docs) == 0:
        raise UserError(f"--eval_documents: {args.eval_documents} leaves no training documents")
    tokenizer = build_tokenizer(cfg, train_docs["text"], Path(args.cache_dir).expanduser(), "C4")
    num_proc = args.num_proc if args.num_proc > 1 else None
    train = tokenize_and_pack(train_docs, tokenizer, args.seq_len, num_proc, desc="tokenizing train")
    evaluation = tokenize_and_pack(eval_docs, tokenizer, args.seq_len, num_proc, desc="tokenizing eval")
    for stray in out.parent.glob(f".{out.name}.tmp-*"):  # left by a run that was killed (SIGKILL) mid-write
        shutil.rmtree(stray, ignore_errors=True)
    tmp = out.with_name(f".{out.name}.tmp-{int(time.time())}-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        train.save_to_disk(str(tmp / "train"))
        evaluation.save_to_disk(str(tmp / "eval"))
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        meta = {
            "source": source, "language": args.language, "num_documents": len(train_docs),
            "eval_documents": len(eval_docs), "eval_source": eval_origin, "train_sequences": len(train),
            "eval_sequences": len(evaluation), "seq_len": args.seq_len, "layout": "packed (EOS between documents, "
            "last sequence of each 1000-document group padded, attention_mask 0 on padding)",
            "tokenizer": tokenizer.name_or_path, "vocab_size": len(tokenizer),
            "vocab_hash": c4_data.vocab_hash(tokenizer), "created": datetime.now(UTC).isoformat(),
        }
        (tmp / c4_data.METADATA_FILE).write_text(json.dumps(meta, indent=2))
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {len(train)} train and {len(evaluation)} eval sequences of {args.seq_len} tokens to {out}")
    print(f"train with:  {_interpreter()} run.py dataset=c4 c4_tokenized_path={out} seq_len={args.seq_len}")
    return out


def _interpreter() -> str:
    """This tool's interpreter as the guide writes it: relative inside the current directory (.venv/bin/python)."""
    exe = Path(sys.executable)
    return str(exe.relative_to(Path.cwd())) if exe.is_relative_to(Path.cwd()) else "python"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return exit_code_of(lambda: tokenize_c4(args),
                        interrupted=f"nothing was written to {Path(args.output_dir).expanduser()}")


if __name__ == "__main__":
    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
