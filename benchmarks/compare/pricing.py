"""Pricing the finished runs: each on its own simulated clock (--cluster), and on the network cost model
(benchmarks/replay.py) per --network and over a grid of bandwidths (the crossover)."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from algorithms import network
from algorithms.clock import ThroughputCurve
from benchmarks import replay
from benchmarks.compare.options import Options, parse_networks
from benchmarks.compare.reader import first_reaching, value_at
from benchmarks.compare.shared import mean_std, plt_, table
from training_logs.plots import readable_y


def _families(results: dict[str, list[dict]]) -> dict[str, str]:
    return {name: runs[0]["family"] for name, runs in results.items()}


def _time_to(curves: list[list[dict]], target: float, higher: bool) -> float | None:
    """Mean predicted time to the target over seeds; None unless every seed reached it."""
    reach = [first_reaching(c, target, "time", higher) for c in curves]
    return statistics.mean(reach) if all(v is not None for v in reach) else None


def time_target(results: dict[str, list[dict]], metric: str, args: Options) -> float:
    """The target of the clock's and the network model's tables: --time_target, else --target (one target drives
    every table), else the loosest value (every run's best point within the token budget reaches it)."""
    higher = metric == "val_accuracy"
    pick = min if higher else max
    runs = [r for rs in results.values() for r in rs]
    return args.time_target or args.target or pick(
        (max if higher else min)(p["metric"] for p in r["curve"] if not p.get("past_budget") or p is r["curve"][0])
        for r in runs)


def cluster_sections(results: dict[str, list[dict]], metric: str, report_target: float | None, args: Options
                     ) -> list[str]:
    """--cluster: which sections of the report the cluster file prices, and the one target each section uses."""
    nets = ", ".join(n.name for n in parse_networks(args)[0])
    repriced = sorted({name for name, rs in results.items() if any(r["summary"].get("repriced") for r in rs)})
    again = (f" Runs re-priced on this cluster's clock from finished runs that differ only in what the clock reads, "
             f"not retrained: {', '.join(repriced)}." if repriced else "")
    return ["## What uses the cluster file", "",
            "- The final models, the to-the-target table and the matched budgets: the runs' own numbers, which the "
            "clock never changes (" + (f"target {metric} {report_target:.4g}" if report_target is not None else
                                        "no target: no DiLoCo reference finished") + ").",
            f"- The simulated cluster's clock: the cluster file `{args.cluster}` (its node speeds, network and "
            f"throughput; target {metric} {time_target(results, metric, args):.4g}).{again}",
            f"- The predicted wall time on a network and the crossover: not the cluster file; equal node speeds, "
            f"{'the curve ' + args.throughput_curve if args.throughput_curve else 'a flat tokens/s'}, the networks "
            f"{nets} (target {metric} {time_target(results, metric, args):.4g}).", ""]


def network_report(results: dict[str, list[dict]], metric: str, args: Options, out: Path) -> list[str]:
    """Predicted wall time on each --network (benchmarks/replay.py): network.csv, crossover.csv, two plots,
    and the report's markdown lines."""
    predicted = predict_on_networks(results, metric, args)
    rows, crossover, target = predicted["rows"], predicted["crossover"], predicted["target"]
    for name, written in (("network.csv", rows), ("crossover.csv", crossover)):
        if written:
            with (out / name).open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(written[0]))
                w.writeheader()
                w.writerows(written)
    families = _families(results)
    figures = [_plot_network(predicted["panels"], families, target, metric, out),
               _plot_crossover(crossover, families, target, metric, predicted["crossover_latency"], out)]
    lines = ["## Predicted wall time on a network (benchmarks/replay.py)", "",
             "A cost model, not a measurement: each run's logged rounds (tokens per node, nodes per trainer, merges, "
             f"node moves) priced at {_throughput_words(predicted['throughput'], args)} plus, per "
             "synchronisation, latency + bytes / bandwidth (ring all-reduce for a trainer's nodes, a ring of "
             "quantized shards for bf16/fp8/int8 payloads, all-gather for top-k and runs made before the ring"
             f"{'' if args.no_statistics else ', the batch test statistics included'}). Nodes compute in parallel, "
             "trainers synchronise in parallel; a streamed fragment costs only what its sync_delay inner steps "
             "do not hide. Ignored: other overlap of compute and communication, stragglers, "
             f"contention, evaluation. Target {metric}: {target:.4g} "
             f"({'given' if args.time_target else 'the loosest value every run reached'}); time budget: "
             f"{'given' if args.time_budget else 'the shortest predicted run'} per network. "
             "network_share: the part of the predicted time the network adds.", ""]
    for net, _, budget in predicted["panels"]:
        lines += [f"### {network.describe(net)}", "",
                  *table([r for r in rows if r["network"] == net.name],
                          ["variant", "time_to_target_s", "vs_fastest", "metric_at_budget_mean", "metric_at_budget_std",
                           "total_time_s", "network_share"]), "",
                  f"metric_at_budget: at {budget:.4g} s of predicted time.", ""]
    lines += [f"### Crossover: who reaches {metric} {target:.4g} first, by bandwidth (latency "
              f"{args.crossover_latency})", "",
              *table(_crossover_ranges(crossover), ["bandwidth", "winner", "runner_up", "margin",
                                                     "adloco_vs_best_diloco"]), "",
              "margin: the runner-up's predicted time to the target over the winner's (range over the band). "
              "adloco_vs_best_diloco: the fastest AdLoCo-family variant's predicted time to the target (whatever its "
              "name) over the fastest DiLoCo variant's (below 1: AdLoCo is faster).", "",
              *[f"![{p.stem}]({p.name})" for p in figures], ""]
    return lines


