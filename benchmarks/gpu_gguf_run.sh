#!/bin/bash
# The GPU run for GGUF models served in block form on CUDA (benchmarks/GPU_QUANT_RUN.md, "Stop 29").
# From the repository root, on the device (`run` tool), in two calls of under 10 minutes each:
#   bash benchmarks/gpu_gguf_run.sh decode    # GPU tests, per-layer GEMV table, batch-1 decode Q4_K_M vs bf16 (~6 min)
#   bash benchmarks/gpu_gguf_run.sh offline   # offline throughput (nano-vllm test, 128 sequences) Q4_K_M vs bf16 (~6 min)
# Results and logs go to $OUT. The tests need the gguf wheel in .whl/ (carry: [".whl"]).
set -o pipefail
stage=${1:-decode}
OUT=${OUT:-/tmp/gguf_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/gguf-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/gguf-*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi -L
MODEL=gguf_random:llama-3-8b
if [ "$stage" = decode ]; then
  timeout 150 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_gguf_cuda.py tests/test_triton_quant.py 2>&1 \
    | tee "$OUT/gguf_gpu_tests.log" | tail -15
  timeout 90 python3 benchmarks/gpu_gguf_model.py kernels --budget-s 70 --out "$OUT/gguf_kernels.json" 2>&1 | tee "$OUT/gguf_kernels.log" | tail -14
  timeout 120 python3 benchmarks/gpu_gguf_model.py decode --tune-gemv --model $MODEL --batch 1 --prompt-len 512 \
    --new-tokens 128 --repeats 3 --cuda-graph-max-batch 1 --out "$OUT/decode_q4km.json" 2>&1 | tee "$OUT/decode_q4km.log" | tail -20
  timeout 60 python3 benchmarks/decode_latency.py --model dummy:llama-3-8b --batch 1 --prompt-len 512 --new-tokens 128 \
    --repeats 3 --cuda-graph-max-batch 1 --out "$OUT/decode_bf16.json" 2>&1 | tee "$OUT/decode_bf16.log" | tail -4
else
  timeout 240 python3 benchmarks/gpu_gguf_model.py offline --tune-gemv --model $MODEL --num-seqs 128 \
    --out "$OUT/offline_q4km.json" 2>&1 | tee "$OUT/offline_q4km.log" | tail -6
  timeout 150 python3 benchmarks/offline_throughput.py --model dummy:llama-3-8b --num-seqs 128 \
    --out "$OUT/offline_bf16.json" 2>&1 | tee "$OUT/offline_bf16.log" | tail -4
fi
