"""The report: every table of comparison.md (final models, to the target, at matched budgets, merges), its CSV
files and the plots against each budget axis; the clock and the network pricing come from pricing.py."""

from __future__ import annotations

import csv
import statistics
from datetime import datetime
from pathlib import Path

from benchmarks.compare import batches, seeds
from benchmarks.compare.options import Options
from benchmarks.compare.pricing import clock_report, cluster_sections, network_report
from benchmarks.compare.reader import first_reaching, last_within_budget, value_at
from benchmarks.compare.shared import mean_std, plt_, table
from benchmarks.theory import communication_bound
from training_logs.plots import readable_y
from utils.config import Config

# budget axes: curve key -> what it counts (definitions in algorithms/traffic.py)
AXES = {"tokens": "tokens seen (all trainers)", "rounds": "rounds (outer steps)",
        "syncs": "syncs (cross-node all-reduces + merges)", "bytes": "bytes communicated"}


WITHIN = "'s mean at its last outer step within the token budget"
NO_TARGET = ("No target: no DiLoCo run finished to be its reference (none ran, or every seed stopped on a training "
             "fault), and --target was not given; the tables to a target are left out.")


def summarise(results: dict[str, list[dict]], base: Config, args: Options) -> dict:
    """Every table of the report, as lists of dicts."""
    any_run = next(iter(results.values()))[0]
    metric = any_run["metric"]
    higher = metric == "val_accuracy"
    diloco_default = f"diloco_b{base.initial_batch_size}"
    finals = {n: [r["final"] for r in runs] for n, runs in results.items()}
    diloco = [n for n, runs in results.items() if runs[0]["family"] == "diloco"]
    reference = diloco_default if diloco_default in finals else next(iter(diloco), "")
    # no reference (none ran, or every seed of it stopped on a training fault) and no --target: no target at all,
    # never 0 (every run would "reach" it, or none)
    # (the reference's metric at its last point within the budget: a target reached only past it is not reached)
    target = args.target or (statistics.mean(last_within_budget(r["curve"])["metric"] for r in results[reference])
                             if reference else None)
    main_rows, budget_rows, merge_rows = [], [], []
    for name, runs in results.items():
        final_mean, final_std = mean_std(finals[name])
        row = {"variant": name, "ran": runs[0]["ran"], "final_mean": final_mean, "final_std": final_std,
               "best_seen_mean": statistics.mean(r["best_seen"] for r in runs if r["best_seen"] is not None)
               if any(r["best_seen"] is not None for r in runs) else None}
        for key in ("tokens", "rounds", "syncs", "bytes", "weights_bytes", "statistics_bytes",
                    "logged_statistics_bytes", "wall"):
            row[key] = statistics.mean(r["curve"][-1].get(key, 0) for r in runs)
        for key in ("tokens", "rounds", "syncs", "bytes", "wall"):
            reach = [first_reaching(r["curve"], target, key, higher) for r in runs] if target is not None else []
            got = [v for v in reach if v is not None]
            row[f"{key}_to_target"] = (None if target is None else statistics.mean(got) if len(got) == len(reach)
                                       else f"{len(got)}/{len(reach)}")
        row.update({"merges": statistics.mean(len(r["merges"]) for r in runs),
                    "max_requested_batch": max(max(r["requested_batches"]) for r in runs),
                    "max_accumulation": max(r["max_accumulation"] for r in runs),
                    "theorem2_bound": communication_bound(base, runs[0])})
        main_rows.append(row)
        events = [m for r in runs for m in r["merges"]]
        if events:
            best_member = [(max if higher else min)(m["before"]) for m in events]
            change = [100 * (m["after"] - b) / b for m, b in zip(events, best_member)]
            better_than_weighted = [(m["after"] >= m["weighted"]) if higher else (m["after"] <= m["weighted"])
                                    for m in events]
            merge_rows.append({"variant": name, "merges": len(events),
                               "best_member_mean": statistics.mean(best_member),
                               "weighted_members_mean": statistics.mean(m["weighted"] for m in events),
                               "after_mean": statistics.mean(m["after"] for m in events),
                               "after_vs_best_member_pct_mean": statistics.mean(change),
                               "after_vs_best_member_pct_worst": (min if higher else max)(change),
                               "share_better_than_weighted": sum(better_than_weighted) / len(events)})
    steps, critical = (batches.rows(results, target, higher) if target is not None else
                       ([{} for _ in results], "critical batch: no target (see above)"))
    for row, measured in zip(main_rows, steps):
        row.update({k: v for k, v in measured.items() if k != "variant"})
    budgets = {"tokens": float(args.max_tokens)}
    for axis in ("rounds", "syncs", "bytes"):
        totals = [r["curve"][-1][axis] for runs in results.values() for r in runs if r["curve"][-1][axis] > 0]
        if totals:
            budgets[axis] = float(min(totals))  # the largest budget every communicating run reached
    for axis, budget in budgets.items():
        for name, runs in results.items():
            values = [value_at(r["curve"], axis, budget, log_scale=not higher) for r in runs]
            mean, std = mean_std([v for v, _ in values])
            budget_rows.append({"axis": axis, "budget": budget, "variant": name, "metric_mean": mean,
                                "metric_std": std, "runs_ended_below_budget": sum(not ok for _, ok in values)})
    return {"metric": metric, "target": target, "reference": reference, "main": main_rows, "budgets": budget_rows,
            "critical_batch": critical,
            "along_training": batches.along_training(results, float(args.max_tokens), higher),
            "merges": merge_rows}