def _throughput_words(throughput, args: Options) -> str:
    if isinstance(throughput, ThroughputCurve):
        return (f"the throughput curve {args.throughput_curve} ({throughput.source}; each trainer's step in the "
                "micro-batches the curve's device fits: the largest it measured that divides the step, the rest "
                "accumulated, not the micro-batches the runs' own machine allowed)")
    how = "given" if args.node_throughput else "measured: all runs, tokens / wall time"
    return f"{throughput:.4g} tokens/s per node ({how})"


def clock_report(results: dict[str, list[dict]], metric: str, args: Options) -> list[str]:
    """--cluster: each run timed by its own simulated clock (sim_time_s), utilisation and idle time."""
    higher = metric == "val_accuracy"
    target = time_target(results, metric, args)
    runs = [r for rs in results.values() for r in rs]
    rows = []
    for name, rs in results.items():
        reach = [first_reaching(r["curve"], target, "sim_time", higher) for r in rs]
        got = [v for v in reach if v is not None]
        s = [r["summary"] for r in rs]
        rows.append({"variant": name, "sim_time_to_target_s": statistics.mean(got) if len(got) == len(reach)
                     else f"{len(got)}/{len(reach)}", "sim_time_s": statistics.mean(x["sim_time_s"] for x in s),
                     "utilisation": statistics.mean(x["utilisation"] for x in s),
                     "idle_node_seconds": statistics.mean(x["idle_node_seconds"] for x in s),
                     "busy_node_seconds": statistics.mean(x["busy_node_seconds"] for x in s),
                     "goodput_tokens_per_s": statistics.mean(x["goodput_tokens_per_s"] for x in s),
                     "final_mean": statistics.mean(x["final_metric"] for x in s)})
    reached = [r["sim_time_to_target_s"] for r in rows if isinstance(r["sim_time_to_target_s"], float)]
    for r in rows:
        r["vs_fastest"] = r["sim_time_to_target_s"] / min(reached) if r["sim_time_to_target_s"] in reached else None
    clock = runs[0]["summary"].get("clock", {})
    how = "given" if args.time_target else "the loosest value every run reached"
    with (Path(args.report_out or args.out) / "clock.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return ["## The simulated cluster's clock (--cluster)", "",
            f"Cluster `{args.cluster}`: network {clock.get('network')}, throughput {clock.get('throughput')}, node "
            f"speeds {clock.get('node_speeds')}. Each run timed live by its own clock (docs/clock.md: "
            "each node computes its tokens at the curve's pace for its micro-batch x its speed, a trainer's round "
            "ends with its slowest node and its collectives, trainers advance independently between merges, a merge "
            f"waits for its members). Target {metric}: {target:.4g} ({how}). utilisation: busy node-seconds / "
            "available node-seconds; idle: present and "
            "not computing (stragglers, collectives, merges, a finished trainer waiting); means over seeds.", "",
            *table(rows, ["variant", "sim_time_to_target_s", "vs_fastest", "final_mean", "sim_time_s", "utilisation",
                           "idle_node_seconds", "busy_node_seconds", "goodput_tokens_per_s"]), ""]


