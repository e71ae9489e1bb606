#!/usr/bin/env bash
# The committed CPU speed-accuracy frontier: measurements/cpu_frontier/cpu_frontier.json and .png
# (issue 12; README.md here).
#
# Preset large (d_model 1024, 16 heads), batch 1, 2 threads, seq 512 and 4096, ONE run: attnx's
# forms on ONNX Runtime CPU (ort-fused in fp32, int8, int4) and the peers measured beside them
# (torch eager in fp32 and bf16, SDPA core; OpenVINO on attnx's fp32 ort-fused graph with its f32
# and bf16 hints), OpenVINO on attnx's int8 and int4 graphs too (f32 hint, its own int8 inputs),
# each as (median ms, rel RMS error against the float64 module on the same inputs). Needs attnx[openvino] for the OpenVINO peer (skipped with the reason otherwise). Run it
# on a quiet machine; a few minutes on 2 cores. Extra arguments go to attnx bench.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root: .venv/bin/attnx below
out=measurements/cpu_frontier
mkdir -p "$out"
attnx=$(command -v attnx || echo .venv/bin/attnx)
"$attnx" bench --preset large --batch 1 --seq 512,4096 --threads 2 \
    --backends torch,ort-cpu,openvino --attention sdpa,ort-fused --dtype fp32,int8,int4,bf16 \
    --repeat 10 --warmup 2 --rounds 3 --timeout 1800 \
    --json "$out/cpu_frontier.json" --plot "$out/cpu_frontier.png" "$@"
