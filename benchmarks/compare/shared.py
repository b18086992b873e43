"""What the report and the pricing share: markdown tables, mean and spread over seeds, matplotlib off-screen, a
figure finished and saved."""

from __future__ import annotations

import statistics
from pathlib import Path

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


def save_figure(fig, ax, path: Path, legend_fontsize: int = 7) -> Path:
    """A report figure finished the one way (grid, legend, tight layout), saved at 120 dpi and closed."""
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt_().close(fig)
    return path
