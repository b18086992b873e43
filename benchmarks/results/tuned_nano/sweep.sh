#!/bin/bash
# The tuned comparison where the critical batch grows (issue 40, item 4): the nano probe's regime (microllama-nano,
# 4 epochs of the embedded corpus, 2848256 tokens, request cap 32; benchmarks/results/critical_probe_nano), every
# method tuned alike as in benchmarks/results/tuned_scratch: the same search spaces around the same lr_inner (3e-3),
# 6 quasi-random trials per study on the tuning seed 1000. The constant batches b1..b32 with the paper's outer SGD,
# the Nesterov DiLoCos from b2 (b1 alone costs 13 minutes of one core per run), both AdLoCos, DDP and SNOO at the
# sweep's middle batch (8). About 7 hours of one core: a multi-session (or multi-machine) study, continued by the
# same command with the same --storage; the journal is committed as it grows. avx2 kernels, as the probe.
# ROOT: this checkout (the script's own); TREE (default ROOT): the checkout whose code runs; OUT (default: this
# folder): where results land.
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=${OUT:-$ROOT/benchmarks/results/tuned_nano}
cd "${TREE:-$ROOT}" || exit 1
exec "$ROOT/.venv/bin/python" -m benchmarks.tune --config configs/compare_cpu.yaml \
  --max_tokens 2848256 --max_outer_steps 600 --node_throughput 8360 --diloco_batches 1,2,4,8,16,32 \
  --variants adloco,adloco_paper,ddp,snoo,diloco_b1,diloco_b2,diloco_b4,diloco_b8,diloco_b16,diloco_b32,\
diloco_nesterov_b2,diloco_nesterov_b4,diloco_nesterov_b8,diloco_nesterov_b16,diloco_nesterov_b32 \
  --trials 6 --workers ${WORKERS:-2} --storage "$OUT"/studies.journal --out "$OUT" \
  model_config.name=microllama-nano max_requested_batch=32 cpu_threads=1 cpu_capability=avx2
