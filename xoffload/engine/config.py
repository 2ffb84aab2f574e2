"""Options of an :class:`~xoffload.engine.llm.LLM`: one dataclass filled from its keyword arguments
by field name, holding every check of them (one-line ValueError / TypeError naming the value)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..kernels.checks import check_bool, check_int, is_int
from ..models.loader import resolve_dtype_device
from ..sparse.policy import DecodePolicy, PrefillPolicy, resolve_decode, resolve_prefill

__all__ = ["EngineConfig", "OFFLOAD_DECODES", "PREFILL_ATTN", "MODES", "MODE_ALIASES", "canonical_mode",
           "KV_CACHE_DTYPES", "KV_CACHE_SCALES", "FP8_SCALE_PAGE"]

#: where the KV lives: the modes of :class:`EngineConfig` (the store table, :mod:`xoffload.kv.table`,
#: picks a store for each)
MODES = ("resident", "offload")
#: accepted alias -> mode
MODE_ALIASES = {"gpu": "resident"}


def canonical_mode(mode) -> str:
    """The canonical name of ``mode`` (an alias resolved). Raises ValueError for an unknown mode."""
    m = MODE_ALIASES.get(mode, mode) if isinstance(mode, str) else mode
    if m not in MODES:
        alias = ", ".join(f"{a!r} = {c!r}" for a, c in sorted(MODE_ALIASES.items()))
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))} (aliases: {alias}), got {mode!r}")
    return m

#: dense causal attention choices of the prefill (see :func:`xoffload.kernels.causal_attention`)
PREFILL_ATTN = ("auto", "cudnn", "xoffload", "sdpa")
#: values of ``EngineConfig.offload_decode``
OFFLOAD_DECODES = ("direct", "uva")

#: values of ``EngineConfig.kv_cache_dtype`` (vLLM's names: ``"fp8"`` and ``"fp8_e4m3"`` are one format)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
#: values of ``EngineConfig.kv_cache_scale``
KV_CACHE_SCALES = ("page", "token")
#: tokens per scale of an fp8 KV cache with page scales (at most ``kv_block_size``): the tile of
#: the decode kernel, and at most this many tokens recomputed when a reused prefix or a prefill
#: chunk is cut back to a page boundary
FP8_SCALE_PAGE = 64

#: keyword arguments of earlier versions, with what replaces them
_REMOVED = {
    "sparse_threshold": "sparse=XAttentionPrefill(threshold=...)",
    "sparse_stride": "sparse=XAttentionPrefill(stride=...)",
    "sparse_block_size": "sparse=XAttentionPrefill(block_size=...)",
    "sparse_kwargs": "sparse=XAttentionPrefill(<option>=...)",
    "dense_layers": "sparse=XAttentionPrefill(dense_layers=...)",
    "num_kv_buffers": "nothing: offload decode stages each layer through two GPU buffers (offload_decode='direct')",
}


@dataclass
class EngineConfig:
    """Options of an LLM.

    Args:
        mode: where the KV lives — ``"resident"`` (on the model's device; ``"gpu"`` is an alias) or
            ``"offload"`` (layerwise prefill, the prompt's KV in the runtime's pinned CPU pool,
            generated tokens on the GPU; see ``offload_decode``). Stored as the canonical name.
        kv_block_size: tokens per block of the KV pool (offload; resident with a decode policy).
        max_model_len: longest sequence (prompt + generated); default the model's context length.
        dtype, device: default bf16 on CUDA, fp32 on the CPU.
        sparse: the prefill policy — a :class:`xoffload.sparse.PrefillPolicy` (e.g.
            ``XAttentionPrefill(threshold=0.9, stride=8, dense_layers=...)``), or None / ``"dense"``
            / ``"xattn"`` (resolved once by :func:`xoffload.sparse.resolve_prefill`). Stored as the
            policy object.
        prefill_chunk: tokens per chunk in prefill (default 8192 on a GPU, 512 on the CPU).
        prefill_attn: dense causal attention of the whole prompt in prefill (no LSE needed):
            ``"auto"`` (default: cuDNN's fused attention through PyTorch SDPA where it runs — the
            fastest on an H200 — else ours), ``"cudnn"``, ``"xoffload"`` (our Triton
            ``flash_attn_with_lse``) or ``"sdpa"`` (PyTorch's own backend choice).
        seed: default sampling seed of requests without one.
        cuda_graph: on CUDA, capture one decode step in a CUDA graph per batch-size bucket and
            replay it per token (default True; removes the host's per-kernel launch cost). False:
            the eager loop. Ignored on the CPU. Both give the same tokens.
        sparse_decode: the decode policy — None (every step reads all of the prompt's KV), ``"quest"``,
            ``"quest-ch"`` (Quest with 16 exact key channels, fitted to the model) or a
            :class:`xoffload.sparse.QuestDecode` (each step reads, per KV head, the pages that
            score highest, up to ``token_budget`` tokens). Works in both
            modes: offloaded, only the chosen pages cross PCIe; resident, it saves HBM reads.
            Resolved once by :func:`xoffload.sparse.resolve_decode`.
        token_budget: tokens a sparse layer attends to per step (sink + recent + chosen pages);
            alone it means ``sparse_decode="quest"`` with this budget.
        offload_decode: how offload-mode decode reads the pool, the whole step in one CUDA
            graph — ``"direct"`` (default: dense decode copies each layer's pages
            into one of two GPU buffers on a copy stream while the layer before computes, or reads
            them in place when the buffers for ``max_num_seqs`` rows do not fit the GPU; sparse
            decode copies the chosen pages it does not have cached), ``"uva"`` (dense decode's
            attention kernel reads the pages in place over PCIe, serialised with the compute; with
            ``sparse_decode`` the same as ``"direct"``). ``"ring"`` (a copy-engine ring of whole
            layers, eager) is not offered: ``"direct"`` streams each layer through two GPU buffers
            inside the step's graph, without the ring's per-layer host work.
        max_num_seqs: most sequences decoded together by the engine's step loop (default 1:
            requests are served one after another; a single request is a batch of one). A
            scheduler admits them in submission order while they fit, one decode step serves
            every running sequence, a finished one leaves and a waiting one is prefilled and joins
            the next step (continuous batching), with one attention launch per layer for the
            whole batch and a CUDA graph per batch-size bucket (1, 2, 4, ...) in ``resident`` mode
            (dense decode) and ``offload`` (dense or Quest decode).
        max_num_batched_tokens: most prompt tokens prefilled between two decode steps (default
            ``max_model_len``; a longer prompt still runs, alone in its step); with chunked
            prefill, the most tokens of one long prompt prefilled per step (default
            :data:`~xoffload.kv.chunk.DEFAULT_CHUNK_TOKENS`).
        enable_chunked_prefill: prefill a prompt longer than ``max_num_batched_tokens`` in chunks
            over several engine steps, the running sequences decoding between them and short
            prompts prefilled first (vLLM's chunked prefill). True needs a store that supports it
            (``offload``, or ``resident`` with a QuestDecode, with ``max_num_seqs > 1``, dense
            prefill, one device; elsewhere ValueError). None / False (default): off -- on the H200 conversation load (8B, eight
            32K documents) it cost throughput and did not lower the follow-ups' TTFT
            (docs/CHANGELOG.md, chunked prefill).
        kv_cache_tokens: tokens of KV the running sequences may hold together:
            ``offload``: the pinned CPU pool (its size; default ``max_num_seqs * max_model_len``, with
            ``prefix_caching`` one block more per sequence for a copy-on-write; allocated when the LLM is made); ``resident``: a cap on the GPU pool, which is
            otherwise sized per call from the requests (what the ``max_num_seqs`` largest need) and
            the free GPU memory; ``resident`` with a QuestDecode and ``max_num_seqs > 1``: the
            prompts' pool on the device, allocated when the LLM is made (default what fits, at
            most ``max_num_seqs * max_model_len``: :mod:`xoffload.kv.device_runtime`). A prompt
            that alone needs more is refused (ValueError).
        tensor_parallel_size: ranks the model is sharded over (default 1: one device). ``N > 1``
            needs one process per rank (``torchrun --nproc-per-node N``): attention / KV heads,
            MLP and vocabulary split across the ranks, each with its own KV store (its pinned
            pool and ring hold ``num_kv_heads / N`` heads); see :mod:`xoffload.models.parallel`.
        prefix_caching: offload mode (dense decode, or Quest decode through the batched Quest
            store) — a request (a session's turn is one) whose leading tokens equal KV already in
            the pool (blocks of earlier requests, matched by a chained hash of each block's token
            ids as vLLM's automatic prefix caching) shares those blocks and prefills only the
            rest, its queries attending to the reused prefix (with Quest decode the reused
            pages' summaries, exact channels, resident sink / recent tokens and GPU dense-layer
            rows are built from the whole prompt, the prefix read back from the pool, as a fresh
            prefill builds them); blocks are reference-counted,
            a shared partly filled block is copied before it is written, and cached blocks no live
            sequence holds are evicted (LRU, leaf first) when the pool runs short
            (:class:`xoffload.runtime.PrefixCache`). Resident mode with ``max_num_seqs > 1``: with
            dense decode, the same within one batched ``generate`` call, over its GPU pool (the
            prompts of a call share their common prefixes;
            :mod:`xoffload.kv.resident_prefix`); with a QuestDecode the batched Quest store
            serves, as offload's, over the engine's pool on the device. Default False.
        kv_cache_dtype: what the KV cache stores: ``"auto"`` (default: the model's dtype) or
            ``"fp8"`` / ``"fp8_e4m3"`` (the same: e4m3 codes with fp32 scales,
            :mod:`xoffload.kernels.fp8`; half the pinned pool's bytes and of the PCIe bytes per
            decode step). fp8 needs ``mode="offload"`` (dense or Quest decode), a fp16/bf16 model and a
            GPU of compute capability >= 8.9 (or the CPU); other combinations raise ValueError,
            an older GPU RuntimeError (:func:`~xoffload.kernels.fp8.check_fp8_supported`).
        kv_cache_scale: fp8 only: ``"page"`` (default: one fp32 scale per :data:`FP8_SCALE_PAGE`
            tokens -- at most ``kv_block_size``; with Quest decode per Quest page -- and KV head,
            written once with the whole page:
            a reused prefix and a prefill chunk start on a page boundary) or ``"token"`` (one per
            token and KV head: 4 more bytes per token and head, no alignment). The GPU tail of
            generated tokens always has token scales (a token is quantized when it is written).
    """

    mode: str = "resident"
    kv_block_size: int = 1024
    max_model_len: int | None = None
    dtype: object = None
    device: object = None
    sparse: object = None
    prefill_chunk: int | None = None
    prefill_attn: str = "auto"
    seed: int = 0
    cuda_graph: bool = True
    sparse_decode: object = None
    token_budget: int | None = None
    offload_decode: str = "direct"
    max_num_seqs: int = 1
    max_num_batched_tokens: int | None = None
    kv_cache_tokens: int | None = None
    tensor_parallel_size: int = 1
    prefix_caching: bool = False
    enable_chunked_prefill: bool | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_scale: str = "page"

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """The config of ``LLM(model, **kwargs)``; TypeError naming an unknown keyword."""
        names = {f.name for f in dataclasses.fields(cls)}
        for k in kwargs:
            if k in _REMOVED:
                raise TypeError(f"LLM option {k!r} was removed: pass {_REMOVED[k]} (xoffload.sparse)")
            if k not in names:
                raise TypeError(f"LLM got an unexpected option {k!r}; options: {', '.join(sorted(names))}")
        return cls(**kwargs)

    def __post_init__(self):
        self.mode = canonical_mode(self.mode)
        self.sparse = resolve_prefill(self.sparse)
        if self.token_budget is not None:
            check_int("token_budget", self.token_budget, 1)
        self.sparse_decode = resolve_decode(self.sparse_decode, self.token_budget)
        if self.offload_decode == "ring":
            raise ValueError("offload_decode='ring' is not offered: 'direct' streams each layer through two GPU buffers "
                             "on a copy stream inside the step's CUDA graph (the ring's job without its per-layer host work)")
        if self.offload_decode not in OFFLOAD_DECODES:
            raise ValueError(f"offload_decode must be one of {OFFLOAD_DECODES}, got {self.offload_decode!r}")
        b = self.kv_block_size
        direct = self.mode == "offload"
        if direct and is_int(b) and (b < 16 or b & (b - 1)):
            raise ValueError(f"kv_block_size must be a power of two >= 16 for offload_decode={self.offload_decode!r}, got {b}")
        if direct or self.mode == "resident":  # resident + a decode policy: the Quest store's device pool
            p = getattr(self.sparse_decode, "page_size", None)
            if p is not None and is_int(b) and b % p:
                raise ValueError(f"kv_block_size {b} must be a multiple of the decode policy's page_size {p}")
        check_bool("cuda_graph", self.cuda_graph)
        if self.max_model_len is not None:
            self.max_model_len = _positive("max_model_len", self.max_model_len)
        if self.prefill_chunk is not None:
            self.prefill_chunk = _positive("prefill_chunk", self.prefill_chunk)
        if self.prefill_attn not in PREFILL_ATTN:
            raise ValueError(f"prefill_attn must be one of {', '.join(map(repr, PREFILL_ATTN))}, "
                             f"got {self.prefill_attn!r}")
        check_int("kv_block_size", self.kv_block_size, 1)
        self.max_num_seqs = _positive("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            self.max_num_batched_tokens = _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.enable_chunked_prefill is not None:
            check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        if self.kv_cache_tokens is not None:
            self.kv_cache_tokens = _positive("kv_cache_tokens", self.kv_cache_tokens)
            if is_int(self.kv_block_size) and self.kv_cache_tokens < self.kv_block_size:
                raise ValueError(f"kv_cache_tokens={self.kv_cache_tokens} holds less than one KV block "
                                 f"(kv_block_size={self.kv_block_size}): use at least {self.kv_block_size}")
        b = self.kv_block_size
        if self.mode == "resident" and self.sparse_decode is None and (b < 16 or b & (b - 1)):
            raise ValueError(f"kv_block_size must be a power of two >= 16 for resident dense decode "
                             f"(the page of the paged KV pool), got {b}")
        self.seed = int(self.seed)
        self.tensor_parallel_size = _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_scale not in KV_CACHE_SCALES:
            raise ValueError(f"kv_cache_scale must be 'page' or 'token', got {self.kv_cache_scale!r}")
        given, self.kv_cache_dtype = self.kv_cache_dtype, "fp8" if self.kv_cache_dtype == "fp8_e4m3" else self.kv_cache_dtype
        if self.kv_cache_dtype == "auto" and self.kv_cache_scale != "page":
            raise ValueError(f"kv_cache_scale={self.kv_cache_scale!r} sets the scales of an fp8 cache; "
                             f"kv_cache_dtype='auto' stores the model's dtype (use kv_cache_dtype='fp8')")
        why = self._fp8_refusal()
        if why:
            raise ValueError(f"kv_cache_dtype={given!r} {why}")
        check_bool("prefix_caching", self.prefix_caching)
        if self.prefix_caching:
            why = self._prefix_caching_refusal()
            if why:
                raise ValueError(f"prefix_caching reuses KV blocks of a pool: {why}")

    def _prefix_caching_refusal(self) -> str | None:
        """Why this config cannot cache prefixes (one clause naming the value), or None: the prefix
        cache shares blocks of one device's pool, so it needs ``tensor_parallel_size=1``."""
        if self.tensor_parallel_size != 1:
            return f"it needs one device, got tensor_parallel_size={self.tensor_parallel_size}"
        return None

    def _fp8_refusal(self) -> str | None:
        """Why this config cannot store an fp8 KV cache (one clause naming the value), or None."""
        if self.kv_cache_dtype != "fp8":
            return None
        if self.mode != "offload":
            return (f"is stored by the offload store only (the pinned pool and its GPU tail); mode={self.mode!r}"
                    f"{' (the default)' if self.mode == 'resident' else ''} keeps a 16-bit cache: use mode='offload' "
                    f"(--mode offload) or kv_cache_dtype='auto'")
        return None

    @property
    def fp8(self) -> bool:
        """Whether the KV cache stores fp8 (e4m3) codes with fp32 scales."""
        return self.kv_cache_dtype == "fp8"

    @property
    def kv_scale_page(self) -> int:
        """Tokens per scale of the fp8 KV cache's pool (1: token scales; page scales:
        ``min(FP8_SCALE_PAGE, kv_block_size)``); 0 for a 16-bit cache."""
        if not self.fp8:
            return 0
        if self.kv_cache_scale == "token":
            return 1
        page = getattr(self.sparse_decode, "page_size", None)  # Quest reads (and caches) its pages
        return int(page) if page is not None else min(FP8_SCALE_PAGE, int(self.kv_block_size))

    @property
    def policy(self) -> PrefillPolicy:
        return self.sparse

    @property
    def decode_policy(self) -> DecodePolicy | None:
        return self.sparse_decode

    def bind(self, model) -> "EngineConfig":
        """This config with the model's defaults filled in (``max_model_len``, ``prefill_chunk``,
        ``dtype``, ``device``, ``max_num_batched_tokens``) and the model-dependent checks done: an explicit dtype must be the
        model's, ``prefill_attn="cudnn"`` needs CUDA, and the decode policy fitted to the model
        (:meth:`~xoffload.sparse.policy.DecodePolicy.for_model`: its layers must exist, its exact
        channels fit the head dim)."""
        dev = model.device
        if self.dtype is not None and resolve_dtype_device(self.dtype, dev)[0] != model.dtype:
            raise ValueError(f"dtype {self.dtype} differs from the given model's {model.dtype}")
        if self.prefill_attn == "cudnn" and dev.type != "cuda":
            raise ValueError(f"prefill_attn='cudnn' needs a CUDA device (model on {dev}); use 'auto'")
        if self.fp8:
            import torch

            from ..kernels.fp8 import check_fp8_supported

            if model.dtype not in (torch.float16, torch.bfloat16):
                raise ValueError(f"kv_cache_dtype='fp8' needs a fp16 or bf16 model (the fp8 decode kernels take 16-bit "
                                 f"queries), the model is {model.dtype} (dtype='bf16'; --dtype bf16 on the command line)")
            check_fp8_supported(dev)  # RuntimeError below compute capability 8.9
        self.sparse.layers(model.cfg.num_layers)  # raises for layers outside the model
        dec = None if self.sparse_decode is None else self.sparse_decode.for_model(model.cfg)
        max_len = self.max_model_len or model.cfg.max_position_embeddings
        return dataclasses.replace(
            self, dtype=model.dtype, device=dev, max_model_len=max_len, sparse_decode=dec,
            prefill_chunk=self.prefill_chunk or (8192 if dev.type == "cuda" else 512),
            max_num_batched_tokens=self.max_num_batched_tokens)

    def resolve_chunked_prefill(self, store_cls, tp) -> "EngineConfig":
        """This bound config with ``enable_chunked_prefill`` decided for ``store_cls`` (the store
        table's choice; ``tp``: the model's tensor-parallel group or None) and
        ``max_num_batched_tokens`` filled in (see the class docstring).

        Raises:
            ValueError: ``enable_chunked_prefill=True`` where the store cannot chunk a prefill.
        """
        from ..kv.chunk import DEFAULT_CHUNK_TOKENS

        can = bool(getattr(store_cls, "chunked_prefill", False)) and self.policy.dense and tp is None
        if self.enable_chunked_prefill and not can:
            raise ValueError(f"enable_chunked_prefill=True needs a store that prefills in chunks (offload mode, or "
                             f"resident with QuestDecode, with max_num_seqs > 1, direct or uva decode, dense prefill, "
                             f"one device); this configuration uses {store_cls.__name__}")
        on = bool(self.enable_chunked_prefill)
        n = self.max_num_batched_tokens or (DEFAULT_CHUNK_TOKENS if on else self.max_model_len)
        if on and n < self.kv_scale_page:
            raise ValueError(f"max_num_batched_tokens={n} is less than one fp8 scale page ({self.kv_scale_page} tokens): "
                             f"a prefill chunk ends on a page boundary; use more tokens or kv_cache_scale='token'")
        return dataclasses.replace(self, enable_chunked_prefill=on, max_num_batched_tokens=n)


def _positive(name: str, x) -> int:
    if not is_int(x) or x < 1:
        raise ValueError(f"{name} must be an int >= 1, got {x!r}")
    return int(x)
