"""Per-request state (xoffload.engine.request): stop ids and the length cap, timings."""
from xoffload.engine import LLM, SamplingParams

from .llm_helpers import tiny_llm as _tiny_llm
from .llm_helpers import tiny_random as _tiny_random


def test_eos_stops_and_length_cap():
    m = _tiny_random("tiny-llama")
    ids = list(range(10, 30))
    base = LLM(m, max_model_len=64).generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    for mode in ("gpu", "offload"):
        llm = LLM(m, mode=mode, max_model_len=64, kv_block_size=16)
        o = llm.generate(ids, SamplingParams(max_tokens=12, stop_token_ids=(stop_tok,)))[0]
        assert o.finish_reason == "stop" and o.token_ids == base.token_ids[:first + 1]
        # prompt + generated never exceeds max_model_len: 60 prompt tokens leave room for 5 new ones
        o = llm.generate(list(range(60)), SamplingParams(max_tokens=50, ignore_eos=True))[0]
        assert len(o.token_ids) == 5 and o.finish_reason == "length"
        assert o.timings["decode_steps"] == 4 and o.timings["prefill_tok_per_s"] > 0


def test_timings_fields():
    llm = _tiny_llm()
    o = llm.generate([[1, 2, 3, 4], [5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(o) == 2
    t = o[0].timings
    for k in ("prefill_ms", "prefill_tok_per_s", "ttft_ms", "decode_ms_per_token", "decode_steps", "total_ms"):
        assert k in t
    assert t["prompt_tokens"] == 4 and t["ttft_ms"] >= t["prefill_ms"] and o[0].peak_gpu_memory_bytes is None

