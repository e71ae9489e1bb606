#!/usr/bin/env bash
# The third device call: MLA's decode step again after 5c049d2 (v the latents whole), the per-head step beside it.
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/p && cp .gpu/part-* /tmp/p/
W=onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
cat /tmp/p/part-* > /tmp/$W && (cd /tmp && sha256sum -c "$OLDPWD/.gpu/sha256") || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/$W .gpu/onnx_ir-1.1.0-py3-none-any.whl 2>&1 | tail -3
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/attnx . 2>&1 | tail -3
export PYTHONPATH=/tmp/site:/tmp/attnx
timeout "$1" python3 measurements/mla_decode_gpu/run.py --out /tmp/mla --lengths 1024,4096,8192 --batch 8 2>&1 | grep -E "^latent|^per-head|^a cached"
cp /tmp/mla/mla_decode.json "$OUT/mla_decode_after.json" 2>/dev/null
