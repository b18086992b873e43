"""The simulated clock in real runs: a heterogeneous cluster with nodes that leave, return and slow down, resumed
exactly after SIGTERM mid-schedule, the same under torchrun; bad cluster descriptions refused in one line."""

import csv
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from algorithms.clock import ThroughputCurve
from algorithms.network import parse_network
from benchmarks.replay import read_rounds, replay
from run import main
from run_dir.past import node_times_before_the_record
from run_dir.reader import RunFiles
from tests.conftest import ROOT, TINY
from tests.test_bad_input import assert_refused_before_any_work, error_lines
from tests.test_distributed import RUN, assert_same_decisions, torchrun
from tests.test_resume_and_faults import (
    STEPS,
    assert_same_run,
    overrides,
    resume,
    sigterm_after_outer_step_3,
    train,
)
from training_logs.records import MergeEvent, NodeTime, TrainerRow
from utils.config import load_config

# 4 nodes: two at full speed, two at half; node 3 away in outer steps 3-4, node 1 four times slower in 2-4;
# inner steps in proportion to speed (the slow nodes take 2 of 3); a measured-shaped curve; 1 Gbit/s, 50 ms
SCHEDULE = "[{node: 3, leave: 3, return: 5}, {node: 1, slowdown: 4, from: 2, until: 5}]"
CLUSTER = ["devices=[{device: cpu, speed: 1.0}, {device: cpu, speed: 0.5}]", f"node_schedule={SCHEDULE}",
           "network=cross-region", "inner_steps_by_speed=true"]


def node_rows(run_dir):
    with (run_dir / "model_training_report" / "node_clock.csv").open() as f:
        return list(csv.DictReader(f))


def curve_file(tmp_path, largest=8):
    path = tmp_path / "curve.json"
    points = [{"micro_batch": b, "accumulation": 1, "tokens_per_s": 1000.0 * b} for b in range(1, largest + 1)]
    path.write_text(json.dumps({"points": points}))
    return path


