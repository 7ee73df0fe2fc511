#!/usr/bin/env bash
# Download the wheels that scripts/gpu_check.sh installs on a GPU machine without network: what
# the check imports beyond the GPU image (docs/gpu.md), at the versions the test venv has --
# pure-Python ones, and xxhash's compiled wheel for the image's Python 3.12 on x86-64 Linux (the
# prefix cache's block hashes). Run where pip reaches PyPI, after `make test` has made .venv:
#   scripts/gpu_wheels.sh [DIR]      # default .whl/ (git-ignored), a few MiB
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --platform any -d "$DEST" \
  "hydra-core==$(version hydra-core)" "omegaconf==$(version omegaconf)"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_17_x86_64 -d "$DEST" "xxhash==$(version xxhash)"
# omegaconf's parser runtime is published as a source archive only: build its (pure-Python) wheel here.
"$PY" -m pip wheel --quiet --no-deps -w "$DEST" "antlr4-python3-runtime==$(version antlr4-python3-runtime)"
ls -1 "$DEST"
du -sh "$DEST" | cut -f1