def along_training_section(rows: list[dict]) -> list[str]:
    """Each constant-batch sweep's critical batch at five targets along training, and whether it grows."""
    if not rows:
        return []
    return ["## The critical batch along training", "",
            "Per constant-batch sweep (batches whose names differ only in _bB), at five targets along training: the "
            "best metric any batch of the sweep had reached with every seed after 20%, 35%, 50%, 65% and 80% of the "
            "token budget (no batch anchors it). Each batch's tokens to the target (mean over seeds, within the "
            "budget), and the critical batch: the largest batch within 20% of the token-optimal batch's tokens. "
            "Beside it, McCandlish et al.'s S(B) = S_min (1 + B_noise / B) fitted by least squares (in 1/B, equal "
            "weight per batch) to the mean optimizer steps to the target of the batches from the token-optimal one "
            "up that every seed reached (at least 3; the model's tokens rise with B, so it cannot describe the "
            "batches below the optimum), with B_noise's 95% interval from 2000 resamples of the seeds (seed i of "
            "every batch together); inf: steps fell as fast as 1/B, no batch of the sweep was past B_noise.",
            "", *table(rows, ["sweep", "when", "target", "tokens_by_batch", "critical_batch", "in_words",
                              "b_noise_words"]), "",
            *(f"- {sentence}" for sentence in batches.grows(rows)), ""]


