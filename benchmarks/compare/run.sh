#!/usr/bin/env bash
# jaxcb against vLLM-CPU and transformers on the same checkpoints and workloads, one engine at a time
# (on a small machine any concurrent job moves the numbers), then one table (summarize.py).
#
#   PEERS=/path/to/peers-venv bash benchmarks/compare/run.sh          # every engine, tiny and small
#   PRESETS=tiny ENGINES=jaxcb bash benchmarks/compare/run.sh         # jaxcb alone, on tiny
#
# Settings (defaults in brackets):
#   PEERS        the venv with vLLM-CPU and/or transformers (docs/benchmarks.md says how to make it)
#   PY [.venv/bin/python]  jaxcb's venv, for the checkpoints, the workloads, jaxcb and the table
#   WORK [compare-work]  checkpoints, workloads and results
#   PRESETS [tiny small]  ENGINES [jaxcb vllm hf]  DTYPE [float32]
#   TINY_N [200] TINY_SCALE [0.5]  SMALL_N [128] SMALL_SCALE [0.25]  MAX_LEN [1024]
#   IN_MEAN [160] OUT_MEAN [340] (lognormal means before the scale: ShareGPT-like)
#   MAX_SEQS [64] BUDGET [2048] (every engine's max_num_seqs and max_num_batched_tokens)  HF_BATCH [16]
#   JAXCB_ARGS  more Hydra overrides for scripts/bench.py, e.g. "engine.async_scheduling=false"
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$REPO/benchmarks/compare"
PY="${PY:-$REPO/.venv/bin/python}"
PEERS="${PEERS:-}"
WORK="$(mkdir -p "${WORK:-compare-work}" && cd "${WORK:-compare-work}" && pwd)"
PRESETS="${PRESETS:-tiny small}"; ENGINES="${ENGINES:-jaxcb vllm hf}"; DTYPE="${DTYPE:-float32}"
TINY_N="${TINY_N:-200}"; TINY_SCALE="${TINY_SCALE:-0.5}"; SMALL_N="${SMALL_N:-128}"; SMALL_SCALE="${SMALL_SCALE:-0.25}"
IN_MEAN="${IN_MEAN:-160}"; OUT_MEAN="${OUT_MEAN:-340}"
MAX_LEN="${MAX_LEN:-1024}"; MAX_SEQS="${MAX_SEQS:-64}"; BUDGET="${BUDGET:-2048}"; HF_BATCH="${HF_BATCH:-16}"
JAXCB_ARGS="${JAXCB_ARGS:-}"
mkdir -p "$WORK/ckpt" "$WORK/runs"

for engine in $ENGINES; do
  if [ "$engine" != jaxcb ] && [ ! -x "$PEERS/bin/python" ]; then
    echo "error: ENGINES has $engine but PEERS=$PEERS is not a venv; set PEERS or ENGINES=jaxcb" >&2
    exit 1
  fi
done

results=()
for preset in $PRESETS; do
  if [ "$preset" = tiny ]; then n=$TINY_N; scale=$TINY_SCALE; else n=$SMALL_N; scale=$SMALL_SCALE; fi
  ckpt="$WORK/ckpt/$preset-$DTYPE"
  [ -f "$ckpt/model.safetensors" ] || "$PY" "$HERE/make_checkpoint.py" --preset "$preset" --dtype "$DTYPE" --out "$ckpt"
  wl="$WORK/wl_$preset.jsonl"
  [ -f "$wl" ] || "$PY" "$HERE/make_workload.py" --model "$ckpt" --num-requests "$n" --scale "$scale" \
                      --input-mean "$IN_MEAN" --output-mean "$OUT_MEAN" --max-model-len "$MAX_LEN" --out "$wl"
  for engine in $ENGINES; do
    out="$WORK/runs/$preset-$DTYPE-$engine"
    echo "=== $preset $engine $(date +%T)"
    case $engine in
      jaxcb)
        # shellcheck disable=SC2086
        "$PY" "$REPO/scripts/bench.py" model=hf "model.checkpoint=$ckpt" "model.dtype=$DTYPE" bench.workload=file \
          "bench.file=$wl" "engine.max_model_len=$MAX_LEN" "scheduler.max_num_seqs=$MAX_SEQS" \
          "scheduler.max_num_batched_tokens=$BUDGET" "hydra.run.dir=$out" $JAXCB_ARGS 2>&1 | grep -v "compiling step"
        ;;
      vllm)
        "$PEERS/bin/python" "$HERE/bench_vllm.py" --model "$ckpt" --workload "$wl" --dtype "$DTYPE" \
          --max-num-seqs "$MAX_SEQS" --max-num-batched-tokens "$BUDGET" --max-model-len "$MAX_LEN" > "$out.log" 2>&1 \
          || { echo "vLLM failed; the end of $out.log:"; tail -20 "$out.log"; continue; }
        out="$out.log"
        ;;
      hf)
        "$PEERS/bin/python" "$HERE/bench_hf.py" --model "$ckpt" --workload "$wl" --dtype "$DTYPE" \
          --batch-size "$HF_BATCH" > "$out.log" 2>&1 \
          || { echo "transformers failed; the end of $out.log:"; tail -20 "$out.log"; continue; }
        out="$out.log"
        ;;
      *) echo "error: unknown engine $engine (jaxcb, vllm or hf)" >&2; exit 1 ;;
    esac
    results+=("$out")
  done
done
"$PY" "$HERE/summarize.py" "${results[@]}"
