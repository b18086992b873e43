#!/bin/bash
# Where could the critical batch grow (issue 40, item 4)? A first look: the constant-batch sweep b1..b16 from
# scratch with microllama-nano (0.6M parameters, 92k outside the embeddings) for 4 epochs of the embedded corpus
# (2848256 tokens: 31 tokens per non-embedding parameter, against 0.8 for microllama-tiny at the from-scratch
# budget), one seed, lr_inner 4.735e-3 (the from-scratch sweep's best for every plain-SGD DiLoCo batch; untuned
# here), --max_outer_steps 600 (batch 1 needs 557 rounds of H = 10). The report's "critical batch along training"
# section says whether it grows. A second call added b32 (17 rounds) and both AdLoCos at the same settings (their
# own ETA and starting batches, the request cap at 32), reusing the five first runs.
# ROOT: this checkout (the script's own); TREE (default ROOT): the checkout whose code runs (we ran a worktree of main,
# so that commits during hours of runs change nothing that runs); OUT (default: this folder): where results land.
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=${OUT:-$ROOT/benchmarks/results/critical_probe_nano}
cd "${TREE:-$ROOT}" || exit 1
exec "$ROOT/.venv/bin/python" -m benchmarks.compare --config configs/compare_cpu.yaml --seeds ${SEEDS:-1} \
  --max_tokens 2848256 --max_outer_steps 600 --node_throughput 8360 --diloco_batches 1,2,4,8,16,32 \
  --variants diloco_b1,diloco_b2,diloco_b4,diloco_b8,diloco_b16,diloco_b32,adloco_paper,adloco --out "$OUT" \
  cpu_threads=1 cpu_capability=avx2 model_config.name=microllama-nano lr_inner=4.735e-3 max_requested_batch=32
