"""Cells of the Markdown tables the benchmark reports write."""

from __future__ import annotations


def cell(value, digits: int = 4) -> str:
    """None -> '-', floats to `digits` significant digits, anything else as str."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)
