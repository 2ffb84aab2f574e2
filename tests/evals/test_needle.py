"""Needle in a haystack on the real model (SmolLM2-135M-Instruct): prompt building, and the needle
found with the KV cache on the "GPU" path and offloaded, with identical answers (CPU in CI; the full
1K-8K x 10 depths grid on a GPU)."""
import random
import time

import pytest
import torch

from xoffload import LLM, SamplingParams
from xoffload.evals.needle import build_prompt, found, make_number, parse_length

from helpers import smollm2


def test_found_and_parse_length():
    assert found(" 7340912.", "7340912") and found("It is 7,340,912", "7340912")
    assert not found("734091", "7340912") and not found(None, "7340912")
    assert parse_length("2k") == 2048 and parse_length("1500") == 1500 and parse_length("0.5K") == 512
    with pytest.raises(ValueError, match="length"):
        parse_length("two")


def test_build_prompt_length_and_depth():
    tok = smollm2().tokenizer
    rng = random.Random(0)
    num = make_number(rng)
    assert len(num) == 7 and num.isdigit()
    poss = []
    for d in (0.0, 0.5, 1.0):
        p = build_prompt(tok, 1024, d, num, answer_tokens=16)
        assert 1024 - 16 - 40 <= len(p.token_ids) <= 1024 - 16, len(p.token_ids)
        text = tok.decode(p.token_ids)
        assert text.count(num) == 2 and "special magic number" in text
        poss.append(p.needle_token_pos)
    assert poss[0] < 60 < poss[1] < poss[2] and abs(poss[1] - 500) < 80, poss
    with pytest.raises(ValueError, match="too short"):
        build_prompt(tok, 40, 0.5, num)
    with pytest.raises(ValueError, match="depth"):
        build_prompt(tok, 1024, 1.5, num)


def _run_grid(model, lengths, depths, modes, max_model_len, seed=0):
    rng = random.Random(seed)
    prompts = [build_prompt(model.tokenizer, L, d, make_number(rng)) for L in lengths for d in depths]
    sp = SamplingParams(max_tokens=16)
    res = {}
    for mode in modes:
        llm = LLM(model, mode=mode, max_model_len=max_model_len)
        res[mode] = [llm.generate(p.token_ids, sp)[0] for p in prompts]
        llm.close()
    return prompts, res


def test_needle_2k_cpu_both_modes():
    """Three ~2K-token prompts (needle at 10%, 50%, 90%): found in both modes, identical answers."""
    model = smollm2()
    t = time.perf_counter()
    prompts, res = _run_grid(model, [2048], [0.1, 0.5, 0.9], ["gpu", "offload"], max_model_len=2048)
    for i, p in enumerate(prompts):
        a, b = res["gpu"][i], res["offload"][i]
        assert 1900 < len(p.token_ids) <= 2048 - 16
        assert found(a.text, p.number), (p.depth, p.number, a.text)
        assert a.token_ids == b.token_ids, (p.depth, a.text, b.text)
    print(f"needle 3 x 2K x 2 modes on CPU: {time.perf_counter() - t:.1f} s")


@pytest.mark.cuda
def test_needle_1k_to_8k_10_depths_gpu_both_modes():
    from xoffload.models import find_smollm2_gguf, load_model

    try:
        model = load_model(find_smollm2_gguf(), device="cuda")  # bf16
    except FileNotFoundError as e:
        pytest.skip(str(e))
    lengths = [1024, 2048, 4096, 8192]
    depths = [i / 9 for i in range(10)]
    prompts, res = _run_grid(model, lengths, depths, ["gpu", "offload"], max_model_len=8192)
    hits = [found(o.text, p.number) for p, o in zip(prompts, res["gpu"])]
    same = [a.token_ids == b.token_ids for a, b in zip(res["gpu"], res["offload"])]
    missed = [(p.length, round(p.depth, 2), o.text) for p, o, h in zip(prompts, res["gpu"], hits) if not h]
    assert all(same), f"{same.count(False)} answers differ between modes"
    assert sum(hits) >= 0.95 * len(hits), f"found {sum(hits)}/{len(hits)}; missed {missed}"
