"""The tuning engine (benchmarks.tune): the same quasi-random points for every method, trials that survive a stop and
are never run twice, one study shared by two processes; every trial a real run.py run on a tiny config."""

import csv
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import psutil
import pytest
from scipy.stats import qmc

from benchmarks.compare.variants import ETA, LR_INNER, Knob, catalogue
from benchmarks.tune import (
    BestPointEnds,
    around_best,
    best_point_ends,
    decided_counts,
    in_named_order,
    knobs_of,
    write_trials,
)
from benchmarks.tune import main as tune_main
from benchmarks.tune.claims import (
    GRACE_S,
    HOST,
    StudyIdentity,
    continued,
    cpu_model,
    fail,
    fail_lost,
    free_points,
    heartbeat,
    open_storage,
    open_study,
    other_studies,
    record,
    started_at,
    variant_of,
)
from benchmarks.tune.points import SEQUENCE_SEED, PointSampler, design_seed, point_params, unit_point
from tests.conftest import ROOT, TINY
from utils.config import load_config

SMALL = [o for o in TINY if not o.startswith(("num_outer_steps", "merge_frequency"))]


def tune_args(out, cache_dir, *extra, max_tokens=1500, seeds="1000"):
    """One tuning seed unless asked (the tool's default is two: 1000,1001), to keep the tests short."""
    return ["--config", str(ROOT / "config.yaml"), "--max_tokens", str(max_tokens), "--max_outer_steps", "400",
            "--variants", "diloco_b2", "--diloco_batches", "2", "--out", str(out), "--tuning_seed", seeds, *extra,
            *SMALL, f"cache_dir={cache_dir}", "max_batch_size=2"]


def trials_of(storage, name="diloco_b2"):
    """The trials of the storage's one study of variant `name` (studies are named VARIANT@DIGEST of their config)."""
    (summary,) = [s for s in optuna.get_all_study_summaries(storage) if variant_of(s) == name]
    assert summary.study_name.startswith(f"{name}@")
    return optuna.load_study(study_name=summary.study_name, storage=storage).get_trials()


def test_points_are_one_halton_sequence_mapped_onto_each_space():
    cfg = load_config(ROOT / "config.yaml", ["lr_inner=0.003"])
    momentum = Knob("outer_momentum", 0.5, 0.95)  # a uniform knob (ETA is log-uniform since its third edge)
    space = (LR_INNER, momentum)
    # relative bounds: 0.1x to 50x the regime's lr, rounded to 4 digits; the others absolute
    assert LR_INNER.bounds(cfg) == (0.0003, 0.15) and ETA.bounds(cfg) == (0.3, 10.0) and ETA.log
    whole = qmc.Halton(d=2, scramble=True, seed=SEQUENCE_SEED).random(6)
    for i in range(6):  # point i does not depend on which points were drawn before it (any worker, any order)
        assert unit_point(i, 2) == pytest.approx(list(whole[i]), abs=1e-12)
        u = unit_point(i, 2)
        params = point_params(i, space, cfg)
        assert params["lr_inner"] == float(f"{0.0003 * 500 ** u[0]:.4g}")  # log-uniform
        assert params["outer_momentum"] == float(f"{0.5 + 0.45 * u[1]:.4g}")  # uniform
    points = [tuple(point_params(i, space, cfg).values()) for i in range(8)]
    assert len(set(points)) == 8
    # the sequence fills the space evenly: axis 1 (base 2) puts 4 of the first 8 points in each half, axis 2 (base 3)
    # 3 of the first 9 in each third
    assert sum(unit_point(i, 2)[0] < 0.5 for i in range(8)) == 4
    assert [sum(k / 3 <= unit_point(i, 2)[1] < (k + 1) / 3 for i in range(9)) for k in range(3)] == [3, 3, 3]
    assert Knob("x", 1.0, 2.0).bounds(cfg) == (1.0, 2.0)


def test_each_study_draws_its_own_points_and_searches_its_knobs_jointly():
    """Two studies with the same space draw different points (each its own scrambling, from its variant's name, the
    same on every machine); within one, the trials near any lr inside the range (within a factor of 2) meet at least
    3 values of every other knob, discrete ones included, at the 28 trials the sweeps run (24 left AdLoCo's knobs
    with 2 near some lrs once the lr range grew to 0.1x-50x)."""
    cfg = load_config(ROOT / "config.yaml", ["lr_inner=0.003"])
    known = catalogue(cfg, [1, 2, 4, 8, 16], 0.3)
    assert design_seed("adloco") == design_seed("adloco") != design_seed("adloco_never_accumulate")
    space = known["adloco"].search
    a = [point_params(i, space, cfg, design_seed("adloco")) for i in range(16)]
    b = [point_params(i, space, cfg, design_seed("adloco_never_accumulate")) for i in range(16)]
    assert {p["lr_inner"] for p in a}.isdisjoint({p["lr_inner"] for p in b})
    # SNOO's inner lr reaches lower (its outer Nesterov step multiplies the inner step); the top is everyone's
    assert [known[n].search[0].bounds(cfg) for n in ("snoo", "snoo_tuned_batch", "ddp_tuned_batch")] == [
        (0.000105, 0.15), (0.000105, 0.15), (0.0003, 0.15)]
    for name in ("adloco", "adloco_never_accumulate", "adloco_paper", "diloco_tuned_batch", "snoo_tuned_batch",
                 "diloco_nesterov_b4", "ddp_tuned_batch"):
        space = known[name].search
        points = [point_params(i, space, cfg, design_seed(name)) for i in range(28)]
        for knob in space:
            if knob.choices:
                assert {p[knob.key] for p in points} == set(knob.choices), (name, knob.key)
        low, high = space[0].bounds(cfg)
        for centre in (p for p in points if 2 * low <= p["lr_inner"] <= high / 2):
            near = [p for p in points if 0.5 <= p["lr_inner"] / centre["lr_inner"] <= 2]
            for knob in space[1:]:
                assert len({p[knob.key] for p in near}) >= 3, (name, knob.key, centre)


