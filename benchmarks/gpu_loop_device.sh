#!/usr/bin/env bash
# The GPU serving loop's checks and figures in one device run (results under $OUT): the GPU tests, the decode
# loop per batch size beside the compiled peer (detent with steps queued ahead, detent without, stock), the
# invariance battery and rescore on a 256-seat engine, and the README's serve-then-verify flow on the GPU.
# Run on the device from the repository root with the package and its wheels installed first:
#   python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/*.whl .
#   PYTHONPATH=/tmp/site bash benchmarks/gpu_loop_device.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
PY="python3 -P"
GPU_TESTS=$(grep -rl 'mark.gpu' tests | sort)
nvidia-smi -L | tee "$OUT/device.txt"
timeout 240 $PY -m pytest -p no:cacheprovider -m gpu -rfE $GPU_TESTS > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests: exit $? ($(tail -1 "$OUT/gpu_tests.txt"))" | tee -a "$OUT/summary.txt"
tail -3 "$OUT/gpu_tests.txt"
timeout 300 $PY benchmarks/gpu_decode_loop.py --steps 40 --warmup 4 > "$OUT/gpu_decode_loop.txt" 2>&1
echo "decode loop: exit $?" | tee -a "$OUT/summary.txt"
tail -25 "$OUT/gpu_decode_loop.txt"
timeout 240 $PY benchmarks/gpu_engine.py --shape llama-3.2-1b --modes detent --max-num-seqs 256 \
    --attention-streaming > "$OUT/gpu_engine_256_seats.txt" 2>&1
echo "256-seat engine: exit $?" | tee -a "$OUT/summary.txt"
tail -4 "$OUT/gpu_engine_256_seats.txt"
CLI="$PY -m detent_audit.cli"
G=$(mktemp -d)
{ $CLI keygen --out "$G/node.key" &&
  $CLI serve --device cuda --dtype bfloat16 --model random:llama-3.2-1b --signing-key "$G/node.key" \
      --manifest-out "$G/run" --input examples/prompts.jsonl --output "$G/outputs.jsonl" &&
  $CLI verify "$G/run" --key "$G/node.key.pub" &&
  $CLI verify "$G/run" --key "$G/node.key.pub" --mode replay; } > "$OUT/gpu_serve_verify.txt" 2>&1
echo "serve then verify on the GPU: exit $?" | tee -a "$OUT/summary.txt"
grep -E "ok, .* failed" "$OUT/gpu_serve_verify.txt"
