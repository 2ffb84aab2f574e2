"""End to end on the CPU: all 11 tasks at 1K, one sample each, SmolLM2 (fp32), KV on the "GPU" path
and offloaded, through ``cmd_eval``; answers capped at 12 tokens (CI time: RULER's own lengths,
up to 128 tokens, took ~20 min of CPU here; the GPU runs use them). Checks the JSON (every task, scores
in [0, 100], agreement of offload with resident) and the PNG.

The test prints its time."""
import argparse
import json
import time

from xoffload.evals.cli import add_eval_parser
from xoffload.evals.tasks import TASKS


def test_eval_all_tasks_1k_both_modes_cpu(tmp_path, capsys, monkeypatch, smol):
    import xoffload.models as models

    monkeypatch.setattr(models, "load_model", lambda model=None, **kw: smol, raising=False)
    p = argparse.ArgumentParser(prog="xoffload")
    add_eval_parser(p.add_subparsers(dest="cmd"))
    out = tmp_path / "res"
    a = p.parse_args(["eval", "--device", "cpu", "--tasks", "all", "--lengths", "1024", "--samples", "1",
                      "--mode", "both", "--out", str(out), "--kv-block-size", "256", "--no-progress",
                      "--max-new-tokens", "12"])
    t = time.perf_counter()
    rc = a.func(a)
    dt = time.perf_counter() - t
    text = capsys.readouterr().out
    assert rc == 0, text
    data = json.loads((out / "ruler.json").read_text())
    assert data["modes"] == ["resident", "offload"] and data["lengths"] == [1024]
    for m in ("resident", "offload"):
        assert set(data["table"][m]) == set(TASKS)
        for t_ in TASKS:
            assert 0.0 <= data["table"][m][t_]["1024"] <= 100.0
        assert 0.0 <= data["average"][m] <= 100.0
    assert len(data["records"]) == 2 * len(TASKS)
    for r in data["records"]:
        assert r["prompt_tokens"] + r["max_new_tokens"] <= 1024 and 0.0 <= r["score"] <= 100.0
        assert isinstance(r["prediction"], str) and r["generated_ids"]
    agr = data["agreement"]["offload"]
    assert agr["total"] == len(TASKS) and 0 <= agr["same_score"] <= agr["total"]
    assert all(isinstance(r["same_tokens"], bool) for r in data["records"] if r["mode"] == "offload")
    assert "token-identical answers" in text and "mode=offload" in text
    assert (out / "ruler.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    gen = sum(len(r["generated_ids"]) for r in data["records"])
    print(f"\neval 11 tasks x 1K x 2 modes on CPU: {dt:.1f} s ({gen} tokens generated); resident average "
          f"{data['average']['resident']:.1f}, offload {data['average']['offload']:.1f}; token-identical "
          f"{agr['token_identical']}/{agr['total']}")
