"""benchmarks.gpu_check, as far as a machine without CUDA can check it: the refusal, the report written
from a recorded result, the cuda marker's announced deselection, and the validity of what each step runs."""

import json
import re
import subprocess
import sys
import time

import pytest
import torch

from benchmarks import gpu_check
from tests.conftest import ROOT
from training_logs.memory_monitor import device_peak_mib
from utils.config import load_config


def test_without_cuda_it_refuses_in_one_line_before_any_work(tmp_path):
    assert not torch.cuda.is_available()  # CI and this machine: no GPU
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path / "record")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: gpu_check needs a CUDA device, and this torch {torch.__version__} (CUDA build: "
        f"{torch.version.cuda or 'none'}) sees none here; run it on a GPU machine"]
    assert not (tmp_path / "record").exists() and time.time() - start < 60


def recorded_result() -> dict:
    """What a GPU machine would record: one step failed, the system numbers in, one target missed."""
    steps = [gpu_check.Step("cuda_tests", "pytest -m cuda", 150, True, 41.2, {"passed": 11}),
             gpu_check.Step("run_bf16", "run.py on cuda, bf16 autocast", 60, True, 12.0,
                            {"final_metric": 181.5, "merges": 3, "against_run_fp32": {
                                "same_decisions": True, "max_rel_perplexity_difference": 0.012, "within": True}}),
             gpu_check.Step("torchrun", "torchrun, 2 processes on one GPU", 120, False, 20.0, {"nccl": "x"},
                            "error: rank 1: a collective failed (ncclInvalidUsage | Duplicate GPU detected)"),
             gpu_check.Step("system", "benchmarks.system", 240, True, 200.0, {
                 "preset": "microllama-300m", "seq_len": 512,
                 "inner": {"bf16": {"tokens_per_s": 109999.0, "engine_speed_over_plain": 0.97, "mfu_datasheet": 0.25},
                           "bf16+compile": {"tokens_per_s": 186481.0, "engine_speed_over_plain": 0.93,
                                            "mfu_datasheet": 0.38}},
                 "end_to_end": {"variant": "fp32", "tokens_per_s": 10300.0, "over_node_loop": 0.45}})]
    return {"started": "2026-11-22 10:00", "budget_s": 480.0, "used_s": 273.2,
            "facts": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.2, "driver": "570.1", "torch": "2.13.0",
                      "cuda": "12.8", "missing_packages": {"clearml": "not needed (clearml_mode=off)"}},
            "steps": [vars(s) for s in steps], "targets": gpu_check.targets_of(steps)}


def test_the_report_says_what_ran_what_failed_and_which_targets_were_met(tmp_path):
    result = recorded_result()
    targets = result["targets"]
    assert targets["engine_speed_over_plain_bf16_compile"] == {
        "what": "engine node loop / strong plain loop tokens/s, bf16 + compile", "target": 0.95, "measured": 0.93,
        "met": False}
    assert targets["engine_speed_over_plain_bf16"]["met"] is True  # 0.97
    assert targets["engine_speed_over_plain_fp32"]["measured"] is None  # not in the record
    assert targets["mfu_bf16_compile"]["met"] is False and targets["end_to_end_over_node_loop"]["met"] is False
    json_path, md_path = gpu_check.write_report(result, tmp_path)
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(result))
    text = md_path.read_text()
    assert text.startswith("# GPU check (2026-11-22 10:00, NVIDIA H100 80GB HBM3, 79.2 GiB, driver 570.1, torch "
                           "2.13.0, CUDA 12.8)")
    assert "Missing packages: clearml (not needed (clearml_mode=off))." in text
    assert "| cuda_tests | pytest -m cuda | ok | 41 | passed 11 |" in text
    assert "| torchrun | torchrun, 2 processes on one GPU | FAILED | 20 | error: rank 1: a collective failed " \
           "(ncclInvalidUsage / Duplicate GPU detected) |" in text  # a | inside a cell would break the table
    assert "against_run_fp32: same decisions True, max rel. perplexity difference 0.012" in text
    assert "| microllama-300m MFU, bf16 + compile, 16k tokens a step (datasheet peak) | 0.38 | >= 0.4 | NO |" in text
    assert "| bf16+compile | 186481 | 0.930 | 0.38 |" in text
    assert not list(tmp_path.glob(".*.tmp"))


