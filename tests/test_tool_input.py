"""What a new user's first month finds in the tools' input (issue 57, items 5-7): every case ends in one line and exit 2
(or says what it cannot judge), creates nothing it should not, and command-line strings stay the strings typed."""

import json
import os
import subprocess
import sys

import optuna
import pytest

from benchmarks.compare import main as compare_main
from benchmarks.compare.variants import custom, split_overrides
from benchmarks.memory_plan import main as memory_plan_main
from benchmarks.tune import main as tune_main
from benchmarks.tune.claims import open_storage, open_study
from benchmarks.tune.points import PointSampler
from tests.conftest import ROOT
from utils.config import load_config
from utils.errors import ConfigError, exit_on_input_error

PAPER = str(ROOT / "configs" / "paper_microllama_c4.yaml")


def one_error_line(call, capsys) -> str:
    """The tool's `python -m` entry (exit_on_input_error) on `call`: exit 2 and exactly one line on stderr."""
    assert exit_on_input_error(call) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("error: ")
    return line


def compare_args(out, *extra):
    return ["--config", str(ROOT / "config.yaml"), "--max_tokens", "1000", "--out", str(out), "--variants",
            "diloco_b2", "--diloco_batches", "2", *extra]


# ----------------------------------------------------------------------------------------------
# The harness's and the tuner's options


@pytest.mark.parametrize("seeds", ["0", "-1"])
def test_compare_needs_at_least_one_seed_and_creates_nothing(tmp_path, capsys, seeds):
    out = tmp_path / "out"
    line = one_error_line(lambda: compare_main(compare_args(out, "--seeds", seeds)), capsys)
    assert line.startswith(f"error: --seeds: {seeds}") and not out.exists()


@pytest.mark.parametrize("tool", ["compare", "tune"])
def test_an_out_that_is_a_file_or_cannot_be_created_is_one_line(tmp_path, capsys, tool):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    for out, words in ((a_file, "a file, not a folder"), (a_file / "sub" / "out", "cannot be created")):
        args = compare_args(out, "--seeds", "1")
        call = ((lambda args=args: compare_main(args)) if tool == "compare" else
                (lambda args=args: tune_main([*args, "--trials", "1"])))
        line = one_error_line(call, capsys)
        assert line.startswith(f"error: --out {out}: ") and words in line, line
    assert a_file.read_text() == "keep me"