def test_a_heterogeneous_cluster_with_a_schedule_runs_logs_and_resumes_exactly_after_sigterm(tmp_path, cache_dir):
    curve = curve_file(tmp_path)
    args = [*CLUSTER, f"throughput={curve}"]
    full, summary = train(load_config(ROOT / "config.yaml", overrides(cache_dir, tmp_path / "a", "run_name=full",
                                                                     f"num_outer_steps={STEPS}", *args)))
    nodes = node_rows(full)
    present = {s: sorted(int(r["node_id"]) for r in nodes if int(r["outer_step"]) == s) for s in range(1, STEPS + 1)}
    assert present[2] == present[5] == [0, 1, 2, 3] and present[3] == present[4] == [0, 1, 2]
    assert {r["slowdown"] for r in nodes if r["node_id"] == "1"} == {"1", "4"}
    assert all(r["slowdown"] == "4" for r in nodes if r["node_id"] == "1" and 2 <= int(r["outer_step"]) <= 4)
    log = (full / "training_log.log").read_text()
    assert "outer step 3: node 3 leaves until outer step 5" in log and "outer step 5: node 3 returns" in log
    # inner_steps_by_speed: a node's steps follow its rate among its trainer's nodes (3 at the fastest)
    for step in range(1, STEPS + 1):
        rows = [r for r in nodes if int(r["outer_step"]) == step]
        for t in {r["trainer_id"] for r in rows}:
            mine = [r for r in rows if r["trainer_id"] == t]
            rate = {r["node_id"]: float(r["speed"]) / float(r["slowdown"]) * int(r["micro_batch"]) for r in mine}
            assert all(int(r["inner_steps"]) == max(1, round(3 * rate[r["node_id"]] / max(rate.values())))
                       for r in mine)
            assert max(int(r["inner_steps"]) for r in mine) == 3
    assert any(int(r["inner_steps"]) < 3 for r in nodes)
    # the clock's totals, recomputed from node_clock.csv: a node is available from its first row's start of
    # waiting (its previous end, or when it came back) to the run's end; idle + compute covers its rounds
    with (full / "model_training_report" / "merge_events.csv").open() as f:
        merged_at = [float(m["sim_time_s"]) for m in csv.DictReader(f)]
    assert len(merged_at) == 3 and merged_at[-1] > max(float(r["end_s"]) for r in nodes)  # the last merge ends it
    end = max(float(r["end_s"]) for r in nodes) if not merged_at else max(merged_at)
    assert summary["sim_time_s"] == pytest.approx(end)
    busy = sum(float(r["compute_s"]) for r in nodes)
    available = sum(sum(float(r["compute_s"]) + float(r["idle_s"]) for r in nodes if r["node_id"] == n)
                    + end - max(float(r["end_s"]) for r in nodes if r["node_id"] == n) for n in "0123")
    assert summary["utilisation"] == pytest.approx(busy / available, rel=1e-4)
    assert summary["busy_node_seconds"] == pytest.approx(busy, rel=1e-4)
    assert summary["idle_node_seconds"] == pytest.approx(available - busy, rel=1e-3)
    assert 0 < summary["utilisation"] < 1 and summary["goodput_tokens_per_s"] == pytest.approx(
        summary["tokens_seen"] / end, rel=1e-6)
    with (full / "model_training_report" / "training_log.csv").open() as f:
        logged = [r for r in csv.DictReader(f) if r["outer_step"] != "0"]
    assert max(float(r["sim_time_s"]) for r in logged) <= end + 1e-9
    assert float(logged[-1]["utilisation"]) == pytest.approx(summary["utilisation"], rel=1e-4)
    metrics = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert any("node_1/idle_s" in m.get("metrics", m) for m in metrics)
    # the replay reads the recorded rounds (node_clock.csv, merge_events.csv): on the run's own network, curve and
    # speeds it is the live clock to the last digit, merges, node moves, the away node and the slowdowns included
    rounds, weight_bytes, _ = read_rounds(full)
    assert any(w.merges for w in rounds) and any(w.node_moves for w in rounds) and any(w.slowdown for w in rounds)
    clock, times = replay(rounds, parse_network("cross-region"), ThroughputCurve.load(curve), weight_bytes,
                          load_config(full / "config.yaml").node_speeds)
    assert clock.now == summary["sim_time_s"] and clock.utilisation() == summary["utilisation"]
    assert sum(clock.busy) == summary["busy_node_seconds"] and clock.idle() == summary["idle_node_seconds"]
    with (full / "model_training_report" / "merge_events.csv").open() as f:
        ends = [(int(r["outer_step"]), float(r["sim_time_s"])) for r in [*logged, *csv.DictReader(f)]]
    # each step's end, as the CSVs print it (6 significant digits)
    assert [times[s] for s in range(1, STEPS + 1)] == pytest.approx(
        [max(t for step, t in ends if step <= s) for s in range(1, STEPS + 1)], rel=1e-5)
    # run_dir/past.py rebuilds the rounds of runs written before node_clock.csv from training_log.csv: on this run it
    # finds the same nodes, trainers, shapes and node moves as the record, and each trainer's tokens
    recorded = RunFiles(full).node_times()
    rebuilt = [NodeTime(**n) for n in node_times_before_the_record(RunFiles(full).records(TrainerRow),
                                                                    RunFiles(full).records(MergeEvent))]
    assert any(n.received_bytes for n in recorded)

    def who(times):
        return sorted((n.outer_step, n.node_id, n.trainer_id, n.micro_batch, n.accumulation_steps, n.received_bytes)
                      for n in times)

    def tokens(times):
        by_trainer = {}
        for n in times:
            by_trainer[n.outer_step, n.trainer_id] = by_trainer.get((n.outer_step, n.trainer_id), 0.0) + n.tokens
        return by_trainer
    assert who(rebuilt) == who(recorded) and tokens(rebuilt) == pytest.approx(tokens(recorded))
    # SIGTERM once outer step 3 is logged (node 3 away, node 1 slowed): the resumed run is the same run
    run_dir = sigterm_after_outer_step_3(cache_dir, tmp_path / "b", args)
    run_dir, _ = resume(run_dir)
    assert_same_run(full, run_dir)


