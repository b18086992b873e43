"""Pieces of the torch.distributed path (issue 11), checked over a real gloo process group on CPU."""

import csv
import json
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from algorithms.calc_batch import (
    STATISTICS_WIRE,
    AugmentedInnerProductTest,
    GradientSamples,
    NodeGradientSums,
    NormTest,
    statistics_of,
    trainer_statistics,
)
from run import train
from tests.conftest import ROOT
from utils.config import load_config

WORLD = 3
SIZES = [[1.0, 2.0, 3.0], [2.0, 2.0], [4.0, 1.0, 1.0, 2.0]]  # unequal micro-batches on each node


def node_samples(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    sizes = torch.tensor(SIZES[rank], dtype=torch.float64)
    return torch.randn(len(sizes), 40, generator=gen, dtype=torch.float64) + 0.2 * (rank + 1), sizes


def batch_tests():
    return {"norm": NormTest(eta=0.05), "aip": AugmentedInnerProductTest(vartheta=0.05, nu=0.1)}


def worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        grads, sizes = node_samples(rank)
        results = {}
        for within_node in (True, False):
            for wire in ("fp64", "minimal"):  # statistics_comm
                share = NodeGradientSums.of(grads, sizes, within_node, STATISTICS_WIRE[wire])
                vectors = share.vectors()
                dist.all_reduce(vectors)  # one vector all-reduce: the b-weighted gradient sum(s) and the batch
                mean = STATISTICS_WIRE[wire].reduced_mean(vectors, within_node)
                scalars = share.scalars(mean)
                dist.all_reduce(scalars)  # then the scalars
                stats = STATISTICS_WIRE[wire].statistics(vectors, scalars, within_node)
                decisions = {name: test(stats, 1, WORLD) for name, test in batch_tests().items()}
                results[f"{within_node}/{wire}"] = {name: d.stats | {"batch": d.requested_batch}
                                                    for name, d in decisions.items()}
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


RING_WORLD = 4
# entry counts the microllama sizes never reach: not a multiple of 4 (bert-tiny's P mod 4 = 2; an odd streamed
# fragment), and fewer 1024-entry chunks than the trainer's nodes (empty shards), both at once
RING_SIZES = (1026, 3, 4097)


def ring_payloads(compression: str, numel: int) -> list[torch.Tensor]:
    from algorithms.outer_sync import OuterSync

    sync = OuterSync(compression)
    return [sync.compressor.encode(torch.randn(numel, generator=torch.Generator().manual_seed(7 * r + numel)))
            for r in range(RING_WORLD)]


def ring_worker(rank: int, store: str, out: str) -> None:
    """The ring of quantized shards over real gloo all_to_all_single calls: the plain sync and a streamed
    fragment's two halves (with flags; rank 3 contributes nothing to the fragment)."""
    from algorithms.outer_sync import OuterSync
    from algorithms.streaming import FLAG_BYTES
    from distributed.ring import QuantizedRing

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=RING_WORLD)
    try:
        def all_to_all(tensor, sent, got, members, async_op=False):
            received = torch.empty(sum(got), dtype=tensor.dtype)
            work = dist.all_to_all_single(received, tensor, got, sent, async_op=async_op)
            return received, work

        members = tuple(range(RING_WORLD))
        results = {}
        for compression in ("bf16", "int8", "fp8"):
            ring = QuantizedRing(OuterSync(compression), rank, all_to_all)
            for numel in RING_SIZES:
                master = {"w": torch.linspace(-1, 1, numel)}
                payload = ring_payloads(compression, numel)[rank]
                mean = ring.mean(master, payload, numel, members, list(members), None)
                flag = torch.tensor([0 if rank == 3 else 1, 0, 0, 0], dtype=torch.uint8)
                work, half = ring.send_fragment(torch.cat([payload, flag]), numel, members)
                work.wait()
                arrival = ring.land_fragment(half, members, "cpu")
                fragment = ring.sync.ring_mean(master, arrival.reduced)["w"]
                results[f"{compression}/{numel}"] = {"mean": mean["w"].tolist(), "landed": arrival.contributed,
                                                     "fragment": fragment.tolist()}
                assert len(flag) == FLAG_BYTES
        torch.save(results, f"{out}/ring{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_quantized_ring_over_gloo_takes_any_entry_count_and_more_nodes_than_chunks(tmp_path):
    """bf16, int8 and fp8 rings of 4 ranks over entry counts that are not multiples of 4 and have fewer chunks than
    ranks: every rank ends with what the simulated ring computes, bit for bit, plain and streamed."""
    from algorithms.outer_sync import OuterSync

    mp.start_processes(ring_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=RING_WORLD,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"ring{r}.pt") for r in range(RING_WORLD)]
    for compression in ("bf16", "int8", "fp8"):
        sync = OuterSync(compression)
        for numel in RING_SIZES:
            master = {"w": torch.linspace(-1, 1, numel)}
            payloads = ring_payloads(compression, numel)
            expected = sync.ring_node_mean(master, payloads, RING_WORLD)["w"].tolist()
            expected_fragment = sync.ring_node_mean(master, payloads[:3], RING_WORLD)["w"].tolist()
            for got in ranks:
                result = got[f"{compression}/{numel}"]
                assert result["mean"] == expected, (compression, numel)
                assert result["landed"] and result["fragment"] == expected_fragment, (compression, numel)


