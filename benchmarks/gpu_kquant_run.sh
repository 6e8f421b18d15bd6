#!/bin/bash
# One GPU call (about 5 minutes) for the stop 30 kernel changes (branch gpu-kquant): the new
# block and fp8 kernels tested on CUDA, timed beside the old ones per layer shape, then the
# model-level runs they decide. From the repository root on the device, after the wheels are
# installed (PYTHONPATH=$PWD:/tmp/site:$PWD/.whl/stub, benchmarks/GPU_QUANT_RUN.md):
#   bash benchmarks/gpu_kquant_run.sh
# Everything goes to $OUT. Stages start only while less than BUDGET_S (default 290) seconds
# have passed; each has its own timeout. Old paths stay selectable by environment:
# TALLOW_GEMV1_FASTCVT=0 (GGUF one-row GEMV with I2F conversions), TALLOW_FP8_FASTCVT=0;
# opt-in new paths: TALLOW_QUANT_GEMV2=1, TALLOW_QUANT_KQ_GEMM=1, TALLOW_FP8_SWAP=1.
set -o pipefail
OUT=${OUT:-/tmp/kquant_out}
BUDGET_S=${BUDGET_S:-290}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
left() { [ $SECONDS -lt "$BUDGET_S" ] || { echo "budget spent at ${SECONDS}s: skipping $1"; return 1; }; }
nvidia-smi -L
MODEL=gguf_random:llama-3-8b

# 1. old and new kernels side by side per layer shape (Q4_K_M's formats; 1, 4 and 128 rows)
left compare && timeout 100 python3 benchmarks/gpu_gguf_model.py compare --formats Q4_K,Q6_K --rows 1,4,128 \
  --budget-s 80 --out "$OUT/kquant_compare.json" 2>&1 | tee "$OUT/kquant_compare.log" | tail -30

# 2. fp8: the GEMV old/new at one row, fp8_gemm vs fp8_gemm_swap at 32 and 128
left fp8_linear && timeout 70 python3 benchmarks/gpu_fp8_linear.py --m 1 32 128 --out "$OUT/fp8_linear.json" 2>&1 \
  | tee "$OUT/fp8_linear.log" | tail -16

# Which opt-in paths won their kernel comparisons (the model runs below take them only then)
read -r KQ SWAP ONE < <(python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
kq = swap = 0
one = "gemv1"
try:
    rows = json.load(open(f"{out}/kquant_compare.json"))["results"]
    # one row: the family whose default setting costs least over a decode step's layers
    # (each layer shape 32 times, the LM head once)
    ones = [r for r in rows if r["M"] == 1]
    cost = {f: sum(r[f] * (1 if r["shape"] == "lm_head" else 32) for r in ones)
            for f in ("gemv1", "gemv2", "kq_gemm") if ones and all(f in r for r in ones)}
    if cost:
        one = min(cost, key=cost.get)
        print("one row, us per step-equivalent: " + ", ".join(f"{f} {c:.0f}" for f, c in cost.items()), file=sys.stderr)
    big = [r for r in rows if r["M"] >= 128 and "dequant_cublas" in r]
    kq_t = sum(min(v for k, v in r.items() if k.startswith("kq_gemm")) for r in big if any(k.startswith("kq_gemm") for k in r))
    old_t = sum(r["dequant_cublas"] for r in big if any(k.startswith("kq_gemm") for k in r))
    kq = int(bool(big) and kq_t < old_t)
    print(f"kq_gemm {kq_t:.1f} us vs dequant+cuBLAS {old_t:.1f} us over {len(big)} shapes at 128 rows", file=sys.stderr)
except Exception as e:  # noqa: BLE001
    print(f"no compare result: {e}", file=sys.stderr)
try:
    rows = json.load(open(f"{out}/fp8_linear.json"))["results"]
    r32 = [r for r in rows if r["M"] == 32 and "fp8_swap_us" in r and "fp8_weight_only_us" in r]
    swap = int(bool(r32) and sum(r["fp8_swap_us"] for r in r32) < sum(r["fp8_weight_only_us"] for r in r32))
    print(f"fp8_gemm_swap at 32 rows: {sum(r['fp8_swap_us'] for r in r32):.1f} us vs fp8_gemm "
          f"{sum(r['fp8_weight_only_us'] for r in r32):.1f} us", file=sys.stderr)
except Exception as e:  # noqa: BLE001
    print(f"no fp8 result: {e}", file=sys.stderr)
print(kq, swap, one)
EOF
)
# the one-row path for the decode run: gemv1 (default), quant_gemv2 or kq_gemm on every row count
DECODE_ENV=""
[ "$ONE" = gemv2 ] && DECODE_ENV="TALLOW_QUANT_GEMV2=1"
[ "$ONE" = kq_gemm ] && DECODE_ENV="TALLOW_QUANT_KQ_GEMM=all"
echo "model runs: offline TALLOW_QUANT_KQ_GEMM=${KQ:-0}, fp8 TALLOW_FP8_SWAP=${SWAP:-0}, decode one row: ${ONE:-gemv1} ${DECODE_ENV}" \
  | tee "$OUT/kquant_choices.txt"

# 3. batch-1 decode of the Q4_K_M 8B with the one-row family that won above (gemv1: the new
# default, codes widened without I2F, the stop 30 tuned tiles)
left decode_q4km && env $DECODE_ENV timeout 110 python3 benchmarks/gpu_gguf_model.py decode --model $MODEL --batch 1 --prompt-len 512 \
  --new-tokens 128 --repeats 3 --cuda-graph-max-batch 1 --out "$OUT/decode_q4km.json" 2>&1 \
  | tee "$OUT/decode_q4km.log" | tail -4

# 4. bf16 and fp8 8B decode at 1 and 32 sequences, side by side (fastcvt GEMV; fp8_gemm_swap at 32 when it won above)
left decode_fp8 && TALLOW_FP8_SWAP=${SWAP:-0} timeout 150 python3 benchmarks/decode_latency.py --model dummy:llama-3-8b \
  --batch 1 32 --prompt-len 512 --new-tokens 128 --repeats 3 --variants auto/auto fp8/auto --out "$OUT/decode_fp8.json" 2>&1 \
  | tee "$OUT/decode_fp8.log" | tail -4

# 5. the gpu tests of what changed (odd shapes, 16-bit activations, K splits; the compare and
# fp8 tables above already checked every output they timed against a float32 reference)
left tests && timeout 80 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_triton_quant.py \
  tests/test_triton_fp8.py -k "(gemv1 and (Q4_K or Q6_K)) or gemv2 or kq_gemm or fp8_gemv or swap" 2>&1 \
  | tee "$OUT/kquant_gpu_tests.log" | tail -6

# 6. offline throughput of the Q4_K_M 8B (128 sequences) with kq_gemm, only when it won above
if [ "${KQ:-0}" = 1 ] && left offline_q4km; then
  TALLOW_QUANT_KQ_GEMM=1 timeout 120 python3 benchmarks/gpu_gguf_model.py offline --model $MODEL --num-seqs 128 \
    --out "$OUT/offline_q4km_kq.json" 2>&1 | tee "$OUT/offline_q4km_kq.log" | tail -4
fi
echo "done in ${SECONDS}s"