def test_a_best_point_on_an_edge_is_flagged(tmp_path):
    storage = open_storage(str(tmp_path / "studies.journal"), tmp_path)
    lr = optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)
    batch = optuna.distributions.CategoricalDistribution((1, 2, 4))
    study = open_study("diloco_tuned_batch", storage, "minimize", PointSampler((LR_INNER,), {}))
    for i, (value_lr, value_b, objective) in enumerate([(9e-3, 2, 100.0), (1e-3, 2, 200.0), (3e-4, 4, 300.0)]):
        study.add_trial(optuna.trial.create_trial(params={"lr_inner": value_lr, "initial_batch_size": value_b},
                                                  distributions={"lr_inner": lr, "initial_batch_size": batch},
                                                  value=objective, user_attrs={"point": i}))
    # log10 9e-3 is 0.98 of the way
    assert best_point_ends(study, {}).edges == {0: "lr_inner 0.009: the top tenth of its range"}
    study.add_trial(optuna.trial.create_trial(params={"lr_inner": 5e-3, "initial_batch_size": 4},
                                              distributions={"lr_inner": lr, "initial_batch_size": batch},
                                              value=50.0, user_attrs={"point": 3}))
    # 5e-3 lies inside; 9e-3 was sampled
    assert best_point_ends(study, {}).edges == {3: "initial_batch_size 4: its largest choice"}
    study.add_trial(optuna.trial.create_trial(params={"lr_inner": 2e-3, "initial_batch_size": 2},
                                              distributions={"lr_inner": lr, "initial_batch_size": batch},
                                              value=10.0, user_attrs={"point": 4}))
    assert best_point_ends(study, {}).edges == {}  # inside the range, between sampled values, a middle choice


def test_a_best_point_at_the_top_of_eta_where_no_batch_grew_is_a_plateau_not_an_edge(tmp_path):
    # the norm test asks for no larger batch as ETA grows: a best point at the top of ETA's range whose runs grew no
    # batch on any tuning seed runs the same at every larger ETA, so the range holds the optimum (a plateau). One
    # increase on one seed, or a summary that cannot be read, leaves it an edge; the bottom of the range never is one.
    storage = open_storage(str(tmp_path / "studies.journal"), tmp_path)
    eta = optuna.distributions.FloatDistribution(0.3, 10.0, log=True)

    def runs(name: str, *increases: int) -> list[str]:
        dirs = []
        for seed, count in enumerate(increases):
            run = tmp_path / f"{name}_seed{seed}"
            run.mkdir()
            (run / "summary.json").write_text(json.dumps({"batch_increases": count}))
            dirs.append(str(run))
        return dirs

    def best_at(name: str, value: float, run_dirs: list[str], decided: dict | None = None) -> BestPointEnds:
        study = open_study(name, storage, "minimize", PointSampler((ETA,), {}))
        for i, (v, objective, dirs) in enumerate([(value, 100.0, run_dirs), (1.0, 200.0, []), (2.0, 300.0, [])]):
            attrs = {"point": i, "run_dirs": dirs, **({"decided": decided} if decided and i == 0 else {})}
            study.add_trial(optuna.trial.create_trial(params={"ETA": v}, distributions={"ETA": eta}, value=objective,
                                                      user_attrs=attrs))
        return best_point_ends(study, {"ETA": ETA})

    words = "ETA 8.33: the top tenth of its range"
    assert best_at("flat", 8.33, runs("flat", 0, 0)) == BestPointEnds(
        {}, {0: f"{words}, where batch_increases is 0 on every tuning seed (every larger ETA runs the same)"})
    assert best_at("grew", 8.33, runs("grew", 0, 1)) == BestPointEnds({0: words}, {})
    assert best_at("unread", 8.33, [*runs("unread", 0), str(tmp_path / "missing")]) == BestPointEnds({0: words}, {})
    assert best_at("bottom", 0.32, runs("bottom", 0, 0)) == BestPointEnds(
        {0: "ETA 0.32: the bottom tenth of its range"}, {})
    assert best_point_ends(optuna.load_study(study_name="flat", storage=storage), {}).edges == {0: words}  # no knob
    # the trial's own record says it once its run directories are gone (they are never committed): the journal alone
    gone = [str(tmp_path / "gone_seed0"), str(tmp_path / "gone_seed1")]
    assert best_at("recorded", 8.33, gone, {"batch_increases": [0, 0]}).plateaus == {
        0: f"{words}, where batch_increases is 0 on every tuning seed (every larger ETA runs the same)"}
    assert best_at("recorded_grew", 8.33, gone, {"batch_increases": [0, 3]}) == BestPointEnds({0: words}, {})
    # a checkout at another path: the journal's absolute run directories are not there, the same runs are under the
    # tuner's --out (out/trials/runs/NAME, unpacked from a tarball), and they are read from there
    elsewhere = tmp_path / "elsewhere"
    for seed in (0, 1):
        run = elsewhere / "trials" / "runs" / f"moved_seed{seed}"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"batch_increases": 0}))
    moved = [str(tmp_path / "old_checkout" / "trials" / "runs" / f"moved_seed{seed}") for seed in (0, 1)]
    study = open_study("moved", storage, "minimize", PointSampler((ETA,), {}))
    for i, (v, objective) in enumerate([(8.33, 100.0), (1.0, 200.0), (2.0, 300.0)]):
        study.add_trial(optuna.trial.create_trial(params={"ETA": v}, distributions={"ETA": eta}, value=objective,
                                                  user_attrs={"point": i, "run_dirs": moved if i == 0 else []}))
    assert best_point_ends(study, {"ETA": ETA}) == BestPointEnds({0: words}, {})  # not told where: an edge
    assert best_point_ends(study, {"ETA": ETA}, elsewhere).plateaus == {
        0: f"{words}, where batch_increases is 0 on every tuning seed (every larger ETA runs the same)"}
    # what a finished trial records: each seed's count of what its variant's knobs decide (none for DiLoCo's)
    known = catalogue(load_config(ROOT / "config.yaml", []), [1, 2, 4], 0.3)
    assert decided_counts(known["adloco"], runs("counted", 0, 2)) == {"batch_increases": [0, 2]}
    assert decided_counts(known["diloco_tuned_batch"], [str(tmp_path / "gone_seed0")]) == {}


