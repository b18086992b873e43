"""C4 three ways, on the real C4 documents in ../shared/data/c4 (C4's own format)."""

import gzip
import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from c4.tokenize_c4 import main as tokenize_main
from fabrics.c4_data import stream_hub_c4
from fabrics.corpus import load_corpus
from run import train
from tests.conftest import ROOT
from utils.errors import DataError

SHARED_C4 = ROOT.parent / "shared" / "data" / "c4"
SHARD = "c4-train.00000-of-01024.first1000.json.gz"


def test_the_real_c4_sample_is_there():
    assert (SHARED_C4 / SHARD).is_file(), "CI runs with ../shared beside the checkout"


def c4_config(tiny_config, *extra):
    return tiny_config("dataset=c4", "embedded_sources=[c4]", "c4_num_documents=0", *extra)


def test_local_shards_hold_out_validation_documents(tiny_config):
    data = load_corpus(c4_config(tiny_config, f"c4_local_path={SHARED_C4}"))
    assert "held-out" in data.description and len(data.val) == 8
    train_rows = {tuple(r) for r in data.train.input_ids.tolist()}
    assert not any(tuple(r) in train_rows for r in data.val.input_ids.tolist())
    assert "BBQ" in data.tokenizer.decode(data.train.input_ids[:200].flatten()) or len(data.train) > 1000


def test_local_validation_split_is_used_when_present(tiny_config, tmp_path):
    (tmp_path / "en").mkdir()
    shutil.copy(SHARED_C4 / SHARD, tmp_path / "en" / "c4-train.00000-of-01024.json.gz")
    with gzip.open(SHARED_C4 / SHARD, "rt") as f:
        lines = [next(f) for _ in range(50)]
    with gzip.open(tmp_path / "en" / "c4-validation.00000-of-00008.json.gz", "wt") as f:
        f.writelines(lines)
    data = load_corpus(c4_config(tiny_config, f"c4_local_path={tmp_path}", "c4_num_documents=300"))
    assert "300 train documents, 50 validation documents (validation split)" in data.description


@pytest.mark.parametrize("content,message", [
    (None, "directory not found"),
    ("", "holds no documents"),
    ('{"text": "fine", "timestamp": "x", "url": "y"}\n{"text": "broken\n', "not valid C4 JSON lines"),
    ('{"body": "no text field"}\n', "has no 'text' field"),
])
def test_bad_local_shards_give_one_line_errors(tiny_config, tmp_path, content, message):
    root = tmp_path / "c4"
    if content is not None:
        (root / "en").mkdir(parents=True)
        with gzip.open(root / "en" / "c4-train.00000-of-01024.json.gz", "wt") as f:
            f.write(content)
    with pytest.raises(DataError, match=message) as err:
        load_corpus(c4_config(tiny_config, f"c4_local_path={root}"))
    assert "\n" not in str(err.value) and str(err.value).startswith("c4_local_path:")


def test_no_shards_in_directory(tiny_config, tmp_path):
    with pytest.raises(DataError, match="no c4-train"):
        load_corpus(c4_config(tiny_config, f"c4_local_path={tmp_path}"))


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("tok") / "c4_en"
    args = ["--local_path", str(SHARED_C4), "--num_documents", "0", "--eval_documents", "60", "--seq_len", "32",
            "--tokenizer", "bpe", "--vocab_size", "512", "--cache_dir", str(cache_dir), "--num_proc", "2",
            "--output_dir", str(out)]
    assert tokenize_main(args) == 0
    return out, args


def test_tokenize_tool_writes_datasets_and_metadata(tokenized):
    out, args = tokenized
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["num_documents"] == 940 and meta["eval_documents"] == 60 and meta["seq_len"] == 32
    assert meta["eval_source"] == "held-out training documents" and meta["vocab_size"] == 512
    assert len(meta["vocab_hash"]) == 16 and "packed" in meta["layout"]
    assert (out / "train" / "dataset_info.json").is_file() and (out / "tokenizer" / "tokenizer.json").is_file()
    assert not list(out.parent.glob(".*tmp*"))  # the temporary directory was renamed away
    assert tokenize_main(args) == 2  # refuses to overwrite
    assert (out / "metadata.json").is_file()


def test_suggested_command_names_the_interpreter_as_the_guide_does(tmp_path, monkeypatch):
    import c4.tokenize_c4 as tool

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    assert tool._interpreter() == ".venv/bin/python"  # c4/guide.md's style, runnable from here
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")
    assert tool._interpreter() == "python"


