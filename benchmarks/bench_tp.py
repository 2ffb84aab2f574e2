"""Tensor-parallel benchmark: full-offload prefill and decode of one long request on 1 GPU vs N GPUs.

Run under torchrun on a machine with N GPUs (one process per GPU)::

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py                       # 8B shape, 128K
    torchrun --nproc-per-node 4 benchmarks/bench_tp.py --out benchmarks/results/tp_x4.json
    torchrun --nproc-per-node 4 benchmarks/bench_tp.py --preset llama-3.1-70b --ctx 32768 --skip-single \\
        --out benchmarks/results/tp_70b_x4.json

Phase 1 (unless ``--skip-single``): rank 0 alone runs the request with ``tensor_parallel_size=1``
on its GPU while the other ranks wait at a barrier; its model is freed afterwards. Phase 2: every
rank runs the same request with ``tensor_parallel_size=N``. Same random weights (the preset's
seed), same prompt, greedy. Per phase: prefill tok/s, TTFT, steady decode ms/token, H2D bytes per
token per rank and the GB/s they imply, each rank's peak GPU memory, the first tokens. Then the
speedups (decode: 1-GPU ms / N-GPU ms; prefill: N-GPU tok/s / 1-GPU tok/s) against the issue's
targets (2 GPUs: decode >= 1.8x, prefill >= 1.7x; 4 GPUs: >= 3.5x, >= 3.2x) and whether the
tokens are equal. Rank 0 writes ``benchmarks/results/tp.json`` (``--out``) with the environment
record. ``--modes`` also takes ``resident`` and ``offload-quest``.
"""
from __future__ import annotations

import os
import time
import traceback

from _common import HAS_CUDA, bench_parser, run, write_json

import torch

TARGETS = {2: {"decode": 1.8, "prefill": 1.7}, 4: {"decode": 3.5, "prefill": 3.2}}


def extra_presets():
    """Shapes not in ``xoffload.models.PRESETS`` (random weights): Llama-3.1-70B."""
    from xoffload.models import get_preset

    base = get_preset("llama-3.1-8b")
    return {"llama-3.1-70b": base.replace(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                                          num_kv_heads=8, name="llama-3.1-70b")}


def mode_options(name: str) -> dict:
    if name == "offload":
        return {"mode": "offload"}
    if name == "offload-quest":
        return {"mode": "offload", "sparse_decode": "quest"}
    if name == "resident":
        return {"mode": "resident"}
    raise ValueError(f"unknown mode {name!r}; use offload, offload-quest or resident")


def one_request(llm, ctx: int, n_new: int, seed: int = 0) -> dict:
    """Timings of one greedy request of ``ctx`` tokens in all (prompt + ``n_new``)."""
    from xoffload import SamplingParams

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, llm.cfg.vocab_size, (ctx - n_new,), generator=g).tolist()
    if llm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    o = llm.generate(ids, SamplingParams(max_tokens=n_new, ignore_eos=True))[0]
    t = o.timings
    rec = {k: t.get(k) for k in ("prompt_tokens", "prefill_tok_per_s", "ttft_ms", "decode_steady_ms_per_token",
                                 "decode_first_steps_ms", "h2d_bytes_per_token", "cache_hit_rate")}
    rec["wall_s"] = time.perf_counter() - t0
    rec["peak_gpu_memory_bytes"] = o.peak_gpu_memory_bytes
    rec["token_ids"] = o.token_ids
    if rec["h2d_bytes_per_token"] and rec["decode_steady_ms_per_token"]:
        rec["h2d_GBps_per_rank"] = rec["h2d_bytes_per_token"] / (rec["decode_steady_ms_per_token"] * 1e-3) / 1e9
    return rec