def test_around_the_best_lr_the_table_counts_each_other_knobs_values(tmp_path):
    # the trials within a factor 2 of the best trial's lr (2e-3 is exactly 2x: in; 3e-3 is not), and the distinct
    # values of each other knob among them; fewer than 3 of one is said
    storage = open_storage(str(tmp_path / "studies.journal"), tmp_path)
    dists = {"lr_inner": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True),
             "ETA": optuna.distributions.FloatDistribution(0.3, 10.0, log=True),
             "merge_frequency": optuna.distributions.CategoricalDistribution((2, 3, 4, 8))}
    study = open_study("adloco", storage, "minimize", PointSampler((LR_INNER,), {}))
    for i, (lr, eta, every, objective) in enumerate([(1e-3, 1.0, 2, 100.0), (1.5e-3, 2.0, 2, 120.0),
                                                     (6e-4, 3.0, 4, 130.0), (3e-3, 4.0, 8, 140.0),
                                                     (2e-3, 1.0, 3, 150.0)]):
        study.add_trial(optuna.trial.create_trial(params={"lr_inner": lr, "ETA": eta, "merge_frequency": every},
                                                  distributions=dists, value=objective, user_attrs={"point": i}))
    assert around_best(study) == {0: "4 trials within 2x of its lr_inner ran 3 values of ETA, 3 values of "
                                     "merge_frequency"}
    study.add_trial(optuna.trial.create_trial(params={"lr_inner": 2.5e-3, "ETA": 5.0, "merge_frequency": 8},
                                              distributions=dists, value=90.0, user_attrs={"point": 5}))
    # the best is now 2.5e-3: near it 1.5e-3, 2e-3, 3e-3 and itself
    assert around_best(study) == {5: "4 trials within 2x of its lr_inner ran 4 values of ETA, 3 values of "
                                     "merge_frequency"}
    lone = open_study("diloco_b2", storage, "minimize", PointSampler((LR_INNER,), {}))
    for i, (lr, eta) in enumerate([(1e-3, 1.0), (1.2e-3, 1.0), (9e-3, 2.0)]):
        lone.add_trial(optuna.trial.create_trial(params={"lr_inner": lr, "ETA": eta}, value=100.0 + i,
                                                 distributions={k: dists[k] for k in ("lr_inner", "ETA")},
                                                 user_attrs={"point": i}))
    assert around_best(lone) == {0: "2 trials within 2x of its lr_inner ran 1 value of ETA; fewer than 3 of ETA"}


def test_every_method_has_a_search_space_and_the_nesterov_baseline_is_dilocos_standard_outer_step():
    base = load_config(ROOT / "config.yaml", [])
    known = catalogue(base, [2, 4], 0.3)
    assert all(v.search and v.search[0].key == "lr_inner" for v in known.values())
    assert [k.key for k in known["adloco_paper"].search] == ["lr_inner", "ETA", "merge_frequency",
                                                             "initial_batch_size"]
    assert [k.key for k in known["adloco_no_merge"].search] == ["lr_inner", "ETA", "initial_batch_size"]
    tuned_batch = known["diloco_tuned_batch"]
    assert tuned_batch.group == "tuned_batch" and tuned_batch.search[-1].choices == (2, 4)
    assert [k.key for k in known["snoo_tuned_batch"].search] == ["lr_inner", "lr_outer", "outer_momentum",
                                                                 "initial_batch_size"]
    assert [k.key for k in known["snoo"].search] == ["lr_inner", "lr_outer", "outer_momentum"]
    nesterov = known["diloco_nesterov_b4"]
    assert nesterov.group == "nesterov" and nesterov.family == "diloco"
    assert set(known["diloco_b4"].overrides) < set(nesterov.overrides)
    cfg = load_config(ROOT / "config.yaml", list(nesterov.overrides))
    assert (cfg.lr_outer, cfg.outer_momentum, cfg.outer_nesterov, cfg.initial_batch_size) == (0.7, 0.9, True, 4)
    assert [k.key for k in nesterov.search] == ["lr_inner", "lr_outer", "outer_momentum"]