def test_a_cluster_file_mixing_number_and_text_keys_is_one_line(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("devices: [cpu, cpu]\n2: fast\n")
    line = one_error_line(lambda: compare_main(compare_args(tmp_path / "out", "--cluster", str(cluster))), capsys)
    assert line.startswith(f"error: --cluster: {cluster}: '2' is not a cluster key")


# ----------------------------------------------------------------------------------------------
# Study storages: unknown, missing, damaged


def open_it(url, out):
    storage = open_storage(url, out)
    return open_study("x", storage, "minimize", PointSampler((), {}))


def test_storages_that_cannot_be_opened_are_one_line_and_left_as_they_were(tmp_path, capsys):
    not_a_db = tmp_path / "studies.db"
    not_a_db.write_bytes(b"this is not an SQLite file " * 50)
    torn = tmp_path / "torn.journal"
    open_it(str(torn), tmp_path).add_trial(optuna.trial.create_trial(params={}, distributions={}, value=1.0))
    whole = torn.read_bytes()
    torn.write_bytes(whole + b'{"op_code": 4, "worker_id": "x", "stud')  # a process died mid-write
    cases = [("foo://bar", "unknown database scheme 'foo'"),
             ("postgresql://user@localhost/db", "no driver for postgresql is installed"),
             (f"sqlite:///{not_a_db}", "not a study storage this tool can open (file is not a database)"),
             (str(torn), "its last line is torn (38 bytes after the last newline"),
             (str(tmp_path), "a folder, not a journal file")]
    for url, words in cases:
        line = one_error_line(lambda url=url: open_it(url, tmp_path), capsys)
        assert words in line, line
    assert f"truncate -s {len(whole)} {torn}" in one_error_line(lambda: open_it(str(torn), tmp_path), capsys)
    assert torn.read_bytes() == whole + b'{"op_code": 4, "worker_id": "x", "stud'  # nothing was changed
    assert not_a_db.read_bytes() == b"this is not an SQLite file " * 50
    os.truncate(torn, len(whole))  # the advice works: the journal opens again with its trial
    assert len(open_it(str(torn), tmp_path).get_trials()) == 1


def test_tune_with_an_unknown_storage_scheme_writes_no_study(tmp_path, capsys):
    out = tmp_path / "tune"
    line = one_error_line(lambda: tune_main([*compare_args(out), "--trials", "1", "--storage", "foo://x"]), capsys)
    assert line == ("error: --storage foo://x: unknown database scheme 'foo' (sqlite:///PATH, postgresql://..., "
                    "mysql+pymysql://..., or a journal file's path)")
    assert not (out / "studies.db").exists()


# ----------------------------------------------------------------------------------------------
# The memory plan


def test_memory_plan_capacity_must_be_finite(capsys):
    for bad in ("inf", "nan", "-1"):
        with pytest.raises(SystemExit) as exc:
            memory_plan_main(["--config", PAPER, "--capacity_gb", bad])
        assert exc.value.code == 2
        assert "--capacity_gb must be a finite number of GiB above 0" in capsys.readouterr().err


def test_memory_plan_without_a_capacity_gives_no_verdict(capsys):
    """A CUDA card that is not here and no --capacity_gb: the plan is shown, "fits" is null, exit 2 with one line
    (it once said "fits": true for a plan of any size)."""
    assert memory_plan_main(["--config", PAPER, "--json", "devices=[cuda:0]", "nodes_per_gpu=64"]) == 2
    captured = capsys.readouterr()
    plan = json.loads(captured.out)
    assert plan["fits"] is None and plan["devices"][0]["fits"] is None and plan["devices"][0]["planned_bytes"] > 0
    assert captured.err.strip() == ("error: --capacity_gb: cuda:0 is not on this machine, so its capacity is unknown; "
                                    "give --capacity_gb for a verdict")


def test_memory_plan_advice_is_at_the_plans_micro_batch_and_never_a_key_already_set(capsys):
    sixteen = str(ROOT / "configs" / "paper_microllama_c4_16nodes.yaml")
    # as written the 16-node config offloads idle nodes and computes one at a time: nothing left to advise at 16
    assert memory_plan_main(["--config", sixteen, "--capacity_gb", "80", "--micro_batch", "16", "--json"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["micro_batch"] == 16 and plan["fits"] is False and plan["keys_that_fit"] == ""
    assert memory_plan_main(["--config", sixteen, "--capacity_gb", "80", "--micro_batch", "2", "--json",
                             "offload_idle_nodes=false"]) == 1
    plan = json.loads(capsys.readouterr().out)
    advice = plan["keys_that_fit"]
    assert advice and "offload_idle_nodes=true" in advice and "max_concurrent_nodes" not in advice
    assert memory_plan_main(["--config", sixteen, "--capacity_gb", "80", "--micro_batch", "2", "--json",
                             *advice.split()]) == 0  # the advice, at that micro-batch, fits


def test_a_reader_that_closes_the_output_early_is_one_line_not_a_traceback():
    read, write = os.pipe()
    os.close(read)  # `| head` that already left
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory_plan", "--config", PAPER, "--capacity_gb", "80"],
                          cwd=ROOT, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == ("error: the output was closed before it ended (a pipe to head?); what was read is "
                                   "incomplete")


# ----------------------------------------------------------------------------------------------
# Config values: strings stay strings, rounds that never evaluate, an ETA that never grows a batch


@pytest.mark.parametrize("typed", ["no", "null", "~", "yes", "off", "1.50", "2024", "007", ""])
def test_command_line_strings_stay_the_strings_typed(typed):
    assert load_config(ROOT / "config.yaml", [f"run_name={typed}"]).run_name == typed
    assert load_config(ROOT / "config.yaml", [f"task_name={typed}"]).task_name == typed


def test_non_string_keys_still_read_yaml():
    cfg = load_config(ROOT / "config.yaml", ["tensorboard=no", "lr_inner=2e-3", "num_outer_steps=3",
                                             "devices=[cpu, cpu]"])
    assert (cfg.tensorboard, cfg.lr_inner, cfg.num_outer_steps, cfg.device_names) == (False, 2e-3, 3, ["cpu", "cpu"])
    with pytest.raises(ConfigError, match="'num_outer_steps': expected an integer"):
        load_config(ROOT / "config.yaml", ["num_outer_steps=no"])


def test_add_variant_values_may_hold_spaces():
    assert split_overrides("node_schedule=[{node: 1, leave: 2}] lr_inner=1e-3 task_name=my run") == [
        "node_schedule=[{node: 1, leave: 2}]", "lr_inner=1e-3", "task_name=my run"]
    assert split_overrides("task_name='a  b' ETA=0.5") == ["task_name=a  b", "ETA=0.5"]  # quotes keep what they hold
    (variant,) = custom(("churn=node_schedule=[{node: 1, leave: 2}] lr_inner=1e-3",), {}).values()
    assert variant.overrides == ("node_schedule=[{node: 1, leave: 2}]", "lr_inner=1e-3")
    cfg = load_config(ROOT / "config.yaml", ["devices=[cpu, cpu]", "num_init_trainers=2", *variant.overrides])
    assert "leave" in str(cfg.node_schedule)


def test_an_evaluation_interval_longer_than_the_round_is_refused():
    with pytest.raises(ConfigError, match="'eval_every_inner_steps': 50 is more than a round's num_inner_steps 20, "
                                          "so it would never evaluate"):
        load_config(ROOT / "config.yaml", ["eval_every_inner_steps=50"])
    assert load_config(ROOT / "config.yaml", ["eval_every_inner_steps=20"]).eval_every_inner_steps == 20


def test_an_eta_that_cannot_grow_a_batch_is_warned_about():
    (warning,) = load_config(ROOT / "config.yaml", ["ETA=1.5"]).warnings()
    assert warning.startswith("ETA 1.5 >= 1: the norm test asks for at most about b / ETA^2 = 0.44 b")
    assert load_config(ROOT / "config.yaml", ["ETA=0.8"]).warnings() == []
    assert load_config(ROOT / "config.yaml", ["ETA=1.5", "sampling_method=augmented_inner_product_test"]
                       ).warnings() == []  # ETA is the norm test's


def test_the_progress_bar_counts_the_rounds_a_budget_leaves():
    """With max_tokens, the bar's total is the step at which the budget is reached at this round's tokens per round
    (a trial that stops after 2 steps shows 2, not the config's 200)."""
    from cluster.controller import last_step_expected

    cfg = load_config(ROOT / "config.yaml", ["num_outer_steps=200", "max_tokens=1000"])
    assert last_step_expected(cfg, 1, 500, 500) == 2  # 500 left at 500 a round: one more step
    assert last_step_expected(cfg, 1, 400, 400) == 3  # 600 left: ceil(600 / 400) = 2 more
    assert last_step_expected(cfg, 2, 1200, 600) == 2  # reached: this step is the last
    assert last_step_expected(cfg, 1, 1, 1) == 200  # never past num_outer_steps
    assert last_step_expected(load_config(ROOT / "config.yaml", ["num_outer_steps=12"]), 3, 10, 5) == 12
