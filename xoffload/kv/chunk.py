"""Chunked prefill of the batched offload stores (:class:`ChunkedPrefill`, a mixin of
:class:`~xoffload.kv.offload.OffloadBatchKV` and
:class:`~xoffload.kv.quest.OffloadQuestBatchKV`).

A long prompt is prefilled over several engine steps, a chunk of at most
``max_num_batched_tokens`` tokens per step, so that the sequences already decoding (and the short
prompts that arrive meanwhile) are not held up for the whole prompt: vLLM's chunked prefill. Every
chunk but the last goes through :meth:`ChunkedPrefill.chunk_sink`: its K/V are appended to the
sequence's pool sequence in the pinned host pool, layer by layer, and its queries attend to the
chunks before it (read back from the pool, dense, non-causal) and causally within the chunk, the
two merged by LSE (``LlamaModel.prefill`` with ``start``). The last chunk is the store's own
:meth:`sink` with ``seq.kv["start"]`` set to the tokens already in the pool, exactly as a prefill
past a reused prefix: the Quest store then builds its page summaries, channels, resident tokens
and dense rows from the whole layer, and the prompt goes into the prefix cache.

Cost: chunk ``i`` reads the ``i`` chunks before it from the pool once per layer, so a prompt of
``T`` tokens in chunks of ``C`` reads about ``T^2 / (2 C)`` tokens of KV over PCIe (8B shape, 32K
in chunks of 4K: ~15 GB, ~0.3 s at ~50 GB/s, against ~2.6 s of prefill compute).
"""
from __future__ import annotations

from ..kernels import flash_attn_with_lse
from .base import _StagedSink
from .staging import PrefixReader

__all__ = ["ChunkedPrefill", "DEFAULT_CHUNK_TOKENS"]

#: prefill tokens per engine step when chunked prefill is on and ``max_num_batched_tokens`` is not
#: given. An estimate balanced between two costs on the 8B shape (H200): a step's prefill work
#: delays every decoding sequence and every waiting follow-up (4K tokens: ~0.1 s of GEMMs), and
#: each chunk re-reads the chunks before it from the host pool (the total grows as ``1 / C``).
DEFAULT_CHUNK_TOKENS = 4096


class ChunkedPrefill:
    """Mixin: :meth:`chunk_sink` for a store whose sequences keep their prompt KV in the offload
    runtime's pool (``self.eng``, ``self._stage``, ``self.block``, ``self.scale``)."""

    #: the runner may prefill a long prompt of this store in chunks across steps
    chunked_prefill = True

    def chunk_sink(self, seq, start: int, end: int):
        """The prefill sink of prompt tokens ``[start, end)`` of ``seq`` (``0 <= start < end <
        prompt_len``; the tokens before ``start`` are in the pool already), a chunk that is not the
        last: each layer's K/V are appended to the pool, and the chunk attends to ``[0, start)``.

        Raises:
            ValueError: bounds outside the prompt, or a chunk that is not where the pool ends.
        """
        kv = seq.kv
        sid, events = kv["sid"], kv["events"]
        if not 0 <= start < end < seq.prompt_len:
            raise ValueError(f"a prefill chunk [{start}, {end}) must lie before the last token of a "
                             f"{seq.prompt_len}-token prompt")
        have = self.eng.seq_len(sid)
        if have != start:
            raise ValueError(f"a prefill chunk starting at {start} continues a pool sequence holding {have} tokens")
        eng, stage, T = self.eng, self._stage, end - start

        def buffers(layer, t):
            if t != T:
                raise ValueError(f"the chunk [{start}, {end}) has {T} tokens, got {t}")
            return stage.buffers(eng, layer, t)

        def done(layer, k, v):
            ev = eng.offload_layer(sid, layer, k, v)
            stage.copied(layer, ev)
            events.append(ev)

        reader = PrefixReader(eng, sid, start, self.cfg.num_layers) if start else None

        def history(layer, q):  # the chunks before this one, read from the pool a layer ahead
            k, v = reader.get(layer)
            return flash_attn_with_lse(q[None], k[None], v[None], causal=False, softmax_scale=self.scale)

        return _StagedSink(buffers, done, history if start else None)
