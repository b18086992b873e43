"""Ending a process whose work is done and written, without the interpreter's teardown.

Python's own exit tears down every loaded module: with torch, transformers and datasets loaded that takes 1-1.5 s
of a CPU core per process and writes nothing (`python -m benchmarks.startup`: 1.29 s against 0.08 s from a
finished run's last line to its end; BENCHMARKS.md). A run pays it, and so does every child run the harness or the
tuner starts. So once `main` has returned, the exit hooks run (trackers' flushes, logging's handlers, locks,
temporary files), the streams are flushed and the process ends with os._exit. Only when nothing else is still
running: with a thread that is not a daemon, which the normal exit would wait for, or under a profiler, tracer or
debugger (`python -m cProfile run.py`: it writes its results once the program returns), the process takes the
normal exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def end_process(code: int, run_exit_hooks: bool = True) -> None:
    """Exit with `code` now. `run_exit_hooks=False`: a stop by a signal, nothing left to wait for (no thread, no
    exit hook, no profiler's results)."""
    if run_exit_hooks and (waited_for() or sys.getprofile() is not None or sys.gettrace() is not None):
        sys.exit(code)
    if run_exit_hooks:
        atexit._run_exitfuncs()  # what the normal exit runs first: logging.shutdown, trackers, locks, temp files
    else:
        import logging

        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (`python run.py | head`), a stream closed: nothing to keep
            pass
    os._exit(code)


def waited_for() -> bool:
    """A thread that is not a daemon is still running: the normal exit waits for it."""
    return any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread())
