"""What older versions of this project wrote, read and resumed today: the one room for the past.

Here: columns and summary.json keys renamed since (`RENAMED`, `value_of`, `renamed_header`), and the fp32 weights'
size P of runs written before summary.json carried `weight_bytes` (`infer_weight_bytes`). Beside it, in run_dir/:
the config's migrations (run_config.py: keys whose meaning or default changed, read in today's meaning). Elsewhere,
each where the format is read, and pointing here:
- checkpoints: utils/config_schema.py `added_later` (keys added since leave an older run's hash, and so its
  --resume, unchanged); cluster/ledgers.py and training_logs/training_monitoring.py start counters an older
  checkpoint lacks at their first value;
- CSVs resumed: training_logs/csv_files.py (an older version's columns, a subset, carry over by name);
- the replay (benchmarks/replay.py): runs before node_clock.csv carried `received_bytes` are rebuilt from
  training_log.csv (`_rounds_before_the_record`), runs before the quantized ring priced as all-gathers;
- the harness's reader (benchmarks/compare/reader.py): runs before the synced mid-round model scored the first node.
Every one of them is tested on files of the older format (tests/fixtures/priced_runs: runs made before node_clock.csv,
the ring and `weight_bytes`; tests/fixtures/first_release_config.yaml). No format version is written: the files of
every older run stay readable, so nothing is dropped.
"""

from __future__ import annotations

from algorithms.traffic import ring_allreduce_bytes

# Columns (and summary.json keys) renamed since files were written, old name -> new: files of older versions are
# read, and a run of an older version resumed, under the new names. The old names did not say what they counted
# (bytes_communicated was the weights' traffic alone, while a run's final line "MB communicated" also counts the
# batch test's statistics).
RENAMED = {"bytes_communicated": "weights_traffic_bytes", "bytes_needed": "total_traffic_bytes"}
_OLD_NAME = {new: old for old, new in RENAMED.items()}


def value_of(values: dict, name: str, default=None):
    """values[name], or the value under its old name in a file of an older version (RENAMED)."""
    if name in values:
        return values[name]
    return values.get(_OLD_NAME.get(name, name), default)


def renamed_header(header: list[str]) -> list[str]:
    """An older CSV's header under today's names."""
    return [RENAMED.get(c, c) for c in header]


def infer_weight_bytes(rows_by_step: dict[int, list]) -> int:
    """P of a run written before summary.json carried `weight_bytes`, from its training_log.csv rows (by outer step:
    each with num_nodes and allreduce_bytes): a round with an all-reduce grew allreduce_bytes by the sum over its
    trainers of 2 (n-1) P. 0: the run never all-reduced."""
    before = 0
    for step in sorted(rows_by_step):
        rows = rows_by_step[step]
        total = rows[0].allreduce_bytes or 0
        ring = sum(ring_allreduce_bytes(r.num_nodes, 1) for r in rows if r.num_nodes)
        if step > 0 and ring and total > before:
            return (total - before) // ring
        before = total
    return 0
