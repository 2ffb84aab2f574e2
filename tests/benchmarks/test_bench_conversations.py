"""The multi-user benchmark (benchmarks/bench_conversations.py) end to end on the CPU with the tiny
model: every mode's row has the figures the report reads, every turn of every conversation is
recorded, a follow-up prefills only its new tokens with prefix caching and the whole conversation
without it, and a bad mode is one argparse line."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import bench_conversations  # noqa: E402


def test_tiny_load_all_modes(tmp_path):
    out = tmp_path / "conv.json"
    argv = ["--shape", "tiny-llama", "--doc-tokens", "160", "--convs", "2", "--questions", "2", "--q-tokens", "8",
            "--answer-tokens", "3", "--gap-ms", "5", "--chunk-tokens", "48", "--out", str(out)]
    assert bench_conversations.main(argv) == 0
    res = json.loads(out.read_text())
    for mode in bench_conversations.MODES:
        row = res["results"][f"{mode}/2"]
        assert "status" not in row, row.get("status")
        assert row["turns"] == 4 and row["generated_tokens"] == 4 * 3
        assert row["tok_per_s"] > 0 and row["followup_ttft_ms_p99"] >= row["followup_ttft_ms_p50"] > 0
        follow = [r for r in row["requests"] if r["turn"] == 1]
        if mode == "reprefill":  # the whole conversation again: document, question, answer, question
            assert all(r["chunk_tokens"] == 160 + 8 + 3 + 8 for r in follow)
        elif mode == "offload+quest":  # the history comes from the prefix cache
            assert all(r["history_tokens"] >= 160 and r["chunk_tokens"] <= 8 + 3 + 8 + 1 for r in follow)
    assert os.path.exists(str(out).replace(".json", ".png"))


def test_unknown_mode_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        bench_conversations.main(["--modes", "nope"])
    assert e.value.code == 2 and "unknown mode 'nope'" in capsys.readouterr().err