def predict_on_networks(results: dict[str, list[dict]], metric: str, args: Options) -> dict:
    """Every run's curve against predicted time, per --network and over a grid of bandwidths: the rows of
    network.csv (time to target, metric at a time budget, network share) and of crossover.csv."""
    higher = metric == "val_accuracy"
    families = _families(results)
    nets, crossover_latency = parse_networks(args)
    runs = [r for rs in results.values() for r in rs]
    for r in runs:
        r["rounds_work"], r["weight_bytes"], _ = replay.read_rounds(
            r["run_dir"], statistics=not args.no_statistics, model_bytes=int(4 * args.model_params) or None)
    measured = sum(r["curve"][-1]["tokens"] for r in runs) / max(sum(r["curve"][-1]["wall"] for r in runs), 1e-9)
    throughput = ThroughputCurve.load(args.throughput_curve) if args.throughput_curve else \
        args.node_throughput or measured

    def timed(net: network.Network) -> dict[str, list[list[dict]]]:
        curves = {}
        for name, rs in results.items():
            for r in rs:
                times, compute = replay.timeline(r["rounds_work"], net, throughput, r["weight_bytes"],
                                                 device_shapes=True)
                curve = [{**p, "time": times[p["step"]]} for p in r["curve"] if p["step"] in times]
                curve[-1]["compute"] = compute
                curves.setdefault(name, []).append(curve)
        return curves

    target = time_target(results, metric, args)
    rows, panels = [], []
    for net in nets:
        curves = timed(net)
        budget = args.time_budget or min(c[-1]["time"] for cs in curves.values() for c in cs)
        reach = {name: _time_to(cs, target, higher) for name, cs in curves.items()}
        fastest = min((v for v in reach.values() if v is not None), default=None)
        for name, cs in curves.items():
            values = [value_at(c, "time", budget, log_scale=not higher) for c in cs]
            mean, std = mean_std([v for v, _ in values])
            got = sum(first_reaching(c, target, "time", higher) is not None for c in cs)
            rows.append({"network": net.name, "variant": name,
                         "time_to_target_s": reach[name] if reach[name] is not None else f"{got}/{len(cs)}",
                         "vs_fastest": reach[name] / fastest if reach[name] is not None and fastest else None,
                         "time_budget_s": budget, "metric_at_budget_mean": mean, "metric_at_budget_std": std,
                         "total_time_s": statistics.mean(c[-1]["time"] for c in cs),
                         "network_share": statistics.mean(1 - c[-1]["compute"] / c[-1]["time"] if c[-1]["time"]
                                                          else 0.0 for c in cs)})
        panels.append((net, curves, budget))
    crossover = []  # which variant reaches the target first, bandwidth by bandwidth
    for bandwidth in replay.bandwidth_grid():
        reach = {name: _time_to(cs, target, higher)
                 for name, cs in timed(network.Network("grid", bandwidth, crossover_latency)).items()}
        row = crossover_row(reach, families)
        if row:
            crossover.append({"bandwidth_bit_s": bandwidth * 8, **row})
    return {"throughput": throughput, "target": target, "crossover_latency": crossover_latency, "rows": rows,
            "panels": panels, "crossover": crossover}