def plot(results: dict[str, list[dict]], metric: str, out: Path) -> list[Path]:
    plt = plt_()
    paths = []
    for key, label in (*AXES.items(), ("wall", "wall time (s)")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, runs in results.items():
            curve = runs[0]["curve"]  # first seed; the tables have the spread over seeds
            ax.plot([p[key] for p in curve], [p["metric"] for p in curve], marker="o", ms=3,
                    ls="-" if runs[0]["family"] == "adloco" else "--", label=f"{name} ({runs[0]['ran']})")
        if metric == "val_perplexity":
            readable_y(ax, [p["metric"] for runs in results.values() for p in runs[0]["curve"]])
        ax.set(xlabel=label, ylabel=f"{metric} (best model alive)", title=f"{metric} against {label} (seed 0)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{metric}_vs_{key}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


FAULT_COLUMNS = ["variant", "seed", "last_good_step", "tokens", "error"]


def fault_section(faults: list[dict] | tuple) -> list[str]:
    """The runs that stopped on a training fault (a non-finite loss: diverged), first, since every table below
    leaves them out: a variant's figures are over its other seeds, and its pairs over the seeds both finished."""
    if not faults:
        return []
    return ["## Runs that stopped on a training fault (faults.csv)", "",
            f"{len(faults)} run(s) stopped on a training fault: an outcome of the method at that seed (the same "
            "config and seed fault again, so they are not re-run). Every table below leaves them out: those "
            "variants' means are over their other seeds, and paired intervals over the seeds both sides finished. "
            "A variant's mean that reads well may hide a seed that diverged: read this table with it.", "",
            *table(list(faults), FAULT_COLUMNS), ""]


def write_outputs(report: dict, results: dict, args: Options, out: Path, faults: list[dict] | tuple = ()) -> str:
    """comparison.md and its CSV files. faults: runs that stopped on a training fault (runner.fault_row), listed in
    faults.csv and their own section; every other table is over each variant's seeds that finished."""
    write_tables(report, results, out, faults)
    text = comparison_markdown(report, results, args, out, faults)
    (out / "comparison.md").write_text(text)
    return text


def write_tables(report: dict, results: dict, out: Path, faults: list[dict] | tuple) -> None:
    """The report's machine-readable tables: faults.csv, comparison.csv, budgets.csv, merges.csv (each replaced)."""
    with (out / "faults.csv").open("w", newline="") as f:  # written every time: no stale list from an earlier call
        w = csv.DictWriter(f, fieldnames=FAULT_COLUMNS)
        w.writeheader()
        w.writerows(faults)
    with (out / "comparison.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(report["main"][0]))
        w.writeheader()
        w.writerows(report["main"])
    with (out / "budgets.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(report["budgets"][0]))
        w.writeheader()
        w.writerows(report["budgets"])
    with (out / "merges.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "seed", "metric_before", "metric_weighted_before", "metric_after"])
        for name, runs in results.items():
            for i, r in enumerate(runs):
                for m in r["merges"]:
                    w.writerow([name, r.get("seed", i), " ".join(f"{v:.6g}" for v in m["before"]), m["weighted"],
                                m["after"]])


def comparison_markdown(report: dict, results: dict, args: Options, out: Path, faults: list[dict] | tuple) -> str:
    """comparison.md's text: the tables for a reader, their definitions, and the figures (drawn into `out`)."""
    metric = report["metric"]
    warm = f"; warm start: {args.warm_from}" if args.warm_from else ""
    lines = [f"# AdLoCo comparison ({datetime.now():%Y-%m-%d})", "",
             f"Config `{args.config}` {' '.join(args.overrides)}; seeds: {args.seeds}; token budget per run: "
             f"{args.max_tokens}{warm}; " + (NO_TARGET if report["target"] is None else
                                              f"target {metric}: {report['target']:.4g} "
                                              f"({'given' if args.target else report['reference'] + WITHIN})."),
             "",
             *fault_section(faults),
             *(cluster_sections(results, metric, report["target"], args) if args.cluster else []),
             f"## Final models ({metric} of the real final model, mean and std over seeds; best seen during the run)",
             "", *table(report["main"], ["variant", "ran", "final_mean", "final_std", "best_seen_mean", "tokens",
                                          "rounds", "syncs", "bytes", "wall", "merges", "max_requested_batch",
                                          "max_accumulation", "theorem2_bound"]), "",
             "## To the target (mean over seeds; k/n: only k of n seeds reached it)", "",
             *(table(report["main"], ["variant", "tokens_to_target", "rounds_to_target", "syncs_to_target",
                                       "bytes_to_target", "wall_to_target"]) if report["target"] is not None
               else [NO_TARGET]), "",
             "## Bytes each variant needs (mean over seeds, at the end)", "",
             "bytes: what the method sends for its own decisions, the weights traffic (weights_bytes: outer syncs or "
             "DDP's gradient all-reduces, merges, node moves) and its batch test's statistics in the precision it "
             "sent them (statistics_bytes); every bytes column and budget counts this. logged_statistics_bytes: "
             "statistics sent for the log only (log_batch_statistics), charged to no method.", "",
             *table(report["main"], ["variant", "bytes", "weights_bytes", "statistics_bytes",
                                      "logged_statistics_bytes"]), "",
             "## Optimizer steps to the target against the best constant batch", "",
             "steps: optimizer steps in sequence (rounds x H) until the best model alive reaches the target; "
             "steps_vs_best_constant: against the constant batch (diloco_bB) that needs fewest (Merrill et al. "
             f"2025's measure for batch warmup). The sweep's {report['critical_batch']}.", "",
             *(table(report["main"], ["variant", "steps_to_target", "steps_vs_best_constant"])
               if report["target"] is not None else [NO_TARGET]), "",
             *along_training_section(report["along_training"]),
             *seeds.sections(results, metric, float(args.max_tokens), report["reference"], out)]
    for axis, label in AXES.items():
        rows = [r for r in report["budgets"] if r["axis"] == axis]
        if not rows:
            continue
        lines += [f"## At a matched budget of {rows[0]['budget']:.6g} {label}", "",
                  *table(rows, ["variant", "metric_mean", "metric_std", "runs_ended_below_budget"]), ""]
    lines += ["## Merges: the merged model against its members (every merge of every seed)", ""]
    lines += (table(report["merges"], ["variant", "merges", "best_member_mean", "weighted_members_mean",
                                        "after_mean", "after_vs_best_member_pct_mean",
                                        "after_vs_best_member_pct_worst", "share_better_than_weighted"])
              if report["merges"] else ["no merges"])
    lines += ["", "ran: loader batch x accumulation steps actually run (first..last). final: the model the run "
              "leaves in model_weights/final (after its last merge). At a matched budget: the metric of the best "
              "model alive, interpolated between the last outer step at or under the budget and the next (log "
              "scale for perplexity); runs_ended_below_budget counts seeds that stopped before it (their last "
              "value is used). Budgets for rounds, syncs and bytes: the smallest total any communicating run "
              "reached. Definitions of rounds, syncs and bytes: algorithms/traffic.py. theorem2_bound: "
              "benchmarks/theory.py.", ""]
    figures = [*plot(results, metric, out), batches.plot(results, out),
               batches.plot_tokens_to_target(report["along_training"], out)]
    lines += [f"![{p.stem}]({p.name})" for p in figures if p is not None]
    if args.cluster:
        lines += ["", *clock_report(results, metric, args)]
    lines += ["", *network_report(results, metric, args, out)]
    return "\n".join(lines) + "\n"
