#!/bin/bash
# The warm regime's finalists (issue 40): each study's best trial on seeds 0-4 from start A, beside the untuned
# variants that the warm paper experiment's report does not hold (adloco at the new cap of 32, the Nesterov DiLoCos);
# the untuned constant batches, DDP, SNOO and adloco_paper come from that report
# (benchmarks/results/compare_warm_paper).
# cpu_capability=avx2, in phase 1 and in every run: that report's kernels. Pretrained and fine-tuned on avx2, its
# diloco_b16 seed 0 is reproduced bit for bit (README.md), so each tuned-minus-untuned pair differs only in its
# settings. Phase 1 pretrains again into OUT/pretrain (the sweep's start was on the default kernels).
# ROOT: this checkout (the script's own); TREE (default ROOT): the checkout whose code runs (we ran a worktree of main,
# so that commits during hours of runs change nothing that runs); OUT (default: this folder): where results land.
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=${OUT:-$ROOT/benchmarks/results/tuned_warm}
cd "${TREE:-$ROOT}" || exit 1
exec "$ROOT/.venv/bin/python" -m benchmarks.tune --config configs/compare_warm_cpu.yaml \
  --pretrain_config configs/pretrain_cpu.yaml --pretrain_set cpu_capability=avx2 \
  --max_tokens 449211 --target 430 --node_throughput 8616 \
  --variants adloco,adloco_paper,ddp,snoo,nesterov,diloco_b1,diloco_b2,diloco_b4,diloco_b8,diloco_b16 \
  --diloco_batches 1,2,4,8,16 --trials 6 --workers ${WORKERS:-2} --seeds 5 \
  --storage "$OUT"/studies.journal --out "$OUT" \
  --untuned "$ROOT"/benchmarks/results/compare_warm_paper:adloco_paper,\
diloco_b1,diloco_b2,diloco_b4,diloco_b8,diloco_b16,ddp,snoo \
  max_requested_batch=32 cpu_threads=1 cpu_capability=avx2
