"""``LLM``: generation with the KV cache on the GPU (``mode="gpu"``) or offloaded to pinned CPU memory
through :class:`xoffload.runtime.OffloadEngine` (``mode="offload"``).

Requests are served one after another; each gets a fresh KV cache (gpu) or a fresh engine sequence
(offload) that is freed at the end, also when the request fails, so calls share nothing but the
weights. Timings use CUDA events on a GPU (the host waits only on events) and ``perf_counter`` on
the CPU.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from .config import ModelConfig
from .llama import LlamaModel
from .loader import load_model, _resolve_dtype_device

_EOS_LAG = 2  # decode steps between producing a token and the host checking it for EOS (GPU)


@dataclass
class SamplingParams:
    """How to pick tokens.

    Args:
        temperature: 0 (default) = greedy argmax; > 0 samples from softmax(logits / temperature).
        top_p: nucleus sampling mass in (0, 1]; 1 = no truncation.
        max_tokens: most new tokens to generate (>= 1); also capped by ``max_model_len``.
        seed: seed of the request's own random generator (None: the LLM's ``seed``).
        ignore_eos: keep generating past EOS (benchmarks).
        stop_token_ids: extra token ids that end generation (besides the model's EOS ids).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple = ()

    def __post_init__(self):
        t = float(self.temperature)
        if not (t >= 0 and t < float("inf")):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        p = float(self.top_p)
        if not (0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        self.temperature, self.top_p = t, p
        self.stop_token_ids = tuple(int(x) for x in self.stop_token_ids)


@dataclass
class RequestOutput:
    """Result of one prompt.

    ``token_ids``: generated ids (the stop token included when generation stopped on it);
    ``text``: their decoding without special tokens (None without a tokenizer); ``finish_reason``:
    ``"stop"`` (EOS / stop id) or ``"length"``; ``timings``: ``prefill_ms``, ``prefill_tok_per_s``,
    ``ttft_ms`` (prefill + first token), ``decode_ms_per_token`` (None if no decode step),
    ``decode_steps``, ``total_ms``, ``prompt_tokens``, and with sparse prefill ``density`` (per layer,
    None for dense layers) and ``mean_density``; ``peak_gpu_memory_bytes``: peak allocated during the
    request (None on the CPU).
    """

    prompt_token_ids: list
    token_ids: list
    text: str | None
    finish_reason: str
    timings: dict = field(default_factory=dict)
    peak_gpu_memory_bytes: int | None = None


class _Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            return float(a.elapsed_time(b))
        return (b - a) * 1e3


class _Splits:
    """Split-KV count for decode attention chosen from a sequence length, the same in both modes
    (the gpu cache is longer than the sequence, the engine's views are not), so the two modes sum
    attention in the same order and give bit-identical results. :class:`LLM` fixes it per request
    from the request's final length (prompt + new tokens): a captured CUDA graph needs one count
    for every step, and offload mode uses the same count. None on the CPU (the reference ignores it)."""

    def __init__(self, cfg: ModelConfig, device: torch.device):
        self.fn = None
        if device.type == "cuda":
            try:
                from xoffload.kernels.decode import default_num_splits
            except ImportError:
                return
            self.fn = default_num_splits
            self.sms = torch.cuda.get_device_properties(device).multi_processor_count
            self.hkv, self.group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads

    def __call__(self, n: int):
        if self.fn is None:
            return None
        return int(self.fn(1, self.hkv, self.group, n, self.sms))


class _GPUCache:
    """Per-request KV cache on the model's device: K and V ``[L, n_tokens, Hkv, D]``.

    The step's position lives on the device (``pos_t``, int64 ``[1]``) and the attention length
    (``lens``, int32 ``[1]`` = pos + 1) is derived from it on the device, so a decode step through
    this cache never reads the position on the host (CUDA-graph safe). ``max_len``: the sequence
    length the split count is fixed from (the request's final length); None chooses it per step
    from the current length (eager callers only).
    """

    def __init__(self, cfg: ModelConfig, n_tokens: int, dtype, device, scale: float, max_len: int | None = None):
        shape = (cfg.num_layers, n_tokens, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.capacity = n_tokens
        self.lens = torch.zeros(1, dtype=torch.int32, device=device)
        self.pos_t = torch.zeros(1, dtype=torch.int64, device=device)
        self.scale = scale
        self.splits = _Splits(cfg, torch.device(device))
        self.fixed = max_len is not None
        self.nsplit = self.splits(max_len) if self.fixed else None

    def buffers(self, layer, T):
        return self.k[layer, :T], self.v[layer, :T]

    def done(self, layer, k, v):
        pass

    def begin_step(self, pos: int | None = None):
        """Start a step at host position ``pos``; None: at the device position ``pos_t`` as it is
        (the CUDA-graph path, which advances it with :meth:`advance`)."""
        if pos is not None:
            self.pos_t.fill_(pos)
            if not self.fixed:
                self.nsplit = self.splits(pos + 1)
        self.lens.copy_(self.pos_t)
        self.lens.add_(1)

    def attend(self, layer, q, k_new, v_new):
        from xoffload.kernels import decode_attn_with_lse

        self.k[layer].index_copy_(0, self.pos_t, k_new)
        self.v[layer].index_copy_(0, self.pos_t, v_new)
        o, _ = decode_attn_with_lse(q[None], self.k[layer][None], self.v[layer][None], self.lens,
                                    softmax_scale=self.scale, num_splits=self.nsplit, check=False)
        return o[0, 0]

    def end_step(self):
        pass

    def advance(self):
        """pos_t += 1 on the device (the last op of a captured step)."""
        self.pos_t.add_(1)


class _OffloadKV:
    """Glue between the model and one :class:`OffloadEngine` sequence. ``max_len`` fixes the
    decode split count as in :class:`_GPUCache` (same value => same summation order as gpu mode);
    None chooses it per step."""

    def __init__(self, eng, seq: int, cfg: ModelConfig, dtype, device, scale: float, max_len: int | None = None):
        self.eng, self.seq, self.cfg = eng, seq, cfg
        self.dtype, self.device, self.scale = dtype, device, scale
        self.lens = torch.zeros(1, dtype=torch.int32, device=device)
        self.splits = _Splits(cfg, torch.device(device))
        self.fixed = max_len is not None
        self.nsplit = self.splits(max_len) if self.fixed else None
        self._stage, self._stage_ev = [None, None], [None, None]

    # prefill: two staging buffers, alternating by layer; the engine copies one out D2H while the
    # next layer fills the other. Before a buffer is refilled the current stream waits (on the GPU,
    # not the host) for its previous copy, so the host may run layers ahead without prefill memory
    # growing (fresh buffers per layer grew by one layer's K/V per layer of host run-ahead).
    def buffers(self, layer, T):
        self.eng.reclaim()
        slot = layer & 1
        st = self._stage[slot]
        if st is None or st[0].shape[0] < T:
            shape = (T, self.cfg.num_kv_heads, self.cfg.head_dim)
            st = (torch.empty(shape, dtype=self.dtype, device=self.device),
                  torch.empty(shape, dtype=self.dtype, device=self.device))
            self._stage[slot], self._stage_ev[slot] = st, None
        ev = self._stage_ev[slot]
        if ev is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(ev)
        return st[0][:T], st[1][:T]

    def done(self, layer, k, v):
        self._stage_ev[layer & 1] = self.eng.offload_layer(self.seq, layer, k, v)
        if layer == self.cfg.num_layers - 1:  # prefill over: the engine keeps them until copied
            self._stage, self._stage_ev = [None, None], [None, None]

    def begin_step(self, pos: int):
        self.eng.begin_step(self.seq)
        self.lens.fill_(pos + 1)
        if not self.fixed:
            self.nsplit = self.splits(pos + 1)

    def attend(self, layer, q, k_new, v_new):
        from xoffload.kernels import decode_attn_with_lse

        k, v = self.eng.layer_kv(self.seq, layer, k_new, v_new)
        o, _ = decode_attn_with_lse(q[None], k[None], v[None], self.lens, softmax_scale=self.scale,
                                    num_splits=self.nsplit, check=False)
        self.eng.end_layer(self.seq, layer)
        return o[0, 0]

    def end_step(self):
        self.eng.end_step(self.seq)


class _GraphDecode:
    """gpu-mode decode steps replayed from one CUDA graph (one per request).

    Step 1 runs eagerly on a side stream (compiles the Triton kernels, creates cuBLAS workspaces:
    torch's required warm-up; its logits are real and used). Step 2 captures one whole decode
    step — embedding of the static token input, all layers (KV written at the device position,
    attention with the request's fixed split count), final norm and logits into a static buffer,
    then ``pos_t += 1`` — into a graph with its own memory pool, and replays it; later steps only
    copy the sampled token into the static input (device to device) and replay. The host never
    reads the position or the token. :meth:`close` frees the graph and its pool.

    Args:
        model: the :class:`LlamaModel` (CUDA).
        kv: the request's :class:`_GPUCache`, built with a fixed ``max_len``.
        pos: position of the first decode step (the prompt length).
    """

    def __init__(self, model, kv: "_GPUCache", pos: int):
        if not kv.fixed:
            raise ValueError("CUDA-graph decode needs a _GPUCache with a fixed split count (max_len)")
        self.m, self.kv = model, kv
        dev = model.device
        model.rope_tables(kv.capacity + 1)  # grown here, never inside the graph
        kv.pos_t.fill_(pos)
        self.tok = torch.zeros(1, dtype=torch.int64, device=dev)
        self.stream = torch.cuda.Stream(dev)
        self.graph = None
        self.out = None
        self.warm = False

    def _body(self) -> torch.Tensor:
        self.kv.begin_step(None)
        logits = self.m.decode_step(self.tok, self.kv.pos_t, self.kv)
        self.kv.end_step()
        self.kv.advance()
        return logits

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Run one decode step for ``token`` (int64 ``[1]``, device) at the current device
        position; returns fp32 logits ``[1, V]`` (after capture: the static buffer, overwritten by
        the next step, so sample from it before calling again)."""
        self.tok.copy_(token)
        if self.graph is not None:
            self.graph.replay()
            return self.out
        cur = torch.cuda.current_stream(self.m.device)
        if not self.warm:
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                logits = self._body()
            cur.wait_stream(self.stream)
            logits.record_stream(cur)
            self.warm = True
            return logits
        # capture_begin/end on the warm-up stream rather than ``torch.cuda.graph``, whose entry
        # synchronises the device and empties the allocator caches; nothing executes during
        # capture, and the private pool keeps the graph's memory apart from everything else
        g = torch.cuda.CUDAGraph()
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            g.capture_begin(pool=torch.cuda.graph_pool_handle())
            try:
                out = self._body()
            finally:
                g.capture_end()
        self.graph, self.out = g, out
        self.graph.replay()
        return self.out

    def close(self):
        """Free the graph, its memory pool and the static buffers."""
        self.out = None
        if self.graph is not None:
            self.graph.reset()
            self.graph = None


def _sample(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """int64 ``[1]`` token from fp32 logits ``[1, V]`` (stays on the device, no host sync)."""
    if sp.temperature <= 0:
        return logits.argmax(-1)
    # subtract the max first: a tiny temperature then gives a one-hot, not inf - inf = NaN
    p = torch.softmax((logits - logits.amax(-1, keepdim=True)) / sp.temperature, dim=-1)
    if sp.top_p < 1.0:
        ps, idx = p.sort(dim=-1, descending=True)
        cum = ps.cumsum(-1)
        ps = ps.masked_fill((cum - ps) > sp.top_p, 0.0)
        choice = torch.multinomial(ps, 1, generator=gen)
        return idx.gather(-1, choice).view(1)
    return torch.multinomial(p, 1, generator=gen).view(1)


class LLM:
    """Generate with a Llama/Qwen3 model, KV cache on the GPU or offloaded to CPU memory.

    Args:
        model: what :func:`~xoffload.models.loader.load_model` accepts — None / ``"smollm2"`` (the
            default SmolLM2-135M-Instruct GGUF), a ``.gguf`` path, a HF directory, a preset name
            (random weights), a ModelConfig, or a loaded :class:`LlamaModel` (weights are shared).
        mode: ``"gpu"`` (KV on the GPU) or ``"offload"`` (layerwise prefill, KV in pinned CPU
            memory, decode through the engine's ring of ``num_kv_buffers`` GPU layer buffers).
        num_kv_buffers, kv_block_size: ring buffers and pool block size (offload mode).
        max_model_len: longest sequence (prompt + generated); default the model's context length.
        dtype, device: default bf16 on CUDA, fp32 on the CPU.
        sparse: None or ``"xattn"`` (XAttention block-sparse prefill on layers not in ``dense_layers``).
        sparse_threshold, sparse_stride, sparse_block_size: XAttention's tau, stride and block size.
        dense_layers: layers kept dense under ``sparse`` (default None: the first four, or all
            layers of a smaller model; on SmolLM2's needle grid, 4 dense layers with tau=0.9, S=8
            found what dense attention found, 2 missed one cell more).
        sparse_kwargs: extra keyword arguments for ``xattention_prefill`` (e.g. ``chunk_size``,
            ``dense_fallback_len``).
        prefill_chunk: tokens per chunk in prefill (default 8192 on a GPU, 512 on the CPU).
        prefill_attn: dense causal attention of the whole prompt in prefill (no LSE needed):
            ``"auto"`` (default: cuDNN's fused attention through PyTorch SDPA where it runs — the
            fastest on an H200 — else ours), ``"cudnn"``, ``"xoffload"`` (our Triton
            ``flash_attn_with_lse``) or ``"sdpa"`` (PyTorch's own backend choice). See
            :func:`xoffload.kernels.causal_attention`.
        seed: default sampling seed of requests without one.
        cuda_graph: in gpu mode on CUDA, capture one decode step in a CUDA graph per request and
            replay it per token (default True; removes the host's per-kernel launch cost). False:
            the eager loop. Ignored in offload mode (the engine's per-layer stream/event work on
            the host stays eager) and on the CPU. Both give the same tokens.

    On the CPU the attention kernels run their PyTorch references (exact fp32) inside
    :meth:`generate`, whatever ``TRITON_INTERPRET`` says. Raises ValueError / TypeError on bad
    options, FileNotFoundError when the model is missing.
    """

    def __init__(self, model=None, *, mode: str = "gpu", num_kv_buffers: int = 4, kv_block_size: int = 1024,
                 max_model_len: int | None = None, dtype=None, device=None, sparse: str | None = None,
                 sparse_threshold: float = 0.9, sparse_stride: int = 8, sparse_block_size: int = 128,
                 dense_layers=None, sparse_kwargs: dict | None = None, prefill_chunk: int | None = None,
                 prefill_attn: str = "auto", seed: int = 0, cuda_graph: bool = True):
        mode = "gpu" if mode == "resident" else mode  # "resident" (KV on the model's device) == "gpu"
        if mode not in ("gpu", "offload"):
            raise ValueError(f"mode must be 'resident' (alias 'gpu') or 'offload', got {mode!r}")
        if sparse not in (None, "xattn", "none", "dense"):
            raise ValueError(f"sparse must be None or 'xattn', got {sparse!r}")
        sparse = None if sparse in ("none", "dense") else sparse
        if isinstance(model, LlamaModel):
            self.model = model
        else:
            dt, dev = _resolve_dtype_device(dtype, device)
            self.model = load_model(model, dtype=dt, device=dev, seed=seed)
        m = self.model
        if dtype is not None and _resolve_dtype_device(dtype, m.device)[0] != m.dtype:
            raise ValueError(f"dtype {dtype} differs from the given model's {m.dtype}")
        self.cfg = m.cfg
        self.device = m.device
        self.dtype = m.dtype
        self.tokenizer = m.tokenizer
        self.mode = mode
        self.seed = int(seed)
        if not isinstance(cuda_graph, bool):
            raise TypeError(f"cuda_graph must be a bool, got {type(cuda_graph).__name__}")
        self.cuda_graph = cuda_graph
        if max_model_len is None:
            max_model_len = self.cfg.max_position_embeddings
        if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or max_model_len < 1:
            raise ValueError(f"max_model_len must be an int >= 1, got {max_model_len!r}")
        self.max_model_len = max_model_len
        if prefill_chunk is None:
            prefill_chunk = 8192 if self.device.type == "cuda" else 512
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        if prefill_attn not in ("auto", "cudnn", "xoffload", "sdpa"):
            raise ValueError(f"prefill_attn must be 'auto', 'cudnn', 'xoffload' or 'sdpa', got {prefill_attn!r}")
        if prefill_attn == "cudnn" and self.device.type != "cuda":
            raise ValueError(f"prefill_attn='cudnn' needs a CUDA device (model on {self.device}); use 'auto'")
        self.prefill_attn = prefill_attn
        self.sparse = sparse
        self.sparse_threshold = float(sparse_threshold)
        if not 0.0 <= self.sparse_threshold <= 1.0:
            raise ValueError(f"sparse_threshold must be in [0, 1], got {sparse_threshold!r}")
        self.sparse_stride = int(sparse_stride)
        self.sparse_block_size = int(sparse_block_size)
        self.sparse_kwargs = dict(sparse_kwargs or {})
        L = self.cfg.num_layers
        if dense_layers is None:
            dense_layers = tuple(range(min(4, L)))
        bad = [i for i in (dense_layers or ()) if not -L <= int(i) < L]
        if bad:
            raise ValueError(f"dense_layers {bad} are outside the model's {L} layers")
        dense = set(int(i) % L if int(i) < 0 else int(i) for i in (dense_layers or ()))
        self.dense_layers = tuple(sorted(dense))
        self.sparse_layers = tuple(i for i in range(L) if i not in dense) if sparse else ()
        self._xattn = None
        if sparse == "xattn":
            try:
                from xoffload.sparse.xattention import xattention_prefill
            except ImportError as e:
                raise ImportError(f"sparse='xattn' needs xoffload.sparse.xattention.xattention_prefill: {e}") from e
            self._xattn = xattention_prefill
        self.engine = None
        self._closed = False
        if mode == "offload":
            try:
                from xoffload.runtime import OffloadEngine
            except ImportError as e:
                raise ImportError(f"mode='offload' needs xoffload.runtime.OffloadEngine: {e}") from e
            self.engine = OffloadEngine(
                L, self.cfg.num_kv_heads, self.cfg.head_dim, dtype=self.dtype, device=str(self.device),
                max_tokens=max_model_len, block_size=kv_block_size, num_buffers=num_kv_buffers)
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
        out = []
        V = self.cfg.vocab_size
        for i, p in enumerate(prompts):
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
            bad = [x for x in ids if x < 0 or x >= V]
            if bad:
                raise ValueError(f"prompt {i}: token id {bad[0]} outside the vocabulary [0, {V})")
            out.append(ids)
        return out

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params: SamplingParams | None = None, *, use_tqdm: bool = False) -> list:
        """Generate for each prompt, one after another.

        Args:
            prompts: a string, a list of token ids, or a list of strings / token-id lists (a
                1-D/2-D int tensor works too). Strings are tokenized as they are (no chat
                template: see :meth:`apply_chat_template`).
            sampling_params: :class:`SamplingParams` (default greedy, 64 tokens).
        Returns:
            list of :class:`RequestOutput`, one per prompt.
        Raises:
            ValueError / TypeError on an empty prompt, one longer than ``max_model_len``, ids
            outside the vocabulary, a string without a tokenizer. All prompts are checked before
            any runs; a failed request frees its KV and the LLM keeps serving.
        """
        if self.mode == "offload" and self.engine is None:
            raise ValueError("this LLM was closed; create a new one")
        sp = sampling_params or SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
        batch = self._normalize(prompts)
        ctx = contextlib.nullcontext()
        if self.device.type == "cpu":
            from xoffload.kernels import cpu_backend

            ctx = cpu_backend("reference")
        outs = []
        it = batch
        if use_tqdm:
            from tqdm.auto import tqdm

            it = tqdm(batch, desc="requests")
        with ctx, torch.no_grad():
            for ids in it:
                outs.append(self._run_one(ids, sp))
        return outs

    def _run_one(self, ids: list, sp: SamplingParams) -> RequestOutput:
        m, dev = self.model, self.device
        cuda = dev.type == "cuda"
        T = len(ids)
        max_new = min(sp.max_tokens, self.max_model_len - T + 1)
        seed = self.seed if sp.seed is None else int(sp.seed)
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        stop = set() if sp.ignore_eos else set(self._stop_ids)
        stop.update(sp.stop_token_ids)
        clock = _Clock(dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        ids_t = torch.tensor(ids, dtype=torch.int64).to(dev)
        t0 = clock.mark()
        seq = None
        if self.mode == "offload":
            seq = self.engine.add_sequence()
            kv = _OffloadKV(self.engine, seq, self.cfg, self.dtype, dev, m.scale, max_len=T + max_new - 1)
        else:
            kv = _GPUCache(self.cfg, T + max_new - 1, self.dtype, dev, m.scale, max_len=T + max_new - 1)
        graph = None
        try:
            densities = [] if self.sparse else None
            sparse_fn = self._sparse_fn() if self.sparse else None
            logits = m.prefill(ids_t, kv, chunk=self.prefill_chunk, sparse_fn=sparse_fn,
                               sparse_layers=self.sparse_layers, densities=densities,
                               attn_backend=self.prefill_attn)
            t_pf = clock.mark()
            tok = _sample(logits, sp, gen)
            t_first = clock.mark()
            toks = [tok]
            host, events, checked, stopped = [], [], 0, False
            if cuda:
                host_buf = torch.empty(max_new, dtype=torch.int64, pin_memory=True)

            def publish(i, t):
                if cuda:
                    host_buf[i:i + 1].copy_(t, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record()
                    events.append(ev)
                else:
                    host.append(int(t))

            publish(0, tok)
            pos = T
            if cuda and self.mode == "gpu" and self.cuda_graph and max_new > 1:
                graph = _GraphDecode(m, kv, pos)
            for i in range(1, max_new):
                limit = i - _EOS_LAG if cuda else i
                while checked < limit and stop:
                    if cuda:
                        events[checked].synchronize()
                        val = int(host_buf[checked])
                    else:
                        val = host[checked]
                    if val in stop:
                        stopped = True
                        break
                    checked += 1
                if stopped:
                    break
                if graph is not None:
                    logits = graph.step(toks[-1])
                else:
                    kv.begin_step(pos)
                    logits = m.decode_step(toks[-1], pos, kv)
                    kv.end_step()
                pos += 1
                tok = _sample(logits, sp, gen)
                toks.append(tok)
                publish(i, tok)
            t_end = clock.mark()
            all_ids = torch.cat(toks).tolist()
            if cuda:
                t_end.synchronize()
        finally:
            if graph is not None:
                graph.close()
                del graph
            if seq is not None:
                self.engine.free(seq)
                # the ring (num_kv_buffers layer buffers of max_model_len tokens) is re-created by
                # the next request's first decode step: off the GPU during its prefill
                self.engine.release_ring_buffers()
            del kv
        n_out, reason = len(all_ids), "length"
        for j, t in enumerate(all_ids):
            if t in stop:
                n_out, reason = j + 1, "stop"
                break
        out_ids = all_ids[:n_out]
        steps = len(all_ids) - 1
        prefill_ms = clock.ms(t0, t_pf)
        dec_ms = clock.ms(t_first, t_end)
        timings = {
            "prompt_tokens": T,
            "prefill_ms": prefill_ms,
            "prefill_tok_per_s": T / prefill_ms * 1e3 if prefill_ms > 0 else float("inf"),
            "ttft_ms": clock.ms(t0, t_first),
            "decode_steps": steps,
            "decode_ms_per_token": dec_ms / steps if steps > 0 else None,
            "total_ms": clock.ms(t0, t_end),
        }
        if self.sparse:
            dens = [None if d is None else float(d.float().mean()) if isinstance(d, torch.Tensor) else float(d)
                    for d in densities]
            timings["density"] = dens
            vals = [d for d in dens if d is not None]
            timings["mean_density"] = sum(vals) / len(vals) if vals else None
        peak = int(torch.cuda.max_memory_allocated(dev)) if cuda else None
        return RequestOutput(prompt_token_ids=list(ids), token_ids=out_ids, text=self.decode(out_ids),
                             finish_reason=reason, timings=timings, peak_gpu_memory_bytes=peak)

    def _sparse_fn(self):
        fn = self._xattn
        kw = dict(threshold=self.sparse_threshold, stride=self.sparse_stride, block_size=self.sparse_block_size)
        kw.update(self.sparse_kwargs)

        def run(q, k, v):
            out, _lse, density = fn(q, k, v, **kw)
            return out, density

        return run

    def close(self):
        """Release the offload engine (its pinned pool and GPU ring); an offload-mode LLM cannot
        generate afterwards. Safe to call twice."""
        if self.engine is not None:
            closer = getattr(self.engine, "close", None) or getattr(self.engine, "reset", None)
            if closer is not None:
                closer()
            self.engine = None
        self._closed = True
