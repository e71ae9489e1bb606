#!/usr/bin/env bash
# The GPU check of issue 52's session: onnxruntime-gpu joined from the chunks moved before, attnx installed, then
# python -m attnx.bench.gpu_check --quick and the cuda-marked tests. $1: seconds for gpu_check, $2: for the tests.
set -u
REPO=$(pwd)
export PYTHONUNBUFFERED=1
mkdir -p /tmp/p && cp .gpu/part-* /tmp/p/
W=onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
cat /tmp/p/part-* > /tmp/$W && (cd /tmp && sha256sum -c "$REPO/.gpu/sha256")
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/$W .gpu/onnx_ir-1.1.0-py3-none-any.whl 2>&1 | tail -3
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/attnx . 2>&1 | tail -3
export PYTHONPATH=/tmp/site:/tmp/attnx
nvidia-smi -L
python3 -c "import onnxruntime as o, torch, onnx, onnx_ir, numpy; print('ort', o.__version__, o.get_available_providers(), 'torch', torch.__version__, torch.cuda.is_available(), 'onnx', onnx.__version__, 'onnx_ir', onnx_ir.__version__, 'numpy', numpy.__version__)"
cd /tmp && timeout "$1" python3 -m attnx.bench.gpu_check --out "$OUT/gpu" --quick > "$OUT/gpu_check.log" 2>&1; echo "gpu_check rc=$?"; tail -40 "$OUT/gpu_check.log"

cd "$REPO" && timeout "$2" python3 -P -m pytest --import-mode=append -q -p no:cacheprovider -p no:xdist -m cuda tests/runtimes/test_ort_cuda.py tests/runtimes/test_torch_cuda.py tests/runtimes/test_gpu_parity.py tests/runtimes/test_decode.py > "$OUT/cuda_tests.log" 2>&1; echo "tests rc=$?"; tail -25 "$OUT/cuda_tests.log"