def test_a_stopped_tuning_run_goes_on_to_exactly_n_finished_trials_none_twice(tmp_path, cache_dir, monkeypatch):
    """Two workers, SIGTERM while both trials run: both marked failed, no orphan; the next call finishes exactly 3
    trials, points 0, 1, 2 once each, the stopped points with the same values as before."""
    out = tmp_path / "tune"
    cmd = [sys.executable, "-m", "benchmarks.tune", *tune_args(out, cache_dir, "--trials", "3", "--workers", "2",
                                                                   max_tokens=8000)]
    tuner = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = out / "trials" / "runs"

    def logs():
        return [log for i in (0, 1) for log in runs.glob(f"diloco_b2@*_p{i}_seed1000/training_log.log")]

    deadline = time.time() + 300
    while not (len(logs()) == 2 and all("[outer 1/" in log.read_text() for log in logs())):
        assert tuner.poll() is None and time.time() < deadline, tuner.communicate()
        time.sleep(0.2)
    children = psutil.Process(tuner.pid).children(recursive=True)
    assert len(children) >= 2
    tuner.send_signal(signal.SIGTERM)
    _, err = tuner.communicate(timeout=180)
    assert tuner.returncode == 143, err
    assert "stopped by SIGTERM" in err.strip().splitlines()[-1]
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive  # no orphan keeps training
    storage = f"sqlite:///{out / 'studies.db'}"
    stopped = trials_of(storage)
    assert [t.state for t in stopped] == [optuna.trial.TrialState.FAIL] * 2
    assert {t.user_attrs["point"] for t in stopped} == {0, 1}
    assert all("stopped by a signal" in t.user_attrs["note"] for t in stopped)

    again_args = tune_args(out, cache_dir, "--trials", "3", "--workers", "2", max_tokens=8000)
    assert tune_main(again_args) == 0
    trials = trials_of(storage)
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert sorted(t.user_attrs["point"] for t in done) == [0, 1, 2]
    assert all(math.isfinite(t.value) for t in done)
    for t in stopped:  # run again at the very same point
        again = next(d for d in done if d.user_attrs["point"] == t.user_attrs["point"])
        assert again.params == t.params
    rows = (out / "trials.csv").read_text().splitlines()
    assert rows[0].startswith("variant,study,trial,point,state,objective,lr_inner")
    assert sum(",COMPLETE," in r for r in rows) == 3
    # each finished trial's run directory, relative to the table's folder (no machine's path in a committed table)
    (study,) = {r.split(",")[1] for r in rows[1:]}  # diloco_b2@DIGEST, the one study
    assert {r.rsplit(",", 1)[1] for r in rows[1:] if ",COMPLETE," in r} == {
        f"trials/runs/{study}_p{p}_seed1000" for p in (0, 1, 2)}
    # a second call with the same --trials has nothing left to do; a larger one extends the same sequence
    assert tune_main(again_args) == 0
    assert len(trials_of(storage)) == len(trials)
    finalists_without_their_untuned_selves(out, cache_dir, min(done, key=lambda t: t.value), monkeypatch)


def test_a_sigkilled_tool_leaves_no_orphan_and_a_busy_run_directory_is_an_error_not_in_flight(tmp_path, cache_dir):
    """SIGKILL, which the tool cannot forward: its child run.py stops anyway (its parent's death reaches it as
    SIGTERM: a checkpoint, status stopped). A call that finds a trial's run directory held by a live process ends in
    one line and exit 2, not in "in flight in other processes" and exit 0; once free, the next call goes on."""
    from run_dir.run_state import RunLock

    out = tmp_path / "tune"
    cmd = [sys.executable, "-m", "benchmarks.tune", *tune_args(out, cache_dir, "--trials", "1", max_tokens=8000)]
    tuner = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = out / "trials" / "runs"
    deadline = time.time() + 300
    while not any("[outer 1/" in log.read_text() for log in runs.glob("diloco_b2@*_p0_seed1000/training_log.log")):
        assert tuner.poll() is None and time.time() < deadline
        time.sleep(0.2)
    children = psutil.Process(tuner.pid).children(recursive=True)
    assert children
    tuner.kill()
    tuner.wait()
    _, alive = psutil.wait_procs(children, timeout=120)
    assert not alive  # no orphan trains on
    (run_dir,) = runs.glob("diloco_b2@*_p0_seed1000")
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["signal"]) == ("stopped", "SIGTERM"), status
    lock = RunLock(run_dir)  # a live process holds the trial's run directory
    assert lock.try_acquire()
    try:
        with pytest.raises(SystemExit) as exc:
            tune_main(tune_args(out, cache_dir, "--trials", "1", max_tokens=8000))
        assert str(exc.value).startswith("error: benchmarks.tune: ") and "is in use by process" in str(exc.value)
    finally:
        lock.release()
    # the killed tool's trial, failed by the next call (its point free again), and the refused call's own
    lost, refused = trials_of(f"sqlite:///{out / 'studies.db'}")
    assert lost.state.name == "FAIL" and "process was lost" in lost.user_attrs["note"]
    assert refused.state.name == "FAIL" and refused.user_attrs["point"] == 0
    assert "runs again" in refused.user_attrs["note"]


def finalists_without_their_untuned_selves(out, cache_dir, best, monkeypatch):
    """--seeds 2 --tuned_only --untuned DIR:diloco_b2 --workers 2: the best trial's point on seeds 0 and 1 at once,
    nothing untuned run here, what tuning changed paired seed by seed with the other report's diloco_b2."""
    import csv

    import benchmarks.compare.runner as runner
    from benchmarks.compare.runner import run_variant

    untuned = out.parent / "untuned_report"
    untuned.mkdir()
    (untuned / "budgets.csv").write_text("axis,budget,variant,metric_mean,metric_std,runs_ended_below_budget\n"
                                         "tokens,8000.0,diloco_b2,1,0,0\n")
    (untuned / "runs.csv").write_text("variant,seed,at_budget\ndiloco_b2,0,900.0\ndiloco_b2,1,1000.0\n")
    args = tune_args(out, cache_dir, "--trials", "3", "--seeds", "2", "--workers", "2", "--tuned_only", "--untuned",
                     f"{untuned}:diloco_b2", max_tokens=8000)
    spans = {}

    def timed(name, overrides, seed, *rest):  # when each finalist's run began and ended
        began = time.monotonic()
        found = run_variant(name, overrides, seed, *rest)
        spans[seed] = (began, time.monotonic())
        return found

    monkeypatch.setattr(runner, "run_variant", timed)  # the finalists' workers (runner.run_on_workers)
    assert tune_main(args) == 0
    runs = {p.name for p in (out / "runs").iterdir() if p.is_dir()}
    assert runs == {"diloco_b2_tuned_seed0", "diloco_b2_tuned_seed1"}
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]  # the two workers ran them at once
    assert load_config(out / "runs" / "diloco_b2_tuned_seed0" / "config.yaml").lr_inner == best.params["lr_inner"]
    tuned = {int(r["seed"]): float(r["at_budget"]) for r in csv.DictReader((out / "runs.csv").open())}
    (row,) = list(csv.DictReader((out / "tuning_changed.csv").open()))
    assert (row["variant"], row["untuned_from"], row["pairs"]) == ("diloco_b2", os.path.relpath(untuned, out), "2")
    assert float(row["mean_difference"]) == pytest.approx((tuned[0] - 900 + tuned[1] - 1000) / 2)
    assert "## What tuning changed" in (out / "comparison.md").read_text()


