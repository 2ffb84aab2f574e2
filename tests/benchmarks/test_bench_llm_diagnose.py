"""bench_llm.py --diagnose on the CPU: the resident and offload stores the engine runs, driven by hand
for one sequence, agree stage by stage (prefill logits, stored K/V, decode logits) on a tiny random
model; the JSON is written."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import bench_llm as B  # noqa: E402


def test_diagnose_stores_agree_stage_by_stage(tmp_path):
    rep = B.diagnose("tiny-llama", lengths=(40, 150), out_dir=str(tmp_path), device="cpu", steps=3)
    assert set(rep["cases"]) == {"40", "150"}
    for case in rep["cases"].values():
        assert "error" not in case, case.get("traceback")
        assert case["stores"] == ["ResidentBatchKV", "OffloadBatchKV"]
        assert case["tokens_gpu"] == case["tokens_offload"] and len(case["tokens_gpu"]) == 6
        assert case["prefill_logits_max_abs_diff"] <= 1e-4 and case["prefill_logits_nan"] == [False, False]
        assert case["first_token"][0] == case["first_token"][1] == case["tokens_gpu"][0]
        assert all(d == [0.0, 0.0] for d in case["stored_kv_max_abs_diff_by_layer"].values())
        assert len(case["decode_logits_max_abs_diff"]) == 3 and max(case["decode_logits_max_abs_diff"]) <= 1e-4
    on_disk = json.loads((tmp_path / "model_diagnose.json").read_text())
    assert on_disk["preset"] == "tiny-llama" and set(on_disk["cases"]) == {"40", "150"}