def test_an_engine_slower_than_the_plain_loop_misses_the_target():
    """benchmarks.system's record of the first GPU check (H100, 2026-11-26): bf16 + compile, the engine's 10 steps
    in 0.3677 s, the plain loop's in 0.2736 s: 0.744x its speed, under 0.95x."""
    from benchmarks.system import inner_record

    record = inner_record({"engine_s": 0.3677, "plain_s": 0.2736, "textbook_s": 0.2736, "tokens": 40960})
    assert record["engine_speed_over_plain"] == pytest.approx(0.2736 / 0.3677)
    assert record["tokens_per_s"] == pytest.approx(40960 / 0.3677)
    steps = [gpu_check.Step("system", "benchmarks.system", 240, True, 81.0, {"inner": {"bf16+compile": record}})]
    target = gpu_check.targets_of(steps)["engine_speed_over_plain_bf16_compile"]
    assert target["measured"] == pytest.approx(0.744, abs=1e-3) and target["met"] is False


def test_a_step_that_did_not_run_leaves_its_targets_unmeasured():
    steps = [gpu_check.Step("system", "benchmarks.system", 240, None, 0.0, {}, "not run: the time budget was used up")]
    assert all(t["measured"] is None and t["met"] is None for t in gpu_check.targets_of(steps).values())
    result = {**recorded_result(), "steps": [vars(s) for s in steps], "targets": gpu_check.targets_of(steps)}
    text = gpu_check.render_markdown(result)
    assert "| system | benchmarks.system | not run | 0 | not run: the time budget was used up |" in text
    assert text.count("| not measured |") == len(gpu_check.TARGETS)


def test_the_stacked_step_rehearsed_on_the_cpu_records_each_cases_ratio(tmp_path):
    """The stacked step's two cases, on the CPU with tiny settings (the same code the GPU runs, smaller): each case's
    stacked / sequential ratio lands in the step's detail and in the targets."""
    from benchmarks.stacked import main as stacked_main

    def in_process(name, cmd, limit):  # the command gpu_check would launch, run here (no interpreter to start)
        assert cmd[1:3] == ["-m", "benchmarks.stacked"]
        return stacked_main(cmd[3:]), ""

    step = gpu_check.Step("stacked", "benchmarks.stacked", 240)
    tiny = ("--preset", "microllama-nano", "--seq-len", "32", "--steps", "1", "--repeats", "1", "--nodes", "2")
    gpu_check.stacked_step(step, in_process, tmp_path, sys.executable, "cpu", tiny)
    assert step.ok, step.error
    assert set(step.detail) == set(gpu_check.STACKED) and all(d["speedup"] > 0 for d in step.detail.values())
    targets = gpu_check.targets_of([step])
    assert targets["stacked_16_tiny"]["measured"] == step.detail["stacked_16_tiny"]["speedup"]
    assert targets["stacked_paper_4"]["target"] == 3.0 and (tmp_path / "stacked.md").is_file()


def test_the_cuda_marker_is_deselected_here_and_says_so():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 5, proc.stdout[-2000:]  # pytest: no test ran (all deselected), not a pass
    assert "deselected 14 CUDA tests (marker cuda): no CUDA device here; python -m benchmarks.gpu_check runs them " \
           "on a GPU" in proc.stdout
    assert "14 deselected" in proc.stdout.strip().splitlines()[-1]


