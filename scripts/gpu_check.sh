#!/usr/bin/env bash
# The GPU check on the GPU image as it is (Python 3.12, jax, flax; no network, no hydra): installs
# the wheels that scripts/gpu_wheels.sh put in .whl/ into a temporary folder, puts the repository
# on PYTHONPATH (jaxcb is not installed) and runs the check.
#   scripts/gpu_check.sh --quick --out DIR    # the headline figures in at most 180 s (scripts/gpu_quick.py):
#                                             # DIR/gpu_quick.json and DIR/gpu_quick.log, nothing else there
#   scripts/gpu_check.sh --quick --dry-run --out DIR   # its plan, then its stages on the CPU at tiny shapes
#   scripts/gpu_check.sh                      # the full check (scripts/gpu_check.py), every stage, 300 s budget
#   scripts/gpu_check.sh --stages step,engine --budget 200
#   scripts/gpu_check.sh --dry-run            # anywhere: CPU, interpret mode, tiny shapes
# The full check's results go to --out DIR or $GPU_CHECK_OUT (default gpu_check_out/): gpu_check.json,
# rewritten after every row, and the dumped HLO and PTX. Other arguments go to the Python script.
set -euo pipefail
export GPU_CHECK_STARTED=${GPU_CHECK_STARTED:-$(date +%s.%N)}  # the quick check's 180 s count from here
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
OUT=${GPU_CHECK_OUT:-gpu_check_out}
QUICK=0
ARGS=()
while (($#)); do
  case $1 in
    --quick) QUICK=1 ;;
    --out) OUT=${2:?--out needs a folder}; shift ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
SITE=$(mktemp -d "${TMPDIR:-/tmp}/jaxcb-gpu-check.XXXXXX")
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/jaxcb-gpu-quick.XXXXXX")  # the quick check's XLA dumps and compilation cache
trap 'rm -rf "$SITE" "$SCRATCH"' EXIT
install_wheels() {
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$SITE" "$WHEELS"/*.whl
  else
    echo "note: no wheels in $WHEELS/ (scripts/gpu_wheels.sh makes them); using what $PY has" >&2
  fi
}
mkdir -p "$OUT"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if ((QUICK)); then
  rm -f "$OUT/gpu_quick.json" "$OUT/gpu_quick.log"
  { install_wheels && "$PY" scripts/gpu_quick.py --out "$OUT" --scratch "$SCRATCH" ${ARGS[@]+"${ARGS[@]}"}; } 2>&1 \
    | tee "$OUT/gpu_quick.log"
else
  install_wheels
  "$PY" scripts/gpu_check.py --json "$OUT/gpu_check.json" --out-dir "$OUT" ${ARGS[@]+"${ARGS[@]}"}
fi
