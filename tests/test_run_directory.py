"""One owner per run directory: a live run's directory is never moved, renamed or written by another run.

Caused for real: two live run.py processes with one run_name, processes racing for one name, a stale
lock file naming a live PID or another host.
"""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

from run_dir.claim import make_run_dir
from run_dir.run_state import RunLock, in_use
from tests.conftest import ROOT, TINY
from utils.errors import UserError


def _wait_for(predicate, proc, timeout=180.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("timed out")


def _csv_rows(run_dir):
    return (run_dir / "model_training_report" / "training_log.csv").read_text().splitlines()


def test_a_second_run_never_takes_a_live_runs_directory(tmp_path, cache_dir):
    """The first run has no checkpoint yet (save_weights_every=0), so its directory looks like the stub of a
    failed run: the second run must still leave it alone and stop with one line naming the holder."""
    args = [sys.executable, str(ROOT / "run.py"), *TINY, f"cache_dir={cache_dir}", f"log_dir={tmp_path}",
            "run_name=live", "save_weights_every=0"]
    first = subprocess.Popen([*args, "num_outer_steps=400"], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "live"
    try:
        _wait_for(lambda: (run_dir / "model_training_report" / "training_log.csv").is_file()
                  and len(_csv_rows(run_dir)) > 2, first)
        second = subprocess.run([*args, "num_outer_steps=2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr
        assert lines[0].startswith(f"error: run_name: run directory {run_dir} is in use by process {first.pid} on host")
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("live")) == ["live"]  # nothing moved
        assert first.poll() is None  # the first run goes on, alone in its directory
        before = len(_csv_rows(run_dir))
        _wait_for(lambda: len(_csv_rows(run_dir)) > before, first)
        status = json.loads((run_dir / "status.json").read_text())
        assert status["state"] == "running" and status["pid"] == first.pid
        config = (run_dir / "config.yaml").read_text()
        assert "num_outer_steps: 400" in config  # not the second run's
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 143, err
    steps = [int(r.split(",")[0]) for r in _csv_rows(run_dir)[1:]]
    assert steps == sorted(steps)  # one writer: rows in order, none interleaved
    assert json.loads((run_dir / "status.json").read_text())["state"] == "stopped"


def _claim(log_dir, barrier, results):
    barrier.wait()
    try:
        _, lock = make_run_dir(log_dir, "race", "m", "d")
        results.put(("ok", os.getpid()))
        time.sleep(1.0)  # hold it while the others try
        lock.release()
    except UserError as exc:
        results.put(("refused", str(exc)))


def test_processes_racing_for_one_run_name_get_one_owner(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(str(tmp_path), barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    outcomes = [results.get(timeout=5) for _ in procs]
    assert [o[0] for o in outcomes].count("ok") == 1, outcomes
    assert all(o[0] == "ok" or "run_name" in o[1] for o in outcomes), outcomes
    assert [p.name for p in tmp_path.iterdir()] == ["race"]


def test_a_stale_lock_never_blocks_and_a_held_one_always_does(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # a lock file left by a dead run whose PID now belongs to a live process (here: this test's parent), and
    # one written on another host: neither is held, so neither blocks
    for text in (json.dumps({"pid": os.getppid(), "host": "this", "process_start": "1"}),
                 json.dumps({"pid": 1, "host": "another-host"}), "garbage"):
        (run_dir / "run.lock").write_text(text)
        assert in_use(run_dir) is None
        lock = RunLock(run_dir).acquire()
        assert json.loads((run_dir / "run.lock").read_text())["pid"] == os.getpid()
        # while held, any other open of the file (another process, or this one) is refused
        host = json.loads((run_dir / "run.lock").read_text())["host"]
        assert in_use(run_dir) == f"process {os.getpid()} on host {host}"
        lock.release()
    # a holder that dies without releasing (SIGKILL) frees the directory at once
    holder = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
                               "from run_dir.run_state import RunLock\n"
                               f"RunLock({str(run_dir)!r}).acquire(); print('held', flush=True)\n"
                               "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    assert in_use(run_dir).startswith(f"process {holder.pid} on host ")
    holder.kill()
    holder.wait()
    assert in_use(run_dir) is None
