#!/usr/bin/env bash
# The wheels a GPU window carries in .whl/ (`carry: [".whl"]`, at most 64 MiB with the rest): the Python
# packages the device image lacked in earlier windows, at the versions constraints.txt pins, for the image's
# Python (3.12) on x86-64 Linux, and nvCOMP for its CUDA major (13: torch 2.11+cu130). bench/gpu_check.sh
# installs each one with --no-deps only where the image lacks it, so none of the image's own is replaced.
#
#   bash bench/gpu_wheels.sh            # PYTHON_VERSION=3.12 CUDA_MAJOR=13 by default
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYV=${PYTHON_VERSION:-3.12}
CU=${CUDA_MAJOR:-13}
PKGS="fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn blake3 openai httpx2
httpcore2 truststore opentelemetry-api jiter distro datasets dill multiprocess pytest-xdist execnet
prometheus_client xxhash"
pin() {  # the constraints.txt pin of a package, or the name alone
  local got
  got=$(grep -i -E "^$(echo "$1" | sed 's/[-_]/[-_]/g')==" constraints.txt | head -1)
  echo "${got:-$1}"
}
specs=""
for p in $PKGS; do specs="$specs $(pin "$p")"; done
specs="$specs nvidia-nvcomp-cu$CU nvidia-libnvcomp-cu$CU"
mkdir -p .whl
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl $specs
du -sh .whl
ls .whl
