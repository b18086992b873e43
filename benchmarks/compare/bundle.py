"""A report's replay bundle: what re-pricing it needs, without its run directories (which stay out of git).

Every report the harness writes gets `replay_bundle.tar.gz` beside comparison.md: per run its config.yaml,
summary.json, status.json and the small CSVs the reader and the replay read (training_log.csv, merge_events.csv,
inner_eval.csv, node_clock.csv: the recorded rounds), plus manifest.json (the harness's options, each run's
variant, seed, family and constant batch, the runs that stopped on a training fault). A few hundred kB for a tuned
report of 75 runs.

    python -m benchmarks.compare --reprice benchmarks/results/REPORT --report_out /tmp/view \\
        --network 1Gbit/s,1ms --model_params 3e8 \\
        --throughput_curve benchmarks/results/curves/h100_bf16_microllama-300m.json

re-prices the report on other networks (and, with --model_params, another model size) in about a minute: nothing
trains, the runs are read from the bundle, and every table is written again into --report_out.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import tarfile
import tempfile
from pathlib import Path

from run_dir.reader import READ_BACK

BUNDLE = "replay_bundle.tar.gz"
FILES = READ_BACK
# what --reprice takes from its own command line; every other option is the bundled report's
PRICING_OPTIONS = ("network", "node_throughput", "time_target", "time_budget", "crossover_latency", "throughput_curve",
                   "no_statistics", "model_params", "report_out")


def write(out: Path, results: dict[str, list[dict]], faults: list[dict], options: dict, run_dirs: dict[str, Path]
          ) -> Path:
    """OUT/replay_bundle.tar.gz for the report's runs. run_dirs: every run directory by its run name (finished
    runs and faulted ones); results: the report's runs by variant (each with its seed, family, constant batch and
    the method it ablates)."""
    runs = [{"variant": name, "seed": r["seed"], "family": r["family"], "constant_batch": r["constant_batch"],
             "ablates": list(r.get("ablates", ())), "run": Path(r["run_dir"]).name}
            for name, rs in results.items() for r in rs]
    manifest = {"options": options, "runs": runs, "faults": faults}
    path = out / BUNDLE
    tmp = path.with_name(f".{BUNDLE}.tmp")
    # gzip's own header carries a time unless told otherwise: mtime 0, so the same runs give the same bytes
    with gzip.GzipFile(tmp, "wb", mtime=0) as packed, tarfile.open(fileobj=packed, mode="w") as tar:
        _add(tar, "manifest.json", json.dumps(manifest, indent=1, default=str).encode())
        for run, run_dir in sorted(run_dirs.items()):
            for name in FILES:
                if (run_dir / name).is_file():
                    _add(tar, f"{run}/{name}", (run_dir / name).read_bytes())
    tmp.replace(path)  # a reader never sees half a bundle
    return path


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # no date in the archive: the same runs, the same bytes
    tar.addfile(info, io.BytesIO(data))


@dataclasses.dataclass
class Bundle:
    """A report's bundle unpacked into a temporary folder (`with Bundle.open(DIR) as b:`): its options, the runs'
    entries (variant, seed, family, constant_batch, ablates: absent from bundles before 2026-12-02, run) and the
    faults, and each run's directory."""

    folder: Path
    options: dict
    runs: list[dict]
    faults: list[dict]
    _tmp: tempfile.TemporaryDirectory | None = None

    @classmethod
    def open(cls, report: Path) -> Bundle:
        path = report / BUNDLE
        if not path.is_file():
            raise SystemExit(f"error: --reprice {report}: no {BUNDLE} there (reports written since 2026-11-27 carry "
                             "one; an older report can only be re-priced from its run directories)")
        tmp = tempfile.TemporaryDirectory(prefix="adloco_reprice_")
        try:
            with tarfile.open(path, "r:gz") as tar:
                tar.extractall(tmp.name, filter="data")  # refuses absolute paths and links out of the folder
            manifest = json.loads((Path(tmp.name) / "manifest.json").read_text())
            return cls(Path(tmp.name), manifest["options"], manifest["runs"], manifest["faults"], tmp)
        except (OSError, tarfile.TarError, ValueError, KeyError, EOFError) as exc:
            tmp.cleanup()
            raise SystemExit(f"error: --reprice {report}: {BUNDLE} is damaged ({type(exc).__name__}: {exc})"
                             ) from None

    def run_dir(self, entry: dict) -> Path:
        return self.folder / entry["run"]

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