def test_what_tuning_changed_pairs_seeds_and_refuses_other_budgets(tmp_path):
    from benchmarks.tune.changed import rows
    from utils.errors import UserError

    def report(name, budget, lines):
        (tmp_path / name).mkdir()
        (tmp_path / name / "budgets.csv").write_text(f"axis,budget\nrounds,9\ntokens,{budget}\n")
        (tmp_path / name / "runs.csv").write_text("variant,seed,at_budget\n" + "".join(
            f"{v},{s},{x}\n" for v, s, x in lines))
        return tmp_path / name

    tuned = report("tuned", 100, [("a_tuned", 0, 10), ("a_tuned", 1, 12), ("a_tuned", 2, 11), ("b_tuned", 0, 5),
                                  ("b", 0, 6), ("b_tuned", 1, 5), ("b", 1, 7), ("c_tuned", 0, 1)])
    other = report("other", 100, [("a", 0, 20), ("a", 1, 20), ("a", 2, 23), ("a", 3, 99)])
    found = {r["variant"]: r for r in rows(tuned, [(other, ["a"])])}
    a = found["a"]  # differences -10, -8, -12 (seed 3 has no pair): mean -10, sd 2, t(0.975, 2) = 4.303
    assert (a["untuned_from"], a["pairs"], a["untuned_mean"], a["tuned_mean"]) == ("../other", 3, 21, 11)
    assert a["mean_difference"] == -10 and a["ci95_low"] == pytest.approx(-10 - 4.303 * 2 / math.sqrt(3))
    assert not a["interval_contains_0"]
    assert (found["b"]["untuned_from"], found["b"]["mean_difference"]) == ("this report", -1.5)
    assert found["c"] == {"variant": "c", "untuned_from": "not run", "pairs": 0}
    one = report("one_pair", 100, [("d_tuned", 0, 4), ("d", 0, 6), ("d", 1, 7)])
    (d,) = rows(one, [])  # one pair: a difference, no interval (empty cells, never nan nor "established")
    assert (d["pairs"], d["mean_difference"]) == (1, -2)
    assert not {"ci95_low", "ci95_high", "interval_contains_0"} & set(d)
    from benchmarks.tune.changed import write

    write(one, [])
    (row,) = list(csv.DictReader((one / "tuning_changed.csv").open()))
    assert (row["ci95_low"], row["ci95_high"], row["interval_contains_0"]) == ("", "", "")
    with pytest.raises(UserError, match="token budget 50, the tuned report's is 100"):
        rows(tuned, [(report("short", 50, [("a", 0, 1)]), ["a"])])
    with pytest.raises(UserError, match="no z in its runs.csv"):
        rows(tuned, [(other, ["z"])])


def test_a_study_is_its_config_a_call_with_another_never_counts_its_trials(tmp_path, cache_dir, capsys):
    """One storage, two calls: 1 trial at 1,500 tokens on two tuning seeds; then at 1,600 tokens with lr_outer 0.3 on
    one (another study: its own point 0 runs, a line names what differs). trials.csv says which study each row
    belongs to. (A call with the same config continues its study: test_a_stopped_tuning_run_...)"""
    out = tmp_path / "tune"
    asked = ["eval_every_inner_steps=1", "plot_every=1"]  # after TINY's plot_every=0: what the call asks for
    assert tune_main([*tune_args(out, cache_dir, "--trials", "1", seeds="1000,1001"), *asked]) == 0
    (first,) = trials_of(f"sqlite:///{out / 'studies.db'}")  # two tuning seeds: the objective is their mean
    per_seed = first.user_attrs["per_seed"]
    assert len(per_seed) == 2 and first.value == pytest.approx(sum(per_seed) / 2)
    assert [d.rsplit("_", 1)[1] for d in first.user_attrs["run_dirs"]] == ["seed1000", "seed1001"]
    assert first.user_attrs["decided"] == {}  # DiLoCo's lr decides no count (AdLoCo's ETA: test above)
    for run in map(Path, first.user_attrs["run_dirs"]):  # the objective reads no mid-round evaluation: none made
        assert (load_config(run / "config.yaml").eval_every_inner_steps, load_config(run / "config.yaml").plot_every
                ) == (0, 0) and not list(run.glob("**/*.png"))
        assert (run / "model_training_report" / "inner_eval.csv").read_text().count("\n") == 1  # its header
    capsys.readouterr()
    assert tune_main(tune_args(out, cache_dir, "--trials", "1", "lr_outer=0.3", max_tokens=1600)) == 0
    said = capsys.readouterr().out
    # progress per trial while it runs: started, then its value and the study's best so far
    (started,) = [x for x in said.splitlines() if x.endswith("point 0: running; 0 of 1 finished, 1 running")]
    (ended,) = [x for x in said.splitlines() if " point 0: " in x and "1 of 1 finished, 0 running; best so far" in x]
    assert started.startswith("diloco_b2@") and ended.endswith("(point 0)")
    (line,) = [x for x in said.splitlines() if "this call's study" in x]
    assert line.startswith("diloco_b2: this call's study diloco_b2@") and "its 1 trials are not counted here" in line
    assert "config.lr_outer: 0.5 -> 0.3" in line
    assert "config.max_tokens: 1500 -> 1600" in line and "tuning_seeds" in line
    assert "eval_every_inner_steps" not in line and "plot_every" not in line  # no part of a study (TRIAL_SKIPS)
    storage = f"sqlite:///{out / 'studies.db'}"
    summaries = optuna.get_all_study_summaries(storage)
    assert sorted(variant_of(x) for x in summaries) == ["diloco_b2", "diloco_b2"]
    assert all(x.n_trials == 1 for x in summaries)  # the second call ran its own point 0, not counting the first's
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert len(rows) == 2 and len({r["study"] for r in rows}) == 2 and {r["point"] for r in rows} == {"0"}
    assert all(r["study"].startswith("diloco_b2@") and r["state"] == "COMPLETE" for r in rows)
    assert {r["cpu"] for r in rows} == {cpu_model()} != {""}  # the processor each trial ran on, recorded
    budgets = {r["study"]: load_config(out / r["run_dir"] / "config.yaml").max_tokens for r in rows}
    assert sorted(budgets.values()) == [1500, 1600]