def crossover_row(reach: dict[str, float | None], families: dict[str, str]) -> dict | None:
    """Who reaches the target first at one bandwidth (reach: each variant's predicted time, None = never), the
    runner-up and the margin; adloco_vs_best_diloco by family (the fastest AdLoCo-family variant of any name over
    the fastest DiLoCo); None when nobody reaches it."""
    ranked = sorted((v, name) for name, v in reach.items() if v is not None)
    if not ranked:
        return None
    fastest = {family: min((v for name, v in reach.items() if families[name] == family and v is not None),
                           default=None) for family in ("adloco", "diloco")}
    return {"winner": ranked[0][1], "winner_time_s": ranked[0][0],
            "runner_up": ranked[1][1] if len(ranked) > 1 else None,
            "margin": ranked[1][0] / ranked[0][0] if len(ranked) > 1 else None,
            "adloco_vs_best_diloco": fastest["adloco"] / fastest["diloco"] if fastest["adloco"] and fastest["diloco"]
            else None,
            **{f"time_{name}": v for name, v in reach.items()}}


def _crossover_ranges(crossover: list[dict]) -> list[dict]:
    """Consecutive bandwidths with the same winner and runner-up, as one row."""
    bands: list[dict] = []
    for row in crossover:
        last = bands[-1] if bands else None
        if last and (last["winner"], last["runner_up"]) == (row["winner"], row["runner_up"]):
            last["high"] = row["bandwidth_bit_s"]
            last["margins"].append(row["margin"])
            last["adloco"].append(row["adloco_vs_best_diloco"])
        else:
            bands.append({"winner": row["winner"], "runner_up": row["runner_up"], "low": row["bandwidth_bit_s"],
                          "high": row["bandwidth_bit_s"], "margins": [row["margin"]],
                          "adloco": [row["adloco_vs_best_diloco"]]})

    def span(values: list) -> str:
        values = [v for v in values if v is not None]
        return f"{min(values):.3g}x..{max(values):.3g}x" if values else "-"

    return [{"bandwidth": f"{network.format_rate(b['low'], 3)} .. {network.format_rate(b['high'], 3)}",
             "winner": b["winner"], "runner_up": b["runner_up"], "margin": span(b["margins"]),
             "adloco_vs_best_diloco": span(b["adloco"])} for b in bands]


def _plot_network(panels: list, families: dict[str, str], target: float, metric: str, out: Path) -> Path:
    plt = plt_()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (net, curves, budget) in zip(axes[0], panels):
        for name, cs in curves.items():
            ax.plot([p["time"] for p in cs[0]], [p["metric"] for p in cs[0]], marker="o", ms=2.5,
                    ls="-" if families[name] == "adloco" else "--", label=name)
        ax.axhline(target, color="grey", lw=0.8, ls=":")
        ax.axvline(budget, color="grey", lw=0.8, ls=":")
        if metric == "val_perplexity":
            readable_y(ax, [p["metric"] for cs in curves.values() for p in cs[0]])
        ax.set(xlabel="predicted wall time (s)", title=network.describe(net))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{metric} (best model alive, seed 0)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle(f"{metric} against predicted wall time (dotted: the target and the time budget)")
    fig.tight_layout()
    path = out / f"{metric}_vs_predicted_time.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_crossover(crossover: list[dict], families: dict[str, str], target: float, metric: str, latency: float,
                    out: Path) -> Path:
    plt = plt_()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8.5, 7), sharex=True)
    bits = [row["bandwidth_bit_s"] for row in crossover]
    for name in families:
        times = [row.get(f"time_{name}") for row in crossover]
        if not any(t is not None for t in times):
            continue
        style = "-" if families[name] == "adloco" else "--"
        top.plot(bits, [t if t is not None else float("nan") for t in times], style, label=name)
        bottom.plot(bits, [t / row["winner_time_s"] if t is not None else float("nan")
                           for t, row in zip(times, crossover)], style, label=name)
    top.set(xscale="log", yscale="log", ylabel="predicted time to target (s)",
            title=f"time to {metric} {target:.4g}, by bandwidth (latency {latency * 1e3:g} ms)")
    bottom.set(xscale="log", yscale="log", xlabel="bandwidth per node link (bit/s)",
               ylabel="time / the fastest variant's")
    for ax in (top, bottom):
        ax.grid(alpha=0.3, which="both")
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    path = out / "crossover_bandwidth.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
