#!/usr/bin/env bash
# `attnx export --preset tiny` in a fresh process, three ways, three runs each: tracing (no trace folder),
# reusing a trace from $ATTNX_TRACE_CACHE, and the ort-fused lowering (emitted, no trace). Prints "way seconds".
set -euo pipefail
attnx=${ATTNX:-.venv/bin/attnx}
folder=$(mktemp -d)
out=$(mktemp -d)
trap 'rm -rf "$folder" "$out"' EXIT
run() { /usr/bin/time -f "$1 %e" "${@:2}" >/dev/null 2>>"$out/times" || true; }
for _ in 1 2 3; do run traced "$attnx" export --preset tiny --out "$out/m.onnx" --no-validate; done
ATTNX_TRACE_CACHE=$folder "$attnx" export --preset tiny --out "$out/m.onnx" --no-validate >/dev/null 2>&1
for _ in 1 2 3; do ATTNX_TRACE_CACHE=$folder run reused "$attnx" export --preset tiny --out "$out/m.onnx" --no-validate; done
for _ in 1 2 3; do run ort-fused "$attnx" export --preset tiny --attention ort-fused --out "$out/m.onnx" --no-validate; done
grep -E '^(traced|reused|ort-fused) ' "$out/times"
