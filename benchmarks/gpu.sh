#!/usr/bin/env bash
# TTFT benchmark on a CUDA host: the four architectures at their real shapes (scale 1, real vocabularies), bf16,
# random weights (nothing is downloaded); then the serving benchmark. Results land in benchmarks/results/gpu/.
#   usage: benchmarks/gpu.sh [extra pop-vlm bench flags, e.g. --repeats 10]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/gpu
mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } > "$OUT/machine.txt"
for arch in qwen3-vl-2b qwen3-vl-8b gemma-3-4b llama-3.1-8b; do
  python -m pop_vlm.cli bench --arch "$arch" --scale 1 --device cuda --dtype bf16 \
    --tokens 32,128,512,1024,2048,4096 --image-sizes 448,896,1344,1792 \
    --repeats 10 --warmup 3 --out "$OUT" "$@" | tee "$OUT/bench-$arch.txt"
done
# Serving: serial vs continuously batched `pop-vlm serve` (full and POP) under 1..32 streaming clients, on the GPU
# (the same three models as the CPU run in benchmarks/results/serving; gemma-3-270m needs the gemma extra).
mkdir -p "$OUT/serving"
PYTHONPATH=. python scripts/bench_serving.py --device cuda --dtype bf16 --threads 0 --clients 1,4,16,32 --seconds 60 \
  --out "$OUT/serving" | tee "$OUT/serving/serving.txt"
