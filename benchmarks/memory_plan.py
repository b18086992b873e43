"""The memory plan of a config, for a card that need not be here (cluster/memory_plan.py; docs/running.md).

    python -m benchmarks.memory_plan --config configs/paper_microllama_c4_16nodes.yaml --capacity_gb 80
    python -m benchmarks.memory_plan --config configs/paper_microllama_c4.yaml --capacity_gb 80 --json
    python -m benchmarks.memory_plan --config configs/paper_microllama_c4_16nodes.yaml --capacity_gb 80 \\
        offload_idle_nodes=false max_concurrent_nodes=0

The model is built on the meta device (no weights, no GPU); a Hub model whose config.json is not on this machine is
planned from the preset of its architecture. Exit 0 when every device fits, 1 when one does not (with the keys that
would make it fit), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
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
    if args.capacity_gb is not None and not args.capacity_gb > 0:
        p.error("--capacity_gb must be > 0")
    if args.micro_batch is not None and args.micro_batch < 1:
        p.error("--micro_batch must be at least 1")
    try:
        cfg = load_config(args.config, args.overrides)
        plan = plan_for_config(cfg, args.micro_batch, args.capacity_gb)
        fix = "" if plan.fits else keys_that_fit(cfg, args.capacity_gb)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**plan.as_dict(), "keys_that_fit": fix}, indent=2))
        return 0 if plan.fits else 1
    print(f"{args.config} ({' '.join(args.overrides) or 'as written'}), micro-batch {plan.micro_batch}:")
    for d in plan.devices:
        cap = f"{d.capacity_bytes / GiB:.2f} GiB" if d.capacity_bytes else "unknown capacity (--capacity_gb)"
        verdict = {True: "fits", False: "does NOT fit", None: "?"}[d.fits]
        print(f"  {d.device}: {d.planned_bytes / GiB:.2f} GiB planned of {cap}: {verdict} ({d.nodes} nodes, "
              f"{d.computing} computing at once)")
        for kind, parts in (("resident", d.resident), ("transient", d.transient)):
            print(f"    {kind}: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in parts.items() if v) + " GiB")
    print(f"  host: {plan.host_bytes / GiB:.2f} GiB (" + ", ".join(f"{k} {v / GiB:.2f}" for k, v in plan.host.items()
                                                           if v) + ")")
    if not plan.fits:
        print(f"  to fit: {fix or 'none of offload_idle_nodes / max_concurrent_nodes is enough; lower nodes_per_gpu, '}"
              + ("" if fix else "seq_len or the model"))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
