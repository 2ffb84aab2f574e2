"""The server benchmark (benchmarks/bench_serve.py) end to end on the CPU with the tiny model:
conversations and short requests over HTTP with no errors, every turn counted, follow-ups served
from the prefix cache, the offline run of the same load beside it (the same prompt and
prefix-cache token counts), the load generator in a process of its own unless asked inline, memory
recorded, a plot written; a bad mode is one argparse line."""
import json
import os
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import bench_serve  # noqa: E402


def _run(tmp_path, *extra) -> dict:
    out = tmp_path / "serve.json"
    assert bench_serve.main(["--tiny", "--modes", "offload+quest", "--offline", "--out", str(out), *extra]) == 0
    res = json.loads(out.read_text())
    row = res["results"]["offload+quest/2"]
    assert "status" not in row, row.get("status")
    return res


def _same_load(row: dict) -> None:
    """The HTTP row and the offline row ran one load: every turn, the same prompts, the same
    prefix-cache hits (a server that changed the re-sent ids or lost hits would differ)."""
    off = row["offline"]
    assert row["errors"] == off["errors"] == 0
    assert row["turns"] == off["turns"] == 2 * 2 and row["generated_tokens"] == off["generated_tokens"] == 4 * 3
    assert row["prompt_tokens"] == off["prompt_tokens"] == 2 * (160 + 8) + 2 * (160 + 8 + 3 + 8)
    assert row["cached_tokens"] == off["cached_tokens"] >= 2 * 128  # each follow-up found its document
    assert row["tok_per_s"] > 0 and off["tok_per_s"] > 0 and row["http_over_offline_tok_per_s"] > 0
    assert row["ttft_followup_ms_p99"] >= row["ttft_followup_ms_p50"] > 0 and off["ttft_followup_ms_p50"] > 0
    assert row["itl_ms_p50"] is not None and off["itl_ms_p50"] is not None


def test_tiny_serve_load(tmp_path):
    res = _run(tmp_path)
    row = res["results"]["offload+quest/2"]
    _same_load(row)
    print(f"CPU tiny HTTP/offline tok/s: {row['http_over_offline_tok_per_s']:.2f}")
    assert res["client"] == "process" and res["client_lib"] == "httpx" and res["warmup"]
    # the clients' Python never shares the server's GIL
    assert row["client_pid"] != os.getpid() == res["server_pid"]
    assert row["ttft_first_ms_p50"] > 0
    short = row["short"]
    assert short["errors"] == 0 and short["turns"] == 6 and short["generated_tokens"] == 6 * 2
    assert short["client_pid"] == row["client_pid"]
    assert short["memory_start"]["host_rss_bytes"] > 0 and short["memory_end"]["host_rss_bytes"] > 0
    assert os.path.exists(str(tmp_path / "serve.png"))


def test_inline_openai_client_runs_the_same_load(tmp_path):
    pytest.importorskip("openai")
    res = _run(tmp_path, "--client", "inline", "--client-lib", "openai")
    row = res["results"]["offload+quest/2"]
    _same_load(row)
    assert res["client"] == "inline" and row["client_pid"] == os.getpid()


def test_unknown_mode_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        bench_serve.main(["--tiny", "--modes", "nope"])
    assert e.value.code == 2 and "unknown mode 'nope'" in capsys.readouterr().err
