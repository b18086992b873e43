"""What the report and the pricing share: markdown tables, mean and spread over seeds, matplotlib off-screen."""

from __future__ import annotations

import statistics

from benchmarks.tables import cell


def table(rows: list[dict], cols: list[str]) -> list[str]:
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
            *("| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows)]


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def plt_():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
