"""CPU time and wall time of one short run.py job, alone and beside busy processes, per OpenMP wait policy.

    python -m benchmarks.busy_machine --busy 2 --out benchmarks/results/busy_machine [run.py key=value ...]

Each setting runs the same job (default: the default config, 2 outer steps, ClearML off) once alone and once
beside --busy processes that spin at the same priority (a shared machine), and records the job's wall time
and CPU-seconds (user + sys of the process and its children). Ratios are against libgomp's default alone, in
the same invocation. Settings:
  libgomp_default   GOMP_SPINCOUNT=300000: what torch's OpenMP threads do unless told (spin, then sleep)
  ours              nothing set: run.py asks for a spin of 1000 (utils/openmp.py)
  passive           OMP_WAIT_POLICY=PASSIVE: sleep at once
Run it on an otherwise idle machine: other load makes "alone" busy too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.launch import child
from benchmarks.tables import cell

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {"libgomp_default": {"GOMP_SPINCOUNT": "300000"}, "ours": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
JOB = ["num_outer_steps=2", "clearml_mode=off", "save_weights_every=0"]


def timed_job(env_extra: dict[str, str], overrides: list[str], log_dir: Path, name: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env_extra
    err_path = log_dir / f"{name}.err"
    start = time.perf_counter()
    with child([sys.executable, str(ROOT / "run.py"), *JOB, *overrides, f"log_dir={log_dir}", f"run_name={name}"],
               err_path, env=env) as job:
        _, status, usage = os.wait4(job.pid, 0)  # the job's own rusage (its threads included), not the busy ones'
        job.returncode = os.waitstatus_to_exitcode(status)  # reaped here: the launcher must not wait for it again
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        last = (err_path.read_text().strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"error: the job {name} failed (exit {code}): {last}")
    return {"wall_s": round(wall, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2)}


def measure(busy: int, overrides: list[str]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="busy_machine_") as scratch:
        for load in ("alone", f"beside {busy} busy"):
            with contextlib.ExitStack() as spinners:
                for _ in range(0 if load == "alone" else busy):  # each killed when the load is done
                    spinners.callback(spinners.enter_context(child([sys.executable, "-c", "while True: pass"])).kill)
                for setting, env in SETTINGS.items():
                    result = timed_job(env, overrides, Path(scratch), f"{setting}_{len(rows)}")
                    rows.append({"setting": setting, "load": load, **result})
                    print(f"{setting:16s} {load:14s} wall {result['wall_s']:7.2f} s  cpu {result['cpu_s']:7.2f} s",
                          flush=True)
    base = next(r for r in rows if r["setting"] == "libgomp_default" and r["load"] == "alone")
    for r in rows:
        r["wall_ratio"] = round(r["wall_s"] / base["wall_s"], 2)
        r["cpu_ratio"] = round(r["cpu_s"] / base["cpu_s"], 2)
    return rows


def markdown(rows: list[dict], busy: int, overrides: list[str]) -> str:
    columns = ["setting", "load", "wall_s", "cpu_s", "wall_ratio", "cpu_ratio"]
    lines = [f"run.py {' '.join([*JOB, *overrides])}; {os.cpu_count()} CPUs; busy processes: {busy}; ratios: "
             "against libgomp_default alone", "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the job (default 2)")
    parser.add_argument("--out", default="", help="directory for busy_machine.json / .md (default: print only)")
    parser.add_argument("overrides", nargs="*", help="run.py key=value overrides for the job")
    args = parser.parse_args(argv)
    if args.busy < 1:
        parser.error("--busy: at least 1")
    rows = measure(args.busy, args.overrides)
    table = markdown(rows, args.busy, args.overrides)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "busy_machine.json").write_text(json.dumps(rows, indent=1) + "\n")
        (out / "busy_machine.md").write_text(table)
    return 0


if __name__ == "__main__":
    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
