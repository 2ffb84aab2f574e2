"""A CPU dry run of ``bench_flash_attn.py --suite options --sweep``'s softcap / ALiBi cases: the kernel
under the interpreter on a tiny shape, the timer replaced (nothing is measured), so that the code
paths the GPU run takes — the launch-config sweep of each case, its JSON rows, ``--cases`` — are
exercised before device time is spent on them."""
import argparse
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import bench_flash_attn as bfa  # noqa: E402


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


def test_softcap_case_and_its_sweep(dry):
    rec = bfa.run_score_case("softcap", "tiny", 80, True, with_flex=False, sweep=True)
    assert rec["case"] == "softcap" and "softcap_mode" not in rec and "softcap_modes" not in rec
    assert rec["impl"]["ours_softcap"]["tflops"] > 0 and "ours_softcap/ours_plain(>=0.9)" in rec["ratios"]
    assert "sweep" in rec  # the launch-config sweep ran (no configs for the tiny shape's D=32: SWEEP)


def test_alibi_rows_still_appear(dry):
    rec = bfa.run_score_case("alibi", "tiny", 80, False, with_flex=False, sweep=True)
    assert rec["case"] == "alibi" and "alibi_form" in rec and "sweep" in rec
    assert rec["impl"]["ours_alibi"]["tflops"] > 0 and "ours_alibi/ours_plain(>=0.9)" in rec["ratios"]


def test_options_suite_cases_filter_and_json(dry, tmp_path, monkeypatch):
    monkeypatch.delenv("XOFFLOAD_BENCH_OUT", raising=False)
    out = tmp_path / "attention_options.json"
    args = argparse.Namespace(out=str(out), seqs=None, quick=True, window=16, sweep=True, cases=("softcap", "alibi"))
    assert bfa.main_options(args, no_flex=True) == 0
    recs = json.loads(out.read_text())["records"]
    assert [(r["case"], r["causal"]) for r in recs] == [("softcap", True), ("alibi", True)]
    assert all("sweep" in r and "softcap_modes" not in r for r in recs)
    assert [c[1][0] for c in bfa.option_cases(False, 16, kinds=("alibi",))] == ["alibi"] * 6  # 3 shapes x causal
    with pytest.raises(argparse.ArgumentTypeError, match="unknown case kind 'bogus'"):
        bfa._kinds("softcap,bogus")
