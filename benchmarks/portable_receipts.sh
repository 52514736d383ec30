#!/usr/bin/env bash
# Receipts served under the portable ISA setting by each engine (the embedded one, vLLM, SGLang) on this CPU,
# for a machine of the other x86 class to verify (tests/test_portable_fixtures.py does, on whatever CPU runs
# the tests): `--isa portable serve --engine E --model random-20m --input tests/fixtures/portable/requests.jsonl`
# signed with the compat fixtures' test-only key. Usage: bash benchmarks/portable_receipts.sh [FOLDER]
# (default tests/fixtures/portable/<vendor>-<ISA class>; its cpu.txt names the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
CLI=${CLI:-.venv/bin/detent-audit}
PY=${PY:-.venv/bin/python}
CLASS=$($PY -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())")
case $(grep -m1 vendor_id /proc/cpuinfo | awk '{print $3}') in
  GenuineIntel) VENDOR=intel ;; AuthenticAMD) VENDOR=amd ;; *) VENDOR=x86 ;;
esac
OUT=${1:-tests/fixtures/portable/$VENDOR-$CLASS}
WORK=$(mktemp -d)
install -m 600 tests/fixtures/compat/test-only-node.key "$WORK/node.key"
mkdir -p "$OUT"
{ grep -m1 "model name" /proc/cpuinfo; $PY -c "import torch; print('torch', torch.__version__, \
  torch.backends.cpu.get_cpu_capability())"; } > "$OUT/cpu.txt"
for engine in embedded vllm sglang; do
  rm -rf "${OUT:?}/$engine" && mkdir -p "$OUT/$engine"
  $CLI --isa portable serve --engine "$engine" --model random-20m --signing-key "$WORK/node.key" \
    --manifest-out "$WORK/$engine" --input tests/fixtures/portable/requests.jsonl \
    --output "$OUT/$engine/responses.jsonl"
  cp "$WORK/$engine"/receipts/*.receipt "$OUT/$engine/"
  # the verifier here, under the same setting: every receipt OK
  $CLI --isa portable verify "$OUT/$engine"/*.receipt --key tests/fixtures/compat/test-only-node.key.pub \
    --model random-20m
done
rm -rf "$WORK"