def main(argv=None):
    ap = bench_parser(__doc__, "tp", "32K instead of 128K")
    ap.add_argument("--preset", default="llama-3.1-8b", help="model shape (random weights), incl. llama-3.1-70b")
    ap.add_argument("--ctx", type=int, default=None, help="tokens per request, prompt + new (default 131072)")
    ap.add_argument("--n-new", type=int, default=24, help="tokens generated (first 2 steps: warm-up, capture)")
    ap.add_argument("--modes", default="offload", help="comma-separated: offload, offload-quest, resident")
    ap.add_argument("--skip-single", action="store_true", help="no 1-GPU phase (a model one GPU cannot hold)")
    ap.add_argument("--no-cuda-graph", action="store_true", help="eager decode (cuda_graph=False)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of this script (gloo; "
                    "e.g. --preset tiny-llama --ctx 64 --n-new 4)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not HAS_CUDA:
        print("bench_tp: no CUDA GPU, skipped")
        return 0
    import torch.distributed as dist

    from xoffload import LLM
    from xoffload.models.parallel import init_tensor_parallel

    n = int(os.environ.get("WORLD_SIZE", "1"))
    tp = init_tensor_parallel(n, a.device) if n > 1 else None
    rank = tp.rank if tp is not None else 0
    ctx = a.ctx or (32768 if a.quick else 131072)
    presets = extra_presets()
    model = presets.get(a.preset, a.preset)
    common = dict(max_model_len=ctx, cuda_graph=not a.no_cuda_graph, device=a.device)
    res = {"name": "tp", "preset": a.preset, "ctx": ctx, "n_new": a.n_new, "world_size": n,
           "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), "results": {}, "errors": {}, "tracebacks": {}}
    if tp is not None:
        res["numa"] = [None] * n
        dist.all_gather_object(res["numa"], {"node": tp.numa_node, "cpus": len(tp.numa_cpus or [])})
    for mname in a.modes.split(","):
        opts = {**common, **mode_options(mname)}
        row = res["results"][mname] = {}
        if not a.skip_single:
            if rank == 0:
                try:
                    llm = LLM(model, **opts)
                    row["gpus_1"] = one_request(llm, ctx, a.n_new)
                    llm.close()
                    del llm
                except Exception as e:  # keep going: the N-GPU phase still runs
                    res["errors"][f"{mname}/gpus_1"] = f"{type(e).__name__}: {e}"
                    res["tracebacks"][f"{mname}/gpus_1"] = traceback.format_exc()
                if a.device == "cuda":
                    torch.cuda.empty_cache()
                print(f"[{mname}] 1 GPU: {row.get('gpus_1')}", flush=True)
            if tp is not None:
                tp.barrier()
        if n > 1:
            llm = LLM(model, tensor_parallel_size=n, **opts)
            rec = one_request(llm, ctx, a.n_new)
            peaks = [None] * n
            dist.all_gather_object(peaks, rec["peak_gpu_memory_bytes"])
            toks = [None] * n
            dist.all_gather_object(toks, rec["token_ids"])
            rec["peak_gpu_memory_bytes_per_rank"] = peaks
            rec["tokens_equal_across_ranks"] = all(t == toks[0] for t in toks)
            row[f"gpus_{n}"] = rec
            llm.close()
            del llm
            if a.device == "cuda":
                torch.cuda.empty_cache()
            if rank == 0:
                print(f"[{mname}] {n} GPUs: {rec}", flush=True)
        one, many = row.get("gpus_1"), row.get(f"gpus_{n}")
        if one and many:
            sp = {"decode": one["decode_steady_ms_per_token"] / many["decode_steady_ms_per_token"],
                  "prefill": many["prefill_tok_per_s"] / one["prefill_tok_per_s"],
                  "tokens_equal_to_1_gpu": one["token_ids"] == many["token_ids"]}
            tg = TARGETS.get(n)
            if tg:
                sp["targets"] = tg
                sp["meets"] = {k: sp[k] >= v for k, v in tg.items()}
            row["speedup"] = sp
            if rank == 0:
                print(f"[{mname}] speedup x{n}: {sp}", flush=True)
    if rank == 0:
        print("wrote", write_json(a.out, res))
        if res["errors"]:
            print("errors:", res["errors"])
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    run(main)
