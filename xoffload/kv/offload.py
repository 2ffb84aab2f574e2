"""``offload`` with dense decode: :class:`OffloadBatchKV`, prompts in the pinned pool, copied per layer
into GPU staging buffers ahead of their attention (``offload_decode="direct"``) or read in place
(``"uva"``), generated tokens in a GPU tail (see :mod:`.base`)."""
from __future__ import annotations

import torch

from ..kernels import flash_attn_with_lse, merge_attention_states, paged_decode_attn_with_lse
from .answers import KeptAnswers
from .cached_prompts import CachedPrompts
from .chunk import ChunkedPrefill
from .fp8 import Fp8Region, Fp8RowPool, pool_read_bytes
from .staging import LayerStaging, PrefillStaging, PrefixReader
from .base import (TAIL_BLOCK, BatchKV, RowPool, _Region, _StagedSink, _blocks, _join,
                   _pool_memory_limit, _to_device, _top_sum)


class OffloadBatchKV(KeptAnswers, ChunkedPrefill, CachedPrompts, BatchKV):
    """``offload`` (direct or uva decode, no decode policy): every prompt's KV in the offload
    runtime's pinned CPU pool, the generated tokens in a paged GPU tail pool (blocks of
    :data:`TAIL_BLOCK`).

    Admission reserves the prompt's blocks in the engine's pool (``kv_cache_tokens``, default
    ``max_num_seqs * max_model_len``, fixed when the LLM is made) and tail blocks for the tokens it
    may generate (the tail pool is sized per call from the requests). Prefill copies each layer to
    the pool through :class:`~.staging.PrefillStaging`. Decode per layer: one paged launch over
    every row's prompt pages, one over the rows' tails on the GPU, the two merged by LSE. The
    prompt pages are read

    - staged (``offload_decode="direct"``, when the buffers fit): a
      :class:`~.staging.LayerStaging` of ``R x P`` blocks (``R = max_num_seqs`` rows, ``P`` =
      pool blocks of the longest prompt the store was sized for; row ``i``'s blocks at ``i * P``,
      a fixed staging page table) copies layer ``l + 1``'s blocks of the batch's rows (one gather
      launch; a padding row or page copies nothing) on a copy stream while layer ``l`` computes,
      inside the step's CUDA graph; whole blocks cross PCIe;
    - in place (``"uva"``, or ``"direct"`` when ``2 x 2 x R x P`` blocks of one layer's K and V do
      not fit the GPU memory left after the tail and a prefill's headroom: ``staging_limited`` in
      :meth:`describe`): the attention kernel reads the pool's pages over PCIe (UVA), serialised
      with the layer's compute; only the prompt's tokens cross.

    One choice per store, whatever the bucket. At a large batch both ways are bound by the same
    PCIe bytes (the sum of the rows' prompts, against one read of the weights for the step) and
    read the pool at about the same rate (the gather and the paged kernel are both UVA loads), so
    staging keeps its gain, each layer's compute hidden under the next layer's copy, and costs each
    row's partly filled last block and the buffers' GPU memory; so it stays the choice while the
    buffers fit, and in place is what runs when they do not.

    With ``kv_cache_dtype="fp8"`` (:mod:`.fp8`) the pool, the staging buffers and the tail hold
    e4m3 codes with fp32 scales; the prompt pages are read with the pool's scale page as the
    kernel's page (``read_page``: a scale per page, or per token and then the pool block), the
    tail with token scales.

    Attributes: ``staged`` (bool), ``stager`` (the :class:`~.staging.LayerStaging` or None),
    ``staging_limited`` (direct decode asked for, the buffers did not fit), ``fp8`` (bool),
    ``read_page`` (tokens per page of the prompt read).
    """

    capturable = True

    def __init__(self, model, config, shared, seqs, prefix_cache=None):
        super().__init__(model, config, shared, seqs)
        self.eng = shared
        self.block = self.eng.block_size
        self.cache = prefix_cache
        self.cap_blocks = self.eng.num_free_blocks  # the pool is this call's (requests run one call at a time)
        if prefix_cache is not None:  # cached blocks no live sequence holds give way when needed
            self.cap_blocks += prefix_cache.evictable_blocks()
        self._keys = 0
        new = [max(s.req.max_new - 1, 0) for s in seqs] + [0]
        pool = self.eng.pool
        self.fp8 = bool(getattr(pool, "fp8", False))
        tail_cls, region_cls = (Fp8RowPool, Fp8Region) if self.fp8 else (RowPool, _Region)
        self.tail = tail_cls(self.cfg, _top_sum([_blocks(n, TAIL_BLOCK) for n in new], self.max_num_seqs), TAIL_BLOCK,
                             self.dtype, self.device)
        R = self.buckets[-1]
        self.region = region_cls(self.tail, R, _blocks(max(new), TAIL_BLOCK), self.device)
        # the prompt read's page: a page-scale pool's scale page, else the pool block
        self.read_page = pool.scale_page if self.fp8 and pool.scale_page > 1 else self.block
        P = self.hpages = max(1, _blocks(max([s.prompt_len for s in seqs] + [1]), self.block))
        self.hlens = torch.zeros(R, dtype=torch.int32, device=self.device)
        self._reserved = 0  # pool blocks of the admitted sequences' prompts
        self._admitted: dict = {}
        self._stage = PrefillStaging(self.cfg.num_kv_heads, self.cfg.head_dim, self.dtype, self.device)
        self._tok_bytes = self.cfg.kv_bytes_per_token(self.dtype)
        # K and V of R x P blocks of one layer (codes and scales), two buffers
        self.staging_bytes = 2 * self._read_bytes(R * P * self.block, True) // self.cfg.num_layers
        self.stager, self.staging_limited = None, False
        if config.offload_decode == "direct":
            limit = _pool_memory_limit(model, seqs, config, self.device)  # after the tail pool
            self.staging_limited = limit is not None and self.staging_bytes > limit
            if not self.staging_limited:
                self.stager = LayerStaging(self.eng.pool, R * P, self.cfg.num_layers, self.device,
                                           skip_negative=True)
        self.staged = self.stager is not None
        # the prompt pages' table [R, 1, P] (rows of the staging buffers: fixed; or of the pool)
        pp = P * (self.block // self.read_page)  # read pages per row
        first = torch.arange(R * pp, dtype=torch.int32, device=self.device).view(R, 1, pp) * self.read_page
        self.table = first if self.staged else torch.zeros_like(first)

    def _prompt_blocks(self, seq) -> int:
        return _blocks(seq.prompt_len, self.block)  # (+ a copy-on-write block where there is room: _reserve)

    @staticmethod
    def _new(seq) -> int:
        return max(seq.req.max_new - 1, 0)

    def check(self, seq):
        self.check_shape(seq)
        n = self._prompt_blocks(seq)
        if n > self.cap_blocks:
            raise ValueError(f"prompt {seq.index} needs {n * self.block} tokens of KV in the CPU pool ({seq.prompt_len} "
                             f"prompt tokens in blocks of {self.block}) but the pool holds {self.cap_blocks * self.block} "
                             f"tokens (kv_cache_tokens)")

    def can_admit(self, seq) -> bool:
        return (self._reserved + self._prompt_blocks(seq) <= self.cap_blocks
                and _blocks(self._new(seq), TAIL_BLOCK) <= self.tail.alloc.num_free)

    @classmethod
    def open(cls, model, config, shared, seqs, prefix_cache=None) -> "OffloadBatchKV":
        return cls(model, config, shared, seqs, prefix_cache)

    def admit(self, seq):
        # with a prefix cache the engine sequence starts at the prefill (prefill_start): the
        # match then sees the blocks of the sequences prefilled before it in this call
        key = self._keys
        self._keys += 1
        sid = self.eng.add_sequence() if self.cache is None else None
        try:
            tail = self.tail.reserve(key, self._new(seq))
        except BaseException:  # nothing of it is left behind
            if sid is not None:
                self.eng.free(sid)
            raise
        self._admitted[key] = seq
        seq.kv = {"key": key, "sid": sid, "start": 0, "tail": tail, "events": [], "joined": False,
                  "held": self._reserve(seq, self._prompt_blocks(seq))}

    def release(self, seq):
        kv = seq.kv
        if kv is None:
            return
        self.keep_answer(seq, 0, kv["held"])  # generated token j is tail row j
        self._admitted.pop(kv["key"], None)
        self._reserved -= kv["held"]
        self.tail.free(kv["key"])
        if kv["sid"] is not None:
            self.eng.free(kv["sid"])
        seq.kv = None

    def h2d_bytes_per_step(self, seq) -> int:
        """Bytes of ``seq``'s prompt KV read from the pool per decode step: its whole blocks when
        staged, its tokens in place."""
        n = _blocks(seq.prompt_len, self.block) * self.block if self.staged else seq.prompt_len
        return self._read_bytes(n, self.staged)

    def _read_bytes(self, n: int, whole_blocks: bool) -> int:
        """Bytes of ``n`` prompt tokens of every layer read from the pool (codes and the scales of
        the pages they span: every scale row of the blocks when ``whole_blocks``)."""
        pool = self.eng.pool
        if not self.fp8:
            return n * self._tok_bytes
        p = pool.scale_page
        return pool_read_bytes(self.cfg, pool, n, n // p if whole_blocks else _blocks(n, p))

    def describe(self) -> dict:
        """The call's choices: ``prompt_read`` (``"staged"`` or ``"in place"``), ``staging_bytes``
        (of the two buffers, staged or not), ``staging_limited`` (direct decode asked for, the
        buffers over the GPU memory free for them), ``tail_bytes``."""
        pool = self.eng.pool
        return {"store": type(self).__name__, "prompt_read": "staged" if self.staged else "in place",
                "staging_bytes": self.staging_bytes, "staging_limited": self.staging_limited,
                "tail_bytes": self.tail.nbytes if self.tail is not None else 0,
                "kv_cache_dtype": "fp8" if self.fp8 else str(self.dtype).replace("torch.", ""),
                "kv_scale_page": pool.scale_page, "pool_bytes_per_token": pool.bytes_per_token}

    def sink(self, seq):
        sid, events = seq.kv["sid"], seq.kv["events"]

        def buffers(layer, t):
            return self._stage.buffers(self.eng, layer, t)

        def done(layer, k, v):
            ev = self.eng.offload_layer(sid, layer, k, v)
            self._stage.copied(layer, ev)
            events.append(ev)
            if self.cache is not None and layer == self.cfg.num_layers - 1:
                self.cache.insert(sid, seq.req.ids)  # later sequences of this call may share the prompt

        start = seq.kv["start"]
        reader = PrefixReader(self.eng, sid, start, self.cfg.num_layers) if start else None

        def history(layer, q):
            """The reused prefix of ``layer`` (every block, read from the pool a layer ahead) for the
            prompt's remaining queries ``q [T, Hq, D]``."""
            k, v = reader.get(layer)
            return flash_attn_with_lse(q[None], k[None], v[None], causal=False, softmax_scale=self.scale)

        return _StagedSink(buffers, done, history if start else None)

    def set_batch(self, seqs) -> int:
        rows = self.bucket(len(seqs))
        _join(seqs, self.device)
        self._set_positions(seqs, rows)
        self.region.set_rows([s.kv["tail"] for s in seqs], [s.prompt_len for s in seqs], rows)
        blocks = torch.full((rows, self.hpages), -1, dtype=torch.int32)  # pool block per page (-1: none)
        lens = torch.zeros(rows, dtype=torch.int32)
        for i, s in enumerate(seqs):
            bt = self.eng.block_table(s.kv["sid"])[:_blocks(s.prompt_len, self.block)]
            blocks[i, :len(bt)] = torch.tensor(bt, dtype=torch.int32)
            lens[i] = s.prompt_len
        if self.staged:
            _to_device(self.stager.ids[:rows * self.hpages], blocks.flatten())
        else:  # the first row of each read page of each pool block
            sub = torch.arange(0, self.block, self.read_page, dtype=torch.int32)
            rows_ = blocks.clamp(min=0)[:, :, None] * self.block + sub
            _to_device(self.table[:rows, 0], rows_.flatten(1))
        _to_device(self.hlens[:rows], lens)
        self.n = rows
        return rows

    def begin_step(self):
        self.region.step(self.pos, self.active, self.n)
        if self.staged:  # layers 0 and 1 start copying the batch's rows
            self.stager.begin(self.n * self.hpages)

    def attend(self, layer, q, k_new, v_new):
        n, q4 = self.n, q[:, None]
        o_t, l_t = self.region.attend(layer, q4, k_new, v_new, n, self.scale)
        ks = vs = None
        if self.staged:
            k, v = (t.flatten(0, 1) for t in self.stager.acquire(layer))
            if self.fp8:
                ks, vs = (t.flatten(0, 1) for t in self.stager.scales(layer))
        else:
            pool = self.eng.pool
            k, v = pool.k_rows(layer), pool.v_rows(layer)
            if self.fp8:
                ks, vs = pool.k_scale_rows(layer), pool.v_scale_rows(layer)
        o_p, l_p = paged_decode_attn_with_lse(q4, k, v, self.table[:n], self.hlens[:n], page_size=self.read_page,
                                              softmax_scale=self.scale, check=False, k_scale=ks, v_scale=vs)
        if self.staged:
            self.stager.release(layer)
        o, _ = merge_attention_states(o_p, l_p, o_t, l_t)
        return o[:, 0]

    def close(self):
        for seq in list(self._admitted.values()):
            self.release(seq)
        self.tail = self.region = self.stager = None
        self._stage.clear()
        super().close()


