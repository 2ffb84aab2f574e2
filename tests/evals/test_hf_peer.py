"""The transformers peer (xoffload.evals.hf_peer, mode ``hf``): transformers' model holding our
weight tensors computes our logits (tiny random Llama with Llama-3 RoPE scaling, tiny Qwen3 with
tied embeddings); on the real SmolLM2 (fp32, CPU) ``xoffload eval --modes resident,hf`` answers
every sample with the same tokens and the records say so sample by sample.

CPU time: ~20 s for the SmolLM2 test (3 prompts of 1K, 10 answer tokens, in both modes)."""
import argparse
import json

import pytest
import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.evals.cli import add_eval_parser
from xoffload.evals.hf_peer import (HFPeerLLM, check_source, first_diff, hf_from_ours, hf_peer_llm,
                                    stop_token_ids)
from xoffload.kernels import cpu_backend
from xoffload.models import get_preset, random_model


def test_first_diff():
    assert first_diff([1, 2, 3], [1, 2, 3]) is None
    assert first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert first_diff([1, 2], [1, 2, 3]) == 2 and first_diff([], [4]) == 0 and first_diff([], []) is None


@pytest.mark.parametrize("name,scaling", [
    ("tiny-llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32}),
    ("tiny-qwen3", None),
])
def test_hf_from_ours_same_logits_no_copy(name, scaling):
    cfg = get_preset(name).replace(rope_scaling=scaling, eos_token_ids=(7,))
    ours = random_model(cfg, dtype=torch.float32, device="cpu", seed=3, std=0.08)
    hf = hf_from_ours(ours)
    assert type(hf).__name__ == ("Qwen3ForCausalLM" if name == "tiny-qwen3" else "LlamaForCausalLM")
    assert hf.config._attn_implementation == "sdpa"
    # the very same storage: no copy of the weights
    q = hf.model.layers[0].self_attn.q_proj.weight
    assert q.data_ptr() == ours.w.layers[0].wqkv.data_ptr() and not q.requires_grad
    assert hf.lm_head.weight.data_ptr() == ours.w.lm_head.data_ptr()
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(1))  # past 32: scaled RoPE
    with torch.no_grad(), cpu_backend("reference"):
        ref = ours.forward(ids, chunk=32)
        got = hf(ids[None]).logits[0].float()
    err = (got - ref).abs().max().item()
    assert err < 1e-4 * max(1.0, ref.abs().max().item()), f"{name}: max logit error {err}"
    assert list(hf.generation_config.eos_token_id) == [7] and hf.generation_config.do_sample is False


def test_hf_peer_llm_interface_and_stop_ids():
    cfg = get_preset("tiny-llama").replace(eos_token_ids=(5,))
    ours = random_model(cfg, dtype=torch.float32, device="cpu", seed=0, std=0.3)
    peer = hf_peer_llm(ours, max_model_len=64)
    assert peer.stop_ids == stop_token_ids(ours) == (5,)
    assert tuple(sorted(LLM(ours, max_model_len=64).engine.stop_ids)) == peer.stop_ids  # the LLM's own rule
    ids = list(range(1, 60))
    o = peer.generate(ids, SamplingParams(max_tokens=16))[0]
    assert o.prompt_token_ids == ids and o.finish_reason in ("stop", "length")
    assert 1 <= len(o.token_ids) <= 6  # capped so that prompt + answer <= max_model_len + 1, as LLM does
    assert (o.finish_reason == "stop") == (o.token_ids[-1] == 5)
    assert len(o.timings["top2_gap"]) == len(o.token_ids) and all(g >= 0 for g in o.timings["top2_gap"])
    assert o.text is None  # no tokenizer
    with pytest.raises(ValueError, match="greedily only"):
        peer.generate(ids, SamplingParams(temperature=0.5))
    with pytest.raises(ValueError, match="unknown hf weights"):
        hf_peer_llm(ours, weights="theirs")
    with pytest.raises(ValueError, match="HF model directory or a .gguf file"):
        check_source(ours.source)  # random weights: transformers has nothing to load
    assert isinstance(peer, HFPeerLLM)


def test_eval_resident_vs_hf_agree_per_sample_cpu(tmp_path, capsys, monkeypatch, smol):
    import xoffload.models as models

    monkeypatch.setattr(models, "load_model", lambda model=None, **kw: smol, raising=False)
    p = argparse.ArgumentParser(prog="xoffload")
    add_eval_parser(p.add_subparsers(dest="cmd"))
    out = tmp_path / "res"
    a = p.parse_args(["eval", "--device", "cpu", "--tasks", "niah_single_1,vt,fwe", "--lengths", "1024",
                      "--samples", "1", "--modes", "resident,hf", "--out", str(out), "--no-progress",
                      "--max-new-tokens", "10"])
    rc = a.func(a)
    text = capsys.readouterr().out
    assert rc == 0, text
    data = json.loads((out / "ruler.json").read_text())
    assert data["modes"] == ["resident", "hf"] and data["peer"] == "hf"
    assert data["meta"]["hf_weights"] == "ours" and data["meta"]["hf_stop_token_ids"] == list(stop_token_ids(smol))
    hf = {(r["task"], r["index"]): r for r in data["records"] if r["mode"] == "hf"}
    ours = [r for r in data["records"] if r["mode"] == "resident"]
    assert len(ours) == len(hf) == 3
    for r in ours:  # per sample: the same tokens as transformers' greedy answer, and the records say so
        h = hf[(r["task"], r["index"])]
        assert r["generated_ids"] == h["generated_ids"], (r["task"], r["prediction"], h["prediction"],
                                                          r["hf_first_diff"], r["hf_top2_gap_at_diff"])
        assert r["hf_same_tokens"] is True and r["hf_first_diff"] is None and "hf_generated_ids" not in r
        assert h["max_new_tokens"] == r["max_new_tokens"] == 10 and h["prompt_sha1"] == r["prompt_sha1"]
        assert len(h["timings"]["top2_gap"]) == len(h["generated_ids"])
    pa = data["peer_agreement"]["resident"]
    assert pa["token_identical"] == pa["total"] == 3 and pa["differing"] == []
    assert data["agreement"]["hf"]["token_identical"] == 3
    assert "hf vs resident: token-identical answers 3/3" in text
