"""The ``xoffload`` command line: needle (table, JSON, PNG) and generate, on SmolLM2 (CPU)."""
import json
import os
import subprocess
import sys

import pytest

from xoffload import cli

from helpers import smollm2


@pytest.fixture
def shared_model(monkeypatch):
    """Serve the already loaded SmolLM2 to the CLI (loading is tested elsewhere; saves ~10 s per call)."""
    m = smollm2()
    import xoffload.models as models
    import xoffload.models.llm as llm_mod

    def fake_load(model=None, **kw):
        assert model is None or model == "smollm2"
        return m

    monkeypatch.setattr(models, "load_model", fake_load, raising=False)
    monkeypatch.setattr(llm_mod, "load_model", fake_load)
    return m


def test_needle_cli_writes_table_json_png(shared_model, tmp_path, capsys):
    out = tmp_path / "res"
    rc = cli.main(["needle", "--device", "cpu", "--lengths", "400", "--depths", "50", "--out", str(out),
                   "--kv-block-size", "128"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "mode=gpu" in text and "mode=offload" in text and "accuracy" in text
    assert "answers identical in both modes: 1/1" in text
    data = json.loads((out / "needle.json").read_text())
    assert data["meta"]["lengths"] == [400] and data["meta"]["depths"] == [0.5]  # "50" read as a percentage
    assert len(data["records"]) == 2 and {r["mode"] for r in data["records"]} == {"gpu", "offload"}
    for r in data["records"]:
        assert r["prompt_tokens"] <= 400 - 16 and r["prefill_tok_per_s"] > 0 and isinstance(r["found"], bool)
    assert set(data["summary"]) == {"gpu", "offload"}
    png = (out / "needle.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_generate_cli(shared_model, tmp_path, capsys):
    rc = cli.main(["generate", "--device", "cpu", "--prompt", "What is the capital of France?",
                   "--max-tokens", "12", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and "Paris" in res["text"] and res["timings"]["prefill_tok_per_s"] > 0
    f = tmp_path / "p.txt"
    f.write_text("Name a color.")
    rc = cli.main(["generate", "--device", "cpu", "--prompt-file", str(f), "--max-tokens", "4", "--mode", "gpu"])
    cap = capsys.readouterr()
    assert rc == 0 and cap.out.strip() and "prompt tokens" in cap.err


def test_cli_errors(tmp_path, capsys):
    rc = cli.main(["generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "hi", "--device", "cpu"])
    assert rc == 2 and "not found" in capsys.readouterr().err
    rc = cli.main(["generate", "--model", "no-such-preset", "--prompt", "hi", "--device", "cpu"])
    assert rc == 2 and "unknown model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--device", "cpu"])  # neither --prompt nor --prompt-file
    with pytest.raises(SystemExit):
        cli.main(["needle", "--depths", "2,x"])
    with pytest.raises(SystemExit):
        cli.main(["bogus"])


def test_console_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "xoffload", "needle", "--help"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(cli.__file__))})
    assert r.returncode == 0 and "--lengths" in r.stdout and "--mode" in r.stdout
