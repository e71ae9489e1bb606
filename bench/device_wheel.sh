#!/usr/bin/env bash
# onnxruntime-gpu for the lent GPU machine, whose image has only CPU onnxruntime and no
# network. Its wheel (~255 MB) is over the 64 MiB one device call carries, so it travels in
# chunks over several calls to a warm machine, is put together there and installed into
# /tmp/site (shadowing the CPU build through PYTHONPATH).
#
#   here:       bash bench/device_wheel.sh split        # .whl/ortgpu.part-aa, -ab, ... (56 MiB each: the tree that travels with a call must stay under 64 MiB)
#   device, once per chunk (carry: [".whl/ortgpu.part-XX"], a warm machine keeps /tmp):
#               bash bench/device_wheel.sh stash
#   device, last call (carry nothing more), then the GPU check in the same command:
#               bash bench/device_wheel.sh install && export PYTHONPATH=/tmp/site && \
#               PYTHONUNBUFFERED=1 python3 bench/gpu_check.py
#
# The wheel's sha256 is written beside the chunks (.whl/ortgpu.sha256, carried with the
# first chunk) and checked before installing: a missing or broken chunk is an error.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${ORT_GPU_VERSION:-1.31.1}
PARTS=/tmp/ortgpu-parts

case "${1:-}" in
split)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    mkdir -p .whl
    tmp=$(mktemp -d)
    # The device's python3 is 3.12 (KINDS.md); the CUDA 13 / cuDNN 9 libraries it needs are
    # in the image already (nvidia-cublas, nvidia-cudnn-cu13, ...).
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        -d "$tmp" "onnxruntime-gpu==$VERSION"
    wheel=$(ls "$tmp"/*.whl)
    rm -f .whl/ortgpu.part-*
    split -b 56M "$wheel" .whl/ortgpu.part-
    (cd "$tmp" && sha256sum "$(basename "$wheel")") >.whl/ortgpu.sha256
    rm -rf "$tmp"
    ls -l .whl/
    ;;
stash)
    mkdir -p "$PARTS"
    cp .whl/ortgpu.part-* "$PARTS"/
    [ -f .whl/ortgpu.sha256 ] && cp .whl/ortgpu.sha256 "$PARTS"/
    ls -l "$PARTS"
    ;;
install)
    [ -f "$PARTS/ortgpu.sha256" ] || { echo "no $PARTS/ortgpu.sha256: stash the chunks first" >&2; exit 2; }
    name=$(awk '{print $2}' "$PARTS/ortgpu.sha256")
    cat "$PARTS"/ortgpu.part-* >"$PARTS/$name"
    (cd "$PARTS" && sha256sum -c ortgpu.sha256) || { echo "the wheel does not match its sha256: a chunk is missing" >&2; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$PARTS/$name"
    PYTHONPATH=/tmp/site python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
    ;;
*)
    echo "usage: bash bench/device_wheel.sh split|stash|install" >&2
    exit 2
    ;;
esac
