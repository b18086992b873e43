"""benchmarks/launch.py, the one launcher of child processes: exit codes, timeouts, stops forwarded or refused, a block
left by an error stopping its child, and the parent-death watch given to run.py children only."""

import signal
import sys
import time

import pytest

from benchmarks import launch
from utils.signals import PARENT_ENV

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_child_runs_to_its_exit_code_or_is_stopped_at_its_timeout(tmp_path):
    log = tmp_path / "child.log"
    assert launch.run_child([sys.executable, "-c", "print('hello'); raise SystemExit(3)"], log) == 3
    assert log.read_text() == "hello\n"
    start = time.monotonic()
    assert launch.run_child(SLEEP, tmp_path / "slow.log", timeout=0.5) == 124
    assert time.monotonic() - start < 30 and not launch.LIVE_CHILDREN


def test_a_stopped_parent_forwards_its_signal_and_starts_no_child(tmp_path):
    with launch.child(SLEEP, tmp_path / "a.log") as proc:
        launch.stop_children(signal.SIGTERM)  # as benchmarks.tune's handler does
        assert proc.wait(timeout=30) == -signal.SIGTERM
    try:
        assert launch.run_child(SLEEP, tmp_path / "b.log") == 128 + signal.SIGTERM
        with pytest.raises(launch.Stopped):
            with launch.child(SLEEP):
                pass
    finally:
        launch.allow_children()
    assert launch.run_child([sys.executable, "-c", "pass"], tmp_path / "c.log") == 0


def test_a_block_left_by_an_error_stops_its_child_first(tmp_path):
    with pytest.raises(RuntimeError):
        with launch.child(SLEEP, tmp_path / "d.log") as proc:
            raise RuntimeError("the parent failed")
    assert proc.returncode == -signal.SIGTERM and proc not in launch.LIVE_CHILDREN


def test_only_a_run_py_child_watches_its_parent(tmp_path):
    """PARENT_ENV (utils/signals.py stop_with_parent) goes to `python run.py ...` alone: a torchrun world's workers
    have torchrun as their parent, and would stop at once."""
    script = f"import os; open({str(tmp_path / 'env')!r}, 'w').write(os.environ.get({PARENT_ENV!r}, 'none'))"
    fake_run = tmp_path / "run.py"
    fake_run.write_text(script)
    assert launch.run_child([sys.executable, str(fake_run)]) == 0
    assert (tmp_path / "env").read_text() == str(__import__("os").getpid())
    assert launch.run_child([sys.executable, "-c", script]) == 0
    assert (tmp_path / "env").read_text() == "none"
