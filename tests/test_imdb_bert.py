"""The authors' second task: BERT sentiment classification on IMDB, through the same engine."""

import csv
import random

import datasets
import pytest

from fabrics.corpus import load_corpus
from run import train
from utils.errors import DataError

POSITIVE = ["a wonderful film", "great acting and a moving story", "I loved every minute", "brilliant and funny",
            "a masterpiece, beautifully shot", "superb cast, excellent script"]
NEGATIVE = ["a terrible film", "awful acting and a boring story", "I hated every minute", "dull and stupid",
            "a disaster, badly shot", "poor cast, dreadful script"]


def write_imdb(root, n_train=160, n_test=60, seed=0):
    """A small IMDB in the Hub's layout: plain_text/{train,test}-00000-of-00001.parquet (text, label)."""
    rng = random.Random(seed)
    (root / "plain_text").mkdir(parents=True)
    for split, n in (("train", n_train), ("test", n_test)):
        rows = []
        for i in range(n):
            label = i % 2
            words = rng.sample(POSITIVE if label else NEGATIVE, 2)
            rows.append({"text": f"Review {i}: {words[0]}. Also, {words[1]}.", "label": label})
        datasets.Dataset.from_list(rows).to_parquet(str(root / "plain_text" / f"{split}-00000-of-00001.parquet"))
    return root


def bert_config(tiny_config, root, *extra):
    return tiny_config("model_type=bert", "dataset=imdb", "model_config.name=bert-tiny", f"imdb_local_path={root}",
                       "val_size=40", "seq_len=24", "tokenizer=bpe", "tokenizer_vocab_size=400", *extra)


def test_imdb_local_files_load_balanced(tiny_config, tmp_path):
    data = load_corpus(bert_config(tiny_config, write_imdb(tmp_path / "imdb")))
    assert data.train.labels is not None and len(data.train) == 160 and len(data.val) == 40
    assert int(data.val.labels.sum()) == 20  # balanced between the classes
    assert (data.train.input_ids[:, 0] == data.tokenizer.cls_token_id).all()


def test_bert_imdb_end_to_end_accuracy(tiny_config, tmp_path):
    cfg = bert_config(tiny_config, write_imdb(tmp_path / "imdb"), "num_outer_steps=4", "num_inner_steps=8",
                      "lr_inner=0.003", "run_name=bert", "plot_every=4")
    run_dir, summary = train(cfg)
    assert summary["metric"] == "val_accuracy"
    assert summary["final_metric"] >= 0.9 and summary["final_metric"] > summary["initial_metric"]
    with (run_dir / "model_training_report" / "training_log.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert all(r["val_accuracy"] and not r["val_perplexity"] for r in rows)
    assert (run_dir / "model_training_report" / "val_accuracy_per_trainer.png").is_file()
    assert (run_dir / "model_weights" / "final" / "final_model" / "config.json").is_file()


def test_imdb_errors(tiny_config, tmp_path):
    with pytest.raises(DataError, match="directory not found"):
        load_corpus(bert_config(tiny_config, tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no train-"):
        load_corpus(bert_config(tiny_config, tmp_path / "empty"))