def test_batch_tests_over_a_gloo_all_reduce_match_the_simulation(tmp_path):
    mp.start_processes(worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert ranks[0] == ranks[1] == ranks[2]  # every rank takes the same decision
    parts = [node_samples(r) for r in range(WORLD)]
    grads = torch.cat([g for g, _ in parts])
    sizes = torch.cat([b for _, b in parts])
    for within_node in (True, False):
        groups = torch.cat([torch.full((len(b),), r) for r, (_, b) in enumerate(parts)]) if within_node \
            else torch.zeros(len(sizes), dtype=torch.long)
        direct = statistics_of(GradientSamples(grads, sizes, groups))
        # the minimal wire: the simulated cluster's path with the same wire (fp32 sums in another order: 1e-6)
        fp32 = trainer_statistics(parts, within_node, STATISTICS_WIRE["minimal"])
        for name, test in batch_tests().items():
            for wire, reference, tolerance in (("fp64", direct, 1e-9), ("minimal", fp32, 1e-6)):
                expected = test(reference, 1, WORLD)
                got = ranks[0][f"{within_node}/{wire}"][name]
                assert got["batch"] == expected.requested_batch > 1
                for key, value in expected.stats.items():
                    assert abs(got[key] - value) <= tolerance * abs(value), (within_node, wire, name, key)
            assert test(fp32, 1, WORLD).requested_batch == test(direct, 1, WORLD).requested_batch


# ----------------------------------------------------------------------------------------------
# Whole runs under torchrun (gloo, CPU) against the simulated cluster

RUN = ["num_inner_steps=3", "num_init_trainers=4", "nodes_per_gpu=2", "devices=[cpu,cpu]", "seq_len=32", "val_size=8",
       "eval_batch_size=8", "initial_batch_size=3", "max_batch_size=2", "ETA=0.3", "max_requested_batch=8",
       "merge_frequency=2", "save_weights_every=2", "plot_every=0", "tokenizer=bpe", "tokenizer_vocab_size=512",
       "embedded_sources=[tiny]", "clearml_mode=off", "num_outer_steps=6", "outer_momentum=0.9",
       "outer_nesterov=true", "eval_every_inner_steps=2"]


WEIGHTS_COLUMNS = ("train_loss", "val_perplexity", "val_loss")
STATISTICS_COLUMNS = ("T_k", "variance", "sum_sq_diffs", "inner_variance", "ortho_variance", "T_ip", "T_ortho",
                      "grad_sq_norm")


def csv_rows(run_dir, name):
    with (run_dir / "model_training_report" / name).open() as f:
        return [{k: v for k, v in r.items() if k != "wall_time"} for r in csv.DictReader(f)]


def assert_same_decisions(expected_dir, got_dir, ignore=()):
    """Decisions identical (nodes, batches, merges); every number within 1e-4 relative (but `ignore`'s)."""
    for name in ("training_log.csv", "merge_events.csv", "step_loss_log.csv", "node_clock.csv", "inner_eval.csv"):
        expected, got = csv_rows(expected_dir, name), csv_rows(got_dir, name)
        assert len(expected) == len(got), name
        for e, g in zip(expected, got):
            for key in set(e) - set(ignore):
                if key in ("nodes", "merged", "survivor", "weights", "requested_batches", "requested_batch",
                           "next_requested_batch", "loader_batch", "accumulation_steps", "trainer_id", "outer_step"):
                    assert e[key] == g[key], (name, key)
                elif e[key] != g[key]:  # numbers, or space-separated lists of them (metric_before)
                    expected_values, got_values = e[key].split(), g[key].split()
                    assert len(expected_values) == len(got_values), (name, key)
                    assert [float(v) for v in got_values] == pytest.approx([float(v) for v in expected_values],
                                                                            rel=1e-4), (name, key)


@pytest.fixture(scope="module")
def simulated(tmp_path_factory, cache_dir):
    log_dir = tmp_path_factory.mktemp("simulated")
    run_dir, summary = train(load_config(ROOT / "config.yaml", [*RUN, f"cache_dir={cache_dir}", f"log_dir={log_dir}",
                                                                "run_name=sim"]))
    assert summary["merges"] == 3 and summary["accumulation_used"] and summary["batch_increases"] >= 1
    return run_dir


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args, str(ROOT / "run.py")]