def test_two_processes_share_one_study_and_never_run_a_point_twice(tmp_path, cache_dir):
    """Two tune processes on one journal file (the several-machines recipe), started together."""
    out = tmp_path / "tune"
    journal = tmp_path / "shared.journal"
    cmd = [sys.executable, "-m", "benchmarks.tune", *tune_args(out, cache_dir, "--trials", "3", "--storage",
                                                                   str(journal), max_tokens=3000)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    from optuna.storages.journal import JournalFileBackend

    storage = optuna.storages.JournalStorage(JournalFileBackend(str(journal)))
    trials = trials_of(storage)
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert sorted(t.user_attrs["point"] for t in done) == [0, 1, 2]
    assert len({t.user_attrs["pid"] for t in done}) == 2  # both processes ran trials
    # nothing else ran: any other trial is a claim that found no point left, and started no run
    assert all(t.user_attrs.get("note", "").startswith("no point left") for t in trials if t not in done)
    (study,) = {t.user_attrs["run_dir"].rsplit("/", 1)[1].split("_p")[0] for t in done}
    assert sorted(p.name for p in (out / "trials" / "runs").iterdir() if p.is_dir()) == [
        f"{study}_p{i}_seed1000" for i in range(3)]


def test_a_paused_worker_keeps_its_point_a_dead_or_reused_or_silent_remote_owner_loses_it(monkeypatch):
    """A worker stopped by SIGSTOP beats no heartbeat; on its own host its live process keeps its point however long
    it is silent (a neighbour would otherwise run the same point and find its directory locked). A dead owner, a pid
    now another process's, and a silent owner on another host lose theirs; a worker whose trial was judged lost
    stops beating and records nothing over it."""
    study = optuna.create_study()
    paused = subprocess.Popen(["sleep", "120"])
    try:
        paused.send_signal(signal.SIGSTOP)
        long_ago = time.time() - 10 * GRACE_S
        owners = {  # point: its owner's attributes
            0: {"host": HOST, "pid": paused.pid, "pid_started": started_at(paused.pid)},  # paused, silent
            1: {"host": HOST, "pid": paused.pid, "pid_started": started_at(paused.pid) - 5.0},  # the pid reused
            2: {"host": "elsewhere", "pid": paused.pid, "pid_started": 1.0},  # another host, silent
            3: {"host": "elsewhere", "pid": 1, "pid_started": 1.0, "alive_at": time.time()},  # another host, beating
        }
        trials = {}
        for point, attrs in owners.items():
            trials[point] = study.ask()
            for key, value in {"point": point, "alive_at": long_ago, **attrs}.items():
                trials[point].set_user_attr(key, value)
        fail_lost(study)
        assert [study.trials[p].state.name for p in range(4)] == ["RUNNING", "FAIL", "FAIL", "RUNNING"]
        assert free_points(study, 5) == [1, 2, 4]
        paused.kill()
        paused.wait()
        fail_lost(study)  # the paused worker died: its point is free now
        assert study.trials[0].state.name == "FAIL" and free_points(study, 5) == [0, 1, 2, 4]
        assert "process was lost" in study.trials[0].user_attrs["note"]
    finally:
        paused.kill()
        paused.wait()
    monkeypatch.setattr("benchmarks.tune.claims.HEARTBEAT_S", 0.01)
    heartbeat(study, trials[0], threading.Event())  # returns: the trial is no longer its own to beat for
    fail(study, trials[0], "stopped by a signal")  # and a stop records nothing over the judgement
    assert "process was lost" in study.trials[0].user_attrs["note"]
    assert study.trials[0].state.name == "FAIL"
    # nor does a finished run's value, judged lost after any check the worker could make: the first write says so
    assert not record(study, trials[0], 123.0, {"per_seed": [120.0, 126.0]})
    assert (study.trials[0].state.name, study.trials[0].values) == ("FAIL", None)
    assert "per_seed" not in study.trials[0].user_attrs
    assert record(study, trials[3], 123.0, {"per_seed": [120.0, 126.0]})  # its own, in flight: recorded
    assert (study.trials[3].values, study.trials[3].user_attrs["per_seed"]) == ([123.0], [120.0, 126.0])


def test_a_study_is_created_once_in_a_journal_however_often_it_is_opened(tmp_path):
    journal = tmp_path / "studies.journal"
    sampler = PointSampler((LR_INNER,), {})
    for _ in range(3):  # three calls of the tool on one journal
        study = open_study("diloco_b2", open_storage(str(journal), tmp_path), "minimize", sampler)
    assert study.direction == optuna.study.StudyDirection.MINIMIZE
    assert journal.read_text().count('"op_code":0') == 1  # one create record, not one per call


def test_a_key_added_later_at_its_default_continues_the_study_made_before_it(tmp_path):
    """A study stored before a key existed keeps its trials once the key exists at its default (it does there what
    those runs did); the key set otherwise, another value changed, or another variant make another study."""
    storage = open_storage(str(tmp_path / "studies.journal"), tmp_path)
    before = StudyIdentity("adloco", {"config": {"lr_outer": 0.5}, "search": {"ETA": [0.3, 1.5, "linear"]},
                                      "tuning_seeds": [1000, 1001]})
    open_study("adloco", storage, "minimize", PointSampler((LR_INNER,), {}), before)
    later = {"compile_backend": "inductor"}

    def now(**config) -> StudyIdentity:
        return StudyIdentity("adloco", {**before.values, "config": {"lr_outer": 0.5, **config}})

    assert continued(storage, now(compile_backend="inductor"), later).study_name == before.study_name
    assert now(compile_backend="inductor").study_name != before.study_name  # its digest alone would start anew
    for other in (now(compile_backend="eager"), now(compile_backend="inductor", lr_outer=0.3),
                  now(compile_backend="inductor", sync_delay=1), StudyIdentity("diloco", now().values)):
        assert continued(storage, other, later) is other
    # a key identities no longer hold (what trials stopped reading: TRIAL_SKIPS) continues a study stored with it
    with_key = StudyIdentity("snoo", {**before.values, "config": {"lr_outer": 0.5, "eval_every_inner_steps": 2}})
    open_study("snoo", storage, "minimize", PointSampler((LR_INNER,), {}), with_key)
    without = StudyIdentity("snoo", {**before.values, "config": {"lr_outer": 0.5}})
    assert continued(storage, without, later, frozenset({"eval_every_inner_steps"})).study_name == with_key.study_name
    assert continued(storage, without, later) is without
    changed = StudyIdentity("snoo", {**before.values, "config": {"lr_outer": 0.3}})
    assert continued(storage, changed, later, frozenset({"eval_every_inner_steps"})) is changed
    (line,) = other_studies(storage, changed, frozenset({"eval_every_inner_steps"}))  # what differs, and only that
    assert line.endswith("(config.lr_outer: 0.5 -> 0.3): its 0 trials are not counted here"), line


def test_trials_csv_keeps_the_studies_a_call_does_not_name(tmp_path):
    # a call naming a subset of the variants (finalists run first for a few) rewrites trials.csv: the rows of the
    # storage's other studies stay (they were lost once, the table holding only the call's variants), in the
    # storage's order whichever call writes them, so the status tool writes the same bytes (the tuner once put its
    # own studies first, and every call reordered the committed file)
    from benchmarks.tune.status import main as status_main

    storage = open_storage(str(tmp_path / "studies.journal"), tmp_path)
    lr = optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)
    eta = optuna.distributions.FloatDistribution(0.4, 0.9)
    for name, params, value in (("adloco", {"lr_inner": 1e-3, "ETA": 0.7}, 300.0),
                                ("diloco_b2", {"lr_inner": 2e-3}, 250.0)):
        study = open_study(name, storage, "minimize", PointSampler((LR_INNER,), {}))
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={"lr_inner": lr, "ETA": eta} if "ETA" in params else {"lr_inner": lr},
            value=value, user_attrs={"point": 0, "run_dir": str(tmp_path / "trials" / "runs" / f"{name}_p0")}))
    known = catalogue(load_config(str(ROOT / "config.yaml"), TINY), [2], 0.5)
    named = {"diloco_b2": optuna.load_study(study_name="diloco_b2", storage=storage)}
    write_trials(named, knobs_of(known), storage, tmp_path / "trials.csv")
    rows = list(csv.DictReader((tmp_path / "trials.csv").open()))
    assert [(r["variant"], r["objective"], r["lr_inner"], r["ETA"]) for r in rows] == [
        ("adloco", "300.0", "0.001", "0.7"), ("diloco_b2", "250.0", "0.002", "")]
    assert rows[0]["run_dir"] == os.path.join("trials", "runs", "adloco_p0")  # relative, as the call's own rows
    assert status_main(["--storage", str(tmp_path / "studies.journal"), "--csv", str(tmp_path / "status.csv")]) == 0
    assert (tmp_path / "status.csv").read_bytes() == (tmp_path / "trials.csv").read_bytes()


