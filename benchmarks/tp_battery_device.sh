#!/usr/bin/env bash
# The embedded engine's invariance battery at TP=1, 2 and 4 (random-20m: 8 heads, 4 KV heads), detent and
# stock, gloo over CPU processes with 1 thread per rank, on whatever CPU runs it (results under $OUT, one JSON
# per battery, a line each in summary.txt). Run from the repository root with the package installed (on the
# device: PYTHONPATH=/tmp/site bash benchmarks/tp_battery_device.sh, see gpu_loop_device.sh for the install).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
CLI=${CLI:-"python3 -P -m detent_audit.cli"}
lscpu | grep -E "Model name|^CPU\(s\)" | tee "$OUT/cpu.txt"
for tp in ${TP_SIZES:-1 2 4}; do
    for mode in detent stock; do
        f="$OUT/battery-random-20m-tp$tp-$mode.json"
        timeout 900 $CLI battery --model random-20m --mode "$mode" --tensor-parallel-size "$tp" --json > "$f" \
            2> "$f.stderr"
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(f'TP={d[\"tensor_parallel_size\"]} \
{d[\"mode\"]}: {d[\"passed\"]}/{d[\"total\"]}', [c['name'] for c in d['cells'] if not c['passed']])" "$f" \
            | tee -a "$OUT/summary.txt"
    done
done
