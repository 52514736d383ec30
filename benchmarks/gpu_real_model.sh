#!/usr/bin/env bash
# The real model (SmolLM2-135M-Instruct) on the GPU. Its GGUF (98,362,432 bytes) is larger than what one device
# run carries, so it travels in two parts over two runs back to back (a warm machine keeps ignored files
# between runs):
#   here:      bash benchmarks/gpu_real_model.sh prepare   # .gguf-parts/part-1, part-2 and the gguf wheel in .whl/
#   device 1:  bash benchmarks/gpu_real_model.sh store     # carry .gguf-parts/part-1: kept in $WORK/gguf-store/
#   device 2:  bash benchmarks/gpu_real_model.sh run       # carry .gguf-parts/part-2 and .whl: join, check the
#                                                           # SHA-256, import to bf16, gpu_engine.py (battery per
#                                                           # mode, decode step against the HBM floor)
# `prepare` adds /.gguf-parts/, /.gguf-store/ and /.whl/ to the repository's info/exclude. Results go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SIZE=98362432
PART1_BYTES=$((47 * 1024 * 1024))
GGUF_VERSION=0.19.0
PY=${PY:-python3}
WORK=${WORK:-/tmp}  # the joined file, the site packages, the imported model and the cache

case "${1:-}" in
prepare)
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    for d in /.gguf-parts/ /.gguf-store/ /.whl/; do
        grep -qxF "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"
    done
    gguf_file=$(${VENV_PY:-.venv/bin/python} -c \
        "from detent_audit.runtime.named_models import wheel_gguf; print(wheel_gguf('smollm2-135m-instruct')[0])")
    echo "$SHA256  $gguf_file" | sha256sum -c -
    mkdir -p .gguf-parts .whl
    head -c "$PART1_BYTES" "$gguf_file" > .gguf-parts/part-1
    tail -c +"$((PART1_BYTES + 1))" "$gguf_file" > .gguf-parts/part-2
    ${VENV_PY:-.venv/bin/python} -m pip download -q --no-deps --only-binary=:all: -d .whl "gguf==$GGUF_VERSION"
    ls -l .gguf-parts .whl
    echo "device run 1: carry [.gguf-parts/part-1], command: bash benchmarks/gpu_real_model.sh store"
    echo "device run 2: carry [.gguf-parts/part-2, .whl], command: bash benchmarks/gpu_real_model.sh run"
    ;;
store)
    test -s .gguf-parts/part-1 || { echo "FAIL: .gguf-parts/part-1 was not carried"; exit 2; }
    mkdir -p "$WORK/gguf-store"  # outside the repository: a warm machine keeps /tmp, not moved ignored files
    mv .gguf-parts/part-1 "$WORK/gguf-store/part-1"
    ls -l "$WORK/gguf-store"
    ;;
run)
    out=${OUT:-out/gpu-real-model}
    mkdir -p "$out"
    test -s "$WORK/gguf-store/part-1" || { echo "FAIL: .gguf-store/part-1 is gone (run 'store' again, then this at once)"; exit 2; }
    test -s .gguf-parts/part-2 || { echo "FAIL: .gguf-parts/part-2 was not carried"; exit 2; }
    gguf_file=$WORK/SmolLM2-135M-Instruct.Q4_1.gguf
    cat "$WORK/gguf-store/part-1" .gguf-parts/part-2 > "$gguf_file"
    test "$(stat -c %s "$gguf_file")" = "$SIZE"
    echo "$SHA256  $gguf_file" | sha256sum -c - | tee "$out/0_sha256.txt"
    # the project and gguf (pure Python; numpy, pyyaml, tqdm and requests are on the device) into $WORK/site
    $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" .whl/*.whl . 2>&1 | tail -3
    export PYTHONPATH="$WORK/site" DETENT_AUDIT_CACHE="$WORK/detent-cache" PYTHONUNBUFFERED=1
    model=$WORK/smollm2-135m-instruct-bf16
    rm -rf "$model"
    # from $WORK: the repository root's detent_audit/ folder would shadow the installed package
    (cd "$WORK" && $PY -m detent_audit.cli import-gguf "$gguf_file" --out "$model" --dtype bfloat16) | tee "$out/1_import.txt"
    nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/1_device.txt"
    # battery per mode (failing cells listed), tokens/s, the decode step at batch 1 against the HBM floor, rescore
    OUT="$out" $PY benchmarks/gpu_engine.py --model "$model" | tee "$out/2_gpu_engine.txt"
    ;;
*)
    echo "usage: $0 prepare | store | run"
    exit 2
    ;;
esac
