"""Bad input answered in one line: each case a new user met, reproduced and checked.

Every case must end in a one-line error with a non-zero exit (or behave correctly), before any
expensive work where the input allows, without a traceback, and without losing anything written.
"""

import gzip
import http.server
import json
import logging
import shutil
import socket
import threading
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from fabrics.c4_data import load_local_c4
from run import main, train
from run_dir.claim import make_run_dir
from run_dir.run_state import in_use
from tests.conftest import ROOT, TINY
from utils.config import load_config
from utils.errors import ConfigError, DataError, UserError

SHARD = ROOT.parent / "shared" / "data" / "c4" / "c4-train.00000-of-01024.first1000.json.gz"


def error_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("error:")]


# ----------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("key", ["lr_inner", "padding_percentage", "memory_sample_interval_s", "clearml_timeout_s",
                                 "ETA"])
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan"])
def test_non_finite_numbers_are_refused(key, value):
    with pytest.raises(ConfigError, match=f"'{key}': expected a finite number"):
        load_config(ROOT / "config.yaml", [f"{key}={value}"])


@pytest.mark.parametrize("override, key", [
    ("run_name=../../x", "run_name"), ("run_name=/tmp/abs", "run_name"), ("run_name=a/b", "run_name"),
    ("run_name=..", "run_name"), ("log_file=../x.log", "log_file"), ("log_file=", "log_file"),
    ("log_file=/tmp/x.log", "log_file"), (f"run_name={'r' * 300}", "run_name"), ("log_dir=", "log_dir"),
    ('run_name="a\\nb"', "run_name"), ("log_file=model_weights", "log_file"), ("log_file=config.yaml", "log_file"),
])
def test_paths_stay_in_their_place(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(ROOT / "config.yaml", [override])


@pytest.mark.parametrize("override, key, words", [
    ("topk_fraction=0", "topk_fraction", "is not in (0, 1]"), ("topk_fraction=1.5", "topk_fraction", "(0, 1]"),
    ("topk_fraction=-0.1", "topk_fraction", "(0, 1]"),
    ("statistics_sketch_dim=0", "statistics_sketch_dim", "below the minimum 1"),
    ("outer_compression=int4", "outer_compression", "int8"), ("statistics_comm=fp16", "statistics_comm", "sketch"),
    ("merge_compression=topk", "merge_compression", "int8"),
    ("num_inner_steps=20 sync_fragments=2 sync_delay=10", "sync_delay",
     "below num_inner_steps / sync_fragments = 20 / 2"),
    ("num_inner_steps=5 sync_fragments=2 sync_delay=2", "sync_delay", "(rounded down: 2)"),
    ("num_inner_steps=3 sync_fragments=4", "sync_fragments", "need at least as many inner steps"),
    ("num_inner_steps=20 sync_fragments=5", "sync_fragments", "model 'microllama-tiny' has 4 layers"),
    ("sync_delay=-1", "sync_delay", "below the minimum 0"),
    ("fragment_alpha=-0.1", "fragment_alpha", "[0, 1] (the weight of the local copy)"),
    ("fragment_alpha=1.5", "fragment_alpha", "[0, 1]"),
])
def test_bad_communication_settings_stop_in_one_line_before_any_work(override, key, words, tmp_path, capsys):
    assert_refused_before_any_work(override.split(), key, words, tmp_path, capsys)


def assert_refused_before_any_work(overrides: list[str], key: str, words: str, tmp_path, capsys) -> None:
    """run.py with these overrides: exit 2, one error line naming `key` and saying `words`, nothing made."""
    logs = tmp_path / "logs"
    assert main(["--config", str(ROOT / "config.yaml"), f"log_dir={logs}", "clearml_mode=off", *overrides]) == 2
    (line,) = error_lines(capsys)
    assert f"'{key}'" in line and words in line, line
    assert not logs.exists()  # nothing was made


def test_duplicate_yaml_keys_and_bad_encoding(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("lr_inner: 1.0e-3\nnum_outer_steps: 2\nlr_inner: 2.0e-3\n")
    with pytest.raises(ConfigError, match="'lr_inner': appears twice .*line 3"):
        load_config(dup)
    nested = tmp_path / "nested.yaml"
    nested.write_text("model_config:\n  name: microllama-tiny\n  name: microllama-mini\n")
    with pytest.raises(ConfigError, match="'name': appears twice"):
        load_config(nested)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("task_name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match="^--config: .* is not UTF-8 text"):  # a flag, not a config key
        load_config(latin)
    with pytest.raises(UserError, match="^--config: file not found: "):
        load_config(tmp_path / "missing.yaml")


def test_log_dir_expands_home_and_run_names_are_unique(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    claimed = [make_run_dir("~/runs", "", "microllama-tiny", "embedded") for _ in range(3)]  # the same second
    dirs = {d for d, lock in claimed}
    assert all(lock.held for _, lock in claimed)
    assert len(dirs) == 3 and all(d.parent == tmp_path / "home" / "runs" for d in dirs)
    assert not (tmp_path / "~").exists()
    (tmp_path / "home" / "runs" / "a_file").write_text("x")
    with pytest.raises(UserError, match="run_name: .*a_file exists and is not a directory"):
        make_run_dir("~/runs", "a_file", "m", "d")
    blocker = tmp_path / "plain_file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="log_dir: cannot create a run directory in .*plain_file"):
        make_run_dir(str(blocker / "logs"), "", "m", "d")


def test_command_line_mistakes_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--resume"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == "error: argument --resume: expected one argument (see python run.py --help)"


def test_a_cache_dir_that_is_a_file_costs_only_the_cache(tmp_path, capsys, cache_dir):
    """A cache is a speed-up: cache_dir naming a plain file is one warning line (the key and the reason), and the
    run goes on with what it builds in memory; the file is left as it was."""
    blocker = tmp_path / "plain_file"
    blocker.write_text("x")
    args = ["--config", str(ROOT / "config.yaml"), *TINY, "num_outer_steps=1", f"log_dir={tmp_path / 'logs'}",
            f"cache_dir={blocker}", "run_name=blocked"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    log = (tmp_path / "logs" / "blocked" / "training_log.log").read_text()
    (line,) = [x for x in log.splitlines() if "could not cache" in x]
    assert f"cache_dir {blocker}: could not cache" in line and "Not a directory" in line
    assert blocker.read_text() == "x"


def test_unwritable_log_dir_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "plain_file"
    blocker.write_text("keep me")
    assert main(["--config", str(ROOT / "config.yaml"), f"log_dir={blocker}/logs", "clearml_mode=off"]) == 2
    (line,) = error_lines(capsys)
    assert "log_dir: cannot create a run directory" in line and str(blocker) in line
    assert blocker.read_text() == "keep me"


def test_a_failed_run_logs_its_error_and_never_blocks_a_retry(tiny_config, tmp_path, capsys):
    shard = tmp_path / "c4" / "en" / "c4-train.00000-of-01024.json.gz"  # only reading it shows the damage
    shard.parent.mkdir(parents=True)
    shard.write_bytes(SHARD.read_bytes()[: SHARD.stat().st_size // 2])
    cfg = tiny_config("run_name=retry", "dataset=c4", f"c4_local_path={tmp_path / 'c4'}")
    for _ in range(2):
        with pytest.raises(DataError, match="is not a complete gzip text file"):
            train(cfg)
    log_dir = Path(cfg.log_dir)
    stubs = sorted(p.name for p in log_dir.iterdir() if p.name.startswith("retry.failed_"))
    assert len(stubs) == 1  # the first attempt's directory, moved aside and kept
    for run in (log_dir / "retry", log_dir / stubs[0]):
        assert "is not a complete gzip text file" in (run / "training_log.log").read_text()
        assert in_use(run) is None  # the lock went with the process that failed


@pytest.mark.parametrize("overrides, words", [
    (["model_config.name=microllama-huge"], "model_config.name: 'microllama-huge' is neither a preset"),
    (["model_config.name=./no/such/model", "model_config.pretrained=true"],
     "model_config.name: ./no/such/model is not a Hugging Face model directory"),
    (["dataset=c4", "c4_local_path={tmp}/missing"], "c4_local_path: directory not found"),
    (["dataset=c4", "c4_tokenized_path={tmp}/tokenized", "seq_len=32"],
     "was packed with seq_len 64, the config asks for seq_len 32"),
    (["model_type=bert", "dataset=imdb", "model_config.name=bert-tiny", "imdb_local_path={tmp}/missing"],
     "imdb_local_path: directory not found"),
    (["run_name=taken"], "holds a run with checkpoints; continue it with `python run.py --resume"),
])
def test_input_errors_arrive_before_any_data_is_loaded(tmp_path, capsys, monkeypatch, overrides, words):
    """No corpus loading, no tokenizer training, no run directory: one line and exit 2."""
    import fabrics.corpus

    def no_data(cfg):
        raise AssertionError("data was loaded before the input was checked")

    monkeypatch.setattr(fabrics.corpus, "load_corpus", no_data)
    tokenized = tmp_path / "tokenized"
    tokenized.mkdir()
    (tokenized / "metadata.json").write_text(json.dumps({"seq_len": 64, "tokenizer": "x"}))
    logs = tmp_path / "logs"
    (logs / "taken" / "model_weights" / "outer_step_0001").mkdir(parents=True)
    (logs / "taken" / "model_weights" / "outer_step_0001" / "manifest.json").write_text("{}")
    before = sorted(p.name for p in logs.iterdir())
    args = [o.format(tmp=tmp_path) for o in overrides]
    assert main(["--config", str(ROOT / "config.yaml"), f"log_dir={logs}", "clearml_mode=off", *args]) == 2
    (line,) = error_lines(capsys)
    assert words in line
    assert sorted(p.name for p in logs.iterdir()) == before  # no run directory was made


def test_devices_and_model_limits_are_checked_before_any_data_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    base = ["--config", str(ROOT / "config.yaml"), f"log_dir={tmp_path}", "clearml_mode=off"]
    assert main([*base, "devices=[cuda, cuda]"]) == 2
    (line,) = error_lines(capsys)
    assert "'devices': 'cuda' needs CUDA" in line
    assert main([*base, "seq_len=4096"]) == 2
    (line,) = error_lines(capsys)
    assert "'seq_len': 4096 is above the 1024 positions of model 'microllama-tiny'" in line
    assert not any(tmp_path.iterdir())  # nothing was started


def test_unexpected_errors_are_one_line_with_the_traceback_in_the_log(tiny_config, tmp_path, capsys, monkeypatch):
    import cluster

    def broken(self):
        raise RuntimeError("something nobody foresaw")

    monkeypatch.setattr(cluster.ClusterController, "train", broken)
    args = [*TINY, f"cache_dir={tiny_config().cache_dir}", f"log_dir={tmp_path}", "run_name=bug"]
    assert main(["--config", str(ROOT / "config.yaml"), *args]) == 1
    (line,) = error_lines(capsys)
    assert line.startswith("error: internal error (RuntimeError: something nobody foresaw); traceback in")
    log_text = (tmp_path / "bug" / "training_log.log").read_text()
    assert "Traceback" in log_text and "something nobody foresaw" in log_text


# ----------------------------------------------------------------------------------------------
# Memory probe


def test_default_device_memory_shares_half_the_available_memory_up_to_a_bound(monkeypatch):
    import cluster.max_batch_calculator as mbc

    memory = namedtuple("memory", "available total")
    monkeypatch.setattr(mbc.psutil, "virtual_memory", lambda: memory(2 << 30, 64 << 30))
    assert mbc.default_device_memory_mb(2) == 512.0  # half of 2 GiB available, over 2 devices
    monkeypatch.setattr(mbc.psutil, "virtual_memory", lambda: memory(48 << 30, 64 << 30))
    assert mbc.default_device_memory_mb(2) == 1024.0  # a big machine: bounded, so no-key runs stay laptop-sized
    assert load_config(ROOT / "config.yaml", ["device_memory_mb=0"]).device_memory_mb == 0.0


def test_the_probe_never_allocates_past_its_budget(monkeypatch, tiny_config):
    import cluster.max_batch_calculator as mbc
    from fabrics.models import build_model
    from trainers import DiLoCoTrainer

    cfg = tiny_config()
    model = build_model(cfg, 512, 1)
    make_optimizer = DiLoCoTrainer.inner_optimizer_factory(cfg)
    static = mbc._static_bytes(model, make_optimizer, cfg.seq_len)
    per_sequence = mbc._activation_bytes(model, cfg.seq_len, 2) - mbc._activation_bytes(model, cfg.seq_len, 1)
    budget = static + mbc._activation_bytes(model, cfg.seq_len, 1) + 10.5 * per_sequence  # room for ~11
    measured = []
    real = mbc._activation_bytes

    def spy(model, seq_len, batch):
        measured.append(batch)
        return real(model, seq_len, batch)

    monkeypatch.setattr(mbc, "_activation_bytes", spy)
    found = mbc.cpu_max_batch(model, make_optimizer, cfg.seq_len, budget, upper=4096)
    assert found == 11
    # no forward pass ran at a batch whose activations exceed the budget (the old search tried 16)
    assert max(measured) == 11 and all(static + real(model, cfg.seq_len, b) <= budget for b in measured)


def test_the_probe_counts_a_saved_weight_once(tiny_config):
    """The static bytes hold the parameters; a layer's forward saves its weight for backward, the very same storage.
    By hand: every layer but the input embedding (which saves the token ids, not its table) saves its weight, so
    the activations count exactly those parameters' bytes fewer than everything autograd saves. The probe once
    counted them twice (for the tiny model at batch 1, two thirds of what it counted were weights), so a budget
    that held k sequences was judged to hold fewer (no committed config's max batch changed: default, compare,
    warm, c4, paper shape, nano).
    Then a budget with room for exactly 3 sequences (and a byte to spare) gives 3; the double count gave 0 (not
    even one sequence: the run refused to start)."""
    import cluster.max_batch_calculator as mbc
    from fabrics.models import build_model
    from trainers import DiLoCoTrainer

    cfg = tiny_config()
    model = build_model(cfg, 512, 1)
    everything = mbc.saved_bytes(lambda: model(**mbc._batch(model, cfg.seq_len, 1, "cpu")))
    saved_weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                        if name != "model.embed_tokens.weight")
    assert mbc._activation_bytes(model, cfg.seq_len, 1) == everything - saved_weights > 0

    make_optimizer = DiLoCoTrainer.inner_optimizer_factory(cfg)
    budget = mbc._static_bytes(model, make_optimizer, cfg.seq_len) + mbc._activation_bytes(model, cfg.seq_len, 3) + 1
    assert saved_weights > 1 and mbc.cpu_max_batch(model, make_optimizer, cfg.seq_len, budget, upper=4096) == 3


def test_the_probe_counts_the_optimizer_state_of_every_parameter(tiny_config):
    """The probes hand the optimizer factory model.parameters(), a generator: every parameter gets its AdamW
    state. By hand, n fp32 numbers in t tensors: parameters, gradients, exp_avg and exp_avg_sq (16 n bytes) and
    one fp32 step count per tensor (4 t). The factory once read the generator to pick the fused kernel and
    handed AdamW what was left: no state for the first tensor (the embedding), and on CUDA no parameters at all
    (found by the first GPU check, 2026-11-26)."""
    import cluster.max_batch_calculator as mbc
    from fabrics.models import build_model
    from trainers import DiLoCoTrainer

    cfg = tiny_config()
    model = build_model(cfg, 512, 1)
    make_optimizer = DiLoCoTrainer.inner_optimizer_factory(cfg)
    params = list(model.parameters())
    n, t = sum(p.numel() for p in params), len(params)
    assert mbc._static_bytes(model, make_optimizer, cfg.seq_len) == 16 * n + 4 * t
    optimizer = make_optimizer(p for p in params)
    assert [p for group in optimizer.param_groups for p in group["params"]] == params


def test_the_cuda_probe_predicts_a_candidate_from_the_two_largest_batches_measured():
    """By hand, on the peaks (MB above the start) the first GPU check measured for the 0.87M-parameter model:
    flat from 1 to 2 (the optimizer step dominates), then 1.7 MB per sequence. From 8 and 16 the line
    puts 64 at 37.5 + 48 x 13.5 / 8 = 118.5 MB, over a 67 MB budget, so it is not run; the line through 1 and 2
    (14.0 + 63 x 0.1 = 20.3) had let it run, at 120 MB."""
    from cluster.max_batch_calculator import extrapolated_peak

    peaks = {1: 14.0, 2: 14.1, 4: 17.2, 8: 24.0, 16: 37.5}
    assert extrapolated_peak({}, 1) == 0.0 and extrapolated_peak({1: 14.0}, 2) == 0.0  # run before two are known
    assert extrapolated_peak(peaks, 4) == pytest.approx(14.1 + 0.1 * 2)
    assert extrapolated_peak(peaks, 64) == pytest.approx(37.5 + 48 * 13.5 / 8)
    assert extrapolated_peak(peaks, 12) == pytest.approx(24.0 + 4 * 6.8 / 4)  # between: from 4 and 8, below it


# ----------------------------------------------------------------------------------------------
# Data


def test_a_truncated_shard_is_one_line(tmp_path):
    shard = tmp_path / "en" / "c4-train.00000-of-01024.json.gz"
    shard.parent.mkdir()
    shard.write_bytes(SHARD.read_bytes()[: SHARD.stat().st_size // 2])
    with pytest.raises(DataError, match="c4-train.00000-of-01024.json.gz is not a complete gzip text file"):
        load_local_c4(tmp_path, "en", 100)


def test_documents_without_text_are_skipped(tmp_path, caplog):
    shard = tmp_path / "c4-train.00000-of-01024.json.gz"
    lines = [{"text": "first document", "url": "a"}, {"text": None, "url": "b"}, {"text": "", "url": "c"},
             {"text": "second document", "url": "d"}]
    with gzip.open(shard, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    with caplog.at_level(logging.WARNING):
        train_docs, val_docs = load_local_c4(tmp_path, "en", 0)
    assert train_docs["text"] == ["first document", "second document"] and val_docs is None
    assert "2 of 4 documents have no text" in caplog.text


def test_val_size_beyond_the_data_fails_before_training_a_tokenizer(tiny_config, monkeypatch):
    import fabrics.dataset_loader as loader
    from fabrics.corpus import load_corpus

    monkeypatch.setattr(loader, "_train_bpe", lambda *a: pytest.fail("a tokenizer was trained"))
    with pytest.raises(DataError, match="val_size: 100000 validation sequences .* lower val_size"):
        load_corpus(tiny_config("val_size=100000"))


# ----------------------------------------------------------------------------------------------
# ClearML


class NotClearML(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"<html>a web page</html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_clearml_falls_back_offline_with_the_right_reason(monkeypatch, caplog):
    from training_logs.clearml_tracker import resolve_mode, server_problem

    server = http.server.HTTPServer(("127.0.0.1", 0), NotClearML)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = f"http://127.0.0.1:{server.server_port}"
        monkeypatch.setenv("CLEARML_API_HOST", api)
        monkeypatch.setenv("CLEARML_API_ACCESS_KEY", "key")
        monkeypatch.setenv("CLEARML_API_SECRET_KEY", "secret")
        monkeypatch.delenv("CLEARML_OFFLINE_MODE", raising=False)
        with caplog.at_level(logging.WARNING):
            assert resolve_mode("online", 2.0) == "offline"
        assert "answered HTTP 200, but is not a ClearML API server" in caplog.text
    finally:
        server.shutdown()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    problem = server_problem(f"http://127.0.0.1:{closed}", 5.0)
    assert problem == "could not be reached (refused the connection)"


# ----------------------------------------------------------------------------------------------
# gradient_analysis


def test_gradient_analysis_names_what_is_wrong_with_a_model_directory(tmp_path, tiny_config, capsys):
    from fabrics.models import build_model
    from gradient_analysis.gradient_analysis import main as analysis_main

    model_dir = tmp_path / "final_model"
    build_model(tiny_config(), 512, 1).save_pretrained(model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert analysis_main([f"checkpoint_path={model_dir}"]) == 2
    (line,) = error_lines(capsys)
    assert "model.safetensors is not a readable safetensors file" in line
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    shutil.copy(weights, no_config / "model.safetensors")
    assert analysis_main([f"checkpoint_path={no_config}"]) == 2
    (line,) = error_lines(capsys)
    assert "has no config.json, so it is not a Hugging Face model directory" in line
    # a checkpoint that is not there: what is there instead, before any data work
    final = tmp_path / "run" / "model_weights" / "final"
    (final / "final_model").mkdir(parents=True)
    (final / "trainer_2.safetensors").write_bytes(b"")
    assert analysis_main([f"checkpoint_path={final / 'trainer_0.safetensors'}"]) == 2
    (line,) = error_lines(capsys)
    assert "trainer_0.safetensors does not exist;" in line and "holds: final_model/, trainer_2.safetensors" in line


def test_imdb_without_a_local_copy_gives_imdb_advice(tiny_config, monkeypatch):
    from fabrics.imdb_data import load_imdb_splits

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="set imdb_local_path to a copy of stanfordnlp/imdb") as err:
        load_imdb_splits(tiny_config("model_type=bert", "dataset=imdb", "model_config.name=bert-tiny"))
    assert "c4" not in str(err.value)


def test_the_cpu_probe_frees_what_it_measured(tiny_config):
    """Every activation a probe pass saw is freed when the pass ends: a leaked pass at the budget used to
    keep the whole budget alive (an autograd cycle no collector frees), so a big budget grew RSS by GBs."""
    import weakref

    import torch

    from cluster.max_batch_calculator import _activation_bytes
    from fabrics.models import build_model

    model = build_model(tiny_config(), 512, 1)
    model.train()
    outputs = []

    def keep(module, args, output):
        for t in output if isinstance(output, tuple) else (output,):
            if isinstance(t, torch.Tensor):
                outputs.append(weakref.ref(t))

    handles = [m.register_forward_hook(keep) for m in model.modules() if not list(m.children())]
    assert _activation_bytes(model, 32, 4) > 0
    for h in handles:
        h.remove()
    assert len(outputs) > 10
    alive = [r for r in outputs if r() is not None]
    assert alive == []


def test_a_sketch_too_large_for_the_machine_is_refused_before_any_work(tmp_path, capsys):
    """statistics_sketch_dim 1e11: each node's sketch would need 1.5 TB; refused at startup (exit 2, one line), not
    found by training as a node fault with a resumable checkpoint that fails the same way on every resume."""
    assert_refused_before_any_work(["statistics_comm=sketch", "statistics_sketch_dim=100000000000"],
                                   "statistics_sketch_dim", "each node's sketch of its gradient samples needs 1.49e+03 "
                                   "GiB", tmp_path, capsys)


def test_a_sketch_too_small_to_measure_anything_is_warned_about(tiny_config):
    (warning,) = tiny_config("statistics_comm=sketch", "statistics_sketch_dim=1").warnings()
    assert warning.startswith("statistics_sketch_dim 1: the sketch's estimates err by about sqrt(2/k) = 141% each")
    assert "use at least 16" in warning
    assert tiny_config("statistics_comm=sketch", "statistics_sketch_dim=16").warnings() == []
    assert tiny_config("statistics_comm=fp64", "statistics_sketch_dim=1").warnings() == []  # no sketch: no warning


def test_fragment_alpha_one_is_warned_about(tiny_config):
    (warning,) = tiny_config("fragment_alpha=1.0").warnings()
    assert "never take their trainer's" in warning and "0 takes the global weights" in warning
    assert tiny_config("fragment_alpha=0.5", "sync_fragments=3").warnings() == []


def test_a_node_schedule_event_after_the_last_outer_step_is_warned_about(tiny_config):
    cfg = tiny_config("num_outer_steps=3", "devices=[cpu, cpu]", "node_schedule=[{node: 1, leave: 2}, "
                      "{node: 2, slowdown: 2, from: 4}, {node: 3, leave: 5, return: 6}]")
    assert cfg.warnings() == [
        "node_schedule[1]: node 2 slows down at outer step 4, after the run's last (3): it will never happen (unless "
        "the run is extended: --resume RUN num_outer_steps=N)",
        "node_schedule[2]: node 3 leaves at outer step 5, after the run's last (3): it will never happen (unless "
        "the run is extended: --resume RUN num_outer_steps=N)"]
