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
    import xoffload.engine.llm as llm_mod

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
    assert "mode=resident" in text and "mode=offload" in text and "accuracy" in text
    assert "answers identical in both modes: 1/1" in text
    data = json.loads((out / "needle.json").read_text())
    assert data["meta"]["lengths"] == [400] and data["meta"]["depths"] == [0.5]  # "50" read as a percentage
    assert len(data["records"]) == 2 and {r["mode"] for r in data["records"]} == {"resident", "offload"}
    for r in data["records"]:
        assert r["prompt_tokens"] <= 400 - 16 and r["prefill_tok_per_s"] > 0 and isinstance(r["found"], bool)
    assert set(data["summary"]) == {"resident", "offload"}
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


# ---------------------------------------------------------------------------- user errors: one line, exit 2
@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the CLI loads a model: argument errors must be caught before that."""
    import xoffload.models as models

    def fail(*a, **k):
        raise AssertionError("load_model called")

    monkeypatch.setattr(models, "load_model", fail)


def _run_error(argv, capsys):
    """main(argv) must end with exit status 2 and exactly one stderr line ``xoffload <cmd>: error: ...``."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert rc == 2, (rc, cap.err)
    assert len(lines) == 1 and lines[0].startswith(f"xoffload {argv[0]}: error: "), cap.err
    assert "Traceback" not in cap.err + cap.out
    return lines[0]


@pytest.mark.parametrize("args, words", [
    (["--lengths", "0"], "lengths"), (["--lengths", "-5"], "lengths"), (["--lengths", "two"], "bad length"),
    (["--lengths", ","], "lengths"), (["--samples", "0"], "samples"), (["--samples", "x"], "samples"),
    (["--depths", "2,x"], "depths"), (["--depths", "150"], "depths"), (["--depths", "-0.5"], "depths"),
    (["--num-depths", "0"], "num-depths"), (["--max-tokens", "0"], "max-tokens"), (["--dtype", "bogus"], "dtype"),
    (["--device", "tpu"], "device"), (["--mode", "bogus"], "mode"), (["--min-accuracy", "2"], "min-accuracy"),
    (["--lengths", "4k", "--max-model-len", "2048"], "max-model-len"),
    (["--mode", "offload", "--sparse-decode", "quest", "--offload-decode", "ring"], "offload_decode='ring'"),
    (["--mode", "offload", "--kv-block-size", "48"], "power of two"),
])
def test_needle_argument_errors_before_model_load(no_model_load, tmp_path, capsys, args, words):
    out = tmp_path / "res"
    line = _run_error(["needle", "--out", str(out), *args], capsys)
    assert words in line
    assert not out.exists()


def test_generate_engine_option_clash_before_model_load(no_model_load, capsys):
    line = _run_error(["generate", "--prompt", "hi", "--mode", "offload", "--offload-decode", "ring",
                       "--token-budget", "256"], capsys)
    assert "offload_decode='ring'" in line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_one_line(no_model_load, tmp_path, capsys):
    line = _run_error(["needle", "--device", "cuda", "--out", str(tmp_path / "res")], capsys)
    assert "not available" in line and "--device cpu" in line
    assert not (tmp_path / "res").exists()


def test_runtime_errors_one_line(tmp_path, capsys):
    out = tmp_path / "res"
    line = _run_error(["needle", "--model", str(tmp_path / "missing.gguf"), "--device", "cpu", "--out", str(out)], capsys)
    assert "not found" in line and not out.exists()
    line = _run_error(["needle", "--model", "tiny-llama", "--device", "cpu", "--lengths", "100", "--out", str(out)], capsys)
    assert "no tokenizer" in line and not out.exists()
    line = _run_error(["generate", "--model", "no-such-preset", "--prompt", "hi", "--device", "cpu"], capsys)
    assert "unknown model" in line
    _run_error(["generate", "--device", "cpu"], capsys)  # neither --prompt nor --prompt-file
    _run_error(["generate", "--device", "cpu", "--prompt", "  "], capsys)


