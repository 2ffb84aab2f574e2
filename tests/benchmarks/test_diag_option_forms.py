"""tools/diag_option_forms.py without a GPU: its SASS loop counter on the prefill kernel's
option forms (compiled for sm_90 by Triton's ptxas in a subprocess, as test_compile_sm90 does), and
the structure the edge loop is meant to give: a window's query block runs two loops with both masked
edges in one, three without, and the unmasked interior loop is the same size either way."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools", "diag_option_forms.py")


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    out = tmp_path_factory.mktemp("sass") / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    p = subprocess.run([sys.executable, SCRIPT, "--sass", "--out", str(out)], env=env, capture_output=True,
                       text=True, timeout=900)
    if p.returncode != 0 and "ptxas" in p.stderr.lower() and "not found" in p.stderr.lower():
        pytest.skip("no ptxas in this Triton install")
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())["loops"]


def test_edges_in_one_loop_leave_two_loops_per_window_block(loops):
    for tiles in ("64x64w4", "128x64w8"):
        two, one = loops[f"window two loops d64 {tiles}"], loops[f"window one loop d64 {tiles}"]
        assert len(two) == 3 and len(one) == 2
        interior_two = min(two, key=lambda x: x["instructions"])
        interior_one = min(one, key=lambda x: x["instructions"])
        assert abs(interior_one["instructions"] - interior_two["instructions"]) <= 8  # the jump costs ~nothing
        assert all(x["spill_ops"] == 0 for x in one + two)


def test_softcap_has_two_mufu_per_score_where_plain_has_one(loops):
    plain = min(loops["plain d64 128x64w8"], key=lambda x: x["instructions"])
    soft = min(loops["softcap d64 128x64w8"], key=lambda x: x["instructions"])
    assert soft["MUFU"] >= 2 * plain["MUFU"] - 4 and soft["HGMMA"] == plain["HGMMA"]
