"""Config validation: one-line errors naming the key, exit code 2, before any work starts."""

import subprocess
import sys

import pytest
import yaml

from run_dir.run_config import load_run_config
from tests.conftest import ROOT
from utils.config import TABLE_END, TABLE_START, Config, load_config, markdown_table
from utils.errors import ConfigError


def test_default_config_file_is_valid():
    cfg = load_config(ROOT / "config.yaml")
    assert cfg.devices == ["cpu", "cpu"] and cfg.distributed_algo == "DiLoCo"


def test_overrides_take_precedence_and_are_typed():
    cfg = load_config(ROOT / "config.yaml", ["num_outer_steps=5", "lr_outer=0.7", "model_config.name=microllama-mini",
                                             "devices=[cuda:0, cuda:1]"])
    assert cfg.num_outer_steps == 5 and cfg.lr_outer == 0.7
    assert cfg.model_config.name == "microllama-mini" and cfg.devices == ["cuda:0", "cuda:1"]


def test_quoted_learning_rates_as_in_the_authors_config():
    assert load_config(None, ['lr_inner="2e-5"']).lr_inner == pytest.approx(2e-5)


@pytest.mark.parametrize("override,key,fragment", [
    ("num_outer_step=3", "num_outer_step", "did you mean 'num_outer_steps'"),
    ("num_outer_steps=abc", "num_outer_steps", "expected an integer"),
    ("num_outer_steps=0", "num_outer_steps", "below the minimum"),
    ("lr_inner=fast", "lr_inner", "expected a number"),
    ("merging_policy=worst_with_best", "merging_policy", "did you mean"),
    ("padding_percentage=1.5", "padding_percentage", "above the maximum"),
    ("devices=[tpu]", "devices", "not cpu, cuda"),
    ("num_init_trainers=9", "num_init_trainers", "at least as many nodes"),
    ("model_config.pretrained=maybe", "model_config.pretrained", "true or false"),
    ("model_config.nme=x", "model_config.nme", "did you mean 'model_config.name'"),
    ("outer_nesterov=true", "outer_nesterov", "outer_momentum"),
    ("sampling_method=linear_rampup", "rampup_tokens", "max_tokens"),
])
def test_bad_values_name_the_key(override, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "config.yaml", [override])
    assert err.value.key == key and fragment in str(err.value)


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_outer_steps: 3\nlr_outr: 0.5\n")
    for args in (["--config", str(bad)], ["--config", str(tmp_path / "missing.yaml")], ["ETA=-1"]):
        proc = subprocess.run([sys.executable, "run.py", *args, f"log_dir={tmp_path}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        expected = "error: --config: file not found" if "missing" in args[-1] else "error: config key"
        assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr  # a flag is not called a key
        assert "Traceback" not in proc.stderr
    assert not any(tmp_path.glob("*/training_log.log"))  # nothing started


def test_every_key_is_documented_in_readme_and_config_yaml():
    readme = (ROOT / "docs" / "configuration.md").read_text()  # the table's page (moved from the README)
    assert f"{TABLE_START}\n{markdown_table()}\n{TABLE_END}" in readme, "run: python -m utils.config --update-docs"
    config_yaml = (ROOT / "config.yaml").read_text()
    for line in markdown_table().splitlines()[2:]:
        key = line.split("`")[1]
        assert f"`{key}`" in readme, key
        assert key.split(".")[-1] + ":" in config_yaml, key
    assert set(Config().to_dict())  # the table is built from the dataclass itself


@pytest.mark.parametrize("overrides", [
    # the paper's estimator with one node per trainer and no merges: no trainer ever sees two samples
    ["variance_estimator=nodes", "num_init_trainers=4", "merge_frequency=0"],
    ["variance_estimator=nodes", "devices=[cpu]", "nodes_per_gpu=1", "num_init_trainers=1"],
    # one example per node step cannot be split into micro-batches
    ["variance_estimator=micro_batches", "initial_batch_size=1"],
])
def test_configs_whose_batches_can_never_grow_are_refused(overrides):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "config.yaml", overrides)
    assert err.value.key == "variance_estimator" and "never grow" in str(err.value)
    # the same settings without adaptive batching are fine
    assert load_config(ROOT / "config.yaml", [*overrides, "sampling_method=constant"]).warnings() == []


def test_one_node_trainers_with_the_nodes_estimator_are_warned_about():
    cfg = load_config(ROOT / "config.yaml", ["variance_estimator=nodes", "num_init_trainers=3"])  # 4 nodes
    (warning,) = cfg.warnings()
    assert "trainers 1 2 start with one node" in warning
    assert load_config(ROOT / "config.yaml", ["variance_estimator=nodes", "num_init_trainers=2"]).warnings() == []
    assert load_config(ROOT / "config.yaml").warnings() == []  # micro_batches works with one node


def test_readme_quotes_config_yaml_values_truly():
    import re

    import yaml

    readme = (ROOT / "docs" / "configuration.md").read_text()  # the table's page (moved from the README)
    values = yaml.safe_load((ROOT / "config.yaml").read_text())
    sentence = readme[readme.index("`config.yaml` sets"):].split(")")[0]
    quoted = re.findall(r"`(\w+): ([^`]+)`", sentence)
    assert len(quoted) >= 3
    for key, value in quoted:
        assert values[key] == yaml.safe_load(value), key


def test_cpu_kernels_are_chosen_before_torch_starts_and_recorded(tmp_path, cache_dir, monkeypatch):
    """cpu_capability=avx2 reaches torch through the environment before its first operation; config.yaml,
    the log and summary.json say which kernels and threads made the run; a capability torch does not use
    is refused in one line."""
    import json
    import os

    import torch
    import yaml

    from tests.conftest import TINY

    args = [sys.executable, str(ROOT / "run.py"), *TINY, f"cache_dir={cache_dir}", f"log_dir={tmp_path}",
            "num_outer_steps=1", "cpu_threads=1"]
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.run([*args, "run_name=avx2", "cpu_capability=avx2"], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = tmp_path / "avx2"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["cpu_capability"] == "avx2"
    # idle OpenMP threads spin briefly, then sleep (utils/openmp.py), unless the user chose otherwise
    spin = "spin 1000 then sleep (GOMP_SPINCOUNT)"
    assert json.loads((run_dir / "summary.json").read_text())["cpu_kernels"] == {"capability": "avx2", "threads": 1,
                                                                               "idle_threads": spin}
    assert f"cpu kernels: avx2, 1 threads (cpu_capability, cpu_threads; the last digits of a run depend on them); " \
           f"idle threads: {spin}" in (run_dir / "training_log.log").read_text()
    # auto records what this CPU gives; a wait policy of the user's own is kept
    proc = subprocess.run([*args, "run_name=auto"], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert summary["cpu_kernels"]["idle_threads"] == "OMP_WAIT_POLICY=ACTIVE"
    best = torch.backends.cpu.get_cpu_capability().lower() if "ATEN_CPU_CAPABILITY" not in os.environ else None
    recorded = yaml.safe_load((tmp_path / "auto" / "config.yaml").read_text())["cpu_capability"]
    assert recorded in ("default", "avx2", "avx512") and (best is None or recorded == best)
    # a capability that this (already started) process does not use: refused before any work
    from run import train

    actual = torch.backends.cpu.get_cpu_capability().lower()
    other = "default" if actual != "default" else "avx2"
    # train() asks for its kernels in this process's environment: undone after the test, so the subprocesses of
    # later tests do not inherit the request
    monkeypatch.setitem(os.environ, "ATEN_CPU_CAPABILITY", os.environ.get("ATEN_CPU_CAPABILITY", actual))
    with pytest.raises(ConfigError, match=f"'cpu_capability': '{other}' is not what torch uses in this process"):
        train(load_config(ROOT / "config.yaml", [*TINY, f"log_dir={tmp_path}", f"cpu_capability={other}"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auto", "avx2"]


def test_committed_configs_name_the_data_they_load():
    """A config's data header says which corpus its dataset key loads (cpu_c4.yaml once said 'embedded corpus'
    over dataset: c4)."""
    checked = 0
    for path in [ROOT / "config.yaml", *sorted((ROOT / "configs").glob("*.yaml"))]:
        text = path.read_text()
        header = next((line for line in text.splitlines() if line.startswith("# --- data")), None)
        dataset = (yaml.safe_load(text) or {}).get("dataset")
        if header is None or dataset is None:
            continue
        checked += 1
        assert ("embedded English corpus" in header) == (dataset == "embedded"), (path.name, header)
        assert ("C4 sample" in header) == (dataset == "c4"), (path.name, header)
    assert checked >= 5


def test_openmp_spinning_is_limited_only_before_torch_loads_and_when_the_user_chose_nothing():
    """libgomp reads its wait policy once, when torch loads it: set later, it would be recorded but not used."""
    import os

    code = ("import os, sys; sys.path.insert(0, {root!r}); {before}from utils.openmp import limit_openmp_spinning; "
            "limit_openmp_spinning(); print(os.environ.get('GOMP_SPINCOUNT'))")
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

    def spin(before: str = "", **env: str) -> str:
        proc = subprocess.run([sys.executable, "-c", code.format(root=str(ROOT), before=before)], capture_output=True,
                              text=True, env={**clean, **env}, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert spin() == "1000"
    assert spin(GOMP_SPINCOUNT="5") == "5"
    assert spin(OMP_WAIT_POLICY="PASSIVE") == "None"
    assert spin(before="import torch; ") == "None"
    # run.py's own imports load no torch, so its main() sets the policy before torch loads (the run directory's
    # reader once pulled torch in through run_dir/lifecycle.py, and the policy was recorded but not used)
    assert spin(before="import run; ") == "1000"


FIRST_RELEASE = ROOT / "tests" / "fixtures" / "first_release_config.yaml"
FIRST_RELEASE_HASH = "ea1ae77b7380180f"  # its config hash when it was committed
LEGACY_HASH = "cab2a4860df0a6c4"  # what versions before 2026-11-24 wrote (node_schedule counted at its default)


def test_a_run_from_the_first_checkpoint_format_stays_resumable():
    """A key that changes the numbers and is not marked added_later (or resume) enters the config hash of every
    older run with its default, so their checkpoints stop being resumable: this hash would change."""
    # its run directory is read as it ran (fp64 statistics, before statistics_comm existed)
    as_run = load_run_config(FIRST_RELEASE)
    assert as_run.statistics_comm == "fp64" and load_config(FIRST_RELEASE).statistics_comm == "minimal"
    assert as_run.meaning_hash() == FIRST_RELEASE_HASH
    # the checkpoints those versions wrote are still taken
    assert as_run.meaning_hashes() == (FIRST_RELEASE_HASH, LEGACY_HASH)
    # today's default statistics compute something else: a hash of their own, no older checkpoint taken for them
    assert not {FIRST_RELEASE_HASH, LEGACY_HASH} & set(load_config(FIRST_RELEASE).meaning_hashes())


def test_the_first_release_hash_catches_a_new_key_without_its_marks():
    import dataclasses

    from utils.config_schema import _f

    def later(**marks):
        cls = dataclasses.make_dataclass("Later", [("new_knob", float, _f(1.0, "a new key", **marks))], bases=(Config,))
        return load_config(FIRST_RELEASE, ["statistics_comm=fp64"], schema=cls).meaning_hash()  # as it ran

    assert later() != FIRST_RELEASE_HASH  # the trap: unmarked, it changes every older run's hash
    assert later(added_later=True) == FIRST_RELEASE_HASH  # at its default, it leaves them resumable
    assert later(resume=True) == FIRST_RELEASE_HASH
    with pytest.raises(TypeError, match="unknown marks \\['resum'\\]"):  # a misspelt mark is no silent no-op
        later(resum=True)


def test_what_a_key_is_is_read_off_its_field():
    import dataclasses

    from utils import config

    fields = {f.name: f.metadata for f in dataclasses.fields(Config)}
    assert config.RESUME_MAY_CHANGE == {k for k, m in fields.items() if m["resume"]}
    assert {"num_outer_steps", "max_tokens", "target_metric"} <= config.RESUME_MAY_CHANGE
    assert "lr_outer" not in config.RESUME_MAY_CHANGE and "sync_fragments" in config.ADDED_LATER
    assert config.PER_MACHINE_KEYS >= {"cache_dir", "cpu_threads"} and config.WHERE_KEYS == {"log_dir", "cache_dir",
                                                                                              "run_name"}
    assert config.CLUSTER_KEYS[0] == "devices" and "node_schedule" in config.CLUSTER_KEYS
    # each section's cross-key check is named after a section the fields declare
    assert set(config.SECTION_CHECKS) <= {m["section"] for m in fields.values()}


def test_every_compressor_is_a_choice_of_outer_compression():
    """Adding an outer-sync scheme: its class in algorithms/compression.py (COMPRESSORS) and its name among
    outer_compression's choices (utils/config_schema.py stays free of torch, so the choices are written out there)."""
    import dataclasses

    from algorithms.compression import COMPRESSORS

    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(Config)}
    assert set(choices["outer_compression"]) == set(COMPRESSORS)
    assert set(choices["merge_compression"]) <= set(COMPRESSORS)


def test_values_that_name_strings_stay_strings_on_the_command_line_and_in_files(tmp_path):
    """YAML 1.1 would read 2024-11-25 as a date, 3:1 as 181 (base 60) and 007 as an octal 7."""
    cfg = load_config(ROOT / "config.yaml", ["run_name=2024-11-25", "task_name=007"])
    assert (cfg.run_name, cfg.task_name) == ("2024-11-25", "007")
    assert load_config(ROOT / "config.yaml", ["run_name=2024"]).run_name == "2024"
    with pytest.raises(ConfigError, match="'3:1' is not '<outer_step>:<node_id>:<kind>'"):
        load_config(ROOT / "config.yaml", ["inject_fault=3:1"])
    numbers = load_config(ROOT / "config.yaml", ["lr_inner=2e-5", "ETA=0.75", "num_outer_steps=1_000"])
    assert (numbers.lr_inner, numbers.ETA, numbers.num_outer_steps) == (2e-5, 0.75, 1000)
    path = tmp_path / "c.yaml"
    path.write_text("run_name: 2024-11-25\n")
    assert load_config(path).run_name == "2024-11-25"


def test_every_registry_agrees_with_its_config_choices():
    """A config string picks a class from a registry; the key's choices (what --help, the docs and the one-line
    errors name) are written beside the key, so each pair must list the same names."""
    import dataclasses

    from algorithms.calc_batch import BATCH_TESTS, STATISTICS_WIRE
    from algorithms.compression import COMPRESSORS, TopK
    from algorithms.policies import MERGE_POLICIES
    from algorithms.switch_mode import SWITCH_MODES
    from fabrics.corpus import DATA_SOURCES
    from fabrics.models import MODEL_TYPES
    from fabrics.precision import PRECISIONS
    from trainers import TRAINERS

    choices = {f.name: f.metadata.get("choices") for f in dataclasses.fields(Config)}
    registries = {"distributed_algo": TRAINERS, "sampling_method": BATCH_TESTS, "statistics_comm": STATISTICS_WIRE,
                  "outer_compression": COMPRESSORS, "merging_policy": MERGE_POLICIES, "switch_mode": SWITCH_MODES,
                  "dataset": DATA_SOURCES, "model_type": MODEL_TYPES, "precision": PRECISIONS}
    for key, registry in registries.items():
        assert set(choices[key]) == set(registry), key
    # merges average whole states: every compressor but top-k's sparse payloads
    assert set(choices["merge_compression"]) == set(COMPRESSORS) - {TopK.name}