def test_every_run_the_check_makes_is_a_valid_config():
    for extra in (["precision=fp32", "node_execution=sequential"], ["precision=bf16", "node_execution=sequential"],
                  ["precision=fp32", "node_execution=threads"]):
        cfg = load_config(ROOT / "config.yaml", [*gpu_check.RUN, *extra])
        assert cfg.devices == ["cuda"] and cfg.total_nodes == 4 and cfg.merge_frequency == 2
    for backend in ("nccl", "gloo"):
        cfg = load_config(ROOT / "config.yaml", [*gpu_check.TORCHRUN, f"dist_backend={backend}"])
        assert cfg.total_nodes == 2  # torchrun --nproc-per-node 2
        cfg = load_config(ROOT / "config.yaml", [*gpu_check.TORCHRUN, *gpu_check.COMM, f"dist_backend={backend}"])
        assert cfg.sync_fragments == 2 and cfg.outer_compression == "int8"
    cfg = load_config(ROOT / "configs" / "paper_microllama_c4.yaml", gpu_check.PAPER)  # the paper step
    assert (cfg.precision, cfg.total_nodes, cfg.num_outer_steps, cfg.eval_every_inner_steps) == ("fp16", 4, 2, 10)
    assert not cfg.hub_downloads and cfg.model_config.name == "microllama-300m"
    assert gpu_check.SYSTEM[gpu_check.SYSTEM.index("--batch") + 1] == "32"  # 32 x 512: the MFU target's 16k tokens
    # the targets' steps come first and fit the default 8 minutes (the others run while the budget lasts)
    names = [n for n, _, _ in gpu_check.STEPS]
    assert names[:4] == ["cuda_tests", "system", "memory", "stacked"]
    assert sum(limit for _, _, limit in gpu_check.STEPS[:4]) <= 8 * 60
    for config, extra in gpu_check.READINGS.values():  # the memory step's short paper rounds
        cfg = load_config(ROOT / config, [*gpu_check.PAPER_ROUND, *extra])
        assert cfg.model_config.name == "microllama-300m" and not cfg.hub_downloads and cfg.num_inner_steps == 5
        assert cfg.max_batch_size == cfg.initial_batch_size == 8  # the round at the plan's micro-batch, no probe
        assert cfg.total_nodes in (4, 16) and (cfg.offload_idle_nodes == (cfg.total_nodes == 16 or bool(extra)))


def training_log(run_dir, walls):
    """A training_log.csv with two trainers' rows per outer step, each step ending at its cumulative wall_time."""
    report = run_dir / "model_training_report"
    report.mkdir(parents=True, exist_ok=True)
    rows = [f"{step},{t},{wall}" for step, wall in enumerate([0.0, *walls]) for t in (0, 1)]
    (report / "training_log.csv").write_text("outer_step,trainer_id,wall_time\n" + "\n".join(rows) + "\n")


