"""ClearML (offline session read back), TensorBoard read back, memory monitor, step-loss log,
plots, and loggers hammered from many threads."""

import csv
import glob
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from run import train
from tests.conftest import ROOT, TINY
from training_logs.memory_monitor import MemoryMonitor
from training_logs.trackers import JsonlTracker, Tracker
from training_logs.training_monitoring import TrainingLogger


def clearml_env(tmp_path, **extra):
    conf = tmp_path / "clearml.conf"
    conf.write_text("sdk { development { report_use_subprocess: false } }\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLEARML")}
    env.update(CLEARML_CACHE_DIR=str(tmp_path / "clearml_cache"), CLEARML_CONFIG_FILE=str(conf), HOME=str(tmp_path),
               **extra)
    return env


def run_cli(tmp_path, cache_dir, env, *overrides, timeout=300):
    args = [*TINY, f"cache_dir={cache_dir}", f"log_dir={tmp_path / 'logs'}", "run_name=r", *overrides]
    start = time.time()
    proc = subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, time.time() - start


def read_offline_session(tmp_path):
    [folder] = glob.glob(str(tmp_path / "clearml_cache" / "offline" / "offline-*[!p]"))
    events = []
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            events += json.loads(line)
    task = json.load(open(os.path.join(folder, "task.json")))
    return folder, events, task


