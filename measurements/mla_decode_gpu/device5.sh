#!/usr/bin/env bash
# Stop 60's device call (after four that moved the wheel's first chunks into /tmp/p): onnxruntime-gpu joined and
# installed, then cuda_checks.py on CUDA: the decomposed buffer form of per-head and latent configs (the latent's step
# now an If of the expanded prompt and the absorbed step), attnx optimize --provider cuda of the tiny DeepSeek-V3
# export, and again with --weights int4 (its blocks written at the graph's MatMulNBits).
set -u
export PYTHONUNBUFFERED=1
S=.gpu5/stage
mkdir -p /tmp/p && cp .gpu5/part-* /tmp/p/
W=onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
cat /tmp/p/part-* > /tmp/$W && (cd /tmp && sha256sum -c "$OLDPWD/$S/sha256") || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/$W $S/onnx_ir-1.1.0-py3-none-any.whl 2>&1 | tail -3
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/attnx . 2>&1 | tail -3
export PYTHONPATH=/tmp/site:/tmp/attnx
nvidia-smi -L; date -u
cd /tmp && timeout 200 python3 "$OLDPWD/measurements/mla_decode_gpu/cuda_checks.py" "$OUT/cuda_checks_stop60.json" \
    "$OLDPWD/$S/mla/sdpa/model.onnx" "$OLDPWD/$S/mla/checkpoint" cuda 2>&1 | grep -v "Removing initializer" | tail -40
date -u