def test_torchrun_four_processes_equal_the_simulated_cluster(simulated, tmp_path, cache_dir):
    proc = subprocess.run([*torchrun("--standalone", "--nproc-per-node", "4"), *RUN, f"cache_dir={cache_dir}",
                           f"log_dir={tmp_path}", "run_name=dist"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_decisions(simulated, tmp_path / "dist")
    assert "torchrun: 4 processes" in (tmp_path / "dist" / "training_log.log").read_text()
    # The accounting is what the collectives sent: trainer-group all-reduces, node moves and merges
    # (send/recv of exactly the trainer state), summed over the ranks.
    expected, got = (json.loads((d / "summary.json").read_text()) for d in (simulated, tmp_path / "dist"))
    assert expected["node_move_bytes"] > 0 and expected["merge_bytes"] > 0 and expected["allreduce_bytes"] > 0
    for key in ("allreduce_bytes", "merge_bytes", "node_move_bytes", "weights_traffic_bytes", "statistics_bytes"):
        assert got[key] == expected[key], key
    sent = got["bytes_sent_by_collectives"]
    assert sent["weights"] == got["weights_traffic_bytes"]
    # the minimal statistics (the default): what the collectives sent is what was accounted
    assert sent["statistics"] == got["statistics_bytes"] > 0 and sent["checkpoint"] > 0
    # the batch test's statistics at the weights' tolerance: the minimal statistics' fp32 vector and fp64 scalars are
    # added in node-id order on both backends, so where the weights' numbers (losses, perplexities) carry the same
    # digits, so do the statistics (they differed by 1.2e-4 when gloo's all-reduce added in its own order)
    for e, g in zip(csv_rows(simulated, "training_log.csv"), csv_rows(tmp_path / "dist", "training_log.csv")):
        assert [g[k] for k in WEIGHTS_COLUMNS] == [e[k] for k in WEIGHTS_COLUMNS]
        assert [g[k] for k in STATISTICS_COLUMNS] == [e[k] for k in STATISTICS_COLUMNS], e["outer_step"]
    assert any(e["variance"] for e in csv_rows(simulated, "training_log.csv"))
    # the mid-round evaluations: each trainer's synced model, its nodes averaged in node-id order on both backends,
    # the same digits; their collectives counted apart from the method's bytes
    inner = csv_rows(simulated, "inner_eval.csv")
    assert len(inner) == len(csv_rows(simulated, "training_log.csv")) - 4  # one per trainer and round (not step 0)
    assert any(len(r["nodes"].split()) > 1 for r in inner)
    assert csv_rows(tmp_path / "dist", "inner_eval.csv") == inner
    assert sent["evaluation"] > 0


def requested_batches(run_dir):
    return [(r["outer_step"], r["trainer_id"], r["requested_batch"], r["next_requested_batch"])
            for r in csv_rows(run_dir, "training_log.csv")]


@pytest.mark.parametrize("estimator", ["micro_batches", "nodes"])
def test_minimal_statistics_take_the_fp64_protocols_decisions_on_whole_runs(simulated, tmp_path, cache_dir,
                                                                            estimator):
    """The default statistics (one fp32 vector and fp64 scalars) against the exact two-vector fp64 protocol:
    the same requested batches, step by step, for the norm test (micro_batches) and the AIPT (the nodes
    estimator, the paper's); the statistics bytes at most 1.1x the weights' all-reduce bytes (from 2x and 4x)."""
    extra = [] if estimator == "micro_batches" else [
        "variance_estimator=nodes", "sampling_method=augmented_inner_product_test", "vartheta=0.2", "nu=0.5"]
    runs = {}
    for mode in ("minimal", "fp64"):
        if mode == "minimal" and not extra:
            runs[mode] = simulated
            continue
        runs[mode], _ = train(load_config(ROOT / "config.yaml", [
            *RUN, *extra, f"statistics_comm={mode}", f"cache_dir={cache_dir}", f"log_dir={tmp_path}",
            f"run_name={mode}"]))
    minimal, reference = (requested_batches(runs[m]) for m in ("minimal", "fp64"))
    assert minimal == reference
    assert any(r[3] != r[2] for r in reference)  # some batch grew: the decisions were tested, not only kept
    # every number the same but what the statistics cost (bytes, and the seconds the clock gives them)
    costs = [k for k in csv_rows(runs["fp64"], "training_log.csv")[0] if "bytes" in k or k.startswith("sim_")]
    assert_same_decisions(runs["fp64"], runs["minimal"], ignore=[*costs, "utilisation", "goodput_tokens_per_s",
                                                                 "start_s", "idle_s", "end_s"])
    summary = {m: json.loads((runs[m] / "summary.json").read_text()) for m in runs}
    assert summary["minimal"]["allreduce_bytes"] == summary["fp64"]["allreduce_bytes"] > 0
    ratio = {m: s["statistics_bytes"] / s["allreduce_bytes"] for m, s in summary.items()}
    assert 0 < ratio["minimal"] <= 1.1 and ratio["fp64"] >= (2 if estimator == "micro_batches" else 4) * 0.99


def test_torchrun_world_size_must_match_the_config(tmp_path, cache_dir):
    proc = subprocess.run([*torchrun("--standalone", "--nproc-per-node", "2"), *RUN, f"cache_dir={cache_dir}",
                           f"log_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert lines and all("torchrun started 2 processes, but devices x nodes_per_gpu = 2 x 2 = 4" in x for x in lines)
    # torchrun prints its own ChildFailedError report; no traceback comes from our processes
    assert f'{ROOT / "run.py"}", line' not in proc.stderr and "ChildFailedError" in proc.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_of_two_processes_equal_the_simulated_cluster(simulated, tmp_path, cache_dir):
    """Two torchrun invocations, as on two machines, meeting at a c10d rendezvous on 127.0.0.1."""
    launch = [*torchrun("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        f"127.0.0.1:{free_port()}", "--rdzv-id", "two_machines"),
              *RUN, f"cache_dir={cache_dir}", f"log_dir={tmp_path}", "run_name=two"]
    machines = [subprocess.Popen(launch, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for _ in range(2)]
    for machine in machines:
        _, err = machine.communicate(timeout=600)
        assert machine.returncode == 0, err[-3000:]
    assert_same_decisions(simulated, tmp_path / "two")


def test_a_killed_rank_is_restarted_and_the_run_resumes(simulated, tmp_path, cache_dir):
    """SIGKILL of rank 2 after the step-2 checkpoint; torchrun --max-restarts 1 restarts the group, which
    resumes from the checkpoint and ends as the uninterrupted run."""
    proc = subprocess.Popen([*torchrun("--standalone", "--nproc-per-node", "4", "--max-restarts", "1"), *RUN,
                             f"cache_dir={cache_dir}", f"log_dir={tmp_path}", "run_name=elastic"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    checkpoint = tmp_path / "elastic" / "model_weights" / "outer_step_0002" / "manifest.json"
    deadline = time.time() + 300
    while not checkpoint.is_file():
        assert time.time() < deadline and proc.poll() is None, "no checkpoint"
        time.sleep(0.2)
    workers = [c for c in psutil.Process(proc.pid).children(recursive=True) if "run.py" in " ".join(c.cmdline())]
    (victim,) = [w for w in workers if w.environ().get("RANK") == "2"]
    victim.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert f"torchrun restarted the processes: resuming {tmp_path / 'elastic'}" in err
    # what the surviving ranks said: rank 2's process ended first; ranks 0 and 3 were only stopped by torchrun
    said = [line for line in err.splitlines() if "a collective failed" in line]
    assert said and all(re.search(r"rank [013]: a collective failed, rank 2's process ended first, and the group was "
                                  "stopped", line) for line in said), said
    assert_same_decisions(simulated, tmp_path / "elastic")


def test_sigterm_under_torchrun_stops_every_rank_and_resumes_under_torchrun(simulated, tmp_path, cache_dir):
    args = [*RUN, f"cache_dir={cache_dir}", f"log_dir={tmp_path}", "run_name=sig"]
    proc = subprocess.Popen([*torchrun("--standalone", "--nproc-per-node", "4"), *args, "num_outer_steps=40"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "sig" / "training_log.log"
    deadline = time.time() + 300
    while not (log.is_file() and "[outer 3/" in log.read_text()):
        assert time.time() < deadline and proc.poll() is None, "no step 3"
        time.sleep(0.2)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to every rank
    _, err = proc.communicate(timeout=120)
    assert time.time() - sent < 30
    stops = [x for x in err.splitlines() if x.startswith("stopped by SIGTERM after outer step")]
    assert len(stops) == 4 and len(set(stops)) == 1  # every rank stopped at the same step
    # torchrun reports 1 whatever the ranks exited with; the run directory says what happened
    assert proc.returncode != 0
    status = json.loads((tmp_path / "sig" / "status.json").read_text())
    assert status["state"] == "stopped" and status["signal"] == "SIGTERM" and status["exit_code"] == 143
    assert status["resumable"] and stops[0].startswith(f"stopped by SIGTERM after outer step {status['outer_step']};")
    resumed = subprocess.run([*torchrun("--standalone", "--nproc-per-node", "4"), "--resume", str(tmp_path / "sig"),
                              f"num_outer_steps={6}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_decisions(simulated, tmp_path / "sig")
    assert json.loads((tmp_path / "sig" / "status.json").read_text())["state"] == "completed"


def test_a_hung_rank_ends_the_run_after_dist_timeout_s_naming_it(tmp_path, cache_dir):
    """Node 1 hangs in round 2 (inject_fault hang): rank 0 waits dist_timeout_s, then ends the run in one
    line that names rank 1 as the one that did not arrive."""
    started = time.time()
    proc = subprocess.run([*torchrun("--standalone", "--nproc-per-node", "2"), *RUN, "nodes_per_gpu=1",
                           "num_init_trainers=2", "inject_fault=2:1:hang", "dist_timeout_s=5",
                           f"cache_dir={cache_dir}", f"log_dir={tmp_path}", "run_name=hang"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert time.time() - started < 120
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error: rank 0:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "a collective failed, rank 1 did not answer within dist_timeout_s (hung?)" in lines[0]
    log = (tmp_path / "hang" / "training_log.log").read_text()
    assert "[outer 1/" in log and "[outer 2/" not in log


def test_a_ranks_own_error_is_reported_as_its_own_with_its_traceback_in_the_run_log(tmp_path, cache_dir):
    """Node 1's process raises outside the fault policy in round 2 (inject_fault crash, as a bug would): rank 1
    says so in its own line, its traceback is in the run's log (which only rank 0 writes otherwise), and rank 0's
    line and status.json name rank 1's error as the first cause, with no --max-restarts advice (a restart would
    meet the same error)."""
    proc = subprocess.run([*torchrun("--standalone", "--nproc-per-node", "2"), *RUN, "nodes_per_gpu=1",
                           "num_init_trainers=2", "inject_fault=2:1:crash", f"cache_dir={cache_dir}",
                           f"log_dir={tmp_path}", "run_name=crash"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    run_log = tmp_path / "crash" / "training_log.log"
    cause = f"internal error (InjectedCrash: inject_fault: crash on node 1); traceback in {run_log}"
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error: rank ")]
    assert sorted(lines) == [f"error: rank 0: a collective failed because rank 1 failed first: {cause}",
                             f"error: rank 1: {cause}"], proc.stderr[-3000:]
    log = run_log.read_text()
    assert re.search(r"ERROR rank 1 run: run failed\nTraceback \(most recent call last\):\n(.*\n)*"
                     r"node\.InjectedCrash: inject_fault: crash on node 1", log), log[-3000:]
    status = json.loads((tmp_path / "crash" / "status.json").read_text())
    assert status["state"] == "failed"
    assert status["error"] == f"error: rank 0: a collective failed because rank 1 failed first: {cause}"


def _two_machines(tmp_path, first: list[str], second: list[str], run_id: str):
    port = free_port()
    launch = [*torchrun("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        f"127.0.0.1:{port}", "--rdzv-id", run_id), *RUN, f"log_dir={tmp_path / 'logs'}",
              "run_name=mixed"]
    machines = [subprocess.Popen([*launch, *extra], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True) for extra in (first, second)]
    return [(m.communicate(timeout=600)[1], m.returncode) for m in machines]


def test_machines_started_with_different_configs_stop_before_any_work(tmp_path, cache_dir):
    """Two 'machines' at one rendezvous, one with another lr_inner and seed: every rank stops with one line
    naming the keys and which ranks hold which value, and no run directory is made."""
    ended = _two_machines(tmp_path, [f"cache_dir={cache_dir}"],
                          [f"cache_dir={cache_dir}", "lr_inner=0.001", "training_seed=7"], "mixed_configs")
    for err, code in ended:
        assert code != 0
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert err.count("error: torchrun:") == 2 and lines, err[-3000:]  # one per process of this machine
        for line in lines:
            assert line.startswith("error: torchrun: the processes were started with different configurations: ")
            assert re.search(r"lr_inner: 0\.003 on ranks \d, \d; 0\.001 on ranks \d, \d", line), line
            assert "training_seed: 42 on ranks" in line and "7 on ranks" in line
            assert "start every machine with the same config file" in line
        assert f'{ROOT / "run.py"}", line' not in err  # no traceback of ours
    assert not (tmp_path / "logs" / "mixed").exists()


def test_machines_with_different_data_stop_naming_it(tmp_path, cache_dir):
    """The same config, but one machine's cache holds a packed corpus that differs (a damaged or stale
    entry under the same key): the data fingerprints differ and every rank stops saying so."""
    import shutil

    from fabrics.corpus import load_corpus
    from fabrics.dataset_loader import fetch_wheel

    mine = tmp_path / "cache"  # a cache of this run's data alone: one packed entry, made as a run makes it
    (mine / "wheels").mkdir(parents=True)
    shutil.copy(fetch_wheel(cache_dir), mine / "wheels")
    load_corpus(load_config(ROOT / "config.yaml", [*RUN, f"cache_dir={mine}"]))
    other = tmp_path / "other_cache"
    shutil.copytree(mine, other)
    (entry,) = (other / "packed").glob("*.pt")
    stored = torch.load(entry, weights_only=True)
    ids, mask = stored["train"]
    stored["train"] = (ids.roll(1, dims=0), mask.roll(1, dims=0))  # the same sequences, another order
    torch.save(stored, entry)
    ended = _two_machines(tmp_path, [f"cache_dir={mine}"], [f"cache_dir={other}"], "mixed_data")
    for err, code in ended:
        assert code != 0
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert lines and all(x.startswith("error: torchrun: the processes were started with different data: "
                                          "train_corpus_sha256: ") for x in lines), err[-3000:]
        assert all("val_corpus_sha256" not in x for x in lines)  # only what differs is named


# Communication (issue 22): int8 pseudo-gradients with error feedback, sketched batch statistics and int8 merges
COMPRESSED = ["outer_compression=int8", "error_feedback=true", "statistics_comm=sketch", "statistics_sketch_dim=256",
              "merge_compression=int8"]


def _simulated_then_torchrun(tmp_path, args, procs: int = 4, merges: int | None = 3):
    """The simulated run (`merges` merges and a batch increase, unless None) and the `procs`-process torchrun one:
    same decisions; both summaries. The simulated run trains in this process (as the `simulated` fixture does), on
    the one intra-op thread its args ask for (cpu_threads=1, as in each torchrun process; the test workers have one
    anyway, conftest.py)."""
    assert "cpu_threads=1" in args
    expected_dir, expected = train(load_config(ROOT / "config.yaml", [*args, "run_name=sim"]))
    assert expected_dir == tmp_path / "sim"
    if merges is not None:
        assert expected["merges"] == merges and expected["batch_increases"] >= 1
    proc = subprocess.run([*torchrun("--standalone", "--nproc-per-node", str(procs)), *args, "run_name=dist"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_decisions(expected_dir, tmp_path / "dist")
    return expected_dir, expected, json.loads((tmp_path / "dist" / "summary.json").read_text())


def test_torchrun_with_compressed_sync_and_sketched_statistics_equals_the_simulated_cluster(tmp_path, cache_dir):
    """What crosses the network is the encoded payload (as a ring of quantized shards) and the sketched sums: both
    backends take the same decisions with the same numbers, and the collectives sent exactly what the accounting
    says."""
    # One intra-op thread in both (torchrun's default): int8 turns an fp32 difference at a rounding boundary
    # into a whole step, so the nodes' own arithmetic must match too.
    args = [*RUN, *COMPRESSED, f"cache_dir={cache_dir}", f"log_dir={tmp_path}", "cpu_threads=1"]
    expected_dir, expected, got = _simulated_then_torchrun(tmp_path, args)
    for key in ("allreduce_bytes", "merge_bytes", "node_move_bytes", "weights_traffic_bytes", "statistics_bytes"):
        assert got[key] == expected[key], key
    sent = got["bytes_sent_by_collectives"]
    assert sent["weights"] == got["weights_traffic_bytes"] and sent["statistics"] == got["statistics_bytes"] > 0
    # each sync is a ring of the int8 payload's shards (an fp32 scale per 1024 entries): 2 (n-1) x C, by hand
    numel = expected["weight_bytes"] // 4
    payload = numel + 4 * -(-numel // 1024)
    nodes = [int(r["num_nodes"] or 0) for r in csv_rows(expected_dir, "training_log.csv")]  # step 0: none
    ring = sum(2 * (n - 1) * payload for n in nodes if n > 1)
    assert expected["allreduce_bytes"] == ring


# Streaming DiLoCo (issue 22, part 3): two fragments, each in flight for one inner step, on top of the above
STREAMED = [*COMPRESSED, "num_inner_steps=4", "sync_fragments=2", "sync_delay=1", "fragment_alpha=0.5"]


def test_torchrun_streaming_with_fragments_in_flight_equals_the_simulated_cluster(tmp_path, cache_dir):
    """Each fragment's int8 shards travel asynchronously while the nodes train one more inner step (the ring's
    first half; the reduced shards come back at the landing), then the fragment is stepped and mixed: both
    backends take the same decisions with the same numbers, and the collectives sent what the accounting says,
    one ring per fragment (each shard message with its sender's 4 flag bytes)."""
    from algorithms.streaming import fragment_names
    from benchmarks.replay import accounted_bytes, read_rounds
    from fabrics.models import build_model
    from utils.config import load_config

    args = [*RUN, *STREAMED, f"cache_dir={cache_dir}", f"log_dir={tmp_path}", "cpu_threads=1"]
    expected_dir, expected, got = _simulated_then_torchrun(tmp_path, args)
    for key in ("allreduce_bytes", "merge_bytes", "node_move_bytes", "weights_traffic_bytes", "statistics_bytes",
                "syncs"):
        assert got[key] == expected[key], key
    sent = got["bytes_sent_by_collectives"]
    assert sent["weights"] == got["weights_traffic_bytes"] and sent["statistics"] == got["statistics_bytes"] > 0
    # by hand: per round, each fragment's int8 payload C (a scale per 1024) in a ring, each of the n shard messages
    # of each half with its sender's 4 flag bytes: 2 (n-1) x (C + 4 n)
    model = build_model(load_config(expected_dir / "config.yaml"), 512, 0)
    state = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
    sizes = [sum(state[n].numel() for n in names)
             for names in fragment_names(list(state), {k: v.numel() for k, v in state.items()}, 2)]
    nodes = [int(r["num_nodes"] or 0) for r in csv_rows(expected_dir, "training_log.csv")]
    assert expected["allreduce_bytes"] == sum(2 * (n - 1) * (f + 4 * -(-f // 1024) + 4 * n)
                                              for n in nodes if n > 1 for f in sizes) > 0
    # and the network model reads the same bytes back, fragment by fragment
    rounds, weight_bytes, communicated = read_rounds(expected_dir)
    assert all(t.sync.fragment_bytes and t.sync.overlap_steps == 1 for w in rounds for t in w.trainers)
    assert accounted_bytes(rounds, weight_bytes) == communicated == expected["weights_traffic_bytes"]


def test_eight_processes_with_an_int8_ring_equal_the_simulated_cluster_and_send_what_is_accounted(tmp_path,
                                                                                                  cache_dir):
    """One trainer of 8 nodes (8 torchrun processes): each int8 sync is a ring of 8 shards; the same numbers as
    the simulated cluster, and the collectives send exactly 2 x 7 x C per round, under 0.30x the fp32 ring."""
    args = [*RUN, "num_init_trainers=1", "nodes_per_gpu=4", "num_outer_steps=2", "merge_frequency=0",
            "outer_compression=int8", f"cache_dir={cache_dir}", f"log_dir={tmp_path}", "cpu_threads=1"]
    _, expected, got = _simulated_then_torchrun(tmp_path, args, procs=8, merges=None)
    numel = expected["weight_bytes"] // 4
    payload = numel + 4 * -(-numel // 1024)
    assert got["allreduce_bytes"] == expected["allreduce_bytes"] == 2 * 2 * 7 * payload  # 2 rounds
    weights = got["bytes_sent_by_collectives"]["weights"]
    assert weights == got["weights_traffic_bytes"] == expected["weights_traffic_bytes"]
    assert expected["allreduce_bytes"] <= 0.30 * 2 * 2 * 7 * expected["weight_bytes"]


def odd_model(where) -> str:
    """A Llama of 2114 parameters (P mod 4 = 2, as bert-tiny's) in 3 chunks of 1024 entries: a trainer of 4 nodes
    has more nodes than chunks, and the quantized payload's shards start at offsets that are not multiples of 4."""
    where.mkdir()
    (where / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 2,
        "intermediate_size": 2, "num_hidden_layers": 2, "num_attention_heads": 1, "num_key_value_heads": 1,
        "hidden_act": "silu", "max_position_embeddings": 64, "tie_word_embeddings": False}))
    return str(where)


@pytest.mark.parametrize("compression, streamed", [("int8", False), ("fp8", True), ("bf16", True)])
def test_torchrun_rings_of_odd_sizes_and_more_nodes_than_chunks_equal_the_simulated_cluster(tmp_path, cache_dir,
                                                                                            compression, streamed):
    """Issue 43: one trainer of 4 nodes on a model whose entry count is not a multiple of 4 and spans fewer
    1024-entry chunks than nodes, compressed, whole and streamed: the same numbers as the simulated cluster, and
    the collectives send what the accounting says."""
    args = [*RUN, "num_init_trainers=1", "merge_frequency=0", "num_outer_steps=2", f"outer_compression={compression}",
            f"model_config.name={odd_model(tmp_path / 'odd')}", f"cache_dir={cache_dir}", f"log_dir={tmp_path}",
            "cpu_threads=1", *(["num_inner_steps=4", "sync_fragments=2", "sync_delay=1"] if streamed else [])]
    _, expected, got = _simulated_then_torchrun(tmp_path, args, merges=None)
    numel = expected["weight_bytes"] // 4
    assert numel % 4 == 2 and -(-numel // 1024) < 4
    for key in ("allreduce_bytes", "weights_traffic_bytes", "statistics_bytes", "syncs"):
        assert got[key] == expected[key], key
    assert got["bytes_sent_by_collectives"]["weights"] == got["weights_traffic_bytes"] > 0
    if not streamed:  # by hand: 2 rounds of a ring of 4, each 2 x 3 x C (C: the int8 payload, a scale per chunk)
        assert expected["allreduce_bytes"] == 2 * 2 * 3 * (numel + 4 * -(-numel // 1024))


@pytest.mark.parametrize("algo", ["DDP", "SNOO"])
def test_torchrun_ddp_and_snoo_equal_the_simulated_cluster(tmp_path, cache_dir, algo):
    """Synchronous data parallel under torchrun: one real all-reduce of the trainer's gradients (and a count) per
    inner step; two trainers of two nodes, merged after step 2 into one of four. Both backends take the same
    decisions with the same numbers, and the collectives send what the accounting says: H gradient all-reduces
    per round, nothing at the round's end."""
    args = [*RUN, f"distributed_algo={algo}", "num_init_trainers=2", "num_outer_steps=3", f"cache_dir={cache_dir}",
            f"log_dir={tmp_path}", "cpu_threads=1"]
    expected_dir, expected, got = _simulated_then_torchrun(tmp_path, args, merges=None)
    assert expected["merges"] == 1
    for key in ("allreduce_bytes", "merge_bytes", "node_move_bytes", "weights_traffic_bytes", "statistics_bytes",
                "syncs"):
        assert got[key] == expected[key], key
    assert got["bytes_sent_by_collectives"]["weights"] == got["weights_traffic_bytes"]
    nodes = [int(r["num_nodes"] or 0) for r in csv_rows(expected_dir, "training_log.csv")]
    assert expected["allreduce_bytes"] == sum(3 * 2 * (n - 1) * expected["gradient_bytes"] for n in nodes if n > 1)


def test_ring_scaling_benchmark_measures_under_torchrun_the_bytes_the_accounting_gives(tmp_path):
    """benchmarks.ring_scaling on 2 processes: every scheme's sync through the torchrun backend's own collectives,
    each rank's counted bytes summed equal to the accounting (the tool exits 1 where they differ), priced at the
    larger sizes too."""
    from benchmarks.ring_scaling import SCHEMES, main

    assert main(["--procs", "2", "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "ring_scaling.json").read_text())
    measured = {r["scheme"]: r for r in rows if "measured_bytes_all_nodes" in r}
    assert set(measured) == set(SCHEMES) and all(r["nodes"] == 2 for r in measured.values())
    for r in measured.values():
        assert r["measured_bytes_all_nodes"] == r["bytes_all_nodes"] > 0
    # a ring of int8 shards sends about a quarter of fp32's bytes; top-k 2% far less
    assert 0.24 < measured["int8"]["ratio_to_fp32"] < 0.27 and measured["topk"]["ratio_to_fp32"] < 0.1
    assert {r["nodes"] for r in rows} == {2, 4, 8, 16, 64}
