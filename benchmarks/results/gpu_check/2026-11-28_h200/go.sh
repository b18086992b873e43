#!/bin/bash
# issue 59: the GPU check, then the paper-scale slice in whatever time is left (one device call)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl .whl/optuna-*.whl .whl/alembic-*.whl \
  .whl/colorlog-*.whl .whl/mako-*.whl .whl/sqlalchemy-*.whl || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site2 \
  .whl/transformers-*.whl .whl/tokenizers-*.whl
export PYTHONPATH=/tmp/site
if PYTHONPATH=/tmp/site:/tmp/site2 python3 -c "import transformers, tokenizers, datasets; from transformers import LlamaForCausalLM; print('carried transformers', transformers.__version__)"; then
  export PYTHONPATH=/tmp/site:/tmp/site2
else
  echo "carried transformers failed to import: the image's own"
fi
python3 -c "import torch, transformers, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__)"
export ADLOCO_EXLLAMAV2_WHEEL=$PWD/.gpu/exllamav2-0.3.2-py3-none-any.whl
CHECK=/tmp/gpu_check
python3 -m benchmarks.gpu_check --minutes ${MINUTES:-7.2} --out $CHECK ${ONLY:+--only $ONLY}
echo "gpu_check exit $? after $((SECONDS - T0)) s"
cp $CHECK/gpu_check.md $CHECK/gpu_check.json $OUT/ 2>/dev/null
LEFT=$(( ${CALL_S:-575} - (SECONDS - T0) ))
echo "left for the paper-scale slice: $LEFT s"
if [ "$LEFT" -gt 60 ]; then
  timeout -s INT $((LEFT - 15)) python3 -m benchmarks.compare --config configs/paper_microllama_c4.yaml --seeds 1 \
    --variants adloco_paper,diloco_b1 --diloco_batches 1 --max_tokens ${SLICE_TOKENS:-1228800} --out /tmp/slice \
    dataset=c4 c4_local_path=.gpu/c4 hub_downloads=false model_config.pretrained=false \
    model_config.name=microllama-300m tokenizer=bpe tokenizer_vocab_size=32000 cache_dir=/tmp/adloco_cache \
    clearml_mode=off save_weights_every=0 plot_every=0 val_size=${SLICE_VAL:-50} > /tmp/slice.log 2>&1
  echo "slice exit $?"; tail -40 /tmp/slice.log
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/nvidia_smi.csv 2>&1
tar czf $OUT/gpu_check.tgz --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' -C /tmp gpu_check 2>/dev/null
[ -d /tmp/slice ] && tar czf $OUT/slice.tgz --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' -C /tmp slice slice.log
ls -la $OUT
