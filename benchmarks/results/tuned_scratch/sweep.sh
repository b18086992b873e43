#!/bin/bash
# The from-scratch regime's tuning sweep (issue 40), run from a worktree of main so that edits elsewhere cannot
# break a trial. Its study lives in studies.journal (Optuna's journal file, committed as it grows), so a later
# session, or another machine, continues it: the same command with the same --storage.
cd /work/sweep_tree || exit 1
exec /work/main/.venv/bin/python -m benchmarks.tune --config configs/compare_cpu.yaml --max_tokens 610427 \
  --node_throughput 8360 \
  --variants adloco,adloco_paper,ddp,snoo,nesterov,diloco_b1,diloco_b2,diloco_b4,diloco_b8,diloco_b16 \
  --diloco_batches 1,2,4,8,16 \
  --trials 6 --workers ${WORKERS:-2} --storage /work/main/benchmarks/results/tuned_scratch/studies.journal \
  --out /work/main/benchmarks/results/tuned_scratch max_requested_batch=32 cpu_threads=1
