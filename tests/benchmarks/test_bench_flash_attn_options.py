"""A CPU dry run of ``bench_flash_attn.py --suite options --sweep``'s softcap / ALiBi cases: the kernel
under the interpreter on a tiny shape, the timer replaced (nothing is measured), so that the code
paths the GPU run takes — the softcap-mode sweep, its JSON rows, a mode that fails, ``--cases`` —
are exercised before device time is spent on them."""
import argparse
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import bench_flash_attn as bfa  # noqa: E402

from xoffload.kernels import flash_attn_opts as fo  # noqa: E402


@pytest.fixture
def dry(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the dry run is for machines without a GPU (the GPU runs the real benchmark)")
    monkeypatch.setattr(bfa, "DEVICE", "cpu")
    monkeypatch.setattr(bfa, "DTYPE", torch.float16)
    monkeypatch.setattr(bfa, "SHAPES", {"tiny": (2, 1, 32), "d128_h32_kv8": (2, 1, 32), "d64_h9_kv3": (2, 1, 16)})
    monkeypatch.setattr(bfa, "SCORE_SEQ", 80)
    calls = []

    def fake_bench_ms(fn, **kw):
        fn()
        calls.append(1)
        return 1.0 + 0.01 * len(calls)

    monkeypatch.setattr(bfa, "bench_ms", fake_bench_ms)
    return calls


def test_softcap_sweep_times_every_mode_and_records_it(dry):
    rec = bfa.run_score_case("softcap", "tiny", 80, True, with_flex=False, sweep=True)
    assert rec["softcap_mode"] == {"mode": fo.SOFTCAP_MODE, "quarters": fo.SOFTCAP_POLY_QUARTERS}
    modes = rec["softcap_modes"]
    assert [(m["mode"], m["quarters"]) for m in modes] == bfa.SOFTCAP_SWEEP
    for m in modes:
        assert "error" not in m, m
        assert m["tflops"] > 0 and m["ratio_vs_plain"] > 0
        assert m["max_abs_diff_vs_mode0"] <= 4 * torch.finfo(torch.float16).eps  # fp16 output, same softmax
    assert (fo.SOFTCAP_MODE, fo.SOFTCAP_POLY_QUARTERS) == (0, 2)  # restored
    assert "ours_softcap/ours_plain(>=0.9)" in rec["ratios"]


def test_a_failing_mode_is_recorded_and_the_sweep_goes_on(dry):
    calls = {"n": 0}

    def fn():
        calls["n"] += 1
        if fo.SOFTCAP_MODE == 1:
            raise RuntimeError("ptxas: no such instruction")
        return torch.zeros(2), None

    rows = bfa.sweep_softcap_modes(fn, 1e9, plain_ms=1.0, pairs=[(0, 2), (1, 2), (2, 2), (9, 2)])
    assert [r["mode"] for r in rows] == [0, 1, 2, 9]
    assert "ptxas" in rows[1]["error"] and "SOFTCAP_MODE must be one of" in rows[3]["error"]
    assert "error" not in rows[0] and "error" not in rows[2] and rows[2]["max_abs_diff_vs_mode0"] == 0.0


def test_alibi_rows_still_appear(dry):
    rec = bfa.run_score_case("alibi", "tiny", 80, False, with_flex=False, sweep=True)
    assert rec["case"] == "alibi" and "alibi_form" in rec and "softcap_modes" not in rec
    assert rec["impl"]["ours_alibi"]["tflops"] > 0 and "ours_alibi/ours_plain(>=0.9)" in rec["ratios"]


def test_options_suite_cases_filter_and_json(dry, tmp_path, monkeypatch):
    monkeypatch.delenv("XOFFLOAD_BENCH_OUT", raising=False)
    out = tmp_path / "attention_options.json"
    args = argparse.Namespace(out=str(out), seqs=None, quick=True, window=16, sweep=True, cases=("softcap", "alibi"))
    assert bfa.main_options(args, no_flex=True) == 0
    recs = json.loads(out.read_text())["records"]
    assert [(r["case"], r["causal"]) for r in recs] == [("softcap", True), ("alibi", True)]
    assert len(recs[0]["softcap_modes"]) == len(bfa.SOFTCAP_SWEEP)
    assert [c[1][0] for c in bfa.option_cases(False, 16, kinds=("alibi",))] == ["alibi"] * 6  # 3 shapes x causal
    with pytest.raises(argparse.ArgumentTypeError, match="unknown case kind 'bogus'"):
        bfa._kinds("softcap,bogus")
