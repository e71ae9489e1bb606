#!/usr/bin/env bash
# Stop 59's device call (after four that moved the wheel's first chunks into /tmp/p): onnxruntime-gpu joined and
# installed, then MLA's decode step with the buffer form and a profile (run.py --buffer --profile) and issue 52's new
# paths on CUDA (cuda_checks.py: the decomposed buffer form's parity, attnx optimize --provider cuda of DeepSeek-V3).
set -u
export PYTHONUNBUFFERED=1
S=.gpu4/stage
mkdir -p /tmp/p && cp .gpu4/part-* /tmp/p/
W=onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
cat /tmp/p/part-* > /tmp/$W && (cd /tmp && sha256sum -c "$OLDPWD/$S/sha256") || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/$W $S/onnx_ir-1.1.0-py3-none-any.whl 2>&1 | tail -3
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/attnx . 2>&1 | tail -3
export PYTHONPATH=/tmp/site:/tmp/attnx
nvidia-smi -L; date -u
cd /tmp && timeout 150 python3 "$OLDPWD/measurements/mla_decode_gpu/cuda_checks.py" "$OUT/cuda_checks.json" \
    "$OLDPWD/$S/mla/sdpa/model.onnx" "$OLDPWD/$S/mla/checkpoint" cuda 2>&1 | grep -v "Removing initializer" | tail -30
cd "$OLDPWD"
timeout 200 python3 measurements/mla_decode_gpu/run.py --out /tmp/mla --lengths 1024,4096,8192 --batch 8 --buffer \
    --profile 2>&1 | grep -E "^latent|^per-head|^a cached|Error|error" | cut -c1-400
cp /tmp/mla/mla_decode.json "$OUT/mla_decode_buffer.json" 2>/dev/null
date -u
