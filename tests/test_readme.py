"""The README's API tour runs as written (CPU: the kernels' references and the tiny presets)."""
import pathlib
import re

import torch

from xoffload.kernels import cpu_backend

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _tour() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## API tour"):]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "the API tour has no python block"
    return m.group(1)


def test_api_tour_runs(capsys):
    code = _tour()
    ns = {}
    with cpu_backend("reference"):  # the model part of the tour runs its references on the CPU anyway
        exec(compile(code, str(README) + ":api-tour", "exec"), ns)
    # what the tour claims: the two halves merged by LSE equal attention over all of K
    full, full_lse = ns["flash_attn_with_lse"](ns["q"], ns["k"], ns["v"])
    assert torch.allclose(ns["o"].float(), full.float(), atol=1e-4) and torch.allclose(ns["l"], full_lse, atol=1e-4)
    assert torch.allclose(ns["d1"].float(), ns["d2"].float(), atol=1e-5)  # paged == contiguous decode
    assert len(ns["res"].token_ids) == 8 and ns["out"].timings["h2d_bytes_per_token"] > 0
    assert [len(o.token_ids) for o in ns["outs"]] == [8, 1, 8] and ns["batched"].batch_stats["max_running"] == 3
    a1, a2 = ns["a1"].timings, ns["a2"].timings
    assert (a1["history_tokens"], a1["chunk_tokens"]) == (1500, 20)  # the document came from the prefix cache
    assert (a2["history_tokens"], a2["chunk_tokens"]) == (1527, 1 + 20)  # the last answer's last token + the prompt
    assert ns["again"].timings["prefix_reused_tokens"] == 1504  # all but the last prompt token
    printed = capsys.readouterr()
    assert "tok" not in printed.err
    assert "('r1', [" in printed.out and ", True)]" in printed.out  # the step loop's outputs, the last one finished
