"""``LLM``: generation with the KV cache where the ``mode``'s store keeps it — on the model's device
(``"resident"``, alias ``"gpu"``) or offloaded to pinned CPU memory through
:class:`xoffload.runtime.OffloadEngine` (``"offload"``).

With ``max_num_seqs=1`` (the default) requests are served one after another; each gets a fresh KV
store (:mod:`.kv_store`) that is closed at the end, also when the request fails, so calls share
nothing but the weights (and, in offload mode, the engine's pool). With ``max_num_seqs > 1`` a
call's prompts are decoded together with continuous batching (:mod:`.runner`, :mod:`.scheduler`,
:mod:`.kv_batch`). Options: :class:`~.config.EngineConfig`; sampling: :mod:`.sampling`;
per-request state and timings: :mod:`.request`; the CUDA-graph decode: :mod:`.cuda_graph`.
"""
from __future__ import annotations

import contextlib

import torch
from tqdm.auto import tqdm

from ..kernels import cpu_backend
from ..models.llama import LlamaModel
from ..models.loader import load_model, resolve_dtype_device
from .config import EngineConfig
from .cuda_graph import GraphDecode
from .kv_store import store_class
from .request import Clock, Request, RequestOutput, TokenLog, request_timings
from .runner import BatchRunner
from .sampling import SamplingParams, sample

__all__ = ["LLM"]

#: decode steps before the steady state (step 1 eager warm-up, step 2 graph capture)
_STEADY_FROM = 2


