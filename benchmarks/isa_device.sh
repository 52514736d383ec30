#!/bin/bash
# The portable ISA setting on another CPU: its flags, the embedded battery in detent mode under the cap and
# natively, receipts served portably here (brought back to verify on the other CPU class) and there (verified
# here), detent tok/s portable vs native.
# Run from the repository root with the wheels of the project's dependencies the machine lacks in .whl/ (platformdirs,
# cryptography, cffi, pycparser, fastapi, starlette, pydantic, pydantic_core, annotated-types, typing-inspection,
# uvicorn, typer); docs/isa.md reads the results. $OUT
# receives what comes back.
set -u
OUT=${OUT:-/tmp/isa-out}; mkdir -p "$OUT"; rm -rf /tmp/site /tmp/proj /tmp/cache
{ grep -m1 "model name" /proc/cpuinfo; nproc
  grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx|fma|f16c|bmi|amx)' | tr '\n' ' '; echo; } > "$OUT/cpu.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/proj . || exit 1
export PYTHONPATH=/tmp/proj:/tmp/site DETENT_AUDIT_CACHE=/tmp/cache PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.backends.cpu.get_cpu_capability())" >> "$OUT/cpu.txt"
# the random-20m checkpoint written once, under the cap, before the processes below read it
(cd /tmp && env ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 python3 -c \
  "from detent_audit.engine.checkpoint import ensure_default_model as e; print(e())" > /tmp/model.txt)
sha256sum "$(cat /tmp/model.txt)"/*.safetensors >> "$OUT/log.txt"
R=$PWD
cli() { (cd /tmp && python3 -m detent_audit.cli "$@"); }  # the installed package, not the source folders
for isa in portable native; do  # one thread each, side by side (the timing below runs alone)
  (cli --isa "$isa" battery --model random-20m --json > "$OUT/battery-$isa.json" 2> "/tmp/battery-$isa.err"
   echo "battery $isa rc=$?" >> "$OUT/log.txt") &
done
rm -rf /tmp/served; install -m 600 "$R/tests/fixtures/compat/test-only-node.key" /tmp/node.key
cli --isa portable serve --model random-20m --signing-key /tmp/node.key \
  --manifest-out /tmp/served --input "$R/tests/fixtures/portable/requests.jsonl" --output /tmp/responses.jsonl \
  >> "$OUT/log.txt" 2>&1
echo "serve rc=$?" >> "$OUT/log.txt"
# receipts served under the portable setting on the other class of CPU (benchmarks/results/isa/epyc-portable)
cli --isa portable verify "$R/benchmarks/results/isa/epyc-portable" --key "$R/tests/fixtures/compat/test-only-node.key.pub" \
  --json > "$OUT/verify-epyc-here.json" 2> "$OUT/verify-epyc-here.err"
echo "verify epyc receipts rc=$?" >> "$OUT/log.txt"
cli --isa portable verify /tmp/served --key "$R/tests/fixtures/compat/test-only-node.key.pub" > "$OUT/verify-own.txt" 2>&1
echo "verify own receipts rc=$?" >> "$OUT/log.txt"
wait; tail -n 3 /tmp/battery-*.err >> "$OUT/log.txt"
cp /tmp/responses.jsonl /tmp/served/; tar -C /tmp/served -cf "$OUT/served.tar" .
python3 benchmarks/isa_ops.py --isa portable > "$OUT/ops.json" 2>> "$OUT/log.txt"
[ -n "${SKIP_SPEED:-}" ] || python3 benchmarks/isa_speed.py --runs 3 --requests 8 > "$OUT/speed.txt" 2>> "$OUT/log.txt"
echo "speed rc=$?" >> "$OUT/log.txt"
cat "$OUT/cpu.txt" "$OUT/log.txt" "$OUT/speed.txt"
