"""What older versions of this project wrote, read and resumed today: the one room for the past.

Here, each answering in today's terms:
- columns and summary.json keys renamed since (`RENAMED`, `value_of`, `renamed_header`);
- the fp32 weights' size P of runs written before summary.json carried `weight_bytes` (`infer_weight_bytes`);
- each node's round of runs written before node_clock.csv carried `received_bytes`, rebuilt from training_log.csv
  (`node_times_before_the_record`); run_dir/reader.py serves it and P as it serves today's, so the replay reads
  every run's recorded rounds alike;
- how an older run synced (`reduced_as_ring`: runs before the quantized ring all-gathered their payloads) and what
  its mid-round evaluations scored (`scored_synced_models`: before the synced rule, a trainer's first node), which the
  replay and the harness's reader ask.
Beside it, in run_dir/: the config's migrations (run_config.py: keys whose meaning or default changed, read in
today's meaning). Elsewhere, each where the format is read, and pointing here:
- checkpoints: utils/config_schema.py `added_later` (keys added since leave an older run's hash, and so its
  --resume, unchanged); cluster/ledgers.py and training_logs/training_monitoring.py start counters an older
  checkpoint lacks at their first value;
- CSVs resumed: training_logs/csv_files.py (an older version's columns, a subset, carry over by name).
Every one of them is tested on files of the older format (tests/fixtures/priced_runs: runs made before node_clock.csv,
the ring and `weight_bytes`; tests/fixtures/first_release_config.yaml). No format version is written: the files of
every older run stay readable, so nothing is dropped.
"""

from __future__ import annotations

import math

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


def reduced_as_ring(summary: dict) -> bool:
    """Whether a run with a reducible compressed sync reduced it as a ring of quantized shards (summary.json's
    `compressed_sync`); runs before the ring all-gathered every payload, and say nothing."""
    return summary.get("compressed_sync") == "ring"


def scored_synced_models(evaluations: list) -> bool:
    """Whether a run's mid-round evaluations (inner_eval.csv's records) scored each trainer's synced model; runs
    before that rule (no `nodes` column) scored its first node's own weights."""
    return all(e.nodes is not None for e in evaluations)


_STALE = (-1, -1)  # what an away node holds (cluster/state.py STALE)


def node_times_before_the_record(rows: list, merges: list) -> list[dict]:
    """node_clock.csv's rows (as dicts of its columns: training_logs/records.py `NodeTime`) of a run written before
    they carried `received_bytes` (or before node_clock.csv), rebuilt from its training_log.csv: each trainer's
    tokens of a round split evenly over its nodes, at full speed; the node moves re-simulated as the cluster tracks
    them (cluster/round_driver.py `jobs`: a node receives a trainer's state when it holds another, an older version
    of it, or a copy gone stale while it was away: in no trainer's row of a round), each receiving the round's move
    bytes divided among its moves.
    The clock's own columns (start, compute, idle, end, inner steps), which a replay computes again, are unknown.
    rows, merges: training_log.csv's and merge_events.csv's records (`TrainerRow`, `MergeEvent`)."""
    by_step: dict[int, list] = {}
    for r in rows:
        by_step.setdefault(r.outer_step, []).append(r)
    merges_at: dict[int, list] = {}
    for m in merges:
        merges_at.setdefault(m.outer_step, []).append(m)
    tokens_before = {r.trainer_id: 0.0 for r in by_step.get(0, [])}
    moves_before = move_bytes_before = 0
    held: dict[int, tuple[int, int]] = {}  # node -> (trainer, weights version) it holds, as the cluster tracks it
    version: dict[int, int] = {}
    times = []
    for step in sorted(s for s in by_step if s > 0):
        first = by_step[step][0]
        moves, move_bytes = (first.node_moves or 0) - moves_before, (first.node_move_bytes or 0) - move_bytes_before
        moves_before, move_bytes_before = first.node_moves or 0, first.node_move_bytes or 0
        present = {int(n) for r in by_step[step] for n in (r.nodes or "").split()}
        for n in set(held) - present:  # away this round: its copy goes stale as its trainer trains on
            held[n] = _STALE
        nodes_of: dict[int, tuple[int, ...]] = {}  # this round's nodes of each trainer
        for r in by_step[step]:
            seen, t = float(r.tokens_seen), r.trainer_id
            nodes = nodes_of[t] = tuple(map(int, (r.nodes or "").split()))
            mine = (t, version.get(t, 0))
            receivers = {n for n in nodes if held.get(n, mine) != mine}
            held.update({n: mine for n in nodes})
            times += [{"outer_step": step, "node_id": n, "trainer_id": t, "speed": 1.0, "slowdown": 1.0,
                       "inner_steps": 0, "micro_batch": r.loader_batch or 1,
                       "accumulation_steps": r.accumulation_steps or 1,
                       "tokens": (seen - tokens_before.get(t, 0.0)) / r.num_nodes, "start_s": math.nan,
                       "compute_s": math.nan, "idle_s": math.nan, "end_s": math.nan,
                       "received_bytes": move_bytes // moves if n in receivers and moves else 0} for n in nodes]
            tokens_before[t] = seen
        for m in merges_at.get(step, []):  # the survivor's count goes on from its members' sum
            for merged in map(int, m.merged.split()):
                tokens_before[m.survivor] = tokens_before.get(m.survivor, 0.0) + tokens_before.pop(merged, 0.0)
            version[m.survivor] = version.get(m.survivor, 0) + 1
            if nodes_of.get(m.survivor):  # the merge is computed on the survivor's first node, which so holds it
                held[min(nodes_of[m.survivor])] = (m.survivor, version[m.survivor])
    return times