def test_the_memory_step_sets_the_peak_against_the_plan(tmp_path):
    """Each reading's planned bytes (summary.json) against the peak of its memory log; the targets take the worse
    reading, and the offloaded 4-node reading against the resident one projected to the paper's H = 200."""
    import csv

    gib = 2**30
    given = {"paper_4_nodes": (30 * gib, 31 * 1024, 10.0), "paper_16_nodes": (45 * gib, 40 * 1024, 30.0),
             "paper_4_nodes_offloaded": (20 * gib, 20 * 1024, 20.0)}  # planned bytes, peak MiB, second round's s

    def run(name, cmd, limit):
        assert "max_batch_size=8" in cmd and "initial_batch_size=8" in cmd  # plan and round at one micro-batch
        planned, peak, second = given[name]
        report = tmp_path / name / "memory_report"  # where run.py writes memory_log.csv
        report.mkdir(parents=True)
        (tmp_path / name / "summary.json").write_text(json.dumps({
            "memory_plan": {"devices": [{"planned_bytes": planned}], "micro_batch": 8},
            "tokens_seen": 20480, "wall_time_s": 7.0 + second}))
        training_log(tmp_path / name, [7.0, 7.0 + second])  # a first round of 7 s (pinned buffers allocated)
        with (report / "memory_log.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["stage", "cuda:0_peak_mib"])
            w.writerows([["before_round", peak / 2], ["round_peak", peak]])
        return 0, ""

    detail, _ = gpu_check.memory_checks(run, tmp_path, sys.executable, 60)
    assert detail["paper_4_nodes"]["accuracy"] == pytest.approx(1 - 1 / 30)
    assert detail["paper_16_nodes"]["accuracy"] == pytest.approx(1 - 5 / 45)
    steps = [gpu_check.Step("memory", "memory", 480, True, 100.0, detail)]
    targets = gpu_check.targets_of(steps)
    assert targets["memory_plan_accuracy"]["measured"] == pytest.approx(1 - 5 / 45)
    assert targets["memory_plan_accuracy"]["met"] is False  # 11% off on the 16-node reading
    # by hand, the second rounds: 5 steps in 10 s resident -> 400 s of compute at H = 200; offloading adds 10 s a
    # round: 400 / 410 (the first rounds, 7 s each, do not count)
    assert targets["offloaded_over_resident"]["measured"] == pytest.approx(400 / 410)
    assert targets["offloaded_over_resident"]["met"]


def test_the_peak_is_read_from_where_a_run_writes_its_memory_log(tmp_path):
    """The H200's record of 2026-11-28: the resident 4-node reading's memory_log.csv (memory_report/, where
    run_dir/lifecycle.py puts it; the check once looked in model_training_report/). Its largest peak: 49041.3 MiB."""
    import shutil

    recorded = ROOT / "benchmarks/results/gpu_check/2026-11-28_h200/1_full/runs/paper_4_nodes/memory_log.csv"
    (tmp_path / "memory_report").mkdir()
    shutil.copy(recorded, tmp_path / "memory_report" / "memory_log.csv")
    assert device_peak_mib(tmp_path) == 49041.3
    (tmp_path / "memory_report" / "memory_log.csv").write_text("outer_step,stage,process_rss_mib\n1,round_peak,9\n")
    assert device_peak_mib(tmp_path) == 0.0  # a CPU run has no device peak


def test_a_rounds_seconds_come_from_the_recorded_training_log(tmp_path):
    """The H200's one-round readings of 2026-11-28: the last outer step's wall seconds are its cumulative wall_time
    less the step before's (here outer step 0, at 0)."""
    import shutil

    for name, seconds in (("paper_4_nodes", 3.35362), ("paper_4_nodes_offloaded", 8.91185)):
        (tmp_path / name / "model_training_report").mkdir(parents=True)
        shutil.copy(ROOT / "benchmarks/results/gpu_check/2026-11-28_h200/1_full/runs" / name / "training_log.csv",
                    tmp_path / name / "model_training_report" / "training_log.csv")
        assert gpu_check.second_round_s(tmp_path / name) == pytest.approx(seconds)
    training_log(tmp_path / "two", [8.9, 11.0])
    assert gpu_check.second_round_s(tmp_path / "two") == pytest.approx(2.1)


def test_offloading_is_projected_to_the_papers_h_from_the_recorded_h200_rounds():
    """The H200 of 2026-11-28: one 5-step round of the 4-node reading took 3.355 s resident and 8.914 s offloaded
    (0.38x at H = 5); at H = 200 the compute is 40 x 3.355 = 134.2 s and the moves 5.559 s: 0.960x."""
    assert gpu_check.offloaded_at_paper_h(3.355, 8.914) == pytest.approx(134.2 / (134.2 + 5.559))
    assert gpu_check.offloaded_at_paper_h(3.355, 3.0) == 1.0  # an offloaded round measured faster adds nothing


def test_a_reading_the_memory_plan_refuses_is_recorded_as_refused_not_failed(tmp_path):
    """The 16-node reading needs 127 GiB of host memory; the lent machines have 128 GiB (124 free): run.py refuses
    it in one line (2026-11-28). The step still passes, and the accuracy target reads the readings that ran."""
    refusal = ("error: memory plan: the host needs 127 GiB (offloaded_nodes 54.5, rollback_snapshot 36.3, "
               "checkpoint_copy 36.3 GiB), more than the 124 GiB available; use fewer nodes or a machine with more "
               "memory")

    def run(name, cmd, limit):
        if name == "paper_16_nodes":
            return 1, "data: ...\n" + refusal
        report = tmp_path / "runs" / name / "memory_report"  # run_step's runs directory
        report.mkdir(parents=True)
        (tmp_path / "runs" / name / "summary.json").write_text(json.dumps({
            "memory_plan": {"devices": [{"planned_bytes": 10 * 2**30}], "micro_batch": 8},
            "tokens_seen": 100, "wall_time_s": 1.0}))
        (report / "memory_log.csv").write_text("stage,cuda:0_peak_mib\nround_peak,9728\n")
        training_log(tmp_path / "runs" / name, [0.5, 1.0])
        return 0, ""

    step = gpu_check.Step("memory", "memory", 110)
    gpu_check.run_step(step, run, tmp_path, sys.executable)
    assert step.ok and step.detail["paper_16_nodes"] == {"refused": refusal}
    assert gpu_check.targets_of([step])["memory_plan_accuracy"]["measured"] == pytest.approx(1 - 512 / 10240)


def test_the_system_benchmark_runs_end_to_end_at_a_batch_above_the_configs_cap(tmp_path, cache_dir):
    """benchmarks.system as gpu_check runs it, on the CPU with a tiny model: its batch of 20 is above config.yaml's
    max_requested_batch of 16 (at 32 on the H200 of 2026-11-28, its cluster rounds stopped on that key after the
    inner loop had run). Every number gpu_check reads is in the JSON."""
    from benchmarks.system import main as system_main

    config = tmp_path / "config.yaml"  # config.yaml with the tests' cache and tiny corpus (system takes no overrides)
    text = (ROOT / "config.yaml").read_text()
    for key, value in (("cache_dir", str(cache_dir)), ("tokenizer", "bpe"), ("tokenizer_vocab_size", "512"),
                       ("embedded_sources", "[tiny]")):
        text, found = re.subn(rf"^{key}:.*$", f"{key}: {value}", text, flags=re.M)
        assert found == 1, key
    config.write_text(text)
    out = tmp_path / "system.json"
    assert system_main(["--config", str(config), "--preset", "microllama-nano", "--seq-len", "32", "--batch", "20",
                        "--steps", "2", "--inner-steps", "2", "--repeats", "1", "--variants", "fp32",
                        "--json", str(out)]) == 0
    numbers = json.loads(out.read_text())
    record = numbers["inner"]["fp32"]
    assert record["engine_speed_over_plain"] > 0 and record["strong_over_textbook"] > 0
    assert numbers["end_to_end"]["over_node_loop"] > 0 and numbers["batch"] == 20


def test_two_recorded_runs_are_compared_by_decisions_and_perplexity(tmp_path):
    import csv

    header = [*gpu_check.DECISIONS, "val_perplexity"]
    for name, ppl in (("a", 100.0), ("b", 100.05)):
        path = tmp_path / name / "model_training_report" / "training_log.csv"
        path.parent.mkdir(parents=True)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerow(["1", "0", "0 1", "3", "2", "2", "4", ppl])
    compared = gpu_check.compare_runs(tmp_path / "a", tmp_path / "b", 1e-3)
    assert compared["same_decisions"] and compared["within"]
    assert compared["max_rel_perplexity_difference"] == pytest.approx(0.0005, rel=1e-9)  # 0.05 / 100
    assert not gpu_check.compare_runs(tmp_path / "a", tmp_path / "b", 1e-4)["within"]


def test_the_cuda_tests_step_reads_the_recorded_pytest_summary():
    """The H200's cuda_tests log of 2026-11-28 (13 passed, the stacked test stopped by the budget): the step counts
    each outcome from pytest's summary line and fails; its command asks pytest for each test's seconds."""
    log = (ROOT / "benchmarks/results/gpu_check/2026-11-28_h200/1_full/logs/cuda_tests.log").read_text()

    def run(name, cmd, limit):
        assert cmd[1:4] == ["-m", "pytest", "-q"] and "--durations=0" in cmd and limit == 130
        return 1, log

    step = gpu_check.Step(*next(s for s in gpu_check.STEPS if s[0] == "cuda_tests"))
    gpu_check.run_step(step, run, ROOT, sys.executable)
    assert step.detail == {"failed": 1, "passed": 13, "deselected": 559} and step.ok is False
