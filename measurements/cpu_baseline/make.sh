#!/usr/bin/env bash
# The committed CPU baseline: measurements/cpu_baseline/cpu_baseline.json and .png (README.md here).
#
# Preset large (d_model 1024, 16 heads), batch 1, seq 128 to 8192: torch eager (decomposed
# and sdpa cores) against ONNX Runtime CPU (decomposed, onnx and ort-fused lowerings), all in
# ONE run, so that the compiler's targets are ratios measured side by side:
#   ort-fused vs torch eager (the better core) at seq 512, and
#   ort-fused vs decomposed at seq 8192, in time and in peak memory.
# Run it on a quiet machine (nothing else on the cores: timings here vary up to 2x with
# load) with about 10 GB of memory free (the decomposed lowerings hold the 4 GB score matrix
# twice at seq 8192). Expect 10 to 20 minutes on 2 cores. Extra arguments go to attnx bench.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root: .venv/bin/attnx below
out=measurements/cpu_baseline
mkdir -p "$out"
attnx=$(command -v attnx || echo .venv/bin/attnx)  # the active one, else the one .ci/install made
"$attnx" bench --preset large --batch 1 --seq 128,256,512,1024,2048,4096,8192 \
    --backends torch,ort-cpu --attention decomposed,sdpa,onnx,ort-fused \
    --repeat 10 --warmup 2 --timeout 1800 \
    --json "$out/cpu_baseline.json" --plot "$out/cpu_baseline.png" "$@"

# The numbers its README (and the docs' benchmark page) quote, from the file just written.
python3 - "$out/cpu_baseline.json" <<'EOF'
import json, sys

data = json.load(open(sys.argv[1]))
want = {(512, "torch eager"): "time", (8192, "ort-cpu/decomposed"): "time and memory"}
found = {(r["seq"], r["baseline"]): r for r in data["ratios"] if r["target"] == "ort-cpu/ort-fused"}
print(f"\nfp32 GEMM peak: {data['peak_gflops']:.0f} GFLOP/s; threads {data['settings']['threads']}")
missing = False
for key, what in want.items():
    r = found.get(key)
    if r is None:
        print(f"MISSING: ort-cpu/ort-fused vs {key[1]} at seq {key[0]} (a case was skipped or failed: see the table)")
        missing = True
        continue
    line = f"seq {r['seq']}: ort-fused is {r['speedup']:.2f}x the speed of {r['baseline']} ({r['baseline_case']})"
    if r.get("first_call_speedup"):
        line += f" ({r['first_call_speedup']:.2f}x on the first call)"
    if "memory" in what and r["memory_ratio"]:
        line += f", with {r['memory_ratio']:.1f}x less peak memory"
    print(line)
sys.exit(1 if missing else 0)
EOF
