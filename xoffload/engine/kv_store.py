"""KV stores: where one request's KV lives, behind one small interface.

A store is the model's prefill *sink* and decode *KV store* (:mod:`xoffload.models.llama`):

- prefill: ``buffers(layer, T) -> (k, v)`` (``[T, Hkv, D]`` tensors the model fills), then
  ``done(layer, k, v)`` once layer ``layer``'s K/V are written and attended;
- decode: ``begin_step(pos)`` (``pos``: host position, or None = the device position as it is),
  ``attend(layer, q [1, Hq, D], k_new [1, Hkv, D], v_new) -> out [1, Hq, D]`` (appends the new
  token's K/V and attends over all of it), ``end_step()``, and ``advance()`` (device position += 1,
  the last op of a step replayed from a CUDA graph);
- ``capturable``: whether a whole decode step may be captured in a CUDA graph (such a store also
  exposes ``pos_t``, the int64 ``[1]`` device position, and ``capacity``, its token count);
- ``close()``: free everything of this request (idempotent).

The engine's store table (:func:`~xoffload.kv.table.batch_store_class`) picks the class once,
from ``mode``, through :func:`store_class`, and its :class:`~xoffload.engine.kv_batch_serial.SerialBatchKV`
calls ``cls.for_request(model, shared, req, config)`` per request, where ``shared`` is what
``cls.open_shared(model, config)`` built once per LLM (e.g. the offload runtime; None for the
resident store) and ``req`` the :class:`~xoffload.engine.request.Request` (prompt ids, final
length). A mode's registered class may hand a configuration to another class through
``variant(config)`` (e.g. resident + ``sparse_decode`` -> the paged store). A new store plugs in
as a class with one line::

    @register_store("offload_sparse")
    class SparseOffloadKV(KVStore): ...

Both stores here fix the decode split-KV count from the same length (:class:`Splits`), so they sum
attention in the same order and give bit-identical tokens.
"""
from __future__ import annotations

import torch

from ..kernels import decode_attn_with_lse
from ..kernels.checks import check_int
from ..kernels.decode import default_num_splits
from ..models.config import ModelConfig
from ..runtime import OffloadRuntime
from ..kv.staging import PrefillStaging

__all__ = ["KVStore", "ResidentKV", "OffloadKV", "PrefillStaging", "Splits", "STORES", "MODE_ALIASES", "register_store",
           "canonical_mode", "store_class"]

#: canonical mode name -> store class (filled by :func:`register_store`)
STORES: dict = {}
#: accepted alias -> canonical mode name
MODE_ALIASES: dict = {}


def register_store(name: str, *aliases: str):
    """Class decorator: make the store class available as ``LLM(mode=name)`` (and each alias)."""
    def deco(cls):
        STORES[name] = cls
        for a in aliases:
            MODE_ALIASES[a] = name
        cls.mode = name
        return cls
    return deco


def canonical_mode(mode) -> str:
    """The canonical name of ``mode`` (an alias resolved). Raises ValueError for an unknown mode."""
    m = MODE_ALIASES.get(mode, mode) if isinstance(mode, str) else mode
    if m not in STORES:
        names = ", ".join(repr(n) for n in sorted(STORES))
        alias = ", ".join(f"{a!r} = {c!r}" for a, c in sorted(MODE_ALIASES.items()))
        raise ValueError(f"mode must be one of {names} (aliases: {alias}), got {mode!r}")
    return m


def store_class(mode) -> type:
    """The :class:`KVStore` class registered for ``mode`` (or its alias)."""
    return STORES[canonical_mode(mode)]


