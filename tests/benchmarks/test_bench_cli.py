"""The GPU benchmarks' command lines on a CPU machine: a bad option is one argparse line (exit 2),
a good command skips cleanly (exit 0, "no CUDA GPU, skipped"), ``--help`` describes the script in
whole sentences."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "tools"))

import _common  # noqa: E402
import bench_batch  # noqa: E402
import bench_session  # noqa: E402
import bench_topk  # noqa: E402
import diag_decode_profile  # noqa: E402

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without a GPU")


@no_gpu
@pytest.mark.parametrize("mod,argv", [(bench_topk, ["--quick"]), (bench_session, ["--quick", "--part", "prefix_batch"]),
                                      (bench_batch, ["--quick", "--reuse-bias", "4"]),
                                      (bench_batch, ["--quick", "--dense-layers", "none", "--long-batches", "max",
                                                     "--exact-channels", "16"]),
                                      (bench_batch, ["--quick", "--dense-layers", "0,-1", "--long-batches", "1, 2"]),
                                      (bench_session, ["--quick", "--part", "prefix_batch_profile"]),
                                      (diag_decode_profile, ["--config", "offload+quest-ch", "--lengths", "4096"])])
def test_skips_cleanly_without_a_gpu(mod, argv, capsys):
    assert mod.main(argv) == 0
    assert "no CUDA GPU, skipped" in capsys.readouterr().out


@pytest.mark.parametrize("mod,argv,named", [
    (bench_session, ["--part", "prefix-batch"], "'prefix-batch'"),
    (bench_session, ["--part", "turns,bogus"], "'bogus'"),
    (diag_decode_profile, ["--config", "nope"], "'nope'"),
    (diag_decode_profile, ["--lengths", "1k"], "'1k'"),
    (diag_decode_profile, ["--eager-lengths", "0"], "'0'"),
    (bench_batch, ["--reuse-bias", "0.5"], "'0.5'"),  # QuestDecode refuses < 1: at parse, not in every run
    (bench_batch, ["--reuse-bias", "inf"], "'inf'"),
    (bench_batch, ["--replot-cap", "no-equals-sign"], "'no-equals-sign'"),
    (bench_batch, ["--dense-layers", "abc"], "'abc'"),
    # refused at parse (not after the GPU check, where a bad value was a traceback or a batch of 0)
    (bench_batch, ["--long-batches", "abc"], "'abc'"),
    (bench_batch, ["--long-batches", "4,0"], "'4,0'"),
    (bench_batch, ["--long-batches", "-2"], "'-2'"),
    (bench_batch, ["--long-batches", ","], "','"),
    (bench_batch, ["--exact-channels", "-1"], "'-1'"),
    (bench_batch, ["--exact-channels", "100000"], "'100000'"),
    (bench_batch, ["--exact-channels", "x"], "'x'"),
])
def test_bad_options_are_one_line_naming_the_value(mod, argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and named in err[0]


def test_help_description_is_the_docstrings_first_paragraph():
    assert _common.doc_summary("One line\ngoes on here.\n\nSecond paragraph.") == "One line goes on here."
    assert _common.doc_summary(None, "name") == "name"
    ap = _common.bench_parser(bench_topk.__doc__, "topk")
    assert ap.description.endswith("against ``torch.topk`` and the launch floor.")


def test_bench_batch_replots_recorded_cap_parts_without_a_gpu(tmp_path):
    """``--replot-cap LABEL=FILE[+FILE...]``: one line per label from the merged cap rows of
    recorded JSONs, into --out's .png, with no run (no GPU needed)."""
    import json

    def rec(rows, resident=None):
        cap = {"budget": 2048, "offload_quest": {str(b): {"tok_per_s": t} for b, t in rows.items()}}
        if resident:
            cap["resident"] = {"tok_per_s": resident}
        return {"ctx": 32768, "env": {"gpu": "test", "date": "2026-12-01"}, "results": {"cap_part": cap}}

    files = []
    for i, r in enumerate([rec({1: 100.0, 4: 300.0}, resident=150.0), rec({8: 500.0}), rec({4: 700.0})]):
        f = tmp_path / f"r{i}.json"
        f.write_text(json.dumps(r))
        files.append(str(f))
    series = bench_batch._replot_series([f"a={files[0]}+{files[1]}", f"b={files[2]}"])
    assert series == {"a": files[:2], "b": files[2:]}
    out = tmp_path / "cap.json"
    assert bench_batch.main(["--replot-cap", f"a={files[0]}+{files[1]}", "--replot-cap", f"b={files[2]}",
                             "--out", str(out)]) == 0
    png = tmp_path / "cap.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
