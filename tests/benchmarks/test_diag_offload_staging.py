"""tools/diag_offload_staging.py on the CPU (--cpu-smoke): every case runs through the store the
engine picks (resident; OffloadBatchKV staged for direct, in place for uva, at batch 1 too) and the
ratios to resident and to in-place reads are written."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "tools"))

import diag_offload_staging as D  # noqa: E402


def test_cpu_smoke_runs_every_case(tmp_path):
    out = D.main(["--cpu-smoke", "--lengths", "40", "--batches", "1,2", "--new", "5",
                  "--out", str(tmp_path / "o.json")])
    rows = out["rows"]
    assert [(r["batch"], r["store"], r["offload_decode"]) for r in rows] == [
        (1, "resident", None), (1, "offload", "direct"), (1, "offload", "uva"),
        (2, "resident", None), (2, "offload", "direct"), (2, "offload", "uva")]
    for r in rows:
        assert r["ms_per_step"] > 0
        if r["store"] == "offload":
            assert r["describe"]["store"] == "OffloadBatchKV"
            assert r["describe"]["prompt_read"] == ("staged" if r["offload_decode"] == "direct" else "in place")
            assert r["over_resident"] == pytest.approx(r["ms_per_step"] / rows[rows.index(r) // 3 * 3]["ms_per_step"])
        else:
            assert r["describe"]["store"] == "ResidentBatchKV" and "over_resident" not in r
    assert [("over_in_place" in r) for r in rows] == [False, True, False] * 2
    assert json.loads((tmp_path / "o.json").read_text())["rows"] == json.loads(json.dumps(rows, default=str))


def test_ratios():
    rows = [{"store": "resident", "offload_decode": None, "ms_per_step": 2.0},
            {"store": "offload", "offload_decode": "direct", "ms_per_step": 3.0},
            {"store": "offload", "offload_decode": "uva", "ms_per_step": 4.0}]
    D.add_ratios(rows)
    assert (rows[1]["over_resident"], rows[1]["over_in_place"], rows[2]["over_resident"]) == (1.5, 0.75, 2.0)
    assert "over_in_place" not in rows[2] and "over_resident" not in rows[0]
