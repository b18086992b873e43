"""The run's row files (CSV, JSON lines): started fresh, or cut back to the checkpoint a resume continues from."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from run_dir.past import renamed_header


def start_csv(path: Path, columns: list[str], resume_step: int | None, always_keep=None) -> str | None:
    """A new CSV with its header, or (resume) the existing one cut back to rows of outer steps <= resume_step
    (and rows for which always_keep(row) is true). Returns what is wrong with the file a resume found (it
    is missing, or was written by another version), None when it continues cleanly."""
    kept: list[list[str]] = []
    problem = None
    if resume_step is not None and resume_step > 0 and not path.is_file():
        problem = "is missing (deleted?)"
    elif resume_step is not None and path.is_file():
        with path.open(newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            header = header and renamed_header(header)  # an older version's names, renamed since
            if header is not None and header[:1] == columns[:1] and set(header) <= set(columns):
                # an older version's columns (a subset): its rows carry over by name, new columns empty
                where = [header.index(c) if c in header else None for c in columns]
                kept = [[row[i] if i is not None else "" for i in where] for row in reader
                        if len(row) == len(header) and row[0].isdigit()]  # a row torn by a crash is dropped
                kept = [row for row in kept
                        if int(row[0]) <= resume_step or (always_keep is not None and always_keep(row))]
            else:
                problem = "has other columns than this version writes"
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows(kept)
    os.replace(tmp, path)
    return problem


def cut_jsonl(path: Path, resume_step: int) -> None:
    """metrics.jsonl without the records of steps after resume_step (and without a torn last line)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            if int(json.loads(line)["step"]) <= resume_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
