"""The CSV files' rows as records (training_logs/records.py): read back typed, and every key a run's producers
put in a row is a column of its record (a key that is not would be dropped silently by the writer)."""

import pytest

from tests.conftest import ROOT
from training_logs.records import FaultEvent, MergeEvent, NodeTime, StepLoss, TrainerRow, columns, read_records

REPORT = ROOT / "tests" / "fixtures" / "priced_runs" / "adloco_seed1" / "model_training_report"


def test_a_recorded_run_reads_back_typed():
    rows = read_records(REPORT / "training_log.csv", TrainerRow)
    first = rows[0]
    assert (first.outer_step, first.trainer_id, first.val_perplexity, first.val_loss) == (0, 0, 458.78, 6.12857)
    assert first.nodes is None and first.train_loss is None and first.rounds == 0  # empty cells are None
    trained = [r for r in rows if r.outer_step == 6]
    assert all(isinstance(r.num_nodes, int) and isinstance(r.train_loss, float) for r in trained)
    merges = read_records(REPORT / "merge_events.csv", MergeEvent)
    at_6 = next(m for m in merges if m.outer_step == 6)
    assert (at_6.survivor, at_6.merged, at_6.metric_after) == (0, "2", pytest.approx(432.32))


def test_an_older_file_reads_with_the_columns_it_lacks_as_none(tmp_path):
    path = tmp_path / "training_log.csv"
    path.write_text("outer_step,trainer_id,val_perplexity,a_future_column\n3,1,99.5,x\n")
    (row,) = read_records(path, TrainerRow)
    assert (row.outer_step, row.trainer_id, row.val_perplexity, row.sim_time_s) == (3, 1, 99.5, None)


def test_every_key_a_run_writes_is_a_column_of_its_record(tiny_config, monkeypatch):
    from run import train
    from training_logs.training_monitoring import TrainingLogger

    seen: dict[str, list[dict]] = {"rows": [], "merges": [], "nodes": [], "losses": []}
    original = TrainingLogger.log_step

    def log_step(self, record):
        if record.counted:
            seen["rows"] += [dict(r) for r in record.rows]
            seen["merges"] += [record.merge.event] if record.merge is not None else []
        seen["nodes"] += record.node_times or []
        seen["losses"] += record.step_losses or []
        return original(self, record)

    monkeypatch.setattr(TrainingLogger, "log_step", log_step)
    run_dir, _ = train(tiny_config("run_name=records", "inject_fault=2:1:nan", "on_node_fault=skip"))
    assert seen["rows"] and seen["merges"] and seen["nodes"] and seen["losses"]
    for key, record in (("rows", TrainerRow), ("merges", MergeEvent), ("nodes", NodeTime), ("losses", StepLoss)):
        unknown = {k for row in seen[key] for k in row} - set(columns(record))
        assert not unknown, (record.__name__, unknown)
    # and what was written reads back as those records, the skipped node's fault included
    report = run_dir / "model_training_report"
    assert len(read_records(report / "training_log.csv", TrainerRow)) == len(seen["rows"]) + 2  # + step 0's rows
    (fault,) = read_records(report / "fault_events.csv", FaultEvent)
    assert (fault.outer_step, fault.node_id, fault.kind, fault.action) == (2, 1, "nan", "skip")
