#!/bin/bash
# The warm regime's tuning sweep (issue 40): start A of BENCHMARKS' warm section (pretraining seed 42, phase 1 in
# OUT/pretrain, deterministic, so a fresh checkout re-runs it to the same start), then every variant fine-tunes it
# on the C4 sample. Run from a worktree of main; the study lives in studies.journal, committed as it grows.
# ROOT: this checkout (the script's own); TREE (default ROOT): the checkout whose code runs (we ran a worktree of main,
# so that commits during hours of runs change nothing that runs); OUT (default: this folder): where results land.
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=${OUT:-$ROOT/benchmarks/results/tuned_warm}
cd "${TREE:-$ROOT}" || exit 1
exec "$ROOT/.venv/bin/python" -m benchmarks.tune --config configs/compare_warm_cpu.yaml \
  --pretrain_config configs/pretrain_cpu.yaml --max_tokens 449211 --node_throughput 8616 \
  --variants adloco,adloco_paper,ddp,snoo,nesterov,diloco_b1,diloco_b2,diloco_b4,diloco_b8,diloco_b16 \
  --diloco_batches 1,2,4,8,16 \
  --trials 6 --workers ${WORKERS:-2} --storage "$OUT"/studies.journal \
  --out "$OUT" max_requested_batch=32 cpu_threads=1