def test_clearml_offline_session_holds_every_scalar_once(tmp_path, cache_dir):
    env = clearml_env(tmp_path, CLEARML_OFFLINE_MODE="1")
    proc, _ = run_cli(tmp_path, cache_dir, env, "clearml_mode=auto", "num_outer_steps=3", "plot_every=2")
    folder, events, task = read_offline_session(tmp_path)
    assert os.path.isfile(folder + ".zip") and "import-offline-session" in proc.stdout + proc.stderr
    assert f"{sys.executable} -m training_logs.clearml_tracker" in proc.stdout + proc.stderr  # not a bare python
    assert "config (as config.yaml records it)" not in proc.stdout + proc.stderr  # the log file's only
    # the import command it prints, with no server configured: one line saying what is missing and how to set it up
    imported = subprocess.run([sys.executable, "-m", "training_logs.clearml_tracker", str(tmp_path / "logs" / "r")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert imported.returncode == 1 and len(imported.stderr.strip().splitlines()) == 1, imported.stderr[-2000:]
    assert "no ClearML server is configured" in imported.stderr and "clearml-init" in imported.stderr
    scalars = [(e["metric"], e["variant"], e["iter"]) for e in events if e["type"] == "training_stats_scalar"]
    assert len(scalars) == len(set(scalars)), "an iteration was reported twice"
    pairs = {(m, v) for m, v, _ in scalars}
    for expected in [("val_perplexity", "trainer_0"), ("val_perplexity", "global"), ("train_loss", "trainer_1"),
                     ("requested_batch", "trainer_0"), ("loader_batch", "trainer_0"),
                     ("accumulation_steps", "trainer_0"), ("num_nodes", "trainer_0"), ("trainers_alive", "global"),
                     ("tokens_seen", "global"), ("syncs", "global"), ("rounds", "global"),
                     ("weights_traffic_bytes", "global"), ("val_perplexity_after", "merge"),
                     ("val_perplexity_best_member", "merge"),
                     ("process_rss_mib", "memory_before_round"), ("process_rss_mib", "memory_round_peak")]:
        assert expected in pairs, expected
    assert sorted({i for m, v, i in scalars if (m, v) == ("val_perplexity", "global")}) == [0, 1, 2, 3]
    # the progress bar after the merge of step 2 shows what exists then: 1 trainer, the merged model's metric
    # (tqdm counts a step when the next begins: the postfix set in step k is drawn beside "k-1/3")
    bars = {int(m.group(1)) + 1: m.group(2) for m in re.finditer(r"\| (\d)/3 \[[^\]]*?, ([^\]]*)\]", proc.stderr)}
    merged = next(e["value"] for e in events if (e.get("metric"), e.get("variant"), e.get("iter"))
                  == ("val_perplexity", "global", 2))
    assert "trainers=1" in bars[2] and f"perplexity={merged:.4g}" in bars[2], bars
    assert "trainers=2" in bars[1], bars
    images = {e["variant"] for e in events if e["type"] == "training_debug_image"}
    assert {"val_perplexity_per_trainer", "requested_batch_per_trainer", "memory_usage", "step_loss"} <= images
    artifacts = {a["key"] for a in task["execution"]["artifacts"]}
    assert {"training_log.csv", "step_loss_log.csv", "summary"} <= artifacts
    assert "config" in task["hyperparams"]
    with zipfile.ZipFile(folder + ".zip") as zf:
        assert any(name.endswith("metrics.jsonl") for name in zf.namelist())


def test_unreachable_clearml_server_falls_back_to_offline_quickly(tmp_path, cache_dir):
    silent = socket.socket()  # accepts TCP connections (backlog) but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    host = f"http://127.0.0.1:{silent.getsockname()[1]}"
    env = clearml_env(tmp_path, CLEARML_API_ACCESS_KEY="key", CLEARML_API_SECRET_KEY="secret",
                      CLEARML_API_HOST=host, CLEARML_WEB_HOST=host, CLEARML_FILES_HOST=host)
    try:
        proc, elapsed = run_cli(tmp_path, cache_dir, env, "clearml_mode=online", "clearml_timeout_s=1",
                                "num_outer_steps=1", timeout=240)
    finally:
        silent.close()
    assert "did not answer within 1 s; using an offline session" in proc.stdout + proc.stderr
    assert glob.glob(str(tmp_path / "clearml_cache" / "offline" / "*.zip"))
    assert elapsed < 120


def test_tensorboard_scalars_read_back(tiny_config):
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    run_dir, _ = train(tiny_config("run_name=tb", "tensorboard=true"))
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"trainer_0/val_perplexity", "global/val_perplexity", "global/trainers_alive",
            "memory_round_peak/process_rss_mib"} <= tags
    with (run_dir / "model_training_report" / "training_log.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["trainer_id"] == "0"]
    csv_ppl = {int(r["outer_step"]): float(r["val_perplexity"]) for r in rows}
    tb_ppl = {e.step: e.value for e in acc.Scalars("trainer_0/val_perplexity")}
    assert tb_ppl.keys() == csv_ppl.keys()
    for step, value in csv_ppl.items():
        assert tb_ppl[step] == pytest.approx(value, rel=1e-5)


def test_memory_step_loss_and_plots_of_a_run(tiny_config):
    run_dir, summary = train(tiny_config("run_name=obs", "num_outer_steps=2", "merge_frequency=2", "plot_every=2"))
    with (run_dir / "memory_report" / "memory_log.csv").open() as f:
        memory = list(csv.DictReader(f))
    stages = [(r["outer_step"], r["stage"]) for r in memory]
    assert stages == [("1", "before_round"), ("1", "round_peak"), ("1", "after_outer_step"),
                      ("2", "before_round"), ("2", "round_peak"), ("2", "after_outer_step"), ("2", "after_merge")]
    for before, peak in zip(memory[0::3], memory[1::3]):
        assert float(peak["process_rss_mib"]) >= float(before["process_rss_mib"]) > 0
    with (run_dir / "model_training_report" / "step_loss_log.csv").open() as f:
        steps = list(csv.DictReader(f))
    assert len(steps) == 2 * 2 * 3  # outer steps x nodes x inner steps
    assert {r["inner_step"] for r in steps} == {"0", "1", "2"} and all(float(r["loss"]) > 0 for r in steps)
    assert {r["learning_rate"] for r in steps} == {"0.003"}
    assert {r["micro_batch"] for r in steps if r["outer_step"] == "1"} == {"2"}  # initial_batch_size
    report = run_dir / "model_training_report"
    for name in ("val_perplexity_vs_tokens.png", "val_perplexity_vs_communication.png", "node_assignment.png",
                 "step_loss.png", "trainers_alive.png"):
        assert (report / name).stat().st_size > 5000, name
    assert (run_dir / "memory_report" / "memory_usage.png").is_file()


class _Null(Tracker):
    def log(self, metrics, step):
        pass


class _Calls(Tracker):
    def __init__(self):
        self.calls = []

    def log(self, metrics, step):
        self.calls.append((step, dict(metrics)))


def test_a_step_reaches_the_trackers_in_one_call_with_its_memory_readings(tmp_path, caplog):
    from cluster.round_driver import MergeRecord, RoundRecord

    tracker = _Calls()
    memory = MemoryMonitor(tmp_path / "mem", ["cpu"])
    logger = TrainingLogger(tmp_path / "report", tracker, memory, num_outer_steps=3)
    for stage in ("before_round", "round_peak", "after_outer_step", "after_merge"):
        memory.record(stage, 1)
    node = {"outer_step": 1, "node_id": 0, "trainer_id": 0, "compute_s": 2.0, "idle_s": 0.5}
    fault = {"outer_step": 1, "trainer_id": 0, "node_id": 1, "kind": "nan", "action": "skip", "message": "x"}
    loss = {"outer_step": 1, "trainer_id": 0, "node_id": 0, "inner_step": 0, "loss": "6.1", "micro_batch": 2,
            "accumulation_steps": 1, "learning_rate": 0.003}
    rows = [{"outer_step": 1, "trainer_id": t, "nodes": str(t), "requested_batch": 2, "loader_batch": 2,
             "next_requested_batch": 4, "accumulation_steps": 1, "train_loss": 6.0, "val_perplexity": ppl,
             "global_tokens": 64} for t, ppl in ((0, 400.0), (1, 300.0))]
    event = {"outer_step": 1, "survivor": 0, "merged": "1", "weights": "0.5000 0.5000", "metric_before": "400 300",
             "metric_weighted_before": 350.0, "metric_after": 320.0}
    record = RoundRecord(1, faults=[fault], step_losses=[loss], node_times=[node], rows=rows, trainers_alive=1,
                         merge=MergeRecord(0, [0, 1], [100], 320.0, event), counted=True)
    with caplog.at_level(logging.INFO):
        best = logger.log_step(record)
    [(step, scalars)] = tracker.calls  # the round's files, the step's rows and the readings taken during it, together
    assert step == 1 and scalars["node_0/compute_s"] == 2.0 and scalars["node_0/idle_s"] == 0.5
    assert scalars["global/node_faults"] == 1.0 and scalars["merge/val_perplexity_after"] == 320.0
    assert {k.split("/")[0] for k in scalars if k.startswith("memory")} == {
        "memory_before_round", "memory_round_peak", "memory_after_outer_step", "memory_after_merge"}
    assert best == scalars["global/val_perplexity"] == 320.0 and not memory.pending  # the merged model, alive after it
    assert ("[outer 1/3] trainers 2 | T0 nodes [0] req 2 loader 2x1 loss 6.000 perplexity 400 -> req 4 | "
            "T1 nodes [1] req 2 loader 2x1 loss 6.000 perplexity 300 -> req 4 | "
            "merged T1 into T0 (weights 0.5000 0.5000; perplexity 400 300 -> 320)") in caplog.messages
    # a step that failed in its round: the round's files and scalars, no rows, no console line
    memory.record("before_round", 2)
    failed = RoundRecord(2, faults=[{**fault, "outer_step": 2, "action": "stop"}])
    assert logger.log_step(failed) is None
    assert tracker.calls[1][0] == 2 and tracker.calls[1][1]["global/node_faults"] == 2.0
    assert "memory_before_round/process_rss_mib" in tracker.calls[1][1]
    memory.record("before_round", 3)  # a step that failed before anything of it was logged: sent at the close
    logger.close()
    assert tracker.calls[2][0] == 3 and set(tracker.calls[2][1]) == {
        f"memory_before_round/{k}" for k in ("process_rss_mib", "system_used_mib", "system_available_mib")}
    with (tmp_path / "report" / "node_clock.csv").open() as f:
        assert [r["compute_s"] for r in csv.DictReader(f)] == ["2"]
    with (tmp_path / "report" / "step_loss_log.csv").open() as f:
        assert [r["loss"] for r in csv.DictReader(f)] == ["6.1"]
    with (tmp_path / "report" / "training_log.csv").open() as f:
        assert [(r["outer_step"], r["trainer_id"], r["trainers_alive"]) for r in csv.DictReader(f)] == [
            ("1", "0", "1"), ("1", "1", "1")]
    with (tmp_path / "report" / "fault_events.csv").open() as f:
        assert [r["action"] for r in csv.DictReader(f)] == ["skip", "stop"]


def test_loggers_hammered_from_many_threads_lose_and_duplicate_nothing(tmp_path):
    jsonl = JsonlTracker(tmp_path / "metrics.jsonl")
    logger = TrainingLogger(tmp_path / "report", _Null(), MemoryMonitor(tmp_path / "mem", ["cpu"]))
    threads, per_thread = 16, 200

    def work(t):
        for i in range(per_thread):
            logger.log_step(SimpleNamespace(
                outer_step=i, comm=None, faults=[], node_times=None, inner_evals=[],
                step_losses=[{"outer_step": t, "trainer_id": t, "node_id": i, "inner_step": 0, "loss": 1.0,
                              "micro_batch": 1, "accumulation_steps": 1, "learning_rate": 0.1}],
                counted=True, merge=None, trainers_alive=1,
                rows=[{"outer_step": i, "trainer_id": t, "nodes": "0", "requested_batch": 1, "loader_batch": 1,
                       "next_requested_batch": 1, "accumulation_steps": 1, "train_loss": 1.0, "val_perplexity": 2.0,
                       "global_tokens": 0, "syncs": 0, "weights_traffic_bytes": 0}]))
            jsonl.log({"thread": float(t), "i": float(i)}, i)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    jsonl.close()
    with (tmp_path / "report" / "step_loss_log.csv").open() as f:
        rows = [(r["trainer_id"], r["node_id"]) for r in csv.DictReader(f)]
    assert len(rows) == len(set(rows)) == threads * per_thread
    lines = [json.loads(line)["metrics"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len({(m["thread"], m["i"]) for m in lines}) == len(lines) == threads * per_thread
    with logger.csv_path.open() as f:
        rows = [(r["trainer_id"], r["outer_step"]) for r in csv.DictReader(f)]
    assert len(rows) == len(set(rows)) == threads * per_thread


def test_perplexity_axes_are_readable():
    """A decade or more: log scale with labelled 1-2-3-5 ticks (the final value can be read); less: linear."""
    import matplotlib.pyplot as plt

    from training_logs.plots import readable_y

    fig, ax = plt.subplots()
    values = [4100.0, 1500.0, 700.0, 326.5]
    ax.plot(range(4), values)
    readable_y(ax, values)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() if ax.get_ylim()[0] <= t.get_position()[1] <= ax.get_ylim()[1]]
    assert ax.get_yscale() == "log" and {"500", "1000", "2000"} <= set(labels)
    assert any(label in ("300", "400") for label in labels)  # a label near the final value
    fig, ax = plt.subplots()
    readable_y(ax, [523.5, 190.2])
    assert ax.get_yscale() == "linear"
    plt.close("all")


@pytest.mark.parametrize("mode", ["auto", "offline"])
def test_clearml_with_an_unwritable_home_says_how_to_run_without_it(tmp_path, cache_dir, mode):
    """HOME on a read-only file system: ClearML cannot keep its session. auto goes on without it, saying so;
    an explicit mode stops before training with one line that names clearml_mode=off."""
    from tests.conftest import small_filesystem

    env = {**os.environ, "HOME": str(tmp_path / "home")}
    env.pop("CLEARML_CONFIG_FILE", None)
    with small_filesystem(tmp_path / "home", 1 << 20, read_only=True):
        proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *TINY, f"cache_dir={cache_dir}",
                               f"log_dir={tmp_path / 'logs'}", "run_name=ro", "num_outer_steps=1",
                               f"clearml_mode={mode}"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out
    if mode == "auto":
        assert proc.returncode == 0, out[-2000:]
        assert "ClearML could not start (" in out and "this run goes on without ClearML" in out
        assert (tmp_path / "logs" / "ro" / "summary.json").is_file()
    else:
        assert proc.returncode == 2
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error: config key 'clearml_mode': ClearML could not start (") and \
            "run without it with clearml_mode=off" in last, last


def test_the_best_model_line_is_the_model_alive_after_each_merge(tmp_path):
    """At a merge step, training_log.csv scores the trainers before the merge; the bold line (and the
    trackers' global metric) must show what exists after it: the merged model, not an absorbed parent."""
    import shutil

    import matplotlib.figure

    from training_logs.alive import best_alive, models_alive
    from training_logs.plots import plot_training

    # hand-computed: T2 (the best, 0.5) is absorbed into T0; the merged model scores 0.8, T1 stays at 2.0
    assert models_alive({"0": 1.0, "1": 2.0, "2": 0.5},
                        [{"survivor": "0", "merged": "2", "metric_after": "0.8"}]) == {"0": 0.8, "1": 2.0}
    assert models_alive({0: 1.0, 1: 2.0}, []) == {"0": 1.0, "1": 2.0}

    # a recorded run: at step 6 trainer 2 (432.426 before the merge) is absorbed into trainer 0; the merged
    # model scores 432.32, and it is the only model left. At step 2 the merged T0 (451.464) is worse than T2.
    report = tmp_path / "report"
    shutil.copytree(ROOT / "tests/fixtures/priced_runs/adloco_seed1/model_training_report", report)
    rows = [r for r in csv.DictReader((report / "training_log.csv").open()) if r["val_perplexity"]]
    merges = list(csv.DictReader((report / "merge_events.csv").open()))
    best = best_alive(rows, merges, "val_perplexity", higher_is_better=False)
    assert best[6][1] == pytest.approx(432.32) and best[6][0]["trainer_id"] == "0"
    assert best[2][1] == pytest.approx(451.283) and best[2][0]["trainer_id"] == "2"

    drawn: dict[str, list] = {}
    original = matplotlib.figure.Figure.savefig

    def record(fig, path, *args, **kwargs):  # the figure's own data, read back as it is saved
        drawn[Path(path).name] = [line for ax in fig.axes for line in ax.get_lines()]
        return original(fig, path, *args, **kwargs)

    matplotlib.figure.Figure.savefig = record
    try:
        plot_training(report / "training_log.csv", report / "merge_events.csv", report)
    finally:
        matplotlib.figure.Figure.savefig = original
    bold = next(line for line in drawn["val_perplexity_per_trainer.png"] if line.get_label() == "best model alive")
    assert dict(zip(bold.get_xdata(), bold.get_ydata()))[6] == pytest.approx(432.32)
    communication = [line for line in drawn["val_perplexity_vs_communication.png"] if line.get_linewidth() == 2]
    assert len(communication) == 3 and all(line.get_ydata()[6] == pytest.approx(432.32) for line in communication)


def test_older_files_are_read_and_resumed_under_the_traffic_names_that_say_what_they_count(tmp_path):
    """summary.json and training_log.csv once called the weights' traffic bytes_communicated, while a run's final
    line "MB communicated" also counts the batch test's statistics, and the total bytes_needed. Files of older
    versions are read, and an older run is resumed, under weights_traffic_bytes and total_traffic_bytes."""
    from run_dir.lifecycle import sent_line
    from run_dir.past import value_of
    from training_logs.csv_files import start_csv
    from training_logs.records import TrainerRow, columns, read_records

    fixture = ROOT / "tests" / "fixtures" / "priced_runs" / "adloco_seed1"  # written before 2026-11-24
    rows = read_records(fixture / "model_training_report" / "training_log.csv", TrainerRow)
    summary = json.loads((fixture / "summary.json").read_text())
    assert rows[-1].weights_traffic_bytes == summary["bytes_communicated"] > 0
    assert value_of(summary, "weights_traffic_bytes") == summary["bytes_communicated"]
    assert rows[-1].total_traffic_bytes is None  # no total in rows of that age: the readers add it up themselves
    # the final line names the total; its parts are the summary's names
    line = sent_line({"total_traffic_bytes": 7_200_000, "weights_traffic_bytes": 7_000_000,
                      "statistics_bytes": 200_000, "logged_statistics_bytes": 0})
    assert line == "7.2 MB communicated (7.0 MB weights + 0.2 MB batch-test statistics)"
    # a run of the version before the rename, resumed from outer step 1: its rows carry over, renamed
    old = tmp_path / "training_log.csv"
    old.write_text("outer_step,trainer_id,bytes_communicated,statistics_bytes,bytes_needed\n"
                   "0,0,0,0,0\n1,0,700,20,720\n2,0,1400,40,1440\n")
    assert start_csv(old, columns(TrainerRow), resume_step=1) is None
    kept = read_records(old, TrainerRow)
    assert [(r.outer_step, r.weights_traffic_bytes, r.statistics_bytes, r.total_traffic_bytes) for r in kept] == \
        [(0, 0, 0, 0), (1, 700, 20, 720)]
    header = old.read_text().splitlines()[0].split(",")
    assert header == columns(TrainerRow) and "bytes_communicated" not in header