def test_train_from_tokenized_c4_with_falling_loss(tokenized, tiny_config):
    out, _ = tokenized
    run_dir, summary = train(c4_config(tiny_config, f"c4_tokenized_path={out}", "tokenizer=auto", "num_outer_steps=4",
                                       "merge_frequency=0", "run_name=c4tok"))
    log = (run_dir / "training_log.log").read_text()
    assert "C4 from the tokenized dataset" in log
    import csv
    with (run_dir / "model_training_report" / "training_log.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["train_loss"]]
    first = [float(r["train_loss"]) for r in rows if r["outer_step"] == "1"]
    last = [float(r["train_loss"]) for r in rows if r["outer_step"] == "4"]
    assert max(last) < min(first)
    assert summary["final_metric"] < summary["initial_metric"]


def test_train_from_local_c4_shards(tiny_config):
    run_dir, summary = train(c4_config(tiny_config, f"c4_local_path={SHARED_C4}", "run_name=c4local"))
    assert "C4 en local shards" in (run_dir / "training_log.log").read_text()
    assert summary["final_metric"] < summary["initial_metric"]


def test_tokenized_dataset_must_match_seq_len_and_tokenizer(tokenized, tiny_config, tmp_path, cache_dir):
    out, _ = tokenized
    with pytest.raises(DataError, match="seq_len 32"):
        load_corpus(c4_config(tiny_config, f"c4_tokenized_path={out}", "tokenizer=auto", "seq_len=64"))
    with pytest.raises(DataError, match="'bpe' would train a new tokenizer"):
        load_corpus(c4_config(tiny_config, f"c4_tokenized_path={out}"))
    other = tmp_path / "other"
    assert tokenize_main(["--local_path", str(SHARED_C4), "--num_documents", "200", "--eval_documents", "20",
                          "--seq_len", "32", "--tokenizer", "bpe", "--vocab_size", "400", "--cache_dir",
                          str(cache_dir), "--output_dir", str(other)]) == 0
    with pytest.raises(DataError, match="not with the configured tokenizer"):
        load_corpus(c4_config(tiny_config, f"c4_tokenized_path={out}", f"tokenizer={other / 'tokenizer'}"))
    with pytest.raises(DataError, match="no metadata.json"):
        load_corpus(c4_config(tiny_config, f"c4_tokenized_path={tmp_path}"))


def test_hub_path_fails_fast_when_offline(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    start = time.time()
    with pytest.raises(DataError, match="unreachable"):
        stream_hub_c4("en", 10, 10)
    assert time.time() - start < 10
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="HF_HUB_OFFLINE"):
        stream_hub_c4("en", 10, 10)


def test_tokenize_tool_offline_names_its_own_flags(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert tokenize_main(["--hub", "--num_documents", "10", "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--hub:" in err and "--local_path" in err and "c4_local_path" not in err  # not run.py's config keys
    assert not (tmp_path / "out").exists()


def test_run_with_hub_c4_exits_2_quickly_when_offline(tmp_path, cache_dir):
    env = {**__import__("os").environ, "HF_ENDPOINT": "http://127.0.0.1:9"}
    start = time.time()
    proc = subprocess.run([sys.executable, "run.py", "dataset=c4", f"log_dir={tmp_path}", f"cache_dir={cache_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "Hub" in proc.stderr and "Traceback" not in proc.stderr
    assert time.time() - start < 60


def test_paper_and_cpu_configs_are_valid():
    from utils.config import load_config

    paper = load_config(ROOT / "configs" / "paper_microllama_c4.yaml")
    assert (paper.num_outer_steps, paper.num_inner_steps, paper.lr_inner, paper.lr_outer) == (20, 200, 2e-5, 0.5)
    assert (paper.nodes_per_gpu, paper.num_init_trainers, paper.initial_batch_size) == (4, 4, 1)
    assert paper.merge_frequency == 3
    assert (paper.ETA, paper.vartheta, paper.nu) == (0.8, 0.01, 0.3)
    assert paper.model_config.name == "keeeeenw/MicroLlama" and paper.dataset == "c4"
    cpu = load_config(ROOT / "configs" / "cpu_c4.yaml")
    assert cpu.dataset == "c4" and cpu.c4_local_path == "../shared/data/c4"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_tokenize_tool_leaves_nothing_behind(tmp_path, cache_dir, signum):
    """A real signal while the tool writes its temporary directory: one line, exit 128 + signal, no traceback,
    no hidden temporary directory, no output directory."""
    out = tmp_path / "c4_tok"
    script = ("import sys, time\n"
              f"sys.path.insert(0, {str(ROOT)!r})\n"
              "import datasets\n"
              "real = datasets.Dataset.save_to_disk\n"
              "def slow(self, *a, **k):\n"
              "    real(self, *a, **k)\n"
              "    print('writing', flush=True)\n"
              "    time.sleep(60)\n"
              "datasets.Dataset.save_to_disk = slow\n"
              "from c4.tokenize_c4 import main\n"
              f"sys.exit(main(['--local_path', {str(SHARED_C4)!r}, '--num_documents', '100', '--eval_documents', '10',"
              f" '--seq_len', '32', '--tokenizer', 'bpe', '--vocab_size', '512', '--cache_dir', {str(cache_dir)!r},"
              f" '--output_dir', {str(out)!r}]))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "writing"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".c4_tok.tmp-")]  # mid-write
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum
    assert err.strip().splitlines()[-1] == f"interrupted by {signal.Signals(signum).name}; nothing was written to {out}"
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
