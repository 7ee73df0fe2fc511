#!/usr/bin/env bash
# The GPU check on the GPU image as it is (Python 3.12, jax, flax; no network, no hydra): installs
# the wheels that scripts/gpu_wheels.sh put in .whl/ into a temporary folder, puts the repository
# on PYTHONPATH (jaxcb is not installed) and runs scripts/gpu_check.py. Results go to
# $GPU_CHECK_OUT (default gpu_check_out/): gpu_check.json, rewritten after every row, and the
# dumped HLO and PTX. Arguments go to gpu_check.py:
#   scripts/gpu_check.sh                      # every stage, 300 s budget
#   scripts/gpu_check.sh --stages step,engine --budget 200
#   scripts/gpu_check.sh --dry-run            # anywhere: CPU, interpret mode, tiny shapes
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
OUT=${GPU_CHECK_OUT:-gpu_check_out}
SITE=$(mktemp -d "${TMPDIR:-/tmp}/jaxcb-gpu-check.XXXXXX")
trap 'rm -rf "$SITE"' EXIT
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$SITE" "$WHEELS"/*.whl
else
  echo "note: no wheels in $WHEELS/ (scripts/gpu_wheels.sh makes them); using what $PY has" >&2
fi
mkdir -p "$OUT"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" scripts/gpu_check.py --json "$OUT/gpu_check.json" --out-dir "$OUT" "$@"
