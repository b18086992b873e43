"""Many nodes on one device: every node resident against idle nodes offloaded with a bound on those computing at
once (issue 42; BENCHMARKS.md, "Many nodes on one device"). Each setting is a real run.py process; this script polls
its resident memory (RSS) and reads its time per round and its memory plan (summary.json).

    python -m benchmarks.offload --nodes 64 --markdown /tmp/offload.md

On a CPU the "device" is host memory too: offloading cannot lower the RSS of the nodes' state there (the host
buffers are the same memory), so what the CPU shows is the bound's effect on the transient bytes (gradients,
activations, statistics of the nodes computing at once) and what the copies cost in time. On a GPU the same code
moves the state off the card (benchmarks.gpu_check measures that).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.launch import child
from run_dir.reader import RunFiles

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {  # name -> run.py overrides
    "resident": [],
    "offloaded, 2 computing": ["offload_idle_nodes=true", "max_concurrent_nodes=2"],
}


def run(name: str, overrides: list[str], out: Path) -> dict:
    """One run.py process: its peak RSS (polled every 20 ms), wall time per round and summary."""
    run_name = name.split(",")[0].replace(" ", "_")
    cmd = [sys.executable, str(ROOT / "run.py"), f"log_dir={out}", f"run_name={run_name}", *overrides]
    start = time.time()
    log = out / f"{run_name}.out"
    with child(cmd, log) as proc:
        watched, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                peak = max(peak, watched.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)
    if proc.returncode:
        raise SystemExit(f"error: {name}: run.py exited {proc.returncode}:\n{log.read_text()[-2000:]}")
    summary = RunFiles(out / run_name).summary()
    plan = summary["memory_plan"]
    planned = sum(d["planned_bytes"] for d in plan["devices"]) + plan["host_bytes"]
    return {"setting": name, "peak_rss_mb": peak / 2**20, "planned_mb": planned / 2**20,
            "seconds_per_round": summary["wall_time_s"] / summary["outer_steps"], "process_s": time.time() - start,
            "final_metric": summary["final_metric"], "plan": plan}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.offload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--trainers", type=int, default=4)
    p.add_argument("--inner_steps", type=int, default=5)
    p.add_argument("--outer_steps", type=int, default=2)
    p.add_argument("--markdown", default="", help="append the table to this file")
    p.add_argument("overrides", nargs="*", help="key=value run.py overrides for both settings")
    args = p.parse_args(argv)
    common = ["devices=[cpu]", f"nodes_per_gpu={args.nodes}", f"num_init_trainers={args.trainers}",
              "node_execution=threads", "device_memory_mb=8192", "max_batch_size=2", "initial_batch_size=2",
              "variance_estimator=nodes", f"num_inner_steps={args.inner_steps}", f"num_outer_steps={args.outer_steps}",
              "merge_frequency=0", "plot_every=0", "clearml_mode=off", "eval_every_inner_steps=0", *args.overrides]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # what the process holds besides the nodes (torch, the data, the tokenizer, the masters): one node's run
        base = run("one node", [*common, "nodes_per_gpu=1", "num_init_trainers=1", "sampling_method=constant"],
                   Path(tmp))
        for name, extra in SETTINGS.items():
            rows.append(run(name, [*common, *extra], Path(tmp)))
            print(f"{name}: peak RSS {rows[-1]['peak_rss_mb']:.0f} MB (plan {rows[-1]['planned_mb']:.0f} MB), "
                  f"{rows[-1]['seconds_per_round']:.2f} s per round", flush=True)
    same = rows[0]["final_metric"] == rows[1]["final_metric"]
    lines = [f"{args.nodes} nodes of microllama-tiny on one simulated CPU device, node threads, {args.trainers} "
             f"trainers, {args.inner_steps} inner steps x {args.outer_steps} rounds (`python -m benchmarks.offload`; "
             f"overrides: {' '.join(args.overrides) or 'none'}); final metric identical: {same}", "",
             "| setting | peak RSS (MB) | above one node's run (MB) | planned: device + host (MB) | planned above one "
             "node's (MB) | s per round | vs resident |", "|---|---|---|---|---|---|---|"]
    for r in [base, *rows]:
        lines.append(f"| {r['setting']} | {r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] - base['peak_rss_mb']:.0f} | "
                     f"{r['planned_mb']:.0f} | {r['planned_mb'] - base['planned_mb']:.0f} | "
                     f"{r['seconds_per_round']:.2f} | {r['seconds_per_round'] / rows[0]['seconds_per_round']:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
