"""The memory plan of a config, for a card that need not be here (cluster/memory_plan.py; docs/running.md).

    python -m benchmarks.memory_plan --config configs/paper_microllama_c4_16nodes.yaml --capacity_gb 80
    python -m benchmarks.memory_plan --config configs/paper_microllama_c4.yaml --capacity_gb 80 --json
    python -m benchmarks.memory_plan --config configs/paper_microllama_c4_16nodes.yaml --capacity_gb 80 \\
        offload_idle_nodes=false max_concurrent_nodes=0

The model is built on the meta device (no weights, no GPU); a Hub model whose config.json is not on this machine is
planned from the preset of its architecture. Exit 0 when every device fits, 1 when one does not (with the keys that
would make it fit, at the plan's micro-batch, none the config already sets), 2 on bad input or when a CUDA card is not
here and --capacity_gb is not given (the plan is printed, "fits" is null: no verdict without a capacity).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from cluster.memory_plan import GiB, keys_that_fit, plan_for_config
from utils.config import load_config
from utils.errors import UserError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory_plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="config.yaml")
    p.add_argument("--capacity_gb", type=float, default=None, help="each CUDA card's memory in GiB (default: the card "
                   "here, if any); simulated CPU devices keep their devices[i].memory_mb / device_memory_mb")
    p.add_argument("--micro_batch", type=int, default=None, help="a node's micro-batch (default: max_batch_size, "
                   "else 1, the least any run needs)")
    p.add_argument("--json", action="store_true", help='print {"devices": [{"device", "planned_bytes", '
                   '"capacity_bytes", "fits", ...}], ...}')
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    if args.capacity_gb is not None and not (math.isfinite(args.capacity_gb) and args.capacity_gb > 0):
        p.error(f"--capacity_gb must be a finite number of GiB above 0, not {args.capacity_gb}")
    if args.micro_batch is not None and args.micro_batch < 1:
        p.error("--micro_batch must be at least 1")
    try:
        cfg = load_config(args.config, args.overrides)
        plan = plan_for_config(cfg, args.micro_batch, args.capacity_gb)
        fix = "" if plan.fits else keys_that_fit(cfg, args.capacity_gb, args.micro_batch)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # a card that is not here and no --capacity_gb: the plan is printed, but no verdict is given (exit 2)
    unknown = [d.device for d in plan.devices if d.fits is None]
    verdict = None if unknown and plan.fits else plan.fits
    if args.json:
        print(json.dumps({**plan.as_dict(), "fits": verdict, "keys_that_fit": fix}, indent=2))
        return capacity_unknown(unknown) if verdict is None else 0 if plan.fits else 1
    print(f"{args.config} ({' '.join(args.overrides) or 'as written'}), micro-batch {plan.micro_batch}:")
    for d in plan.devices:
        cap = f"{d.capacity_bytes / GiB:.2f} GiB" if d.capacity_bytes else "unknown capacity (--capacity_gb)"
        said = {True: "fits", False: "does NOT fit", None: "?"}[d.fits]
        print(f"  {d.device}: {d.planned_bytes / GiB:.2f} GiB planned of {cap}: {said} ({d.nodes} nodes, "
              f"{d.computing} computing at once)")
        for kind, parts in (("resident", d.resident), ("transient", d.transient)):
            print(f"    {kind}: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in parts.items() if v) + " GiB")
    print(f"  host: {plan.host_bytes / GiB:.2f} GiB (" + ", ".join(f"{k} {v / GiB:.2f}" for k, v in plan.host.items()
                                                           if v) + ")")
    if not plan.fits:
        print(f"  to fit: {fix or 'none of offload_idle_nodes / max_concurrent_nodes is enough; lower nodes_per_gpu, '}"
              + ("" if fix else "seq_len or the model"))
    return capacity_unknown(unknown) if verdict is None else 0 if plan.fits else 1


def capacity_unknown(devices: list[str]) -> int:
    print(f"error: --capacity_gb: {', '.join(devices)} is not on this machine, so its capacity is unknown; give "
          "--capacity_gb for a verdict", file=sys.stderr)
    return 2


if __name__ == "__main__":
    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
