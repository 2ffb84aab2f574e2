"""tools/diag_offload_staging.py on the CPU (--cpu-smoke): every case runs, the batched store is the
one forced at batch 1 (staged for direct, in place for uva) and the ratios to the one-request store
are written."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "tools"))

import diag_offload_staging as D  # noqa: E402


def test_cpu_smoke_runs_every_case(tmp_path):
    out = D.main(["--cpu-smoke", "--lengths", "40", "--batches", "1,2", "--new", "5",
                  "--out", str(tmp_path / "o.json")])
    rows = out["rows"]
    assert [(r["batch"], r["store"], r["offload_decode"]) for r in rows] == [
        (1, "resident", None), (1, "batched", "direct"), (1, "batched", "uva"), (1, "one-request", "direct"),
        (1, "one-request", "uva"), (2, "resident", None), (2, "batched", "direct"), (2, "batched", "uva")]
    for r in rows:
        assert r["ms_per_step"] > 0
        if r["store"] == "batched":
            assert r["describe"]["store"] == "OffloadBatchKV"
            assert r["describe"]["prompt_read"] == ("staged" if r["offload_decode"] == "direct" else "in place")
    assert all("over_one_request" in r for r in rows[1:3]) and (tmp_path / "o.json").exists()
    # the table is restored: max_num_seqs=1 is the one-request path again
    assert rows[3]["describe"]["store"] != "OffloadBatchKV"
