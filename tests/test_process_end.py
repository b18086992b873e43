"""Ending a finished process without the interpreter's teardown: the exit hooks still run, the streams are flushed,
the exit code is kept, and a thread that is not a daemon is still waited for."""

import os
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = """
import atexit, logging, sys, threading, time
from pathlib import Path
from utils.process_end import end_process

out = Path(sys.argv[1])
atexit.register(lambda: (out / "hook").write_text("ran"))
logging.basicConfig(filename=out / "log", level=logging.INFO)
logging.info("the last line")
sys.stdout.write("x" * 100_000)  # buffered (stdout is a pipe): lost unless flushed
if sys.argv[2] == "reader_gone":
    sys.stdout.write("x")  # buffered; the reader is gone before the flush
    time.sleep(1)
if sys.argv[2] == "thread":
    def late():
        time.sleep(0.5)
        (out / "thread").write_text("done")
    threading.Thread(target=late).start()
end_process(int(sys.argv[3]), run_exit_hooks=sys.argv[2] != "signal")
raise AssertionError("end_process returned")
"""
BUFFERED = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout to a pipe: block-buffered


def end(tmp_path, case, code):
    out = tmp_path / case
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out), case, str(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=BUFFERED)
    return proc, out


def test_a_finished_process_runs_its_exit_hooks_flushes_and_keeps_its_code(tmp_path):
    proc, out = end(tmp_path, "done", 3)
    assert proc.returncode == 3 and proc.stdout == "x" * 100_000 and "AssertionError" not in proc.stderr
    assert (out / "hook").read_text() == "ran" and "the last line" in (out / "log").read_text()


def test_a_stop_by_a_signal_skips_the_exit_hooks_but_flushes_the_log(tmp_path):
    proc, out = end(tmp_path, "signal", 143)
    assert proc.returncode == 143 and proc.stdout == "x" * 100_000
    assert not (out / "hook").exists() and "the last line" in (out / "log").read_text()


def test_a_thread_still_running_gets_the_normal_exit_which_waits_for_it(tmp_path):
    proc, out = end(tmp_path, "thread", 0)
    assert proc.returncode == 0 and (out / "thread").read_text() == "done" and (out / "hook").read_text() == "ran"


def test_a_reader_gone_before_the_flush_costs_nothing_but_the_output(tmp_path):
    """`python run.py | head -1`: the pipe's reader is gone by the end; the flush fails quietly, the code stays."""
    out = tmp_path / "reader_gone"
    out.mkdir()
    quiet = SCRIPT.replace('sys.stdout.write("x" * 100_000)', "pass")
    proc = subprocess.Popen([sys.executable, "-c", quiet, str(out), "reader_gone", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=BUFFERED)
    proc.stdout.close()
    err = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == 0 and "Error" not in err and (out / "hook").read_text() == "ran", err


def test_under_a_profiler_the_normal_exit_lets_it_write_its_results(tmp_path):
    """`python -m cProfile -o FILE ...` writes FILE once the program returns: os._exit would lose it."""
    out = tmp_path / "profiled"
    out.mkdir()
    script = tmp_path / "script.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n" + SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(out / "profile"), str(script), str(out),
                           "done", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=BUFFERED)
    assert proc.returncode == 0 and (out / "profile").stat().st_size > 0 and (out / "hook").read_text() == "ran"
