"""Memory at named stages of every outer step: process RSS and system memory (psutil), and per CUDA
device allocated / reserved / peak. The round's peak RSS is sampled by a background thread.

Stages: before_round, round_peak, after_outer_step, after_merge. Rows go to memory_log.csv, a plot to
memory_usage.png, and the numbers to the trackers as memory_<stage>/<quantity>: the monitor keeps them in `pending`
and the training logger sends them with the step's own scalars (training_logs/training_monitoring.py), so a step
reaches the trackers in one place.
"""

from __future__ import annotations

import contextlib
import csv
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch

MiB = float(1 << 20)
STAGES = ("before_round", "round_peak", "after_outer_step", "after_merge")


def device_peak_mib(run_dir: Path) -> float:
    """A finished run's largest allocator peak over its rounds and devices (memory_report/memory_log.csv; the peak is
    reset at each round's start, so the max-batch probe before training is not in it). 0.0 on a run without CUDA."""
    with (run_dir / "memory_report" / "memory_log.csv").open(newline="") as f:
        return max((float(row[k]) for row in csv.DictReader(f) for k in row if k.endswith("_peak_mib") and row[k]),
                   default=0.0)


class MemoryMonitor:
    def __init__(self, out_dir: Path, devices: list[str], interval_s: float = 0.05,
                 resume_step: int | None = None) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir, self.interval_s = out_dir, interval_s
        self.pending: dict[int, dict[str, float]] = {}  # outer step -> its readings' scalars, not yet sent
        self.cuda_devices = sorted({d for d in devices if d.startswith("cuda")}) if torch.cuda.is_available() else []
        self.process = psutil.Process()
        self.csv_path = out_dir / "memory_log.csv"
        self.columns = ["outer_step", "stage", "process_rss_mib", "system_used_mib", "system_available_mib"]
        for d in self.cuda_devices:
            self.columns += [f"{d}_allocated_mib", f"{d}_reserved_mib", f"{d}_peak_mib"]
        from training_logs.csv_files import start_csv

        start_csv(self.csv_path, self.columns, resume_step)
        with self.csv_path.open(newline="") as f:  # the rows kept on a resume, for the plot
            self.rows: list[dict] = [{k: (v if k == "stage" else int(v) if k == "outer_step" else float(v))
                                      for k, v in row.items()}
                                     for row in csv.DictReader(f)]
        self._peak_rss = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _snapshot(self) -> dict[str, float]:
        vm = psutil.virtual_memory()
        row = {"process_rss_mib": self.process.memory_info().rss / MiB, "system_used_mib": vm.used / MiB,
               "system_available_mib": vm.available / MiB}
        for d in self.cuda_devices:
            row[f"{d}_allocated_mib"] = torch.cuda.memory_allocated(d) / MiB
            row[f"{d}_reserved_mib"] = torch.cuda.memory_reserved(d) / MiB
            row[f"{d}_peak_mib"] = torch.cuda.max_memory_allocated(d) / MiB
        return row

    def _sample_peak(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak_rss = max(self._peak_rss, self.process.memory_info().rss)

    def record(self, stage: str, outer_step: int) -> dict[str, float]:
        row = {"outer_step": outer_step, "stage": stage, **self._snapshot()}
        if stage == "round_peak":
            row["process_rss_mib"] = max(row["process_rss_mib"], self._peak_rss / MiB)
        self.rows.append(row)
        with self.csv_path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(
                {k: (f"{v:.1f}" if isinstance(v, float) else v) for k, v in row.items()})
        self.pending.setdefault(outer_step, {}).update(
            {f"memory_{stage}/{k}": v for k, v in row.items() if k.endswith("_mib")})
        return row

    @contextlib.contextmanager
    def round(self, outer_step: int) -> Iterator[None]:
        """While a round's node work runs: the reading before it, the peak sampled during it, the peak after it."""
        self.begin_round(outer_step)
        try:
            yield
        finally:
            self.end_round(outer_step)

    def begin_round(self, outer_step: int) -> None:
        for d in self.cuda_devices:
            torch.cuda.reset_peak_memory_stats(d)
        self.record("before_round", outer_step)
        self._peak_rss = self.process.memory_info().rss
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample_peak, name="memory-monitor", daemon=True)
        self._thread.start()

    def end_round(self, outer_step: int) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.record("round_peak", outer_step)

    def plot(self) -> Path:
        from training_logs.plots import plot_memory

        return plot_memory(self.rows, self.cuda_devices, self.out_dir / "memory_usage.png")