def test_bad_tuning_options_are_refused_in_one_line(tmp_path, capsys):
    for extra, said in ((["--trials", "0"], "--trials and --workers must be at least 1"),
                        (["--trials", "2", "--seeds", "3", "--tuning_seed", "1"], "holds one of the finalists' seeds"),
                        (["--trials", "2", "--max_tokens", "0"], "--max_tokens: give the token budget")):
        with pytest.raises(SystemExit) as exc:
            tune_main(tune_args(tmp_path / "t", tmp_path, *extra))
        assert exc.value.code == 2 and said in capsys.readouterr().err
    with pytest.raises(SystemExit, match="error: .*ETA"):
        tune_main(tune_args(tmp_path / "t", tmp_path, "--trials", "2", "ETA=-1"))


def test_a_diverged_run_is_a_finished_trial_and_a_crashed_run_stops_the_tool(tmp_path, cache_dir):
    """exit 3 (a training fault: the node's loss turned NaN) is the method's outcome: a finished trial at the worst
    value. exit 1 (an internal error, inject_fault crash) is not: the tool stops with one line, the trial is marked
    failed, and nothing is counted as finished."""
    import csv

    diverged = tmp_path / "diverged"
    assert tune_main(tune_args(diverged, cache_dir, "--trials", "1", "inject_fault=1:0:nan")) == 0
    (row,) = list(csv.DictReader((diverged / "trials.csv").open()))
    assert row["state"] == "COMPLETE" and math.isinf(float(row["objective"])) and "exit 3" in row["note"]
    # a finalist that diverges does not stop the finalists: the report gets it (here the only run: no report)
    with pytest.raises(SystemExit, match="every run stopped on a training fault"):
        tune_main(tune_args(diverged, cache_dir, "--trials", "1", "--seeds", "1", "--tuned_only",
                            "inject_fault=1:0:nan"))
    assert (diverged / "runs" / "diloco_b2_tuned_seed0" / "status.json").is_file()
    crashed = tmp_path / "crashed"
    with pytest.raises(SystemExit, match=r"error: benchmarks\.tune: RuntimeError: variant diloco_b2@\w+_p0 .*exit 1"):
        tune_main(tune_args(crashed, cache_dir, "--trials", "1", "inject_fault=1:0:crash"))
    (row,) = list(csv.DictReader((crashed / "trials.csv").open()))
    assert row["state"] == "FAIL" and row["objective"] == "" and "not the method's outcome" in row["note"]


