"""The server benchmark (benchmarks/bench_serve.py) end to end on the CPU with the tiny model:
conversations and short requests over HTTP with no errors, every turn counted, follow-ups served
from the prefix cache, the offline run beside it, memory recorded, a plot written; a bad mode is
one argparse line."""
import json
import os
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import bench_serve  # noqa: E402


def test_tiny_serve_load(tmp_path):
    out = tmp_path / "serve.json"
    assert bench_serve.main(["--tiny", "--modes", "offload+quest", "--offline", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    row = res["results"]["offload+quest/2"]
    assert "status" not in row, row.get("status")
    assert row["errors"] == 0 and row["turns"] == 2 * 2 and row["generated_tokens"] == 4 * 3
    assert row["tok_per_s"] > 0 and row["ttft_followup_ms_p99"] >= row["ttft_followup_ms_p50"] > 0
    assert row["ttft_first_ms_p50"] > 0 and row["itl_ms_p50"] is not None
    assert row["cached_tokens"] >= 2 * 128  # each follow-up found its document in the prefix cache
    assert row["offline"]["tok_per_s"] > 0 and row["http_over_offline_tok_per_s"] > 0
    short = row["short"]
    assert short["errors"] == 0 and short["turns"] == 6 and short["generated_tokens"] == 6 * 2
    assert short["memory_start"]["host_rss_bytes"] > 0 and short["memory_end"]["host_rss_bytes"] > 0
    assert os.path.exists(str(out).replace(".json", ".png"))


def test_unknown_mode_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        bench_serve.main(["--tiny", "--modes", "nope"])
    assert e.value.code == 2 and "unknown mode 'nope'" in capsys.readouterr().err
