"""Tensor parallel (xoffload.models.parallel): two ranks on the CPU with gloo (separate processes
with torchrun's environment, tests/models/tp_worker.py) give the unsharded model's greedy tokens
and logits for a tiny Llama and a tiny Qwen3 in both modes; the per-rank pool holds half the KV
heads; a rank that raises ends every rank with an error naming it, within a timeout; the sharded
loaders give slices of the full weights; counts not divisible by N raise.

Logit tolerance: the sharded model adds the ranks' partial o-/down-projection sums instead of one
dot product, a reordering of fp32 sums; over these 2-layer models that moves the logits by a few
fp32 ulps of the logit scale (measured ~5), bounded here by 64 ulps.
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from xoffload.engine import LLM
from xoffload.models import get_preset, load_hf_dir, random_model
from xoffload.models.parallel import (TensorParallel, bind_numa_node, check_divisible, gpu_numa_node, load_hf_sharded,
                                      load_sharded, local_config, parse_cpulist, random_sharded, shard_model)

EPS32 = torch.finfo(torch.float32).eps
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(WORKER)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(case: str, out, n: int = 2, device: str = "cpu", timeout: float = 90, tp_timeout: int = 20):
    """Run ``n`` worker processes as torchrun would (one per rank); returns (records, return codes,
    seconds). Kills them all (by pid) if they outlive ``timeout``."""
    port = _free_port()
    procs = []
    t0 = time.monotonic()
    for r in range(n):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), XOFFLOAD_TP_TIMEOUT_S=str(tp_timeout),
                   OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        log = open(os.path.join(out, f"log{r}.txt"), "w")
        procs.append(subprocess.Popen([sys.executable, WORKER, case, str(out), device], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0))))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = {r: open(os.path.join(out, f"log{r}.txt")).read()[-2000:] for r in range(n)}
        pytest.fail(f"tensor-parallel workers still running after {timeout} s (a hang); logs: {logs}")
    secs = time.monotonic() - t0
    recs = []
    for r in range(n):
        path = os.path.join(out, f"rank{r}.json")
        if not os.path.isfile(path):
            pytest.fail(f"rank {r} wrote no record (exit {codes[r]}): "
                        f"{open(os.path.join(out, f'log{r}.txt')).read()[-3000:]}")
        with open(path) as f:
            recs.append(json.load(f))
    return recs, codes, secs


def _check_equal(recs, codes):
    for rec, c in zip(recs, codes):
        assert c == 0, f"rank {rec['rank']}: {rec.get('traceback')}"
    r0, r1 = recs[0]["result"], recs[1]["result"]
    assert r0 == r1  # every rank returns the same tokens (sampled ones too) and sees the same logits
    for arch, r in r0.items():
        cfg = get_preset(arch)
        for mode in ("resident", "offload"):
            assert r[mode]["tp"] == r[mode]["ref"], (arch, mode)
        assert r["batch"]["tp"] == r["batch"]["ref"], arch
        assert r["quest"]["tp"] == r["quest"]["ref"], arch
        assert r["logit_err"] <= 64 * EPS32 * r["logit_scale"], (arch, r["logit_err"], r["logit_scale"])
        assert r["preset_logit_err"] <= 64 * EPS32 * r["preset_logit_scale"], arch
        assert r["local_heads"] == [cfg.num_heads // 2, cfg.num_kv_heads // 2]
        # the pool: [blocks, block, Hkv, D]: half the KV heads per rank
        assert r["pool_shape"] == r["pool_shape_ref"][:2] + [cfg.num_kv_heads // 2, cfg.head_dim]
        assert r["pool_shape_ref"][2] == cfg.num_kv_heads
        assert "outside the vocabulary" in r["bad_prompt"]
        assert r["after_bad"] == r["resident"]["ref"]
        assert len(r["sampled"]) == 6
        assert "32" in r["too_long"] and len(r["after_too_long"]) == 6  # refused alike, still serving


def test_two_ranks_equal_unsharded(tmp_path):
    """2 ranks (gloo): tiny Llama and tiny Qwen3 equal to unsharded — tokens in resident, offload,
    batched and Quest decode, prefill logits; a random preset loaded shard by shard; same on
    every rank; the pool holds half the KV heads; a bad prompt raises on every rank and the LLM
    keeps serving."""
    recs, codes, _ = _launch("equal", tmp_path)
    _check_equal(recs, codes)


def test_rank_failure_ends_all_ranks(tmp_path):
    """Rank 1 raises in its second decode step: rank 1 ends with its error, rank 0 (blocked in a
    collective) ends with a TensorParallelError naming rank 1 and the error; no hang."""
    recs, codes, secs = _launch("fail", tmp_path, timeout=60, tp_timeout=20)
    assert codes == [1, 1], codes
    assert recs[1]["error_type"] == "RuntimeError" and "injected failure on rank 1" in recs[1]["error"]
    assert recs[0]["error_type"] == "TensorParallelError", recs[0]
    assert "rank 1 raised RuntimeError: injected failure on rank 1" in recs[0]["error"]
    assert secs < 55


def test_rank0_failure_ends_rank1(tmp_path):
    """Rank 0 (the store's host here) raises: rank 1 still ends with a TensorParallelError, no hang."""
    recs, codes, secs = _launch("fail0", tmp_path, timeout=60, tp_timeout=20)
    assert codes == [1, 1], codes
    assert "injected failure on rank 0" in recs[0]["error"]
    assert recs[1]["error_type"] == "TensorParallelError" and "rank" in recs[1]["error"], recs[1]
    assert secs < 55


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_equal_unsharded(tmp_path):
    """The same equality on 2 GPUs with NCCL (fp32 weights, so the tolerance is the CPU one)."""
    recs, codes, _ = _launch("equal", tmp_path, device="cuda", timeout=300, tp_timeout=120)
    _check_equal(recs, codes)


# ---------------------------------------------------------------------------- in one process
@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
def test_random_shards_are_slices_of_the_unsharded_model(arch):
    """Each rank's shard of a random preset (drawn tensor by tensor) equals the slice of the
    unsharded model's weights; concatenated over the ranks they give the whole model back."""
    full = random_model(arch, dtype=torch.float32, device="cpu", seed=3)
    cfg, n = full.cfg, 2
    shards = [random_sharded(arch, TensorParallel(r, n), dtype=torch.float32, seed=3) for r in range(n)]
    for r, s in enumerate(shards):
        ref = shard_model(full, TensorParallel(r, n))
        for a, b in zip(s.w.layers, ref.w.layers):
            for f in ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down", "q_norm", "k_norm"):
                x, y = getattr(a, f), getattr(b, f)
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (r, f)
        assert torch.equal(s.w.embed, ref.w.embed) and torch.equal(s.w.lm_head, ref.w.lm_head)
        assert (s.w.lm_head is s.w.embed) == cfg.tie_word_embeddings
        assert s.cfg.num_kv_heads == cfg.num_kv_heads // n and s.cfg.vocab_size == cfg.vocab_size
    assert torch.equal(torch.cat([s.w.embed for s in shards]), full.w.embed)
    assert torch.equal(torch.cat([s.w.layers[0].wo for s in shards], 1), full.w.layers[0].wo)
    assert torch.equal(torch.cat([s.w.layers[1].w_down for s in shards], 1), full.w.layers[1].w_down)
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    k_rows = torch.cat([s.w.layers[0].wqkv[hq // n * d:(hq + hkv) // n * d] for s in shards])
    assert torch.equal(k_rows, full.w.layers[0].wqkv[hq * d:(hq + hkv) * d])


def test_hf_sharded_loader_reads_slices(tmp_path):
    """A HF directory loaded shard by shard (safetensors slices) equals the full load's shards."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hc = transformers.Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    transformers.Qwen3ForCausalLM(hc).save_pretrained(str(tmp_path))
    full = load_hf_dir(str(tmp_path), dtype=torch.float32, device="cpu", load_tokenizer=False)
    for r in range(2):
        tp = TensorParallel(r, 2)
        a = load_hf_sharded(str(tmp_path), tp, dtype=torch.float32, load_tokenizer=False)
        b = shard_model(full, tp)
        for la, lb in zip(a.w.layers, b.w.layers):
            for f in ("wqkv", "wo", "w_gate_up", "w_down", "q_norm", "k_norm", "attn_norm"):
                assert torch.equal(getattr(la, f), getattr(lb, f)), (r, f)
        assert torch.equal(a.w.embed, b.w.embed) and torch.equal(a.w.lm_head, b.w.lm_head)
    assert load_sharded(str(tmp_path), TensorParallel(1, 2), dtype=torch.float32).tp.rank == 1


def test_gguf_sharded_loader_slices_smollm2():
    """SmolLM2's GGUF (9 heads, 3 KV heads: N=3) loaded as rank 1 of 3, one tensor dequantized at a
    time, equals the full load's shard; N=2 is refused naming the KV heads."""
    from xoffload.models import find_smollm2_gguf, load_gguf
    from xoffload.models.parallel import load_gguf_sharded

    try:
        path = find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tp = TensorParallel(1, 3)
    a = load_gguf_sharded(path, tp, dtype=torch.float32, load_tokenizer=False)
    b = shard_model(load_gguf(path, dtype=torch.float32, device="cpu", load_tokenizer=False), tp)
    for la, lb in zip(a.w.layers, b.w.layers):
        for f in ("wqkv", "wo", "w_gate_up", "w_down", "attn_norm", "mlp_norm"):
            assert torch.equal(getattr(la, f), getattr(lb, f)), f
    assert torch.equal(a.w.embed, b.w.embed) and a.w.lm_head is a.w.embed  # tied
    assert (a.cfg.num_heads, a.cfg.num_kv_heads, a.cfg.vocab_size) == (3, 1, 49152)
    with pytest.raises(ValueError, match=r"num_kv_heads=3 .*tensor_parallel_size=2"):
        load_gguf_sharded(path, TensorParallel(0, 2), load_tokenizer=False)


def test_not_divisible_raises_naming_the_numbers():
    cfg = get_preset("tiny-llama")  # 4 heads, 2 KV heads, intermediate 128, vocab 256
    with pytest.raises(ValueError, match=r"num_kv_heads=2 .*tensor_parallel_size=4"):
        check_divisible(cfg, 4)
    with pytest.raises(ValueError, match=r"vocab_size=255 .*tensor_parallel_size=2"):
        local_config(cfg.replace(vocab_size=255), 2)
    with pytest.raises(ValueError, match=r"intermediate_size=100 .*tensor_parallel_size=8"):
        check_divisible(cfg.replace(num_heads=8, num_kv_heads=8, intermediate_size=100), 8)
    with pytest.raises(ValueError, match=r"num_kv_heads=2 .*tensor_parallel_size=4"):
        random_sharded("tiny-llama", TensorParallel(0, 4))
    assert local_config(cfg, 2).num_kv_heads == 1


def test_llm_tensor_parallel_needs_torchrun(monkeypatch):
    for k in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match=r"torchrun --nproc-per-node 2"):
        LLM("tiny-llama", tensor_parallel_size=2, device="cpu")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 but WORLD_SIZE=3"):
        LLM("tiny-llama", tensor_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM("tiny-llama", tensor_parallel_size=0, device="cpu")
    with pytest.raises(ValueError, match="rank 2 outside"):
        TensorParallel(2, 2)


def test_numa_helpers(tmp_path):
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    with pytest.raises(ValueError, match="malformed"):
        parse_cpulist("0-x")
    assert gpu_numa_node("cpu") is None
    assert bind_numa_node(None) is None
    assert bind_numa_node(0, sysfs=str(tmp_path)) is None  # no such sysfs file: nothing changed
    before = os.sched_getaffinity(0)
    node = tmp_path / "devices" / "system" / "node" / "node0"
    node.mkdir(parents=True)
    node.joinpath("cpulist").write_text(",".join(map(str, sorted(before))))
    try:
        assert bind_numa_node(0, sysfs=str(tmp_path)) == sorted(before)
    finally:
        os.sched_setaffinity(0, before)
