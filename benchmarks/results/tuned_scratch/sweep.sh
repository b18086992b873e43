#!/bin/bash
# The from-scratch regime's tuning sweep (issue 40). Its study lives in studies.journal (Optuna's journal file,
# committed as it grows), so a later session, or another machine, continues it: the same command with the same
# --storage.
# ROOT: this checkout (the script's own); TREE (default ROOT): the checkout whose code runs (we ran a worktree of main,
# so that commits during hours of runs change nothing that runs); OUT (default: this folder): where results land.
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=${OUT:-$ROOT/benchmarks/results/tuned_scratch}
cd "${TREE:-$ROOT}" || exit 1
exec "$ROOT/.venv/bin/python" -m benchmarks.tune --config configs/compare_cpu.yaml --max_tokens 610427 \
  --node_throughput 8360 \
  --variants adloco,adloco_paper,ddp,snoo,nesterov,diloco_b1,diloco_b2,diloco_b4,diloco_b8,diloco_b16 \
  --diloco_batches 1,2,4,8,16 \
  --trials 6 --workers ${WORKERS:-2} --storage "$OUT"/studies.journal \
  --out "$OUT" max_requested_batch=32 cpu_threads=1
