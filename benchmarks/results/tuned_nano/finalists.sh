#!/bin/bash
# The nano regime's finalists (issue 40, item 4): each study's best trial (sweep.sh) on seeds 0-4, tuned variants
# only (--tuned_only): this regime has no untuned report of 5 seeds (critical_probe_nano is one seed at the
# from-scratch sweep's best lr), so the report compares tuned methods with each other, and its "critical batch along
# training" section reads the tuned constant batches. --target 200: about the probe's (197.7, its diloco_b2); the
# report is rewritten from the finished runs when the same command runs again with another --target.
# cpu_capability=avx2: the sweep's and the probe's kernels.
# VARIANTS (default: all 15): a subset, to run some finalists first (their report is written for them alone, then
# rewritten by the full command); we ran the constant batches first, which answer the critical batch's question.
# ROOT: this checkout (the script's own); TREE (default ROOT): the checkout whose code runs (we ran a worktree of main,
# so that commits during hours of runs change nothing that runs); OUT (default: this folder): where results land.
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=${OUT:-$ROOT/benchmarks/results/tuned_nano}
ALL=adloco,adloco_paper,ddp,snoo,diloco_b1,diloco_b2,diloco_b4,diloco_b8,diloco_b16,diloco_b32,\
diloco_nesterov_b2,diloco_nesterov_b4,diloco_nesterov_b8,diloco_nesterov_b16,diloco_nesterov_b32
cd "${TREE:-$ROOT}" || exit 1
exec "$ROOT/.venv/bin/python" -m benchmarks.tune --config configs/compare_cpu.yaml \
  --max_tokens 2848256 --max_outer_steps 600 --target 200 --node_throughput 8360 --diloco_batches 1,2,4,8,16,32 \
  --variants "${VARIANTS:-$ALL}" \
  --trials 6 --workers ${WORKERS:-2} --seeds 5 --tuned_only --storage "$OUT"/studies.journal --out "$OUT" \
  model_config.name=microllama-nano max_requested_batch=32 cpu_threads=1 cpu_capability=avx2
