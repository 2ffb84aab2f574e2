"""A CPU dry run of ``bench_fp8_decode.py``: its decode and quantization cases on tiny shapes, the
kernels under the interpreter, the timer replaced (nothing is measured), so that the code paths
the GPU run takes (stores, fp8 copies, tables, byte counts, the JSON rows) are exercised before
device time is spent on them."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import bench_fp8_decode as bfd  # noqa: E402


@pytest.fixture
def dry(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the dry run is for machines without a GPU (the GPU runs the real benchmark)")
    monkeypatch.setattr(bfd, "DEVICE", "cpu")
    monkeypatch.setattr(bfd, "DTYPE", torch.float16)
    calls = []

    def fake_bench_ms(fn, **kw):
        fn()
        calls.append(1)
        return 0.5 + 0.01 * len(calls)

    monkeypatch.setattr(bfd, "bench_ms", fake_bench_ms)
    monkeypatch.setattr(bfd, "bench_graph_ms", lambda fn: None)
    return calls


@pytest.mark.parametrize("page", [16, 64])
def test_decode_case_rows(dry, page):
    rows = bfd.run_decode_case(2, 200, page, 1000.0, heads=(4, 2, 32))
    assert [r["variant"] for r in rows] == list(bfd.VARIANTS)
    bf, fp_page, fp_tok = rows
    assert bf["bytes"] == 2 * 2 * 200 * 2 * 32 * 2
    pages = 2 * -(-200 // page)
    assert fp_page["bytes"] == 2 * (2 * 200 * 2 * 32 + 4 * pages * 2)
    assert fp_tok["bytes"] == 2 * (2 * 200 * 2 * 32 + 4 * 2 * 200 * 2)
    for r in (fp_page, fp_tok):
        assert r["time_over_bf16"] > 0 and r["timing"] == "eager"
        assert 0 < r["max_abs_diff_vs_bf16"] < 0.2  # e4m3's error on unit-variance data, not garbage


def test_decode_case_configs(dry):
    """``--fp8-configs``: the fp8 variants again under each config, rows named by it."""
    cfgs = [bfd.parse_config("32,4,2"), bfd.parse_config("64,4,3,168")]
    rows = bfd.run_decode_case(1, 160, 32, 1000.0, heads=(4, 2, 32), configs=cfgs)
    assert [(r["variant"], r.get("config")) for r in rows] == [
        ("bf16", None), ("fp8_page", None), ("fp8_token", None), ("fp8_page", "32k w4 s2"), ("fp8_token", "32k w4 s2"),
        ("fp8_page", "64k w4 s3 r168"), ("fp8_token", "64k w4 s3 r168")]
    for r in rows[1:]:
        assert 0 < r["max_abs_diff_vs_bf16"] < 0.2
    with pytest.raises(ValueError, match="BLOCK_N,num_warps,num_stages"):
        bfd.parse_config("64,4")


@pytest.mark.parametrize("layout,page,granularity", bfd.quant_cases())
def test_quant_case_row(dry, layout, page, granularity):
    r = bfd.run_quant_case(layout, page, granularity, 1000.0, tokens=512, heads=(4, 2, 32))
    assert r["equal_to_reference"]
    scales = 512 * 2 if granularity == "token" else (512 // page) * 2
    assert r["bytes"] == 512 * 2 * 32 * 3 + 4 * scales


def test_main_without_gpu(dry, capsys):
    assert bfd.main([]) == 0
    assert "no CUDA GPU, skipped" in capsys.readouterr().out