class Splits:
    """Split-KV count for decode attention chosen from a sequence length, the same for every store
    (the resident cache is longer than the sequence, the engine's views are not), so stores sum
    attention in the same order and give bit-identical results. :class:`LLM` fixes it per request
    from the request's final length (prompt + new tokens): a captured CUDA graph needs one count
    for every step, and the offload store uses the same count. None on the CPU (the reference
    ignores it)."""

    def __init__(self, cfg: ModelConfig, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.sms = torch.cuda.get_device_properties(device).multi_processor_count
            self.hkv, self.group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads

    def __call__(self, n: int):
        if not self.cuda:
            return None
        return int(default_num_splits(1, self.hkv, self.group, n, self.sms))


class KVStore:
    """Base of the KV stores (see the module docstring for the interface).

    Subclasses implement the prefill sink, the decode methods and :meth:`for_request`; the
    defaults here: nothing shared between requests, not capturable, ``done``/``end_step``/``close``
    do nothing.
    """

    mode: str = ""
    capturable: bool = False
    #: bytes a decode step reads from host memory (None: the store reads none)
    h2d_bytes_per_step: int | None = None
    #: layers for which the store wants an estimate of the query one layer ahead (:meth:`prefetch`)
    lookahead: frozenset = frozenset()

    def prefetch(self, layer: int, q_est) -> None:
        """Start fetching what layer ``layer`` will likely read, from ``q_est`` ``[1, Hq, D]`` (its
        query projected from the previous layer's input). Called by the model during layer
        ``layer - 1``, for the layers in :attr:`lookahead` only."""
        raise NotImplementedError(f"{type(self).__name__}.prefetch")

    def decode_stats(self) -> dict:
        """Extra figures of the decode steps run so far, merged into the request's timings (e.g.
        the page cache's hit rate); default none. Called once, after the last step."""
        return {}

    @classmethod
    def open_shared(cls, model, config):
        """What every request of one LLM shares (built once in ``LLM.__init__``; None: nothing).
        If not None it must have ``close()``; ``LLM.close()`` calls it."""
        return None

    @classmethod
    def variant(cls, config) -> type:
        """The store class that serves ``config`` in this mode (default: this class)."""
        return cls

    @classmethod
    def for_request(cls, model, shared, req, config) -> "KVStore":
        """The store of one request ``req`` (its prompt ``req.ids``, final length ``req.final_len``
        tokens: prompt + new) under the LLM's ``config``."""
        raise NotImplementedError(f"{cls.__name__}.for_request")

    # prefill sink
    def buffers(self, layer: int, T: int):
        raise NotImplementedError(f"{type(self).__name__}.buffers")

    def done(self, layer: int, k, v) -> None:
        pass

    # decode
    def begin_step(self, pos: int | None = None) -> None:
        raise NotImplementedError(f"{type(self).__name__}.begin_step")

    def attend(self, layer: int, q, k_new, v_new):
        raise NotImplementedError(f"{type(self).__name__}.attend")

    def end_step(self) -> None:
        pass

    def advance(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no device position (not capturable)")

    def close(self) -> None:
        pass


@register_store("resident", "gpu")
class ResidentKV(KVStore):
    """Per-request KV cache on the model's device: K and V ``[L, n_tokens, Hkv, D]``.

    The step's position lives on the device (``pos_t``, int64 ``[1]``) and the attention length
    (``lens``, int32 ``[1]`` = pos + 1) is derived from it on the device, so a decode step through
    this cache never reads the position on the host (CUDA-graph safe: ``capturable`` when the split
    count is fixed). ``max_len``: the sequence length the split count is fixed from (the request's
    final length); None chooses it per step from the current length (eager callers only).
    """

    def __init__(self, cfg: ModelConfig, n_tokens: int, dtype, device, scale: float, max_len: int | None = None):
        shape = (cfg.num_layers, n_tokens, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.capacity = n_tokens
        self.lens = torch.zeros(1, dtype=torch.int32, device=device)
        self.pos_t = torch.zeros(1, dtype=torch.int64, device=device)
        self.scale = scale
        self.splits = Splits(cfg, torch.device(device))
        self.fixed = max_len is not None
        self.nsplit = self.splits(max_len) if self.fixed else None

    @classmethod
    def variant(cls, config) -> type:
        if config.decode_policy is not None:
            from .kv_paged import ResidentPagedKV

            return ResidentPagedKV
        return cls

    @classmethod
    def for_request(cls, model, shared, req, config) -> "ResidentKV":
        n = req.final_len
        return cls(model.cfg, n, model.dtype, model.device, model.scale, max_len=n)

    @property
    def capturable(self) -> bool:
        return self.fixed

    def buffers(self, layer, T):
        return self.k[layer, :T], self.v[layer, :T]

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
        self.k[layer].index_copy_(0, self.pos_t, k_new)
        self.v[layer].index_copy_(0, self.pos_t, v_new)
        o, _ = decode_attn_with_lse(q[None], self.k[layer][None], self.v[layer][None], self.lens,
                                    softmax_scale=self.scale, num_splits=self.nsplit, check=False)
        return o[0, 0]

    def advance(self):
        """pos_t += 1 on the device (the last op of a captured step)."""
        self.pos_t.add_(1)

    def close(self):
        self.k = self.v = None


class OffloadKV(KVStore):
    """One :class:`~xoffload.runtime.OffloadRuntime` sequence: layerwise prefill copies each layer's
    K/V to the pinned CPU pool, decode streams layers through the engine's GPU ring. ``max_len``
    fixes the decode split count as in :class:`ResidentKV` (same value => same summation order);
    None chooses it per step. :meth:`close` frees the sequence and the ring buffers (re-created by
    the next request's first decode step: off the GPU during its prefill)."""

    def __init__(self, eng, seq: int, cfg: ModelConfig, dtype, device, scale: float, max_len: int | None = None):
        self.eng, self.seq, self.cfg = eng, seq, cfg
        self.dtype, self.device, self.scale = dtype, device, scale
        self.lens = torch.zeros(1, dtype=torch.int32, device=device)
        self.splits = Splits(cfg, torch.device(device))
        self.fixed = max_len is not None
        self.nsplit = self.splits(max_len) if self.fixed else None
        self._stage = PrefillStaging(cfg.num_kv_heads, cfg.head_dim, dtype, device)

    @classmethod
    def open_shared(cls, model, config) -> OffloadRuntime:
        """The LLM's offload runtime; its pinned pool holds ``kv_cache_tokens`` tokens (default one
        ``max_model_len`` sequence, ``max_num_seqs`` of them for batched generation)."""
        cfg = model.cfg
        tokens = config.kv_cache_tokens or config.max_num_seqs * config.max_model_len
        return OffloadRuntime(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype,
                             device=str(model.device), max_tokens=config.max_model_len,
                             block_size=config.kv_block_size, num_buffers=config.num_kv_buffers,
                             num_blocks=-(-tokens // config.kv_block_size))

    @classmethod
    def for_request(cls, model, shared, req, config) -> "OffloadKV":
        seq = shared.add_sequence()
        n = req.final_len
        return cls(shared, seq, model.cfg, model.dtype, model.device, model.scale, max_len=n)

    # prefill: a staging buffer reused by layer after its copy out (PrefillStaging)
    def buffers(self, layer, T):
        return self._stage.buffers(self.eng, layer, T)

    def done(self, layer, k, v):
        self._stage.copied(layer, self.eng.offload_layer(self.seq, layer, k, v))
        if layer == self.cfg.num_layers - 1:
            self._stage.clear()

    @property
    def h2d_bytes_per_step(self) -> int:
        """Bytes a decode step loads from the pool: every layer's K/V of the tokens in it."""
        return self.eng.seq_len(self.seq) * self.cfg.kv_bytes_per_token(self.dtype)

    def begin_step(self, pos: int):
        self.eng.begin_step(self.seq)
        self.lens.fill_(pos + 1)
        if not self.fixed:
            self.nsplit = self.splits(pos + 1)

    def attend(self, layer, q, k_new, v_new):
        k, v = self.eng.layer_kv(self.seq, layer, k_new, v_new)
        o, _ = decode_attn_with_lse(q[None], k[None], v[None], self.lens, softmax_scale=self.scale,
                                    num_splits=self.nsplit, check=False)
        self.eng.end_layer(self.seq, layer)
        return o[0, 0]

    def end_step(self):
        self.eng.end_step(self.seq)

    def close(self):
        if self.seq is not None:
            seq, self.seq = self.seq, None
            self._stage.clear()
            self.eng.free(seq)
            self.eng.release_ring_buffers()
