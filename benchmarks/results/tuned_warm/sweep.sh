#!/bin/bash
# The warm regime's tuning sweep (issue 40): start A of BENCHMARKS' warm section (pretraining seed 42, phase 1 in
# OUT/pretrain, deterministic, so a fresh checkout re-runs it to the same start), then every variant fine-tunes it
# on the C4 sample. Run from a worktree of main; the study lives in studies.journal, committed as it grows.
cd /work/sweep_tree || exit 1
exec /work/main/.venv/bin/python -m benchmarks.tune --config configs/compare_warm_cpu.yaml \
  --pretrain_config configs/pretrain_cpu.yaml --max_tokens 449211 --node_throughput 8616 \
  --variants adloco,adloco_paper,ddp,snoo,nesterov,diloco_b1,diloco_b2,diloco_b4,diloco_b8,diloco_b16 \
  --diloco_batches 1,2,4,8,16 \
  --trials 6 --workers ${WORKERS:-2} --storage /work/main/benchmarks/results/tuned_warm/studies.journal \
  --out /work/main/benchmarks/results/tuned_warm max_requested_batch=32 cpu_threads=1