def test_mode_gpu_alias_reported_as_resident(shared_model, tmp_path, capsys):
    out = tmp_path / "res"
    rc = cli.main(["needle", "--device", "cpu", "--lengths", "300", "--depths", "0.5", "--mode", "gpu",
                   "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "mode=resident" in text and "mode=gpu" not in text and "answers identical" not in text
    assert "peak GPU memory" not in text and "process peak RSS" in text  # CPU: the RSS, labelled as such
    data = json.loads((out / "needle.json").read_text())
    assert data["meta"]["modes"] == ["resident"] and {r["mode"] for r in data["records"]} == {"resident"}
    assert "cells" in text.strip().splitlines()[-1] and "model load" in text.strip().splitlines()[-1]


def test_help_lists_presets_and_every_option_has_help():
    from xoffload.models.config import PRESETS

    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for name, sp in subs.choices.items():
        for act in sp._actions:
            assert act.help, f"xoffload {name} {act.option_strings} has no help"
        text = sp.format_help()
        if name == "eval":  # RULER prompts need the model's tokenizer: presets (random weights) have none
            assert "tokenizer" in " ".join(text.split())
            continue
        for preset in PRESETS:
            assert preset in text.replace("\n", " ").replace(" ", "") or preset in " ".join(text.split()), (name, preset)
    assert all(p in " ".join(parser.format_help().split()).replace("- ", "-") for p in PRESETS)


def test_table_prefill_column_separated(capsys):
    records = [{"mode": "resident", "length": L, "depth": 0.5, "found": True, "prefill_tok_per_s": v,
                "decode_ms_per_token": 1.0, "peak_gpu_memory_bytes": None, "token_ids": [1]}
               for L, v in ((1024, 51657.0), (2048, 120865.0))]
    rate, summary, _ = cli._summarize(records, ["resident"], [1024, 2048], [0.5])
    cli._print_mode_table("resident", records, summary, [1024, 2048], [0.5], 1)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("prefill"))
    assert "51,657 tok/s" in row and "120,865 tok/s" in row and "tok/s1" not in row
    assert "peak GPU memory" not in out and " - " not in out
    header = next(line for line in out.splitlines() if line.startswith("depth"))
    assert len(header) == len(row)  # fixed-width columns


def test_png_title_names_model_device_dtype_date(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    meta = {"model": "/x/SmolLM2-135M-Instruct.Q4_1.gguf", "arch": "llama", "dtype": "torch.float32",
            "device": "cpu", "gpu": None, "date": "2026-12-01 09:00"}
    title = cli._figure_title(meta)
    assert title == "needle in a haystack: SmolLM2-135M-Instruct.Q4_1.gguf (llama), cpu, float32, 2026-12-01 09:00"
    seen = []
    orig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (seen.append(self._suptitle.get_text()),
                                                                   orig(self, *a, **k)))
    rate = {m: {(1024, 0.5): 1.0} for m in ("resident", "offload")}
    cli._heatmap(str(tmp_path / "n.png"), ["resident", "offload"], [1024], [0.5], rate, title)
    assert seen == [title] and (tmp_path / "n.png").read_bytes()[:4] == b"\x89PNG"


def test_sparse_options_one_place():
    """The command line's sparse flags become policy objects in one place."""
    import argparse

    from xoffload.sparse import QuestDecode, XAttentionPrefill

    ns = lambda **kw: argparse.Namespace(**{**dict(sparse=None, sparse_threshold=0.9, sparse_decode=None,  # noqa: E731
                                                   token_budget=None, offload_decode="direct"), **kw})
    assert cli._sparse_options(ns()) == {"offload_decode": "direct"}
    assert cli._sparse_options(ns(sparse="xattn", sparse_threshold=0.8))["sparse"] == XAttentionPrefill(threshold=0.8)
    assert cli._sparse_options(ns(token_budget=512))["sparse_decode"] == QuestDecode(token_budget=512)
    assert cli._sparse_options(ns(sparse_decode="quest"))["sparse_decode"] == QuestDecode()
    assert cli._sparse_options(ns(offload_decode="ring"))["offload_decode"] == "ring"
