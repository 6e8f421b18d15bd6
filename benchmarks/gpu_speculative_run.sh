#!/bin/bash
# The GPU run for speculative decoding (benchmarks/HISTORY.md, stop 38). From the repository
# root, on the device (`run` tool), one call of about 5 minutes; results and logs go to $OUT.
#   GPU tests of the engine (verify graphs against eager verify steps among them), then
#   benchmarks/speculative.py on dummy models: `oracle` (drafts = plain decoding's own tokens, in
#   float32 so the speculating run keeps to them: the most speculation can give) and `random`
#   (nothing to draft: the cost of speculation being on, asynchronous steps kept).
set -o pipefail
OUT=${OUT:-/tmp/spec_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L
timeout 240 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_gpu_engine.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
[ -z "$ONLY_DRAFT" ] && timeout 120 python3 benchmarks/speculative.py --device cuda --model dummy:llama-3.2-1b --dtype float32 --workloads oracle \
  --batch 1 8 32 --max-tokens 128 --repeat 2 --json "$OUT/spec_oracle_1b.json" 2>&1 | tee "$OUT/spec_oracle_1b.log" | tail -5
[ -z "$ONLY_DRAFT" ] && timeout 120 python3 benchmarks/speculative.py --device cuda --model dummy:llama-3.2-1b --workloads random \
  --batch 1 8 32 --max-tokens 128 --repeat 2 --json "$OUT/spec_random_1b.json" 2>&1 | tee "$OUT/spec_random_1b.log" | tail -5
[ -z "$ONLY_DRAFT" ] && timeout 150 python3 benchmarks/speculative.py --device cuda --model dummy:llama-3-8b --dtype float32 --workloads oracle \
  --batch 1 8 32 --max-tokens 128 --repeat 2 --json "$OUT/spec_oracle_8b.json" 2>&1 | tee "$OUT/spec_oracle_8b.log" | tail -5
# A draft model: the same dummy weights drafting for themselves (its own eager runner), bf16
timeout 150 python3 benchmarks/speculative.py --device cuda --model dummy:llama-3.2-1b --speculative-model dummy:llama-3.2-1b \
  --workloads random --batch 1 8 --max-tokens 128 --repeat 2 --json "$OUT/spec_selfdraft_1b.json" 2>&1 | tee "$OUT/spec_selfdraft_1b.log" | tail -4
