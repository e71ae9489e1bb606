#!/usr/bin/env bash
# .ci/install's wall time from a fresh clone of this repository (its own .venv), as CI runs it.
# Usage: bash measurements/install_time/run.sh [COMMIT]   (default HEAD)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
where=$(mktemp -d)
trap 'rm -rf "$where"' EXIT
git clone -q "$repo" "$where/clone"
cd "$where/clone"
git checkout -q "${1:-HEAD}"
start=$(date +%s.%N)
bash .ci/install >/dev/null 2>&1
echo "install $(echo "$(date +%s.%N) - $start" | bc) s at $(git rev-parse --short HEAD) on $(lscpu | sed -n 's/^Model name: *//p')"
