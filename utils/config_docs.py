"""docs/configuration.md's table of every key, generated from the schema (`python -m utils.config --markdown`
prints it, `--update-docs` rewrites it between the page's markers)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from utils.config_schema import ConfigFields


def markdown_table() -> str:
    """docs/configuration.md's table: every key, its default, its section, whether --resume may change it, and
    its meaning."""
    rows = ["| key | default | section | on --resume | meaning |", "|---|---|---|---|---|"]

    def walk(cls: type, prefix: str = "") -> None:
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{f.name}.")
                continue
            choices = f.metadata.get("choices")
            doc = f.metadata["doc"] + (f" One of: {', '.join(choices)}." if choices else "")
            resume = ("given by RUN_DIR" if f.name in ("run_name", "log_dir", "log_file") else "may change") \
                if f.metadata["resume"] else "fixed"
            rows.append(f"| `{prefix}{f.name}` | `{default!r}` | {f.metadata['section']} | {resume} | {doc} |")

    walk(ConfigFields)
    return "\n".join(rows)


TABLE_START, TABLE_END = "<!-- config-table:start -->", "<!-- config-table:end -->"
CONFIG_DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def update_docs(page: Path = CONFIG_DOC) -> None:
    """Rewrite the table between the page's config-table markers."""
    text = page.read_text()
    head, rest = text.split(TABLE_START)
    _, tail = rest.split(TABLE_END)
    page.write_text(f"{head}{TABLE_START}\n{markdown_table()}\n{TABLE_END}{tail}")
