"""The comparison harness on a tiny budget: every variant, matched budgets, merges, and the warm start."""

import csv
import io
import json
import math
import os
import shutil
from contextlib import redirect_stderr

import pytest
import yaml

from benchmarks.compare import main as compare_main
from benchmarks.compare import value_at
from benchmarks.compare.batches import along_training, fit_steps, grows, noise_scale, rows, series_of, token_optimal
from benchmarks.compare.variants import catalogue, custom
from benchmarks.replay import accounted_bytes, read_rounds
from tests.conftest import ROOT, TINY
from utils.config import load_config
from utils.errors import exit_on_input_error

SHARED_C4 = ROOT.parent / "shared" / "data" / "c4"
SMALL = [o for o in TINY if not o.startswith(("num_outer_steps", "merge_frequency"))]


def read_csv(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_value_at_interpolates_between_neighbours_and_flags_short_runs():
    curve = [{"tokens": 0, "metric": 100.0}, {"tokens": 10, "metric": 10.0}, {"tokens": 20, "metric": 1.0}]
    assert value_at(curve, "tokens", 10) == (10.0, True)
    value, reached = value_at(curve, "tokens", 5)  # halfway in log space: sqrt(100 * 10)
    assert reached and value == pytest.approx(31.6227766)
    assert value_at(curve, "tokens", 5, log_scale=False)[0] == pytest.approx(55.0)
    assert value_at(curve, "tokens", 30) == (1.0, False)  # ended below the budget: its last value


def test_the_critical_batch_where_tokens_are_fewest_by_hand():
    # tokens to the target: U-shaped with the fewest at batch 4 (900); within 20% (1080): 2, 4, 8; 16 needs 1500
    assert token_optimal([(1, 2000), (2, 1000), (4, 900), (8, 1050), (16, 1500)]) == (
        8, "8: token-optimal batch 4 (900 tokens); within 20%: 2, 4, 8")
    # the sweep's largest batch still within 20%: a lower bound
    assert token_optimal([(1, 2000), (2, 1000), (4, 950)]) == (
        4, ">= 4: token-optimal batch 4 (950 tokens); within 20%: 2, 4 (the sweep's largest batch is within 20%: a "
           "lower bound)")
    # a batch that never reached the target (within its budget) is beyond it
    assert token_optimal([(2, 1000), (4, 1100), (8, None)])[0] == 4
    assert token_optimal([(2, None), (4, None)])[0] is None and token_optimal([(2, 100)])[0] is None


def test_the_noise_scale_fit_by_hand():
    """S(B) = S_min (1 + B_noise / B): S_min 100, B_noise 8 gives 300, 200, 150, 125 steps at 4, 8, 16, 32."""
    assert fit_steps([4, 8, 16, 32], [300, 200, 150, 125]) == pytest.approx((100, 8))
    # steps falling as fast as 1/B (tokens constant): S_min 0, no batch past B_noise; steps growing with B: 0
    assert fit_steps([4, 8, 16], [400, 200, 100])[1] == math.inf
    assert fit_steps([4, 8, 16], [100, 110, 120])[1] == 0
    # by seed: two seeds 20 apart around the model at every batch, paired; batch 2 (below the optimum 4) is left out,
    # as is batch 64, which one seed did not reach
    points = [(2, [900, 900]), (4, [290, 310]), (8, [190, 210]), (16, [140, 160]), (32, [115, 135]), (64, None)]
    fit, words = noise_scale(points, from_batch=4)
    assert (fit.s_min, fit.b_noise, fit.batches) == (pytest.approx(100), pytest.approx(8), (4, 8, 16, 32))
    # resampling the pair: both seeds (the model exactly), twice the low seed (S = 90 + 800/B: B_noise 8.89) or
    # twice the high one (S = 110 + 800/B: 7.27); each pick has probability 1/4 or more, so the 95% interval is
    # exactly their range
    assert (fit.low, fit.high) == (pytest.approx(800 / 110), pytest.approx(800 / 90))
    assert words == "B_noise 8 (95% seed bootstrap 7.27 to 8.89; S_min 100 steps; fitted to batches 4, 8, 16, 32)"
    assert noise_scale(points, from_batch=4) == (fit, words)  # a fixed RNG: the same interval every time
    # too few batches from the optimum up, and a single seed
    assert noise_scale(points, from_batch=16) == (None, "no B_noise fit: 2 batch(es) from the token-optimal 16 up "
                                                        "reached the target with every seed; the fit needs 3")
    one = noise_scale([(4, [300]), (8, [200]), (16, [150])], from_batch=4)[1]
    assert one.startswith("B_noise 8 (one seed: no interval;")
    # at the report's target: runs whose steps to it follow S(B) exactly (tokens S(B) x B: fewest at batch 2)
    def runs(batch, steps):  # two seeds alike: the metric falls below the target 50 at `steps`
        curve = [{"tokens": 0, "steps": 0, "metric": 100.0}, {"tokens": steps * batch, "steps": steps, "metric": 10.0}]
        return [{"curve": curve, "constant_batch": batch}] * 2
    results = {f"diloco_b{b}": runs(b, 100 * (1 + 8 / b)) for b in (2, 4, 8, 16)}
    _, words = rows(results, 50.0, higher=False)
    assert words.endswith("of diloco: 4: token-optimal batch 2 (1000 tokens); within 20%: 2, 4; B_noise 8 (95% seed "
                          "bootstrap 8 to 8; S_min 100 steps; fitted to batches 2, 4, 8, 16)")


def test_the_critical_batch_along_training_per_sweep():
    """Five targets along training, each the best value any batch of the sweep reached (every seed) by 20%, 35%,
    50%, 65% and 80% of the budget; at each, every batch's tokens to it and the token-optimal rule."""
    def runs(batch, points):  # (tokens, steps, metric)
        return [{"curve": [{"tokens": t, "steps": s, "metric": m} for t, s, m in points], "constant_batch": batch}]

    tokens = [0, 200, 400, 600, 800, 1000]
    results = {
        # batch 2 learns fastest per token early; batch 4 catches up and passes it late
        "diloco_b2": runs(2, zip(tokens, [0, 100, 200, 300, 400, 500], [100, 50, 30, 25, 22, 20])),
        "diloco_b4": runs(4, zip(tokens, [0, 50, 100, 150, 200, 250], [100, 60, 30, 20, 15, 12])),
        "adloco": runs(0, zip(tokens, [0, 100, 200, 300, 400, 500], [100, 40, 15, 9, 7, 6])),  # not a sweep
    }
    assert series_of("diloco_nesterov_b16_tuned") == "diloco_nesterov_tuned" and series_of("b4_mine") == "b4_mine"
    rows = along_training(results, 1000, higher=False)
    assert [r["when"] for r in rows] == ["20%", "35%", "50%", "65%", "80%"]
    # at 20% (200 tokens) the best is b2's 50 (b4 is at 60): b2 reaches it at 200 tokens, b4 at its first point at
    # or below it, 400 > 1.2 x 200: critical batch 2
    first = rows[0]
    assert (first["target"], first["tokens_by_batch"], first["critical_batch"]) == (50, "2: 200; 4: 400", 2)
    # at 80% (800 tokens) the best is b4's 15: b2 never reaches it, b4 at 800 -> critical 4 (the largest: a bound)
    last = rows[-1]
    assert (last["target"], last["tokens_by_batch"], last["critical_batch"]) == (15, "2: not reached; 4: 800", 4)
    assert last["in_words"].startswith(">= 4: token-optimal batch 4")
    (sentence,) = grows(rows)
    assert sentence.startswith("diloco: the critical batch grows along training (2 -> ")
    # two batches: never enough for S(B)'s fit, said at every target
    assert all(r["b_noise"] is None and r["b_noise_words"].startswith("no B_noise fit") for r in rows)
    assert sentence.endswith("; S(B)'s B_noise no fit -> no fit -> no fit -> no fit -> no fit")

    # a tuned variant from the command line keeps its base's batch: it joins its own sweep, not the untuned one
    known = catalogue(load_config(ROOT / "config.yaml"), [2, 4], 1e-3)
    added = custom(("diloco_b4_tuned=diloco_b4:lr_inner=0.001",), known)
    assert added["diloco_b4_tuned"].constant_batch == 4 and known["diloco_nesterov_b2"].constant_batch == 2


BROKEN = "broken=diloco_b2:inject_fault=2:0:nan"  # diverges in round 2 (a NaN loss on node 0): a training fault


def test_harness_runs_every_variant_at_matched_budgets(tmp_path, cache_dir):
    out = tmp_path / "compare"
    rc = compare_main(["--config", str(ROOT / "config.yaml"), "--seeds", "1", "--max_tokens", "3000",
                       "--max_outer_steps", "40", "--diloco_batches", "2,4", "--out", str(out), *SMALL,
                       f"cache_dir={cache_dir}", "merge_frequency=1", "initial_batch_size=3", "max_batch_size=2",
                       "ETA=0.3", "max_requested_batch=6", "--network", "lab=1Gbit/s,1ms", "--network", "consumer",
                       "--add_variant", "mine=adloco_paper:ETA=0.5 merge_frequency=1", "--add_variant", BROKEN])
    assert rc == 0
    table = {r["variant"]: r for r in read_csv(out / "comparison.csv")}
    assert set(table) == {"adloco", "adloco_paper", "adloco_no_adaptive", "adloco_no_merge", "adloco_never_accumulate",
                          "diloco_b2", "diloco_b4", "diloco_rampup", "localsgd", "ddp", "snoo", "mine"}
    # a variant from the command line: its base's overrides, then its own
    mine = load_config(out / "runs" / "mine_seed0" / "config.yaml")
    assert (mine.variance_estimator, mine.ETA, mine.initial_batch_size, mine.merge_frequency) == ("nodes", 0.5, 1, 1)
    bytes_each_variant_needs(out, table)
    # components switched off
    assert float(table["adloco"]["merges"]) >= 1
    assert float(table["adloco_no_merge"]["merges"]) == 0 and float(table["diloco_b2"]["merges"]) == 0
    assert table["adloco_no_adaptive"]["max_requested_batch"] == "3"  # constant batch
    assert int(table["adloco"]["max_requested_batch"]) > 3
    assert table["adloco_never_accumulate"]["max_accumulation"] == "1" and int(table["adloco"]["max_accumulation"]) > 1
    # the constant-batch sweep is labelled with what really ran (max batch 2): B = loader x accumulation
    assert (table["diloco_b2"]["ran"], table["diloco_b4"]["ran"]) == ("2x1", "2x2")
    # the warmup ramps from the initial batch 3 to max_requested_batch 6 over the token budget
    assert table["diloco_rampup"]["ran"].startswith("2x2..") and int(table["diloco_rampup"]["max_requested_batch"]) > 3
    for row in table.values():  # the budget is checked once per outer step: at most one step past it
        assert 3000 <= float(row["tokens"]) < 3000 + 4 * 3 * 8 * 32
    # traffic: one trainer on 2 nodes syncs every round; 2 one-node trainers that never merge send nothing
    assert float(table["diloco_b2"]["syncs"]) == float(table["diloco_b2"]["rounds"]) > 0
    assert float(table["adloco_no_merge"]["syncs"]) == 0 and float(table["adloco_no_merge"]["bytes"]) == 0
    # the real final model, read from summary.json (after the last merge), not the best CSV row
    for name in ("adloco", "diloco_b2"):
        summary = json.loads((out / "runs" / f"{name}_seed0" / "summary.json").read_text())
        assert float(table[name]["final_mean"]) == pytest.approx(summary["final_metric"])
        assert float(table[name]["best_seen_mean"]) == pytest.approx(summary["best_metric_seen"])
    # matched budgets on all four axes, every variant in each
    budgets = read_csv(out / "budgets.csv")
    assert {r["axis"] for r in budgets} == {"tokens", "rounds", "syncs", "bytes"}
    for axis in ("tokens", "rounds", "syncs", "bytes"):
        assert {r["variant"] for r in budgets if r["axis"] == axis} == set(table)
    tokens_budget = {r["budget"] for r in budgets if r["axis"] == "tokens"}
    assert tokens_budget == {"3000.0"}
    assert all(r["runs_ended_below_budget"] == "0" for r in budgets if r["axis"] == "tokens")
    # merge diagnostics: every merge of adloco, with the members before and the result after
    merges = [r for r in read_csv(out / "merges.csv") if r["variant"] == "adloco"]
    assert len(merges) == int(float(table["adloco"]["merges"])) and all(len(m["metric_before"].split()) == 2
                                                                       for m in merges)
    per_seed = read_csv(out / "runs.csv")  # one row per variant and seed, with its value at the token budget
    assert sorted((r["variant"], r["seed"]) for r in per_seed) == sorted((v, "0") for v in table)
    assert all(r["reached_budget"] == "True" and float(r["tokens"]) >= 3000 for r in per_seed)
    # a run that diverges (inject_fault: a NaN loss in round 2) is an outcome, not the harness's failure: listed
    # apart, left out of every table, the report still written
    (fault,) = read_csv(out / "faults.csv")
    assert (fault["variant"], fault["seed"], fault["last_good_step"]) == ("broken", "0", "1")
    assert "non-finite loss" in fault["error"] and float(fault["tokens"]) > 0
    report = (out / "comparison.md").read_text()
    assert "## Runs that stopped on a training fault" in report
    for heading in ("## Final models", "## To the target", "## Per seed, paired", "matched budget of 3000 tokens",
                    "rounds (outer steps)",
                    "syncs (cross-node", "bytes communicated", "## Merges",
                    "## Each ablation against its method", "| adloco_no_merge | adloco |"):
        assert heading in report, heading
    for key in ("tokens", "rounds", "syncs", "bytes", "wall"):
        assert (out / f"val_perplexity_vs_{key}.png").is_file()
    network_model_is_checked(out, table, report, tmp_path, cache_dir)


def bytes_each_variant_needs(out, table):
    """AdLoCo's statistics count in its bytes; DiLoCo's (sent for the log only) are shown apart and not charged; DDP
    sends H times DiLoCo's weights bytes per round at the same nodes and batch (and a 4-byte count per step)."""
    adloco, diloco = table["adloco"], table["diloco_b2"]
    assert float(adloco["statistics_bytes"]) > 0 and float(adloco["logged_statistics_bytes"]) == 0
    assert float(adloco["bytes"]) == float(adloco["weights_bytes"]) + float(adloco["statistics_bytes"])
    assert float(diloco["statistics_bytes"]) == 0 and float(diloco["logged_statistics_bytes"]) > 0
    assert float(diloco["bytes"]) == float(diloco["weights_bytes"])
    summary = json.loads((out / "runs" / "ddp_seed0" / "summary.json").read_text())
    ratio = summary["gradient_bytes"] / summary["weight_bytes"]
    per_round = {name: float(table[name]["weights_bytes"]) / float(table[name]["rounds"])
                 for name in ("ddp", "diloco_b4")}
    assert per_round["ddp"] == pytest.approx(3 * ratio * per_round["diloco_b4"], rel=1e-12)  # H = 3
    assert table["snoo"]["weights_bytes"] == table["ddp"]["weights_bytes"]
    report = (out / "comparison.md").read_text()
    for heading in ("## Bytes each variant needs", "## Optimizer steps to the target against the best constant",
                    "critical batch"):
        assert heading in report, heading
    assert (out / "requested_batch_vs_tokens.png").is_file()


def network_model_is_checked(out, table, report, tmp_path, cache_dir):
    """The second half of the test above: the network model on the same finished runs."""
    # the network model reads each run's rounds back to exactly its accounting: bytes, tokens, P
    for name in table:
        run_dir = out / "runs" / f"{name}_seed0"
        summary = json.loads((run_dir / "summary.json").read_text())
        rounds, weight_bytes, communicated = read_rounds(run_dir)
        assert weight_bytes == summary["weight_bytes"] > 0 and communicated == summary["weights_traffic_bytes"]
        assert accounted_bytes(rounds, weight_bytes) == communicated
        assert sum(t.tokens for w in rounds for t in w.trainers) == summary["tokens_seen"]
    adloco_rounds = read_rounds(out / "runs" / "adloco_seed0")[0]
    assert any(w.merges for w in adloco_rounds) and any(w.node_moves for w in adloco_rounds)
    assert all(t.sync.statistics_bytes > 0 for w in adloco_rounds for t in w.trainers)  # the norm test's statistics
    diloco_rounds = read_rounds(out / "runs" / "diloco_b2_seed0")[0]
    assert all(t.sync.statistics_bytes == 0 for w in diloco_rounds for t in w.trainers)
    # predicted time on each --network: every variant, a time to the target, the crossover and the plots
    network = read_csv(out / "network.csv")
    assert {r["network"] for r in network} == {"lab", "consumer"}
    assert {r["variant"] for r in network if r["network"] == "consumer"} == set(table)
    for r in network:  # the default target is one every run reached
        assert float(r["time_to_target_s"]) <= float(r["total_time_s"]) and 0 <= float(r["network_share"]) < 1
    slow = {r["variant"]: float(r["total_time_s"]) for r in network if r["network"] == "consumer"}
    fast = {r["variant"]: float(r["total_time_s"]) for r in network if r["network"] == "lab"}
    assert slow["diloco_b2"] > fast["diloco_b2"] and slow["adloco_no_merge"] == fast["adloco_no_merge"]
    crossover = read_csv(out / "crossover.csv")
    assert len(crossover) > 20 and all(r["winner"] in table for r in crossover)
    assert crossover[0]["winner"] == "adloco_no_merge"  # at 1 Mbit/s the run that sends nothing wins
    for heading in ("## Predicted wall time on a network", "### lab (1 Gbit/s, 1 ms)", "### consumer", "### Crossover"):
        assert heading in report, heading
    assert (out / "val_perplexity_vs_predicted_time.png").is_file() and (out / "crossover_bandwidth.png").is_file()
    # another view of the same finished runs (no run repeats, the diverged one neither), beside the report
    view = tmp_path / "fast_nodes"
    broken_log = (out / "runs" / "broken_seed0.out").stat().st_mtime
    assert compare_main(["--config", str(ROOT / "config.yaml"), "--seeds", "1", "--max_tokens", "3000",
                         "--max_outer_steps", "40", "--diloco_batches", "2,4", "--out", str(out), *SMALL,
                         f"cache_dir={cache_dir}", "merge_frequency=1", "initial_batch_size=3", "max_batch_size=2",
                         "ETA=0.3", "max_requested_batch=6", "--network", "datacentre", "--node_throughput", "1e9",
                         "--add_variant", BROKEN, "--report_out", str(view)]) == 0
    assert (out / "runs" / "broken_seed0.out").stat().st_mtime == broken_log
    assert read_csv(view / "faults.csv") == read_csv(out / "faults.csv")
    assert read_csv(out / "network.csv") == network  # the report in --out is untouched
    fast = read_csv(view / "network.csv")
    assert {r["network"] for r in fast} == {"datacentre"}
    assert "1e+09 tokens/s per node (given)" in (view / "comparison.md").read_text()
    assert float(next(r for r in fast if r["variant"] == "diloco_b2")["network_share"]) > 0.5  # rounds now dominate
    no_reference_no_target(out, tmp_path, cache_dir)
    damaged_finished_runs_are_refused_in_one_line(out, tmp_path, cache_dir)
    repriced_from_the_bundle_alone(out, tmp_path)


def repriced_from_the_bundle_alone(out, tmp_path):
    """The report's replay bundle, with no run directory beside it: --reprice on the report's own pricing writes the
    same tables (nothing trains)."""
    import tarfile

    from benchmarks.compare.bundle import BUNDLE

    bundle = out / BUNDLE
    assert bundle.is_file() and bundle.stat().st_size < 2_000_000
    with tarfile.open(bundle) as tar:
        names = tar.getnames()
    assert "manifest.json" in names and "adloco_seed0/model_training_report/training_log.csv" in names
    assert "broken_seed0/status.json" in names  # the faulted run travels too (the report lists it)
    alone = tmp_path / "committed_report"  # a committed report: the bundle and no run directory
    alone.mkdir()
    shutil.copy(bundle, alone / BUNDLE)
    same = tmp_path / "same_pricing"
    assert compare_main(["--reprice", str(alone), "--report_out", str(same), "--network", "lab=1Gbit/s,1ms",
                         "--network", "consumer"]) == 0
    assert not (alone / "runs").exists() and not (same / "runs").exists()  # nothing trained, nowhere
    for name in ("comparison.csv", "runs.csv", "budgets.csv", "faults.csv", "merges.csv"):
        assert read_csv(same / name) == read_csv(out / name), name
    assert read_csv(same / "network.csv") == read_csv(out / "network.csv")  # the report's own measured throughput
    assert "| adloco_no_merge | adloco |" in (same / "comparison.md").read_text()  # each ablation's method travels
    assert (same / BUNDLE).is_file()  # a view is itself re-priceable
    # another model size and network: test_a_committed_report_is_repriced_for_another_model_and_network_...
    with pytest.raises(SystemExit, match="--model_params: give the throughput of that model too"):
        compare_main(["--reprice", str(alone), "--report_out", str(tmp_path / "no"), "--model_params", "3e8"])


def harness(out, cache_dir, *extra):
    """The harness's command line of the test above, for another view of its finished runs."""
    return ["--config", str(ROOT / "config.yaml"), "--seeds", "1", "--max_tokens", "3000", "--max_outer_steps", "40",
            "--diloco_batches", "2,4", "--out", str(out), *SMALL, f"cache_dir={cache_dir}", "merge_frequency=1",
            "initial_batch_size=3", "max_batch_size=2", "ETA=0.3", "max_requested_batch=6", *extra]


def no_reference_no_target(out, tmp_path, cache_dir):
    """A view whose only DiLoCo run stopped on a training fault: no reference, so no target (a sentence says so),
    never "target 0" and "0/1" in every cell."""
    view = tmp_path / "no_reference"
    assert compare_main(harness(out, cache_dir, "--variants", "adloco", "--add_variant", BROKEN,
                                "--network", "datacentre", "--report_out", str(view))) == 0
    report = (view / "comparison.md").read_text()
    assert "No target: no DiLoCo run finished to be its reference" in report
    assert "target val_perplexity: 0" not in report and "0/1" not in report
    assert all(r["tokens_to_target"] == "" for r in read_csv(view / "comparison.csv"))


def damaged_finished_runs_are_refused_in_one_line(out, tmp_path, cache_dir):
    """A finished run whose summary.json, config.yaml or training_log.csv is damaged: one line naming the run and the
    file, exit 2, and the damaged run left as it was (never overwritten by a harness that cannot read it)."""
    damages = {"summary.json": ("summary.json", b'{"metric": "val_perpl'),
               "config.yaml": ("config.yaml", b"num_outer_steps: [unclosed\n"),
               "training_log.csv": ("model_training_report/training_log.csv", None)}
    for name, (file, content) in damages.items():
        copy = tmp_path / f"damaged_{name}"
        shutil.copytree(out / "runs" / "adloco_seed0", copy / "runs" / "adloco_seed0")
        path = copy / "runs" / "adloco_seed0" / file
        path.write_bytes(content if content is not None else path.read_bytes()[:-40])  # a row cut short
        before = {p: p.read_bytes() for p in (copy / "runs").rglob("*") if p.is_file()}
        args = harness(copy, cache_dir, "--variants", "adloco", "--network", "datacentre")
        err = io.StringIO()
        with redirect_stderr(err):
            assert exit_on_input_error(lambda args=args: compare_main(args)) == 2, name
        assert "Traceback" not in err.getvalue()
        (line,) = [x for x in err.getvalue().splitlines() if x.startswith("error:")]  # beside tqdm's progress
        assert line.startswith(f"error: {copy / 'runs' / 'adloco_seed0'}: a finished run whose {file}"), line
        assert {p: p.read_bytes() for p in (copy / "runs").rglob("*") if p.is_file()} == before, name



def test_a_bad_network_is_refused_before_any_run(tmp_path):
    with pytest.raises(SystemExit, match="--network.*10Gbit"):
        compare_main(["--network", "10Gbit", "--out", str(tmp_path / "c")])
    assert not (tmp_path / "c").exists()


def test_warm_start_workflow_pretrains_once_and_starts_every_variant_from_it(tmp_path, cache_dir):
    """Two pretrained starts (seed s from start s mod 2): every variant's seed 0 from the one, seed 1 from the other;
    the paired intervals are over the starts; a second call naming both with --init_from reuses everything."""
    out = tmp_path / "warm"
    common = [*SMALL, f"cache_dir={cache_dir}"]
    phase2 = [*common, "dataset=c4", f"c4_local_path={SHARED_C4}", "c4_num_documents=200", "lr_inner=1e-4"]
    rc = compare_main(["--config", str(ROOT / "config.yaml"), "--seeds", "2", "--max_tokens", "2000",
                       "--pretrain_config", str(ROOT / "config.yaml"), "--pretrain_starts", "2",
                       "--variants", "adloco,diloco_b2",
                       *[f"--pretrain_set={o}" for o in common], "--pretrain_set=num_outer_steps=1",
                       "--pretrain_set=num_init_trainers=1", "--pretrain_set=merge_frequency=0",
                       "--out", str(out), *phase2, "merge_frequency=1"])
    assert rc == 0
    final_models = [(out / run / "model_weights" / "final" / "final_model").resolve()
                    for run in ("pretrain", "pretrain_start1")]
    assert all((m / "tokenizer.json").is_file() for m in final_models)
    pretrain_seeds = [yaml.safe_load((m.parents[2] / "config.yaml").read_text())["training_seed"] for m in final_models]
    assert pretrain_seeds[1] == pretrain_seeds[0] + 1
    for seed, final_model in enumerate(final_models):
        starts = set()
        for name in ("adloco", "diloco_b2"):
            run_dir = out / "runs" / f"{name}_seed{seed}"
            cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
            assert cfg["model_config"] == {"name": str(final_model), "pretrained": True} and cfg["dataset"] == "c4"
            starts.add(json.loads((run_dir / "summary.json").read_text())["initial_metric"])
            log = (run_dir / "training_log.log").read_text()
            assert "C4 from local shards" in log and str(final_model) in log  # new data, the start's tokenizer
        assert len(starts) == 1  # every variant starts from the very same model
    runs = list(csv.DictReader((out / "runs.csv").open()))
    assert {(r["variant"], r["seed"], r["start"]) for r in runs} == {
        (v, s, s) for v in ("adloco", "diloco_b2") for s in ("0", "1")}
    report = (out / "comparison.md").read_text()
    assert "the unit of every interval and test below is the start" in report and "| starts |" in report
    mtime = (out / "pretrain" / "summary.json").stat().st_mtime
    assert compare_main(["--config", str(ROOT / "config.yaml"), "--seeds", "2", "--max_tokens", "2000",
                         "--init_from", f"{out / 'pretrain'},{out / 'pretrain_start1'}", "--variants", "diloco_b2",
                         "--out", str(out), *phase2, "merge_frequency=1"]) == 0
    assert (out / "pretrain" / "summary.json").stat().st_mtime == mtime  # phase 1 ran once
    # the starts named where the report's reader finds them, not by this machine's path
    assert ("warm start: pretrain/model_weights/final/final_model (in the report's folder), "
            "pretrain_start1/model_weights/final/final_model (in the report's folder)"
            in (out / "comparison.md").read_text())
    with pytest.raises(SystemExit, match="--init_from"):
        compare_main(["--init_from", str(tmp_path), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--pretrain_starts: 2; .*only with --pretrain_config"):
        compare_main(["--pretrain_starts", "2", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--seeds: 1 seeds for 2 warm starts"):
        compare_main(["--init_from", "a,b", "--seeds", "1", "--out", str(tmp_path / "x")])


def _compare_args(out, cache_dir, *extra):
    return ["--config", str(ROOT / "config.yaml"), "--seeds", "1", "--max_tokens", "1500", "--max_outer_steps", "40",
            "--variants", "diloco_b2", "--diloco_batches", "2", "--network", "consumer", "--out", str(out), *SMALL,
            f"cache_dir={cache_dir}", "max_batch_size=2", *extra]


def test_a_finished_run_is_reused_only_under_the_same_config(tmp_path, cache_dir, capsys):
    out = tmp_path / "compare"
    run_dir = out / "runs" / "diloco_b2_seed0"
    assert compare_main(_compare_args(out, cache_dir)) == 0
    first = (run_dir / "summary.json").stat().st_mtime_ns
    capsys.readouterr()
    assert compare_main(_compare_args(out, cache_dir, "lr_inner=0.002")) == 0  # a changed setting: run again
    said = capsys.readouterr().out
    assert "diloco_b2_seed0: the finished run in" in said and "lr_inner: 0.003 -> 0.002" in said
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["lr_inner"] == 0.002
    second = (run_dir / "summary.json").stat().st_mtime_ns
    assert second != first
    assert compare_main(_compare_args(out, cache_dir, "lr_inner=0.002")) == 0  # the same again: reused
    assert "running it again" not in capsys.readouterr().out
    assert (run_dir / "summary.json").stat().st_mtime_ns == second


def test_without_max_tokens_the_budget_run_is_adloco_seed_0_itself(tmp_path, cache_dir, capsys, monkeypatch):
    """No --max_tokens: AdLoCo seed 0 is trained once, to measure the budget, and is then the comparison's own
    AdLoCo seed 0; counted by the run.py processes the harness starts and by its run directories."""
    from benchmarks.compare import runner

    started = []
    real = runner.run_child
    monkeypatch.setattr(runner, "run_child", lambda cmd, log: started.append(cmd[cmd.index("--config") + 2:]) or
                        real(cmd, log))
    out = tmp_path / "compare"
    args = ["--config", str(ROOT / "config.yaml"), "--seeds", "1", "--max_outer_steps", "40", "--variants",
            "adloco,diloco_b2", "--diloco_batches", "2", "--network", "consumer", "--out", str(out), *SMALL,
            f"cache_dir={cache_dir}", "max_batch_size=2", "num_outer_steps=2", "merge_frequency=1"]
    assert compare_main(args) == 0
    said = capsys.readouterr().out
    assert len(started) == 2  # adloco seed 0 (the budget) and diloco_b2 seed 0: nothing trained twice
    assert "running it again" not in said and "adloco_seed0: reusing" in said
    assert sorted(p.name for p in (out / "runs").iterdir() if p.is_dir()) == ["adloco_seed0", "diloco_b2_seed0"]
    budget = int(said.split("token budget: ")[1].split()[0])
    summary = json.loads((out / "runs" / "adloco_seed0" / "summary.json").read_text())
    assert summary["outer_steps"] == 2 and summary["tokens_seen"] == budget
    table = {r["variant"]: r for r in read_csv(out / "comparison.csv")}
    assert float(table["adloco"]["tokens"]) == budget <= float(table["diloco_b2"]["tokens"])
    # a smaller --max_outer_steps sets the budget run's length too: still one run of AdLoCo seed 0
    started.clear()
    assert compare_main([*args, "--out", str(tmp_path / "short"), "--max_outer_steps", "1"]) == 0
    assert len(started) == 2 and "running it again" not in capsys.readouterr().out


def test_the_harness_never_clears_a_directory_a_live_run_holds(tmp_path, cache_dir):
    from run_dir.run_state import RunLock

    run_dir = tmp_path / "compare" / "runs" / "diloco_b2_seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("lr_inner: 0.003\n")
    lock = RunLock(run_dir).acquire()  # a run (or another harness) still using it
    try:
        with pytest.raises(SystemExit, match=f"{run_dir} is in use by process"):
            compare_main(_compare_args(tmp_path / "compare", cache_dir))
        assert (run_dir / "config.yaml").is_file()
    finally:
        lock.release()


def test_workers_make_the_reports_runs_at_once_and_a_stop_ends_every_one(tmp_path, cache_dir, monkeypatch):
    """--workers 2: two runs at once, each on cores / 2 threads, then the report reuses them; a SIGTERM to the
    harness reaches both runs in flight (each checkpoints, resumable), leaves no orphan, exits 143; the next call
    resumes them and reports."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    import benchmarks.compare.runner as runner

    out = tmp_path / "compare"
    args = _compare_args(out, cache_dir, "--seeds", "2", "--workers", "2", "--max_tokens", "6000")
    harness = subprocess.Popen([sys.executable, "-m", "benchmarks.compare", *args], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    logs = [out / "runs" / f"diloco_b2_seed{s}" / "training_log.log" for s in (0, 1)]
    deadline = time.time() + 240
    while not all(log.is_file() and "[outer 2/" in log.read_text() for log in logs):  # both running at once
        assert harness.poll() is None and time.time() < deadline, harness.communicate()
        time.sleep(0.2)
    children = psutil.Process(harness.pid).children(recursive=True)
    harness.send_signal(signal.SIGTERM)
    _, err = harness.communicate(timeout=180)
    assert harness.returncode == 143, err
    assert "stopped by SIGTERM" in err.strip().splitlines()[-1]
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive
    for s in (0, 1):
        status = json.loads((out / "runs" / f"diloco_b2_seed{s}" / "status.json").read_text())
        assert (status["state"], status["signal"], status["resumable"]) == ("stopped", "SIGTERM", True)
    spans = {}
    real = runner.run_variant

    def timed(name, overrides, seed, *rest):  # when each run began and ended
        began = time.monotonic()
        found = real(name, overrides, seed, *rest)
        spans[seed] = (began, time.monotonic())
        return found

    monkeypatch.setattr(runner, "run_variant", timed)
    assert compare_main(args) == 0
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]  # the two resumed at once
    cores = len(os.sched_getaffinity(0))
    for s in (0, 1):
        config = load_config(out / "runs" / f"diloco_b2_seed{s}" / "config.yaml")
        assert config.cpu_threads == max(1, cores // 2)
        assert "resuming after outer step" in (out / "runs" / f"diloco_b2_seed{s}.out").read_text()
    assert sorted(r["seed"] for r in read_csv(out / "runs.csv")) == ["0", "1"]
    with pytest.raises(SystemExit, match="--workers: 0; give at least 1"):
        compare_main(_compare_args(out, cache_dir, "--workers", "0"))


def test_stopping_the_harness_stops_its_running_variant_which_the_next_call_resumes(tmp_path, cache_dir, capsys,
                                                                                   monkeypatch):
    """A Ctrl-C at the terminal (SIGINT to the whole foreground group): the harness passes it to the running
    variant once, which checkpoints and stops; no orphan keeps training; a stop that lands as the next call resumes
    it keeps the checkpoint and starts nothing; the call after resumes that run from its checkpoint rather than
    training it again."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    out = tmp_path / "compare"
    args = _compare_args(out, cache_dir, "--max_tokens", "6000")
    harness = subprocess.Popen([sys.executable, "-m", "benchmarks.compare", *args], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    log = out / "runs" / "diloco_b2_seed0" / "training_log.log"
    deadline = time.time() + 240
    while not (log.is_file() and "[outer 2/" in log.read_text()):
        assert harness.poll() is None and time.time() < deadline, harness.communicate()
        time.sleep(0.2)
    children = psutil.Process(harness.pid).children(recursive=True)
    assert children
    os.killpg(harness.pid, signal.SIGINT)  # what the terminal does: the harness's group (not the child's session)
    _, err = harness.communicate(timeout=180)
    assert harness.returncode == 130, err
    assert "stopped by SIGINT: the running variant was stopped too" in err.strip().splitlines()[-1]
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive  # no orphan keeps training
    status = json.loads((out / "runs" / "diloco_b2_seed0" / "status.json").read_text())
    assert status["state"] == "stopped" and status["signal"] == "SIGINT" and status["resumable"]
    stopped_at = status["outer_step"]

    from benchmarks import launch
    from benchmarks.compare import runner

    real, started = runner.run_child, []

    def stopped_as_it_starts(cmd, log, **kw):  # benchmarks.tune's handler, landing as the resume starts
        launch.stop_children(signal.SIGTERM)
        started.append(cmd)
        return real(cmd, log, **kw)

    monkeypatch.setattr(runner, "run_child", stopped_as_it_starts)
    try:
        with pytest.raises(SystemExit, match="diloco_b2_seed0 was stopped while it resumed"):
            compare_main(args)
    finally:
        launch.allow_children()
    assert len(started) == 1 and "--resume" in started[0]  # no run from scratch after the stop
    assert json.loads((out / "runs" / "diloco_b2_seed0" / "status.json").read_text()) == status
    assert os.path.isdir(status["checkpoint"])
    monkeypatch.setattr(runner, "run_child", real)
    assert compare_main(args) == 0
    assert f"diloco_b2_seed0: resuming the stopped run in {out / 'runs' / 'diloco_b2_seed0'}" in capsys.readouterr().out
    said = (out / "runs" / "diloco_b2_seed0.out").read_text()  # the stopped run's log, then the resumed one's
    assert f"stopped by SIGINT after outer step {stopped_at}" in said
    assert f"resuming after outer step {stopped_at} of 40" in said
    summary = json.loads((out / "runs" / "diloco_b2_seed0" / "summary.json").read_text())
    assert summary["outer_steps"] > stopped_at and summary["tokens_seen"] >= 6000


def test_a_stopped_run_that_diverges_after_it_resumes_is_an_outcome_not_run_again(tmp_path, cache_dir, monkeypatch):
    """A run stopped by a signal, then resumed by the next call, diverges (inject_fault: a NaN loss in round 12, long
    after the stop): a resume is exact, so a run from the start would diverge at the same step; the harness lists
    the fault instead of training the seed again from scratch (it did, until 2026-11-29: 5 minutes of a core lost
    per diverged seed of the nano study's batch 1), and the call after reuses the outcome."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "compare"
    args = _compare_args(out, cache_dir, "inject_fault=12:0:nan", "--max_tokens", "8000")
    harness = subprocess.Popen([sys.executable, "-m", "benchmarks.compare", *args], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    run_dir = out / "runs" / "diloco_b2_seed0"
    deadline = time.time() + 240
    while not ((run_dir / "training_log.log").is_file() and "[outer 2/" in (run_dir / "training_log.log").read_text()):
        assert harness.poll() is None and time.time() < deadline, harness.communicate()
        time.sleep(0.2)
    os.killpg(harness.pid, signal.SIGINT)
    _, err = harness.communicate(timeout=180)
    assert harness.returncode == 130, err
    stopped = json.loads((run_dir / "status.json").read_text())
    assert stopped["state"] == "stopped" and stopped["resumable"] and stopped["outer_step"] < 12

    from benchmarks.compare import runner

    real, started = runner.run_child, []

    def counted(cmd, log, **kw):
        started.append(cmd)
        return real(cmd, log, **kw)

    monkeypatch.setattr(runner, "run_child", counted)
    with pytest.raises(SystemExit, match="every run stopped on a training fault"):
        compare_main(args)
    assert len(started) == 1 and "--resume" in started[0]  # resumed once, never run again from the start
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "fault" and status["exit_code"] == 3 and status["outer_step"] == 11
    said = (out / "runs" / "diloco_b2_seed0.out").read_text()  # the stopped run's log, then the resumed one's
    assert f"resuming after outer step {stopped['outer_step']}" in said and "inject_fault: nan" in said
    with pytest.raises(SystemExit, match="every run stopped on a training fault"):
        compare_main(args)  # the outcome is reused: nothing runs
    assert len(started) == 1


def test_ran_names_the_smallest_and_largest_shapes_that_really_ran():
    from benchmarks.compare import ran_shapes

    rows = [{"loader_batch": lb, "accumulation_steps": acc} for lb, acc in
            [("2", "1"), ("4", "4"), ("4", "2"), ("4", "1"), ("3", "3")]]  # the largest is not the last row
    assert ran_shapes(rows) == "2x1..4x4"
    assert ran_shapes(rows[:1] * 3) == "2x1"


def test_the_harness_writes_outside_the_committed_results_by_default():
    import subprocess

    from benchmarks.compare import build_parser

    out = build_parser().parse_args([]).out
    assert out == str(ROOT / "logs" / "compare")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(ROOT / "logs" / "compare" / "comparison.md")], cwd=ROOT)
    assert ignored.returncode == 0  # logs/ is not tracked: a user's report never replaces the committed one


def test_communication_variants_are_named_overrides_left_out_of_all():
    from benchmarks.compare import COMMUNICATION_VARIANTS, variants

    chosen = variants(load_config(ROOT / "configs" / "compare_cpu.yaml"), [2, 4, 8, 16], 0.3)
    assert chosen["adloco_int8"] == ["outer_compression=int8"]
    assert chosen["adloco_int8_sketch"] == ["outer_compression=int8", "statistics_comm=sketch"]
    # DiLoCo compressed: the middle DiLoCo batch (8), one trainer, then the scheme
    assert chosen["diloco_int8"] == [*chosen["diloco_b8"], "outer_compression=int8"]
    assert chosen["diloco_streaming"] == [*chosen["diloco_b8"], "sync_fragments=4", "sync_delay=1",
                                          "fragment_alpha=0.5"]
    assert set(COMMUNICATION_VARIANTS) <= set(chosen)
    for name in COMMUNICATION_VARIANTS:  # every override is a valid config
        load_config(ROOT / "configs" / "compare_cpu.yaml", chosen[name])


def test_harness_on_a_described_cluster_times_every_run_by_its_own_clock(tmp_path, cache_dir):
    """--cluster: every run on the described cluster (2 nodes, one at a quarter speed); the report's clock table
    comes from the runs' own sim_time_s; diloco_by_speed gives the slow node fewer inner steps."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("devices: [{device: cpu, speed: 1.0}, {device: cpu, speed: 0.25}]\nnodes_per_gpu: 1\n"
                       "network: cross-region\n")
    out = tmp_path / "compare"
    rc = compare_main(["--config", str(ROOT / "config.yaml"), "--seeds", "1", "--max_tokens", "2000",
                       "--max_outer_steps", "20", "--diloco_batches", "2", "--out", str(out), "--cluster", str(cluster),
                       "--variants", "adloco,diloco_b2,diloco_by_speed",
                       *[o for o in SMALL if not o.startswith(("devices", "nodes_per_gpu"))], f"cache_dir={cache_dir}",
                       "merge_frequency=1", "num_init_trainers=2", "max_batch_size=2", "--network", "consumer"])
    assert rc == 0
    clock = {r["variant"]: r for r in read_csv(out / "clock.csv")}
    assert set(clock) == {"adloco", "diloco_b2", "diloco_by_speed"}
    for name, row in clock.items():
        summary = json.loads((out / "runs" / f"{name}_seed0" / "summary.json").read_text())
        assert summary["clock"]["node_speeds"] == [1.0, 0.25]
        assert float(row["sim_time_s"]) == pytest.approx(summary["sim_time_s"], rel=1e-6)
        assert 0 < float(row["utilisation"]) < 1
    nodes = read_csv(out / "runs" / "diloco_by_speed_seed0" / "model_training_report" / "node_clock.csv")
    assert {r["inner_steps"] for r in nodes if r["node_id"] == "0"} == {"3"}
    assert {r["inner_steps"] for r in nodes if r["node_id"] == "1"} == {"1"}  # 3 x 0.25, rounded, at least 1
    # DyLU's nodes finish (nearly) together: the fast node waits far less for the slow one in each round
    def straggling(name):
        rows = read_csv(out / "runs" / f"{name}_seed0" / "model_training_report" / "node_clock.csv")
        by_step = {}
        for r in rows:
            by_step.setdefault(r["outer_step"], []).append(float(r["compute_s"]))
        return max(max(c) - min(c) for c in by_step.values())

    assert straggling("diloco_by_speed") < 0.5 * straggling("diloco_b2")
    assert "## The simulated cluster's clock (--cluster)" in (out / "comparison.md").read_text()
    cluster.write_text("devices: [cpu]\nlr_inner: 0.1\n")
    with pytest.raises(SystemExit, match="'lr_inner' is not a cluster key"):
        compare_main(["--config", str(ROOT / "config.yaml"), "--out", str(out), "--cluster", str(cluster)])


def test_adding_a_cluster_reprices_finished_runs_that_differ_only_in_what_the_clock_reads(tmp_path, cache_dir,
                                                                                          monkeypatch, capsys):
    """--cluster on a finished comparison: device speeds and the network are read by the clock alone, so the runs
    are re-priced from their logs (no run.py started) to the very figures retraining gives; a node_schedule (which
    changes the numbers) retrains. The report says which sections use the cluster file, with one target each."""
    from benchmarks.compare import runner

    started = []
    real = runner.run_child
    monkeypatch.setattr(runner, "run_child", lambda cmd, log, **kw: started.append(cmd) or real(cmd, log, **kw))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("devices: [{device: cpu, speed: 1.0}, {device: cpu, speed: 0.25}]\nnetwork: cross-region\n")
    out = tmp_path / "compare"
    base = tmp_path / "base.yaml"  # two devices of one node each, at speed 1 (the cluster file sets their speeds)
    base.write_text(yaml.safe_dump({**yaml.safe_load((ROOT / "config.yaml").read_text()), "devices": ["cpu", "cpu"],
                                    "nodes_per_gpu": 1}))
    args = ["--config", str(base), "--seeds", "1", "--max_tokens", "1500", "--max_outer_steps", "20",
            "--diloco_batches", "2", "--out", str(out), "--variants", "adloco,diloco_b2", "--network", "consumer",
            *[o for o in SMALL if not o.startswith(("devices", "nodes_per_gpu"))], f"cache_dir={cache_dir}",
            "merge_frequency=1", "max_batch_size=2"]
    assert compare_main(args) == 0 and len(started) == 2
    started.clear()
    capsys.readouterr()
    assert compare_main([*args, "--cluster", str(cluster)]) == 0
    said = capsys.readouterr().out
    assert started == [] and said.count("re-pricing") == 2 and "clock reads (devices, network)" in said, said[:600]
    # a budget that stops at the same outer step as well (the budget run, re-priced under a cluster file): re-priced
    assert compare_main([*args, "--cluster", str(cluster), "--max_tokens", "1499"]) == 0
    said_again = capsys.readouterr().out
    assert started == [] and said_again.count("re-pricing") == 2 and "running it again" not in said_again
    repriced = {r["variant"]: r for r in read_csv(out / "clock.csv")}
    report = (out / "comparison.md").read_text()
    assert "## What uses the cluster file" in report and "not retrained: adloco, diloco_b2" in report
    section = report.split("## What uses the cluster file")[1].split("## ")[0]
    assert section.count("target val_perplexity ") == 3 and "not the cluster file; equal node speeds" in section
    assert compare_main([*args, "--cluster", str(cluster), "--rerun"]) == 0 and len(started) == 2  # retrained
    retrained = {r["variant"]: r for r in read_csv(out / "clock.csv")}
    for name, row in retrained.items():  # the same figures (training_log.csv keeps sim_time_s to 6 decimals)
        for key, value in row.items():
            if key != "variant" and value:
                assert float(repriced[name][key]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), (name, key)
    started.clear()
    cluster.write_text(cluster.read_text() + "node_schedule: [{node: 1, slowdown: 2, from: 2}]\n")
    assert compare_main([*args, "--cluster", str(cluster)]) == 0 and len(started) == 2  # numbers change: retrained


def test_busy_machine_benchmark_runs_each_wait_policy_alone_and_beside_busy_processes(tmp_path, cache_dir):
    """The harness behind BENCHMARKS "CPU time on a busy machine": every setting under both loads, the job's
    own CPU-seconds (not the busy processes'), ratios against libgomp's default alone; a failing job stops it."""
    from benchmarks.busy_machine import main as busy_main

    out = tmp_path / "busy"
    assert busy_main(["--busy", "1", "--out", str(out), *TINY, f"cache_dir={cache_dir}", "num_outer_steps=1"]) == 0
    rows = json.loads((out / "busy_machine.json").read_text())
    assert [(r["setting"], r["load"]) for r in rows] == [
        (s, load) for load in ("alone", "beside 1 busy") for s in ("libgomp_default", "ours", "passive")]
    assert rows[0]["wall_ratio"] == rows[0]["cpu_ratio"] == 1.0
    for r in rows:
        # a job on at most os.cpu_count() cores: its CPU time cannot exceed cores x wall (the spinner's would)
        assert 0 < r["cpu_s"] <= (os.cpu_count() or 1) * r["wall_s"] + 1
    assert "| ours | beside 1 busy |" in (out / "busy_machine.md").read_text()
    with pytest.raises(SystemExit, match="error: the job libgomp_default_0 failed .exit 2.: error: config key"):
        busy_main(["--busy", "1", *TINY, f"cache_dir={cache_dir}", "num_outer_step=1"])


def test_a_variant_from_the_command_line_takes_its_base_then_its_own_overrides():
    from benchmarks.compare.variants import PAPER, catalogue, custom

    known = catalogue(load_config(ROOT / "configs" / "compare_cpu.yaml"), [2, 4, 8, 16], 0.3)
    assert known["adloco_paper"].overrides == PAPER and "variance_estimator=nodes" in PAPER
    assert known["ddp"].overrides == (*known["diloco_b8"].overrides, "distributed_algo=DDP")
    added = custom(("paper_eta07=adloco_paper:ETA=0.7", "b3=diloco_b2:initial_batch_size=3 max_requested_batch=3",
                    "plain=ETA=0.5"), known)
    assert added["paper_eta07"].overrides == (*PAPER, "ETA=0.7") and added["paper_eta07"].family == "adloco"
    assert added["b3"].family == "diloco" and added["b3"].overrides[-2:] == ("initial_batch_size=3",
                                                                             "max_requested_batch=3")
    assert added["plain"].overrides == ("ETA=0.5",) and added["plain"].family == "adloco"
    for spec, words in (("nothing", r"expected NAME=\[BASE:\]KEY=VALUE"), ("x=nope:ETA=1", "unknown base nope"),
                        ("adloco=ETA=1", "adloco is already a variant"), ("x=adloco:", "expected NAME"),
                        ("short=adloco:num_outer_steps=2", "num_outer_steps is set by the harness"),
                        ("s=max_tokens=5", "max_tokens is set by the harness"), ("q=task_name='open", "quotation")):
        with pytest.raises(SystemExit, match=words):
            custom((spec,), known)
    # a quoted value keeps its spaces; an earlier --add_variant can be the base of a later one
    named = custom(("named=adloco:task_name='my run' ETA=0.6", "named2=named:ETA=0.5"), known)
    assert named["named"].overrides == ("task_name=my run", "ETA=0.6")
    assert named["named2"].overrides == ("task_name=my run", "ETA=0.6", "ETA=0.5")


def test_a_bad_override_of_a_variant_from_the_command_line_is_refused_before_any_run(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--add_variant mine: config key 'ETA'"):
        compare_main(["--config", str(ROOT / "config.yaml"), "--out", str(tmp_path), "--variants", "adloco",
                      "--add_variant", "mine=adloco_paper:ETA=banana"])
    assert not (tmp_path / "runs" / "adloco_seed0").exists()


def test_the_paper_ablations_are_the_paper_variant_with_one_component_off():
    from benchmarks.compare.variants import PAPER, catalogue, select

    known = catalogue(load_config(ROOT / "configs" / "compare_cpu.yaml"), [1, 2, 4, 8, 16], 0.3)
    assert known["adloco_paper_no_adaptive"].overrides == (*PAPER, "sampling_method=constant")
    assert known["adloco_paper_no_merge"].overrides == (*PAPER, "merge_frequency=0")
    # the no-merge ablations search everything their variant does but the merge interval, which they fix at 0
    assert [k.key for k in known["adloco_paper_no_merge"].search] == ["lr_inner", "ETA", "initial_batch_size"]
    assert [k.key for k in known["adloco_no_merge"].search] == ["lr_inner", "ETA", "initial_batch_size"]
    # the paper's merge interval reaches 24 rounds (its nano best merged every 12 of 1-12); ours stays at 1-12
    merge_every = {name: next(k.choices for k in known[name].search if k.key == "merge_frequency")
                   for name in ("adloco", "adloco_paper")}
    assert merge_every == {"adloco": (1, 2, 3, 4, 6, 8, 12), "adloco_paper": (1, 2, 3, 4, 6, 8, 12, 16, 24)}
    assert known["adloco_paper_always_accumulate"].overrides == (*PAPER, "switch_mode=only_gradient_accumulation")
    assert known["adloco_paper_never_accumulate"].overrides == (*PAPER, "switch_mode=only_data_loader")
    with pytest.raises(SystemExit, match="adloco_no_switch had two meanings .* renamed: adloco_never_accumulate"):
        select(known, "adloco_no_switch", "2,4", False)
    paper = select(known, "paper", "1,2,4,8,16", False)
    assert set(paper) == {"adloco_paper", "adloco_paper_no_adaptive", "adloco_paper_no_merge",
                          "adloco_paper_always_accumulate", "adloco_paper_never_accumulate", "diloco_b1", "diloco_b2",
                          "diloco_b4", "diloco_b8", "diloco_b16"}
    assert not set(select(known, "all", "1,2,4,8,16", False)) & {"adloco_paper_no_merge"}  # all: as before
    assert set(select(known, "paper,ddp", "1,2,4,8,16", False)) == set(paper) | {"ddp"}  # groups and names mix
    assert set(select(known, "switch", "1,2,4,8,16", False)) == {  # switch mode's ablations, ours and the paper's,
        "adloco_never_accumulate", "adloco_always_accumulate", "adloco_paper_never_accumulate",  # and the control
        "adloco_paper_always_accumulate", "adloco_one_pass", "adloco_paper_one_pass"}


def fake_run(tmp_path, name, seed, start, points):
    """A finished run as read_run gives it: (tokens, steps, sim_time, perplexity) per outer step."""
    run_dir = tmp_path / f"{name}_seed{seed}"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"initial_batch_size": start, "num_inner_steps": 10,
                                                         "network": "datacentre", "node_tokens_per_s": 1000}))
    curve = [{"tokens": t, "steps": s, "sim_time": c, "metric": m, "rounds": s // 10, "bytes": 100 * s,
              "weights_bytes": 60 * s, "statistics_bytes": 40 * s} for t, s, c, m in points]
    return {"run_dir": run_dir, "curve": curve, "final": points[-1][3], "best_seen": min(p[3] for p in points),
            "requested_batches": [start, 2 * start], "merges": [{}] * seed, "family": name.split("_")[0],
            "constant_batch": int(name.removeprefix("diloco_b")) if name.startswith("diloco_b") else 0}


def paper_pair(tmp_path):
    """adloco (starting batch 2) and DiLoCo at batch 2, two seeds: DiLoCo reaches 400 / 200 / 100 at 1/4, 1/2, all
    of 4000 tokens (seed 1 10% worse), adloco 300 / 150 / 90 (+ its seed) at steps 10, 20, 30."""
    return {
        "adloco": [fake_run(tmp_path, "adloco", s, 2, [(1000, 10, 1.0, 300 + s), (2000, 20, 2.0, 150 + s),
                                                        (4000, 30, 3.0, 90 + s)]) for s in (0, 1)],
        "diloco_b2": [fake_run(tmp_path, "diloco_b2", s, 2, [(1000, 10, 1.0, 400 * (1 + s / 10)),
                                                              (2000, 20, 4.0, 200 * (1 + s / 10)),
                                                              (4000, 40, 8.0, 100 * (1 + s / 10))]) for s in (0, 1)]}


def test_per_seed_rows_paired_intervals_and_the_papers_comparison_by_hand(tmp_path):
    from benchmarks.compare import seeds

    # paired t interval by hand: differences 1, 2, 3: mean 2, sd 1, half width 4.303 / sqrt(3)
    mean, low, high = seeds.paired_interval([1.0, 2.0, 3.0])
    assert (mean, low, high) == pytest.approx((2.0, 2 - 4.303 / 3 ** 0.5, 2 + 4.303 / 3 ** 0.5))
    assert seeds.paired_interval([5.0])[0] == 5.0
    # DiLoCo at the starting batch 2 reaches 400 / 200 / 100 at 1/4, 1/2, all of 4000 tokens (seed 1 worse: 440, ...)
    results = {
        **paper_pair(tmp_path),
        "adloco_paper": [fake_run(tmp_path, "adloco_paper", s, 1, [(4000, 40, 4.0, 500)]) for s in (0, 1)],
        "diloco_b4": [fake_run(tmp_path, "diloco_b4", s, 4, [(4000, 10, 2.0, 80 + s)]) for s in (0, 1)]}
    # a variant whose seed 0 stopped on a training fault: its rows keep the seeds' own numbers
    gap = {"diloco_b8": [{**fake_run(tmp_path, "diloco_b8", 1, 8, [(4000, 5, 1.0, 95)]), "seed": 1}]}
    assert [r["seed"] for r in seeds.run_rows(gap, 4000, {}, False)] == [1]
    targets = seeds.paper_targets(results["diloco_b2"], 4000, higher=False)
    assert targets == pytest.approx({"early": 440.0, "middle": 220.0, "late": 110.0})  # every seed reached them
    lines = seeds.sections(results, "val_perplexity", 4000, "diloco_b2", tmp_path)
    rows = read_csv(tmp_path / "runs.csv")
    assert [(r["variant"], r["seed"]) for r in rows] == [(v, str(s)) for v in results for s in (0, 1)]
    first = rows[0]  # adloco seed 0: reaches 440 at its first point, 220 at its second, 110 at its third
    assert (first["steps_to_early"], first["steps_to_middle"], first["steps_to_late"]) == ("10", "20", "30")
    assert first["at_budget"] == "90" and first["reached_budget"] == "True" and first["bytes_needed"] == "3000"
    assert rows[2]["sim_time_to_late"] == "8.0" and rows[3]["steps_to_late"] == "40"  # 110 = seed 1's own value
    # paired: adloco against diloco_b2 at the budget: 90 - 100 and 91 - 110, mean -14.5, sd 6.36
    paired = {r["variant"]: r for r in seeds.paired_rows(seeds.run_rows(results, 4000, targets, False), "diloco_b2")}
    assert paired["adloco"]["mean_difference"] == pytest.approx(-14.5)
    assert paired["adloco"]["ci95_high"] == pytest.approx(-14.5 + 12.706 * 4.5 * 2 ** 0.5 / 2 ** 0.5)
    assert paired["adloco"]["interval_contains_0"]  # two seeds establish nothing here
    # the paper's comparison: adloco's steps over DiLoCo's, seed by seed (10/10, 20/20, 30/40); its sim time 3/8
    paper = {r["variant"]: r for r in seeds.paper_rows(seeds.run_rows(results, 4000, targets, False), results)}
    assert (paper["adloco"]["steps_early"], paper["adloco"]["steps_late"]) == (1.0, 0.75)
    assert paper["adloco"]["sim_time_late"] == pytest.approx(3 / 8)
    assert paper["adloco_paper"]["vs"] == "diloco_b1 (not in this report)"  # it starts at batch 1
    text = "\n".join(lines)
    assert "## The paper's comparison" in text and "H = 10 inner steps" in text and "| adloco | diloco_b2 |" in text
    assert "on the runs' clock: datacentre network, a flat 1000 tokens/s per node)" in text
    # re-priced runs (a throughput curve given as the clock's key): the times are that clock's, and the text says so
    results["adloco"][0]["summary"] = {"repriced": True, "clock": {"network": "cross-region (1 Gbit/s, 50 ms)",
                                                                   "throughput": "curve h100.json"}}
    assert "on the runs' clock: re-priced on cross-region (1 Gbit/s, 50 ms), curve h100.json)" in "\n".join(
        seeds.sections(results, "val_perplexity", 4000, "diloco_b2", tmp_path))
    # and against the best constant batch at the budget, chosen after the fact: b4 (80.5 on average, b2 105)
    assert "Against the best constant batch at the budget (diloco_b4), chosen after the fact" in text
    # declared primary comparisons first (none here: no tuned-batch DiLoCo, adloco_paper's b1 absent; adloco vs b2
    # is one), then every other comparison with Holm's correction over all of them
    assert text.index("### Primary comparisons") < text.index("### Every other comparison (Holm-corrected")
    assert "| adloco | diloco_b2 | 2 |" in text.split("### Every other")[0] and "only 2 seeds (< 10)" in text
    # a declared pair is shown once and is not one of Holm's m: adloco_paper and b4 against b2, then adloco, b2 and
    # adloco_paper against b4 (5, not 6)
    others = text.split("### Every other")[1].split("## The paper's comparison")[0]
    assert "| adloco | diloco_b2 |" not in others and "over the report's 5 other comparisons" in others
    assert "holm_p" in text and "holm_established" in text
    best = {r["variant"]: r for r in seeds.paired_rows(seeds.run_rows(results, 4000, targets, False), "diloco_b4")}
    assert best["adloco"]["mean_difference"] == pytest.approx(10.0)  # 90 - 80 and 91 - 81
    assert best["diloco_b2"]["mean_difference"] == pytest.approx(24.5) and not best["adloco"]["interval_contains_0"]
    assert "| adloco | diloco_b4 | 2 | 10 |" in text


def test_mid_round_evaluations_give_steps_to_a_target_their_granularity():
    from benchmarks.compare.reader import fine_curve
    from training_logs.records import InnerEval

    curve = [{"step": s, "metric": m, "tokens": 100 * s, "steps": 10 * s, "sim_time": 2.0 * s, "rounds": s}
             for s, m in ((0, 1000.0), (1, 500.0), (2, 300.0))]
    evaluations = [InnerEval(2, t, t, j, 100 + 10 * j, val_perplexity=m)
                   for t, j, m in ((0, 5, 420.0), (1, 5, 380.0))]  # trainer 1's first node is the best at step 1.5
    fine = fine_curve(curve, evaluations, "val_perplexity", 10)
    middle = fine[2]
    assert [p["step"] for p in fine] == [0, 1, 1.5, 2]
    assert (middle["metric"], middle["steps"], middle["tokens"], middle["sim_time"], middle["rounds"]) == (
        380.0, 15, 150, 3.0, 1)  # the best trainer; steps (2 - 1) x 10 + 5; the counters of step 1
    from benchmarks.compare.reader import first_reaching

    assert first_reaching(fine, 400.0, "steps", False) == 15 and first_reaching(curve, 400.0, "steps", False) == 20
    assert fine_curve(curve, [], "val_perplexity", 10) is curve


def test_a_variant_the_regime_refuses_stops_the_harness_before_any_run_or_is_left_out_of_a_group(tmp_path, capsys):
    """With one node per trainer, the paper's variant without merging can never grow a batch (the nodes estimator
    has one sample per trainer), which the config refuses: named, the harness stops in one line before any run;
    as a member of --variants paper, it is left out with the reason and the rest runs."""
    args = ["--config", str(ROOT / "configs" / "compare_cpu.yaml"), "--out", str(tmp_path), "--diloco_batches", "1"]
    with pytest.raises(SystemExit, match="variant adloco_paper_no_merge: config key 'variance_estimator'"):
        compare_main([*args, "--variants", "adloco_paper_no_merge"])
    assert not (tmp_path / "runs").exists()  # nothing written
    from benchmarks.compare import runner

    def no_run(name, *a, **k):
        raise SystemExit(f"ran {name}")

    import benchmarks.compare as harness

    harness.run_variant, original = no_run, harness.run_variant
    try:
        with pytest.raises(SystemExit, match="ran adloco_paper$"):
            compare_main([*args, "--variants", "paper", "--max_tokens", "1000"])
    finally:
        harness.run_variant = original
    assert "adloco_paper_no_merge: left out of this regime" in capsys.readouterr().out
    assert runner.run_variant is original


def test_the_harness_answers_input_mistakes_in_one_line_exit_2_before_writing_anything(tmp_path):
    import subprocess
    import sys

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("devices:\n  - {device: cpu, speed: fast}\n")
    cases = {"--config nope.yaml": "error: --config: file not found: nope.yaml",
             "lr_inner=abc": "error: config key 'lr_inner': expected a number, got 'abc'",
             "--diloco_batches 2,x": "error: --diloco_batches: '2,x' is not a comma-separated list",
             f"--cluster {cluster}": "error: config key 'devices[0].speed': expected a number, got 'fast'"}
    for args, said in cases.items():
        out = tmp_path / "out"
        proc = subprocess.run([sys.executable, "-m", "benchmarks.compare", "--out", str(out), *args.split()],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.startswith(said), (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists(), args


def test_one_target_drives_every_table_and_the_crossover_reads_families_not_names():
    import dataclasses

    from benchmarks.compare.options import Options
    from benchmarks.compare.pricing import crossover_row, time_target

    curve = [{"metric": m, "tokens": t} for m, t in ((500.0, 0), (300.0, 100), (200.0, 200))]
    results = {"mine": [{"curve": curve}], "diloco_b2": [{"curve": curve[:2]}]}
    args = Options.parse(["--seeds", "1"])
    assert time_target(results, "val_perplexity", args) == 300.0  # neither given: the loosest every run reached
    assert time_target(results, "val_perplexity", dataclasses.replace(args, target=250.0)) == 250.0
    assert time_target(results, "val_perplexity", dataclasses.replace(args, target=250.0, time_target=400.0)) == 400.0
    # the crossover: an AdLoCo-family variant of any name is AdLoCo (no variant named exactly adloco here)
    families = {"adloco_paper": "adloco", "paper_eta07": "adloco", "diloco_b2": "diloco", "diloco_b4": "diloco",
                "ddp": "synchronous"}
    row = crossover_row({"adloco_paper": 30.0, "paper_eta07": 24.0, "diloco_b2": 40.0, "diloco_b4": None,
                         "ddp": 20.0}, families)
    assert (row["winner"], row["runner_up"], row["margin"]) == ("ddp", "paper_eta07", 1.2)
    assert row["adloco_vs_best_diloco"] == 24.0 / 40.0 and row["time_diloco_b4"] is None
    assert crossover_row({"diloco_b2": None}, families) is None
    assert crossover_row({"diloco_b2": 5.0, "ddp": 4.0}, families)["adloco_vs_best_diloco"] is None


def test_paired_p_values_and_holms_correction_by_hand():
    from benchmarks.compare.seeds import holm, paired_p

    # differences 1, 2, 3: mean 2, sd 1, t = 2 / (1 / sqrt 3) = 3.4641 on 2 degrees of freedom: p = 0.07418
    assert paired_p([1.0, 2.0, 3.0]) == pytest.approx(0.074180, abs=1e-6)
    assert paired_p([1.0]) != paired_p([1.0])  # nan: one pair has no test
    rows = holm([{"p_value": 0.04}, {"p_value": 0.01}, {"p_value": 0.03}])
    # sorted 0.01, 0.03, 0.04 times 3, 2, 1: 0.03, 0.06, 0.04 -> non-decreasing: 0.03, 0.06, 0.06
    assert [r["holm_p"] for r in rows] == pytest.approx([0.06, 0.03, 0.06])
    assert [r["holm_established"] for r in rows] == [False, True, False]


def test_with_several_warm_starts_the_interval_is_over_the_starts_by_hand():
    from benchmarks.compare.seeds import paired_rows

    # seeds 0..5, start s mod 3; differences a - b: 1, 5, 3, 3, 2, 4 -> starts 0: (1 + 3) / 2 = 2, 1: (5 + 2) / 2
    # = 3.5, 2: (3 + 4) / 2 = 3.5; mean 3, sd sqrt(0.75), half width 4.303 x 0.8660 / sqrt 3 = 2.1515 (2 df)
    a, b = [11, 15, 13, 13, 12, 14], [10] * 6
    rows = [{"variant": v, "seed": s, "start": s % 3, "at_budget": x[s]} for v, x in (("a", a), ("b", b))
            for s in range(6)]
    (row,) = paired_rows(rows, "b")
    assert (row["pairs"], row["starts"], row["mean_difference"]) == (6, 3, pytest.approx(3.0))
    assert (row["ci95_low"], row["ci95_high"]) == pytest.approx((3 - 2.15150, 3 + 2.15150), abs=1e-4)
    # the same numbers without starts: six units, 5 df (squares 4+4+0+0+1+1 = 10 over 5: sd sqrt 2): half 2.571 x
    # 1.41421 / sqrt 6 = 1.48437
    (seeded,) = paired_rows([{k: v for k, v in r.items() if k != "start"} for r in rows], "b")
    assert "starts" not in seeded and seeded["ci95_high"] == pytest.approx(3 + 1.48437, abs=1e-4)


def test_the_papers_comparison_also_pairs_each_adloco_with_dilocos_tuned_batch(tmp_path):
    """Steps and time to the paper comparison's targets (DiLoCo at the starting batch's: 440, 220, 110 here) against
    DiLoCo with its batch tuned as well, by hand: adloco reaches them at steps 10, 20, 30 (times 1, 2, 3), the
    batch-tuned DiLoCo at 5, 10, 20 (times 0.5, 1, 2), so 2, 2 and 1.5 on both seeds; a variant whose starting
    batch is absent still gets its batch-tuned row."""
    from benchmarks.compare import seeds

    results = {
        **paper_pair(tmp_path),
        "diloco_tuned_batch": [fake_run(tmp_path, "diloco_tuned_batch", s, 8, [
            (1000, 5, 0.5, 430), (2000, 10, 1.0, 210), (4000, 20, 2.0, 100)]) for s in (0, 1)],
        "adloco_paper": [fake_run(tmp_path, "adloco_paper", s, 1, [(4000, 40, 4.0, 500)]) for s in (0, 1)]}
    targets = seeds.paper_targets(results["diloco_b2"], 4000, higher=False)
    rows = seeds.paper_rows(seeds.run_rows(results, 4000, targets, False), results)
    assert [(r["variant"], r["vs"]) for r in rows] == [
        ("adloco", "diloco_b2"), ("adloco", "diloco_tuned_batch"),
        ("adloco_paper", "diloco_b1 (not in this report)"), ("adloco_paper", "diloco_tuned_batch")]
    batch_tuned = rows[1]
    assert [batch_tuned[f"steps_{t}"] for t in ("early", "middle", "late")] == pytest.approx([2.0, 2.0, 1.5])
    assert [batch_tuned[f"sim_time_{t}"] for t in ("early", "middle", "late")] == pytest.approx([2.0, 2.0, 1.5])
    assert rows[3]["steps_late"] == "0/2 seeds"  # the paper's never reaches 110
    text = "\n".join(seeds.sections(results, "val_perplexity", 4000, "diloco_b2", tmp_path))
    assert "| adloco | diloco_tuned_batch | 2 | 2 | 2 | 2 | 1.5 | 1.5 |" in text


def test_an_ablation_report_compares_each_ablation_with_its_method_per_token_and_per_step_by_hand(tmp_path):
    """A report of ablations and their methods (switch mode's: no DiLoCo in it) declares each ablation against its
    method as its primary comparisons, and gives tokens, steps and simulated time to the method's targets. adloco
    reaches 300, 150, 90 (+ seed) at 1000, 2000, 4000 tokens (steps 10, 20, 30; times 1, 2, 3), so its targets are
    the worse seed's 301, 151, 91; always_accumulate reaches 320, 140, 80 (+ seed) at steps 5, 10, 20 (times 2, 4,
    8): 301 and 151 at 2000 tokens, step 10, time 4; 91 at 4000, step 20, time 8. never_accumulate only reaches 301,
    at its one point (4000 tokens, step 40, time 4)."""
    from benchmarks.compare import seeds

    def ablation(name, points, ablates=("adloco",)):
        return [{**fake_run(tmp_path, name, s, 2, [(t, k, c, m + s) for t, k, c, m in points]), "ablates": ablates}
                for s in (0, 1)]

    results = {"adloco": paper_pair(tmp_path)["adloco"],
               "adloco_always_accumulate": ablation("adloco_always_accumulate",
                                                    [(1000, 5, 2.0, 320), (2000, 10, 4.0, 140), (4000, 20, 8.0, 80)]),
               "adloco_never_accumulate": ablation("adloco_never_accumulate", [(4000, 40, 4.0, 200)])}
    assert seeds.primary_pairs(results) == [("adloco_always_accumulate", "adloco"),
                                            ("adloco_never_accumulate", "adloco")]
    # the matched control is compared with its method and with always_accumulate, whose batch it runs in one pass
    control = {**results, "adloco_one_pass": ablation("adloco_one_pass", [(4000, 20, 4.0, 80)],
                                                      ("adloco", "adloco_always_accumulate"))}
    assert seeds.primary_pairs(control)[2:] == [("adloco_one_pass", "adloco"),
                                                ("adloco_one_pass", "adloco_always_accumulate")]
    rows, targets = seeds.ablation_rows(results, 4000, higher=False)
    assert targets == {"adloco": pytest.approx({"early": 301.0, "middle": 151.0, "late": 91.0})}
    always, never = rows
    assert [always[f"{k}_early"] for k in ("tokens", "steps", "sim_time")] == pytest.approx([2.0, 1.0, 4.0])
    assert [always[f"{k}_middle"] for k in ("tokens", "steps", "sim_time")] == pytest.approx([1.0, 0.5, 2.0])
    assert [always[f"{k}_late"] for k in ("tokens", "steps", "sim_time")] == pytest.approx([1.0, 20 / 30, 8 / 3])
    assert (never["tokens_early"], never["steps_early"], never["sim_time_early"]) == pytest.approx((4.0, 4.0, 4.0))
    assert never["steps_middle"] == never["tokens_late"] == "0/2 seeds"
    text = "\n".join(seeds.sections(results, "val_perplexity", 4000, "", tmp_path))
    primary = text.split("### Every other")[0]
    assert "Each ablation against the method it ablates (the report holds no DiLoCo" in primary
    # at the budget: 80 - 90 on both seeds (sd 0: p 0), 200 - 90 likewise; 2 seeds, so each is flagged
    assert "| adloco_always_accumulate | adloco | 2 | -10 | -10 | -10 | False | 0 | only 2 seeds (< 10) |" in primary
    assert "| adloco_never_accumulate | adloco | 2 | 110 |" in primary
    assert "over the report's 0 other comparisons" in text
    section = text.split("## Each ablation against its method")[1]
    assert "adloco: early 301, middle 151, late 91" in section
    assert "| adloco_always_accumulate | adloco | 2 | 1 | 4 | 1 | 0.5 | 2 | 1 | 0.6667 | 2.667 |" in section
    # beside a DiLoCo pair the ablations are among the Holm-corrected comparisons, still against their method
    (tmp_path / "with").mkdir()
    results["diloco_b2"] = paper_pair(tmp_path / "with")["diloco_b2"]
    assert seeds.primary_pairs(results) == [("adloco", "diloco_b2")]
    others = "\n".join(seeds.sections(results, "val_perplexity", 4000, "diloco_b2", tmp_path)).split(
        "### Every other")[1].split("## The paper's comparison")[0]
    assert "Each ablation against the method it ablates:" in others
    assert "| adloco_always_accumulate | adloco | 2 | -10 |" in others and "| adloco | diloco_b2 |" not in others


def test_the_primary_comparisons_are_the_paper_pairs_the_report_holds(tmp_path):
    from benchmarks.compare.seeds import primary_pairs

    def runs(name, batch):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(f"initial_batch_size: {batch}\n")
        return [{"run_dir": str(tmp_path / name)}]

    results = {"adloco_paper": runs("adloco_paper", 1), "adloco": runs("adloco", 2), "diloco_b1": runs("diloco_b1", 1),
               "diloco_b2": runs("diloco_b2", 2), "diloco_tuned_batch": runs("diloco_tuned_batch", 4),
               "adloco_paper_tuned": runs("adloco_paper_tuned", 2), "diloco_b2_tuned": runs("diloco_b2_tuned", 2)}
    assert primary_pairs(results) == [("adloco_paper_tuned", "diloco_b2_tuned"),
                                      ("adloco_paper_tuned", "diloco_tuned_batch"),
                                      ("adloco", "diloco_b2"), ("adloco", "diloco_tuned_batch")]


def test_a_committed_report_is_repriced_for_another_model_and_network_from_its_bundle_alone(tmp_path):
    """benchmarks/results/replay_demo, as committed (its bundle, no run directory): re-priced as MicroLlama 300M on
    1 Gbit/s with the measured H100 curve, nothing trained; the bytes scale with the model, the trajectory does not."""
    import time

    report = ROOT / "benchmarks" / "results" / "replay_demo"
    assert (report / "replay_bundle.tar.gz").is_file()  # (its runs/ folder is never committed: .gitignore)
    curve = str(ROOT / "benchmarks" / "results" / "curves" / "h100_bf16_microllama-300m.json")
    start = time.time()
    views = {}
    for name, extra in (("own", []), ("300m", ["--model_params", "3e8"])):
        views[name] = tmp_path / name
        assert compare_main(["--reprice", str(report), "--report_out", str(views[name]), "--network",
                             "1Gbit/s,1ms", "--throughput_curve", curve, *extra]) == 0
    assert time.time() - start < 120 and not (tmp_path / "own" / "runs").exists()  # nothing trains
    share = {n: {r["variant"]: float(r["network_share"]) for r in read_csv(v / "network.csv")}
             for n, v in views.items()}
    assert set(share["300m"]) == {"adloco_paper", "diloco_b1", "diloco_b4"}
    assert all(share["300m"][v] > 0.9 > share["own"][v] for v in share["300m"])  # 1.2 GB a sync swamps compute
    assert read_csv(views["300m"] / "comparison.csv") == read_csv(views["own"] / "comparison.csv")
    assert read_csv(views["own"] / "runs.csv") == read_csv(report / "runs.csv")  # the committed runs, unchanged


def test_a_finished_run_is_compared_in_todays_meaning_of_its_config(tmp_path):
    """The harness reuses a finished run only when its config, read through the run directory's migrations, is the
    one asked for: a run written before statistics_comm existed sent the fp64 reference, so it is not a run of
    today's default (minimal); the same config written today is; an unreadable one is never reused."""
    from benchmarks.compare.runner import config_changes, finished_config, resolved

    wanted_config = load_config(ROOT / "config.yaml", ["training_seed=3"])
    written = wanted_config.to_dict()
    today, old, broken = (tmp_path / name for name in ("today", "old", "broken"))
    for run_dir, values in ((today, written), (old, {k: v for k, v in written.items() if k != "statistics_comm"})):
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    broken.mkdir()
    (broken / "config.yaml").write_text("lr_inner: [not, a, number]\n")
    wanted = resolved(wanted_config)
    assert wanted_config.statistics_comm == "minimal"
    assert config_changes(finished_config(today), wanted) == []
    assert config_changes(finished_config(old), wanted) == ["statistics_comm: 'fp64' -> 'minimal'"]
    assert config_changes(finished_config(broken), wanted) == ["config.yaml: unreadable"]
