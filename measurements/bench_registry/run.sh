#!/usr/bin/env bash
# The registry change's bench commands before and after, alternated in one run on one machine:
#   BEFORE=/path/to/a/checkout/at/0e6b185/.venv/bin/attnx AFTER=.venv/bin/attnx \
#     bash measurements/bench_registry/run.sh OUTDIR
# Each command runs twice per side (A B A B), each time in a process of its own; the comparison takes
# the lower of each side's two numbers.
set -euo pipefail
out=${1:?OUTDIR}
mkdir -p "$out"
decode=(bench --preset llama3-8b --decode --past 2048,8192 --threads 2 --rounds 3)
prefill=(bench --preset large --seq 512,2048 --backends ort-cpu --attention decomposed,ort-fused --threads 2)
for round in 1 2; do
    for side in before after; do
        bin=$BEFORE; [ "$side" = after ] && bin=$AFTER
        "$bin" "${decode[@]}" --json "$out/decode-$side-$round.json" > "$out/decode-$side-$round.txt" 2>&1
        "$bin" "${prefill[@]}" --json "$out/prefill-$side-$round.json" > "$out/prefill-$side-$round.txt" 2>&1
    done
done