def test_the_same_schedule_under_torchrun_gives_the_simulations_decisions(tmp_path, cache_dir):
    """4 processes; node 3's rank idles in outer steps 3-4 (its process stays, it takes part in the world
    collectives only), then rejoins. Same decisions, node rows and simulated times as the simulated cluster."""
    args = [*RUN, *CLUSTER, f"cache_dir={cache_dir}", f"log_dir={tmp_path}", "cpu_threads=1"]
    train(load_config(ROOT / "config.yaml", [*args, "run_name=sim"]))  # in this process, on one thread (cpu_threads)
    proc = subprocess.run([*torchrun("--standalone", "--nproc-per-node", "4"), *args, "run_name=dist"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_decisions(tmp_path / "sim", tmp_path / "dist")
    expected, got = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("sim", "dist"))
    assert expected["merges"] == 3 and got["sim_time_s"] == pytest.approx(expected["sim_time_s"], rel=1e-9)
    assert sorted(int(r["node_id"]) for r in node_rows(tmp_path / "dist") if r["outer_step"] == "3") == [0, 1, 2]


@pytest.mark.parametrize("override, key, words", [
    ("devices=[{device: cpu, sped: 2}]", "devices[0].sped", "did you mean 'devices[0].speed'"),
    ("devices=[{device: cpu, speed: 0}]", "devices[0].speed", "must be > 0"),
    ("devices=[{device: tpu}]", "devices[0]", "is not cpu, cuda or cuda:N"),
    ("node_schedule=[{node: 7, leave: 2}]", "node_schedule", "node 7 does not exist (node ids run from 0 to 3)"),
    ("node_schedule=[{node: 0, leave: 1}, {node: 1, leave: 1}, {node: 2, leave: 1}]", "node_schedule",
     "leaves 1 nodes at outer step 1 for 4 trainers"),
    ("node_schedule=[{node: 1, slowdown: -2}]", "node_schedule", "slowdown must be a positive number"),
    ("node_schedule=[{node: 1, leave: 2, stay: 3}]", "node_schedule", "unknown key 'stay'"),
    ("network=fast", "network", "give BANDWIDTH,LATENCY"),
    ("throughput={tmp}/missing.json", "throughput", "cannot read the curve file"),
    ("throughput={curve}|max_batch_size=16", "throughput", "covers micro-batches up to 8 (accumulation 1), but "
     "max_batch_size is 16"),
    ("inner_steps_by_speed=true|sync_fragments=2|num_inner_steps=4", "inner_steps_by_speed", "Streaming DiLoCo"),
])
def test_bad_cluster_descriptions_stop_in_one_line_before_any_work(override, key, words, tmp_path, capsys):
    args = override.replace("{tmp}", str(tmp_path)).replace("{curve}", str(curve_file(tmp_path))).split("|")
    assert_refused_before_any_work(args, key, words, tmp_path, capsys)


def test_a_curve_below_the_probed_max_batch_is_refused_before_training(cache_dir, tmp_path, capsys):
    """The memory probe finds each node's max batch (here above 2); a curve measured only to 2 cannot price it:
    one line, exit 2, before the first round."""
    curve = curve_file(tmp_path, largest=2)
    assert main(["--config", str(ROOT / "config.yaml"), *TINY, f"cache_dir={cache_dir}", f"log_dir={tmp_path / 'l'}",
                 "max_batch_size=0", "device_memory_mb=200", f"throughput={curve}"]) == 2
    (line,) = error_lines(capsys)
    assert "'throughput'" in line and "covers micro-batches up to 2" in line and "max batch is" in line, line
    (run_dir,) = (tmp_path / "l").iterdir()
    assert "outer 1/" not in (run_dir / "training_log.log").read_text()  # no round ran


def write_curve(path, points, **about):
    path.write_text(json.dumps({**about, "points": [{"micro_batch": b, "accumulation": 1, "tokens_per_s": v}
                                                    for b, v in points]}))
    return path


def test_curve_files_that_lie_are_refused_or_named(cache_dir, tmp_path, capsys):
    """A one-point file is not a curve (it would cover every batch unseen): refused in one line unless it says
    "flat": true, which the run's log and summary then say; a falling or non-concave curve runs with one warning
    line that names its points."""
    run = ["--config", str(ROOT / "config.yaml"), *TINY, f"cache_dir={cache_dir}", "num_outer_steps=1",
           "max_batch_size=4", f"log_dir={tmp_path / 'l'}"]
    one = write_curve(tmp_path / "one.json", [(2, 5000.0)])
    assert main([*run, f"throughput={one}"]) == 2
    (line,) = error_lines(capsys)
    assert "'throughput'" in line and "one point (micro-batch 2)" in line and '"flat": true' in line, line
    flat = write_curve(tmp_path / "flat.json", [(2, 5000.0)], flat=True)
    assert main([*run, f"throughput={flat}", "run_name=flat"]) == 0  # max batch 4 > 2: a flat file covers it
    summary = json.loads((tmp_path / "l" / "flat" / "summary.json").read_text())
    assert summary["clock"]["throughput"] == f"{flat} (flat, 5000 tokens/s)"
    assert "(flat, 5000 tokens/s)" in (tmp_path / "l" / "flat" / "training_log.log").read_text()
    bent = write_curve(tmp_path / "bent.json", [(1, 1000.0), (2, 1200.0), (3, 2400.0), (4, 2000.0)])
    assert main([*run, f"throughput={bent}", "run_name=bent"]) == 0
    log = (tmp_path / "l" / "bent" / "training_log.log").read_text()
    (warning,) = [x for x in log.splitlines() if "config: throughput:" in x]
    assert "falls from micro-batch 3 to 4 (2400 -> 2000 tokens/s" in warning
    assert "is not concave at micro-batch 2 (1200 tokens/s, below the 1700 of the chord from 1 to 3" in warning
    assert "the clock uses it as given" in warning


def test_a_measured_curve_is_cached_and_reused(tiny_config, tmp_path):
    from cluster.throughput import cached_curve

    calls = []

    def measure():
        calls.append(1)
        return ThroughputCurve(((1, 1, 10.0), (4, 1, 30.0)), "measured here")

    key = {"device": "cpu test", "model": "m", "seq_len": 32, "precision": "fp32", "largest": 4}
    first, path = cached_curve(tmp_path, key, measure)
    again, same = cached_curve(tmp_path, key, measure)
    assert calls == [1] and path == same and first.points == again.points == ((1, 1, 10.0), (4, 1, 30.0))
    path.write_text("{")  # an unreadable cache is measured again, not trusted
    cached_curve(tmp_path, key, measure)
    assert calls == [1, 1]


def test_throughput_measured_measures_once_logs_the_curve_and_reuses_the_cache(tiny_config, cache_dir, tmp_path):
    """throughput: measured runs benchmarks.system's curve code on the node's device before training (micro-batches
    1, 2, 4 = the max batch, accumulation 1, 2, 4), caches it, and a second run reads the cache."""
    from cluster.throughput import curve_batches

    assert curve_batches(4) == [1, 2, 4] and curve_batches(6) == [1, 2, 4, 6] and curve_batches(1) == [1]
    cfg = tiny_config("throughput=measured", "num_outer_steps=1")
    shutil.rmtree(Path(cfg.cache_dir) / "throughput", ignore_errors=True)
    run_dir, summary = train(cfg)
    log = (run_dir / "training_log.log").read_text()
    assert "throughput: measured curve" in log and "4x1:" in log
    (cached,) = (Path(cfg.cache_dir) / "throughput").glob("*.json")
    curve = ThroughputCurve.load(cached)
    assert sorted({(b, a) for b, a, _ in curve.points}) == [(b, a) for b in (1, 2, 4) for a in (1, 2, 4)]
    assert summary["clock"]["throughput"] == str(cached) and summary["sim_time_s"] > 0
    stamp = cached.stat().st_mtime_ns
    train(tiny_config("throughput=measured", "num_outer_steps=1", "run_name=again"))
    assert cached.stat().st_mtime_ns == stamp  # read, not measured again


def test_each_trainers_holder_is_the_lowest_node_with_its_current_weights():
    """ClusterState.holders, by hand: the lowest node holding (trainer, current version); a stale version, a node away
    (STALE) or none at all does not count (no holder: node 0, as every process has the common weights)."""
    from types import SimpleNamespace

    from cluster.state import STALE, ClusterState

    nodes = [SimpleNamespace(node_id=n) for n in range(5)]
    trainers = {0: SimpleNamespace(weights_version=2), 1: SimpleNamespace(weights_version=1),
                2: SimpleNamespace(weights_version=0)}
    state = ClusterState(nodes, trainers, streaming=False, cuda=False)
    state.holds = {0: (0, 1), 1: STALE, 2: (0, 2), 3: (1, 1), 4: (0, 2)}
    assert state.holders([0, 1, 2]) == {0: 2, 1: 3, 2: 0}
    state.holds[1] = (0, 2)
    assert state.holders([0]) == {0: 1}
