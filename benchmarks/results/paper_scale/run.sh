#!/bin/bash
# The paper's experiment as one command (issue 59, item 7): MicroLlama 300M (keeeeenw/MicroLlama from the Hub), C4,
# the 4-node reading of the paper's one-A100 cluster (configs/paper_microllama_c4.yaml: fp16, H = 200, 20 outer
# steps, the synced model evaluated every 10 inner steps), the paper's AdLoCo, its three ablations (switch mode as
# both readings), DiLoCo at batches 1 to 16, 3 seeds, every run to the token budget DiLoCo b1 takes in 20 outer
# steps. First the card it needs and the GPU-hours are printed (python -m benchmarks.paper_scale: the memory plan
# and a measured throughput curve; it stops here, exit 1, when the card does not fit); then the harness runs.
# SEEDS (default 3), CURVE (default the H100's bf16 curve of 2026-11-26), OUT (default logs/paper_scale).
set -e
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
"$PY" -m benchmarks.paper_scale --seeds "${SEEDS:-3}" ${CURVE:+--curve "$CURVE"}
MAX_TOKENS=8192000  # 20 outer steps x 200 inner steps x 4 nodes x batch 1 x 512 tokens
exec "$PY" -m benchmarks.compare --config configs/paper_microllama_c4.yaml --seeds "${SEEDS:-3}" \
  --max_tokens "$MAX_TOKENS" --diloco_batches 1,2,4,8,16 --out "${OUT:-logs/paper_scale}" \
  --variants adloco_paper,adloco_paper_no_adaptive,adloco_paper_no_merge,adloco_paper_always_accumulate,\
adloco_paper_never_accumulate,diloco_b1,diloco_b2,diloco_b4,diloco_b8,diloco_b16