def test_switch_modes_matched_control_runs_the_full_request_in_one_pass():
    """Issue 58, item 8: one name per meaning, and the control whose effective batch is always_accumulate's (every
    request in full) without accumulating: max batch at the cap, on a device large enough for it."""
    from benchmarks.compare.variants import select

    cfg = load_config(ROOT / "config.yaml", ["max_requested_batch=16"])
    known = catalogue(cfg, [1, 2, 4], 0.3)
    for prefix in ("adloco", "adloco_paper"):
        control = load_config(ROOT / "config.yaml", ["max_requested_batch=16", *known[f"{prefix}_one_pass"].overrides])
        assert control.max_batch_size == 16 and control.switch_mode == "threshold_switch_mode"
        always = load_config(ROOT / "config.yaml", known[f"{prefix}_always_accumulate"].overrides)
        assert always.switch_mode == "only_gradient_accumulation"
        assert control.variance_estimator == always.variance_estimator  # the same method otherwise
    assert {"adloco_one_pass", "adloco_paper_one_pass"} <= set(select(known, "switch", "1,2,4", False))


def test_status_reads_a_journal_being_written_and_rewrites_trials_csv(tmp_path, capsys):
    """benchmarks.tune.status: one line per study (finished, running, failed; the best with its knobs and its edge)
    and trials.csv from the storage, without running anything; a line half written by a worker at that moment is
    left for the next look; a missing journal is one line, exit 2."""
    from benchmarks.tune.status import main as status_main
    from utils.errors import exit_on_input_error

    journal = tmp_path / "studies.journal"
    storage = open_storage(str(journal), tmp_path)
    study = optuna.create_study(study_name="diloco_b2@0123456789", storage=storage)
    distribution = optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)
    for point, (lr, value) in enumerate([(1e-3, 300.0), (9e-2, 250.0), (1e-2, None)]):  # the last still running
        study.enqueue_trial({"lr_inner": lr})
        trial = study.ask({"lr_inner": distribution})
        trial.set_user_attr("point", point)
        if value is not None:
            study.tell(trial, value)
    failed = study.ask({"lr_inner": distribution})
    study.tell(failed, state=optuna.trial.TrialState.FAIL)
    with journal.open("ab") as f:  # a worker's record, half written
        f.write(b'{"op_code": 4, "worker_id": "x", "trial_id"')
    assert status_main(["--storage", str(journal)]) == 0
    out = capsys.readouterr().out.splitlines()
    # the best (250 at lr 0.09) sits in the top tenth of lr's log range: flagged as trials.csv flags it
    assert out[0].startswith("diloco_b2@0123456789: 2 finished, 1 running, 1 failed; last started ")
    assert "best 250 (trial 1, point 1: lr_inner=0.09); edge: lr_inner 0.09: the top tenth of its range" in out[0]
    assert out[1] == f"trials.csv: {tmp_path / 'trials.csv'}"
    rows = list(csv.DictReader((tmp_path / "trials.csv").open()))
    assert [(r["trial"], r["state"], r["objective"]) for r in rows] == [
        ("0", "COMPLETE", "300.0"), ("1", "COMPLETE", "250.0"), ("2", "RUNNING", ""), ("3", "FAIL", "")]
    assert rows[1]["edge"].startswith("lr_inner 0.09")
    assert exit_on_input_error(lambda: status_main(["--storage", str(tmp_path / "none.journal")])) == 2
    assert capsys.readouterr().err == f"error: --storage: no journal file at {tmp_path / 'none.journal'}\n"


def test_the_finalists_run_in_the_order_variants_names_them():
    """A long final call that stops midway leaves the variants named first complete: the finalists go in --variants'
    order (VARIANT_tuned where VARIANT stands), the rest after them in the catalogue's order."""
    runs = dict.fromkeys(["adloco_tuned", "adloco_paper_tuned", "diloco_b1_tuned", "diloco_b4_tuned", "ddp", "snoo"])
    assert in_named_order(runs, "adloco_paper,diloco_b4,adloco,diloco_b1") == [
        "adloco_paper_tuned", "diloco_b4_tuned", "adloco_tuned", "diloco_b1_tuned", "ddp", "snoo"]
    assert in_named_order(runs, "") == list(runs)