class LLM:
    """Generate with a Llama/Qwen3 model, KV cache resident on its device or offloaded to CPU memory.

    Args:
        model: what :func:`~xoffload.models.loader.load_model` accepts — None / ``"smollm2"`` (the
            default SmolLM2-135M-Instruct GGUF), a ``.gguf`` path, a HF directory, a preset name
            (random weights), a ModelConfig, or a loaded :class:`LlamaModel` (weights are shared).
        **options: the fields of :class:`~xoffload.engine.config.EngineConfig` (``mode``,
            ``num_kv_buffers``, ``kv_block_size``, ``max_model_len``, ``dtype``, ``device``,
            ``sparse``, ``prefill_chunk``, ``prefill_attn``, ``seed``, ``cuda_graph``,
            ``sparse_decode``, ``token_budget``, ``offload_decode``, ``max_num_seqs``,
            ``max_num_batched_tokens``, ``kv_cache_tokens``, ``tensor_parallel_size``).

    With ``tensor_parallel_size=N > 1`` this is one rank of a group started by ``torchrun
    --nproc-per-node N`` (:mod:`xoffload.models.parallel`): the model is this rank's shard, rank 0
    checks and tokenizes the prompts and broadcasts them, every rank runs the same loop and
    returns the same outputs; ``tp`` is the rank's ``TensorParallel`` (None with one device).

    Attributes: ``config`` (the bound :class:`EngineConfig`), ``mode`` (canonical name),
    ``policy`` (the prefill policy object), ``sparse_layers`` (layers it applies to), ``engine``
    (the offload engine, None for a store that shares nothing), ``model``, ``tokenizer``,
    ``batch_stats`` (after a batched generate: per decode step the sequences, padded rows and ms;
    per prefill its tokens and ms; decode tok/s; the most sequences that ran at once; the buckets
    whose CUDA graph was captured).

    On the CPU the attention kernels run their PyTorch references (exact fp32) inside
    :meth:`generate`, whatever ``TRITON_INTERPRET`` says. Raises ValueError / TypeError on bad
    options, FileNotFoundError when the model is missing.
    """

    def __init__(self, model=None, **options):
        cfg = EngineConfig.from_kwargs(**options)
        self.tp = None
        if cfg.tensor_parallel_size > 1:  # one rank of a tensor-parallel group (torchrun)
            from ..models.parallel import tensor_parallel_model

            self.model = tensor_parallel_model(model, cfg)
            self.tp = self.model.tp
        elif isinstance(model, LlamaModel):
            self.model = model
        else:
            dt, dev = resolve_dtype_device(cfg.dtype, cfg.device)
            self.model = load_model(model, dtype=dt, device=dev, seed=cfg.seed)
        m = self.model
        self.config = cfg = cfg.bind(m)
        self.cfg, self.device, self.dtype, self.tokenizer = m.cfg, m.device, m.dtype, m.tokenizer
        self.mode, self.seed, self.cuda_graph = cfg.mode, cfg.seed, cfg.cuda_graph
        self.max_model_len, self.prefill_chunk, self.prefill_attn = cfg.max_model_len, cfg.prefill_chunk, cfg.prefill_attn
        self.policy = cfg.policy
        self.sparse_layers = self.policy.layers(self.cfg.num_layers)
        self._store = store_class(cfg.mode).variant(cfg)  # chosen once; per request: .for_request(...)
        self.engine = self._store.open_shared(m, cfg)
        self._closed, self._shares = False, self.engine is not None
        self._runner = BatchRunner(self) if cfg.max_num_seqs > 1 else None
        self.batch_stats: dict = {}
        self._sessions: dict = {}  # live sessions by id (see session())
        self.prefix_cache = None
        if cfg.prefix_caching and self.engine is not None:  # offload: over the pinned pool, for good
            from ..runtime import PrefixCache

            self.prefix_cache = PrefixCache(self.engine)  # (resident: per batched call, in its GPU pool)
        self._stop_ids = set(self.cfg.eos_token_ids)
        tok = self.tokenizer
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            self._stop_ids.add(int(tok.eos_token_id))

    # ------------------------------------------------------------------ prompts
    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list:
        """Token ids of a chat (a user string or a list of ``{"role", "content"}`` dicts) through the
        tokenizer's chat template. Raises ValueError without a tokenizer or chat template."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError(f"model {self.model.source} has no tokenizer; pass token ids")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"tokenizer of {self.model.source} has no chat template")
        ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(x) for x in ids]

    def encode(self, text: str) -> list:
        """Token ids of raw text (the tokenizer's default special tokens)."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.model.source} has no tokenizer; pass token ids instead of text")
        return [int(x) for x in self.tokenizer.encode(text)]

    def decode(self, ids) -> str | None:
        """Text of token ids (special tokens skipped); None for a model without a tokenizer (the
        random-weight presets)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _normalize(self, prompts) -> list:
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
            if prompts and isinstance(prompts[0], int):
                prompts = [prompts]
        if isinstance(prompts, str):
            prompts = [prompts]
        elif isinstance(prompts, (list, tuple)):
            if len(prompts) == 0:
                raise ValueError("prompts is empty: pass a string, a list of token ids, or a list of those")
            if all(isinstance(x, int) and not isinstance(x, bool) for x in prompts):
                prompts = [list(prompts)]
        else:
            raise TypeError(f"prompts must be str, list of ids, or a list of those; got {type(prompts).__name__}")
        return [self._prompt_ids(i, p) for i, p in enumerate(prompts)]

    def _prompt_ids(self, i: int, p) -> list:
        if isinstance(p, str):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            ids = self.encode(p)
        elif isinstance(p, (list, tuple)) or isinstance(p, torch.Tensor):
            ids = p.tolist() if isinstance(p, torch.Tensor) else list(p)
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
                raise TypeError(f"prompt {i}: token ids must be ints")
        else:
            raise TypeError(f"prompt {i} must be a str or a list of token ids, got {type(p).__name__}")
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty (0 tokens)")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        V = self.cfg.vocab_size
        bad = [x for x in ids if x < 0 or x >= V]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} outside the vocabulary [0, {V})")
        return ids

    # ------------------------------------------------------------------ sessions
    def session(self, *, history_budget: int | None = None, dense_layers=None,
                recent_pages: int = 4):
        """A conversation whose KV stays stored between turns (:class:`~.session.Session`):
        ``s.generate(prompt, params)`` / ``s.chat(message, params)`` prefill only the new tokens
        against the stored history (dense, or the Quest-chosen pages of it with
        ``history_budget`` tokens per KV head) and answer; ``s.close()`` frees the KV. In offload
        mode the history stays in the pinned pool; idle sessions are evicted (LRU) when a turn or
        a request needs the room. Raises ValueError for ``max_num_seqs > 1``, the ring offload
        store and bad options."""
        from .session import Session

        return Session(self, history_budget=history_budget, dense_layers=dense_layers, recent_pages=recent_pages)

    def _reclaimable_blocks(self, keep=None) -> int:
        """Pool blocks that evicting every idle session (not ``keep``, none in a turn) and the
        prefix cache could free: allocated blocks that no other live engine sequence holds."""
        eng = self.engine
        if eng is None:
            return 0
        idle = {s.seq for s in self._sessions.values() if s is not keep and not s._busy and s.seq is not None}
        protected = set()
        for sid in eng.sequences():
            if sid not in idle:
                protected.update(eng.block_table(sid))
        return eng.allocator.num_blocks - eng.num_free_blocks - len(protected)

    def _make_room(self, blocks: int, keep=None) -> int:
        """Evict idle sessions, least recently used first, until the offload pool has ``blocks``
        free blocks counting what the prefix cache can evict (or no idle session is left); never
        ``keep`` or a session in a turn. Returns the sessions' blocks released."""
        eng = self.engine
        if eng is None:
            return 0
        freed = 0

        def room():
            cache = self.prefix_cache.evictable_blocks() if self.prefix_cache is not None else 0
            return eng.num_free_blocks + cache

        for s in sorted(self._sessions.values(), key=lambda s: s._last_used):
            if room() >= blocks:
                break
            if s is keep or s._busy or s.seq is None:
                continue
            freed += s.evict()
        return freed

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = False) -> list:
        """Generate for each prompt: one after another (``max_num_seqs=1``), or decoded together
        with continuous batching (``max_num_seqs > 1``: :mod:`xoffload.engine.runner`).

        Args:
            prompts: a string, a list of token ids, or a list of strings / token-id lists (a
                1-D/2-D int tensor works too). Strings are tokenized as they are (no chat
                template: see :meth:`apply_chat_template`).
            sampling_params: one :class:`SamplingParams` for every prompt (default greedy, 64
                tokens), or a list of them, one per prompt.
            use_tqdm: show a progress bar (batched: finished requests, prefill and decode tok/s).
        Returns:
            list of :class:`RequestOutput`, one per prompt, in the order of ``prompts``.
        Raises:
            ValueError / TypeError on an empty prompt, one longer than ``max_model_len``, ids
            outside the vocabulary, a string without a tokenizer, a list of sampling parameters
            of another length than the prompts, and (batched) a prompt whose KV alone can never
            fit the store (the sizes named). All prompts are checked before any runs; a failed
            request frees its KV and the LLM keeps serving.
        """
        if self._closed and self._shares:
            raise ValueError("this LLM was closed; create a new one")
        batch, sps = self._inputs(prompts, sampling_params)
        ctx = cpu_backend("reference") if self.device.type == "cpu" else contextlib.nullcontext()
        with ctx, torch.no_grad(), (self.tp.guard() if self.tp is not None else contextlib.nullcontext()):
            if self._runner is not None:
                try:
                    return self._runner.run(batch, sps, use_tqdm=use_tqdm)
                finally:
                    self.batch_stats = self._runner.stats
            self._check_pool(batch, sps)
            it = tqdm(list(zip(batch, sps)), desc="requests") if use_tqdm else zip(batch, sps)
            return [self._run_one(ids, sp) for ids, sp in it]

    def _check_pool(self, batch, sps) -> None:
        """One request at a time in offload mode: every request's KV in the pinned pool
        (``kv_cache_tokens``) must fit it by itself — the prompt, and with the ring decode its new
        tokens too (the ring appends them to the pool); ValueError naming the sizes before any
        request runs."""
        eng = self.engine
        if eng is None:
            return
        B, total = eng.block_size, eng.allocator.num_blocks
        ring = self.config.offload_decode == "ring"
        for i, (ids, sp) in enumerate(zip(batch, sps)):
            n = len(ids) + (min(sp.max_tokens, self.max_model_len - len(ids) + 1) - 1 if ring else 0)
            if -(-n // B) > total:
                what = f"{len(ids)} prompt + {n - len(ids)} new tokens" if ring else f"{len(ids)} prompt tokens"
                raise ValueError(f"prompt {i} needs {-(-n // B) * B} tokens of KV in the CPU pool ({what} in blocks "
                                 f"of {B}) but the pool holds {total * B} tokens (kv_cache_tokens="
                                 f"{self.config.kv_cache_tokens})")

    def _inputs(self, prompts, sampling_params):
        """Checked prompt ids and sampling parameters; tensor parallel: rank 0 checks (and
        tokenizes) them and broadcasts them, or the error, so every rank runs or raises alike."""
        if self.tp is None:
            batch = self._normalize(prompts)
            return batch, self._sampling_list(sampling_params, len(batch))
        msg = None
        if self.tp.is_driver:
            try:
                batch = self._normalize(prompts)
                msg = ("ok", batch, self._sampling_list(sampling_params, len(batch)))
            except (ValueError, TypeError) as e:
                msg = ("error", type(e).__name__, str(e))
        msg = self.tp.broadcast_object(msg)
        if msg[0] == "error":
            raise (ValueError if msg[1] == "ValueError" else TypeError)(msg[2])
        return msg[1], msg[2]

    @staticmethod
    def _sampling_list(sp, n: int) -> list:
        if sp is None:
            sp = SamplingParams()
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if isinstance(sp, (list, tuple)):
            if len(sp) != n:
                raise ValueError(f"sampling_params is a list of {len(sp)}, but there are {n} prompts")
            for i, x in enumerate(sp):
                if not isinstance(x, SamplingParams):
                    raise TypeError(f"sampling_params[{i}] must be SamplingParams, got {type(x).__name__}")
            return list(sp)
        raise TypeError(f"sampling_params must be SamplingParams or a list of them, got {type(sp).__name__}")

    def _run_one(self, ids: list, sp: SamplingParams) -> RequestOutput:
        if self.prefix_cache is not None:  # a one-turn session: reuses, then leaves, its blocks
            from .session import Session

            with Session(self) as s:
                out = s.generate(ids, sp)
            out.prompt_token_ids = list(ids)
            return out
        dev = self.device
        cuda = dev.type == "cuda"
        req = Request.make(ids, sp, max_model_len=self.max_model_len, seed=self.seed, stop_ids=self._stop_ids,
                           device=dev)
        clock = Clock(dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        ids_t = torch.tensor(ids, dtype=torch.int64).to(dev)
        marks = {"t0": clock.mark()}
        if self.engine is not None and self._sessions:  # idle sessions give way to a request
            pooled = req.final_len if self.config.offload_decode == "ring" else len(ids)  # else: GPU tail
            self._make_room(-(-pooled // self.engine.block_size))
        kv = self._store.for_request(self.model, self.engine, req, self.config)
        densities = None if self.policy.dense else []
        try:
            tok = self._prefill(ids_t, kv, req, densities, clock, marks)
        except BaseException:
            kv.close()
            raise
        return self._decode_output(tok, kv, req, clock, marks, ids, densities)

    def _decode_output(self, tok, kv, req: Request, clock: Clock, marks: dict, prompt_ids: list, densities,
                       extra: dict | None = None) -> RequestOutput:
        """Decode after the first token ``tok`` (:meth:`_decode_loop`), close ``kv`` (also on an
        error) and build the request's output: timings (``extra`` merged in), the store's figures,
        peak GPU memory since the request's start."""
        try:
            all_ids = self._decode_loop(tok, kv, req, clock, marks)
            h2d, stats = kv.h2d_bytes_per_step, kv.decode_stats()
        finally:
            kv.close()
        out_ids, reason = req.finish(all_ids)
        timings = request_timings(clock, marks, len(prompt_ids), len(all_ids) - 1, densities)
        timings.update(extra or {})
        if h2d is not None:
            timings["h2d_bytes_per_token"] = int(h2d)
        timings.update(stats)
        peak = int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else None
        return RequestOutput(prompt_token_ids=list(prompt_ids), token_ids=out_ids, text=self.decode(out_ids),
                             finish_reason=reason, timings=timings, peak_gpu_memory_bytes=peak)

    def _prefill(self, ids_t, kv, req: Request, densities, clock: Clock, marks: dict) -> torch.Tensor:
        """Layerwise prefill into ``kv``; returns the first token (device). Marks ``prefill`` and
        ``first``."""
        logits = self.model.prefill(ids_t, kv, chunk=self.prefill_chunk, policy=self.policy,
                                    densities=densities, attn_backend=self.prefill_attn)
        marks["prefill"] = clock.mark()
        tok = sample(logits, req.sp, req.gen)
        marks["first"] = clock.mark()
        return tok

    def _decode_loop(self, tok, kv, req: Request, clock: Clock, marks: dict) -> list:
        """Decode up to ``req.max_new - 1`` more tokens after ``tok`` (the eager loop, or replays
        of a CUDA graph when the store is capturable); stops a few steps after a stop id reaches
        the host. Returns every token produced (host ints). Marks ``end``."""
        m, cuda = self.model, self.device.type == "cuda"
        toks, log = [tok], TokenLog(req.max_new, cuda)
        log.publish(0, tok)
        pos = len(req.ids)
        graph = None
        if cuda and self.cuda_graph and kv.capturable and req.max_new > 1:
            graph = GraphDecode(m, kv, pos)
        try:
            for i in range(1, req.max_new):
                if log.stopped(i, req.stop):
                    break
                if graph is not None:
                    logits = graph.step(toks[-1])
                else:
                    kv.begin_step(pos)
                    logits = m.decode_step(toks[-1], pos, kv)
                    kv.end_step()
                pos += 1
                tok = sample(logits, req.sp, req.gen)
                toks.append(tok)
                log.publish(i, tok)
                if i == _STEADY_FROM:
                    marks["steady"] = clock.mark()
            marks["end"] = end = clock.mark()
            all_ids = torch.cat(toks).tolist()
            if cuda:
                end.synchronize()
        finally:
            if graph is not None:
                graph.close()
                del graph
        return all_ids

    def close(self):
        """Release what the requests share (the offload engine: its pinned pool and GPU ring); an
        LLM whose store shares something (offload) cannot generate afterwards (ValueError), a
        resident one shares nothing and keeps serving. Safe to call twice."""
        for sess in list(self._sessions.values()):
            sess.close()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self._closed = True
