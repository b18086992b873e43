"""How torch's OpenMP threads wait between parallel regions: set before torch loads (libgomp reads it once).

By default libgomp lets a thread that finished its share of an operation spin for up to 300000 iterations
before it sleeps. On a machine of one's own that costs nothing; on a shared one the spinning threads take
the cores from the threads with work, and a small model's many short operations make it most of the run:
beside two busy processes the default run took 2.08x the CPU-seconds and 3.55x the wall time of a run
alone (BENCHMARKS.md "CPU time on a busy machine"). libgomp already spins only 1000 iterations when its
own threads outnumber the cores; it cannot see other processes, so we ask for that count always. A wait
policy the user set (OMP_WAIT_POLICY or GOMP_SPINCOUNT) is kept.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "1000"  # libgomp's own count for an oversubscribed machine


def limit_openmp_spinning() -> None:
    """Call before torch is imported; a wait policy already in the environment is left alone."""
    if "torch" not in sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def openmp_waits() -> str:
    """What this process's OpenMP threads do when idle, for the log and summary.json."""
    if os.environ.get("GOMP_SPINCOUNT"):
        return f"spin {os.environ['GOMP_SPINCOUNT']} then sleep (GOMP_SPINCOUNT)"
    if os.environ.get("OMP_WAIT_POLICY"):
        return f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}"
    return "libgomp's default (spin 300000 then sleep)"
