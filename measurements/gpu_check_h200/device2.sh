#!/usr/bin/env bash
# The second device session: the CUDA refusals of b355511 checked where they were found, then MLA's decode step.
set -u
REPO=$(pwd)
export PYTHONUNBUFFERED=1
mkdir -p /tmp/p && cp .gpu/part-* /tmp/p/
W=onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
cat /tmp/p/part-* > /tmp/$W && (cd /tmp && sha256sum -c "$REPO/.gpu/sha256") || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/$W .gpu/onnx_ir-1.1.0-py3-none-any.whl 2>&1 | tail -3
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/attnx . 2>&1 | tail -3
export PYTHONPATH=/tmp/site:/tmp/attnx
mkdir -p /tmp/r && cp -r tests pyproject.toml /tmp/r/
(cd /tmp/r && timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:xdist -m cuda tests/runtimes/test_decode.py tests/runtimes/test_cuda_limits.py > "$OUT/cuda_tests2.log" 2>&1; echo "tests rc=$?"; tail -6 "$OUT/cuda_tests2.log")
(cd /tmp/r && timeout 60 python3 -m pytest -q -p no:cacheprovider -p no:xdist tests/runtimes/test_cuda_limits.py 2>&1 | tail -2)
timeout "$1" python3 measurements/mla_decode_gpu/run.py --out /tmp/mla --lengths 1024,4096,16384 --batch 8 2>&1 | grep -v Warning | tail -8
cp /tmp/mla/mla_decode.json "$OUT/" 2>/dev/null
cd /tmp && timeout "$2" python3 -m attnx.bench.gpu_check --out "$OUT/gpu3" --quick --steps decode > "$OUT/gpu_check3.log" 2>&1; echo "gpu_check rc=$?"; grep -E "decode|buffer|growing|skipped|refused" "$OUT/gpu_check3.log" | tail -12
