"""One rank of the tensor-parallel tests (tests/models/test_parallel.py), run as its own process
with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set by the
test: ``python tp_worker.py CASE OUT_DIR [DEVICE]``. Writes ``OUT_DIR/rank<R>.json``.

Cases:
- ``equal``: for a tiny Llama and a tiny Qwen3 (random fp32 weights), the sharded LLM against the
  unsharded one built on this rank from the same weights: prefill logits (every position), greedy
  tokens in ``resident`` and ``offload`` (CPU: host mode) modes, batched (``max_num_seqs=2``) and
  Quest sparse decode, a sampled request (tokens reported per rank, compared by the test), the
  offload pool's KV-head count, a bad prompt raising the same ValueError on every rank, and the
  random preset loaded shard by shard against the unsharded preset.
- ``fail`` / ``fail0``: rank 1 / rank 0 raises inside a decode step; every rank reports the error
  it ends with.
"""
import json
import os
import sys
import traceback

import torch

from xoffload.engine import LLM, SamplingParams
from xoffload.models import random_model
from xoffload.sparse import QuestDecode


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def case_equal(dev):
    res = {}
    for arch in ("tiny-llama", "tiny-qwen3"):
        full = random_model(arch, dtype=torch.float32, device=dev, seed=1, std=0.15)
        r = res[arch] = {}
        ids = _prompt(40, 3)
        sp = SamplingParams(max_tokens=6, ignore_eos=True)
        for mode, kw in (("resident", {}), ("offload", {"kv_block_size": 16})):
            ref = LLM(full, mode=mode, max_model_len=96, **kw)
            tp = LLM(full, mode=mode, max_model_len=96, tensor_parallel_size=2, **kw)
            r[mode] = {"ref": ref.generate(ids, sp)[0].token_ids, "tp": tp.generate(ids, sp)[0].token_ids}
            if mode == "offload":
                r["pool_shape"] = list(tp.offload.pool.k[0].shape)
                r["pool_shape_ref"] = list(ref.offload.pool.k[0].shape)
            if mode == "resident":
                with torch.no_grad():
                    x = torch.tensor(ids, device=dev)
                    lr, lt = ref.model.forward(x), tp.model.forward(x)
                r["logit_err"] = float((lr - lt).abs().max())
                r["logit_scale"] = float(lr.abs().max())
                r["local_heads"] = [tp.model.cfg.num_heads, tp.model.cfg.num_kv_heads]
                hot = SamplingParams(max_tokens=6, temperature=0.9, seed=5, ignore_eos=True)
                r["sampled"] = tp.generate(ids, hot)[0].token_ids
                try:
                    tp.generate([1, 2, 10 ** 6])
                    r["bad_prompt"] = "no error"
                except ValueError as e:
                    r["bad_prompt"] = str(e)
                r["after_bad"] = tp.generate(ids, sp)[0].token_ids  # still serving
        # batched decode and Quest sparse decode, per rank unchanged
        prompts = [_prompt(30, 4), _prompt(45, 5)]
        kw = dict(max_model_len=96, max_num_seqs=2, kv_block_size=16)
        r["batch"] = {"ref": [o.token_ids for o in LLM(full, **kw).generate(prompts, sp)],
                      "tp": [o.token_ids for o in LLM(full, tensor_parallel_size=2, **kw).generate(prompts, sp)]}
        small = LLM(full, tensor_parallel_size=2, **{**kw, "kv_cache_tokens": 32})
        try:
            small.generate([ids], sp)  # 40 + 6 tokens never fit a 32-token pool: refused on every rank
            r["too_long"] = "no error"
        except ValueError as e:
            r["too_long"] = str(e)
        r["after_too_long"] = small.generate([prompts[0][:20]], sp)[0].token_ids
        pol = QuestDecode(token_budget=64, page_size=16, sink_tokens=16, recent_tokens=32, dense_layers=(0,))
        long = _prompt(150, 6)
        kw = dict(mode="offload", max_model_len=192, kv_block_size=32, sparse_decode=pol)
        r["quest"] = {"ref": LLM(full, **kw).generate(long, sp)[0].token_ids,
                      "tp": LLM(full, tensor_parallel_size=2, **kw).generate(long, sp)[0].token_ids}
        # a preset name: each rank draws its shard from the preset's seed (no full model on the rank)
        pre = LLM(arch, tensor_parallel_size=2, device=dev, max_model_len=64)
        un = random_model(arch, dtype=torch.float32, device=dev, seed=0)
        with torch.no_grad():
            x = torch.tensor(ids, device=dev)
            a, b = un.forward(x), pre.model.forward(x)
        r["preset_logit_err"] = float((a - b).abs().max())
        r["preset_logit_scale"] = float(a.abs().max())
    return res


def case_fail(dev, bad_rank=1):
    full = random_model("tiny-llama", dtype=torch.float32, device=dev, seed=1, std=0.15)
    llm = LLM(full, max_model_len=64, tensor_parallel_size=2)
    rank = llm.tp.rank
    if rank == bad_rank:
        orig = llm.model.decode_step
        calls = [0]

        def boom(*a, **k):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError(f"injected failure on rank {bad_rank}")
            return orig(*a, **k)

        llm.model.decode_step = boom
    llm.generate(_prompt(20, 1), SamplingParams(max_tokens=8, ignore_eos=True))
    return {"finished": True}


def main():
    case, out = sys.argv[1], sys.argv[2]
    dev = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    rank = int(os.environ["RANK"])
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # the unsharded reference on this rank's GPU too
    rec = {"rank": rank}
    code = 0
    try:
        cases = {"equal": case_equal, "fail": case_fail, "fail0": lambda d: case_fail(d, bad_rank=0)}
        rec["result"] = cases[case](dev)
    except Exception as e:
        rec["error_type"] = type(e).__name__
        rec["error"] = str(e)
        rec["traceback"] = traceback.format_exc()
        code = 1
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    sys.exit(code)


if __name__ == "__main__":
    main()
