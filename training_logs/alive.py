"""Which models exist after an outer step: what the trackers, the plots and the harness call the cluster's model.

"Alive after a step" is what exists once the step's merges are done: training_log.csv scores each trainer before the
merge, so at a merge step the absorbed trainers are dropped and the survivor is scored by the merged model
(merge_events.csv's metric_after)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def models_alive(metrics: Mapping[str, float], merge_events: Iterable[Mapping]) -> dict[str, float]:
    """The models that exist after an outer step, by trainer id: each trainer's metric as evaluated before the
    step's merges, without the trainers those merges absorbed, the survivors scored by the merged model."""
    alive = {str(t): float(v) for t, v in metrics.items()}
    for event in merge_events:
        for merged in str(event["merged"]).split():
            alive.pop(merged, None)
        if event.get("metric_after") not in (None, ""):
            alive[str(event["survivor"])] = float(event["metric_after"])
    return alive


def best_alive(rows: list[dict[str, str]], merge_rows: list[dict[str, str]], metric: str,
               higher_is_better: bool) -> dict[int, tuple[dict[str, str], float]]:
    """Per outer step, the best model alive after it: its trainer's training_log.csv row (for the counters)
    and its metric (the merged model's at a merge)."""
    by_step: dict[int, dict[str, dict[str, str]]] = {}
    for r in rows:
        by_step.setdefault(int(r["outer_step"]), {})[r["trainer_id"]] = r
    best: dict[int, tuple[dict[str, str], float]] = {}
    for step, trainers in sorted(by_step.items()):
        events = [m for m in merge_rows if int(m["outer_step"]) == step and m.get("metric", metric) == metric]
        alive = models_alive({t: float(r[metric]) for t, r in trainers.items()}, events)
        pick = max if higher_is_better else min
        trainer = pick((t for t in alive if t in trainers), key=alive.__getitem__)
        best[step] = (trainers[trainer], alive[trainer])
    return best
