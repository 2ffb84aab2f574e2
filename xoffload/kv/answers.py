"""An answer's KV kept for the conversation's next turn (:class:`KeptAnswers`, a mixin of the
offload stores that cache prefixes: :class:`~xoffload.kv.offload.OffloadBatchKV` and
:class:`~xoffload.kv.quest.OffloadQuestBatchKV`).

While a request decodes, its generated tokens' K/V live in the store's GPU tail; its prompt's in
the pool, registered in the prefix cache after its prefill. A conversation's next turn sends the
whole conversation (the earlier prompt, this answer, the new message), so without more the prefix
cache finds the earlier prompt and the turn prefills the answer again with the new message. When a
request finishes (``stop`` or ``length``), the store appends its answer's K/V (every generated token
a decode step has fed, as far as the host has read the token ids) from the tail to the request's
pool sequence, layer by layer (``OffloadRuntime.offload_layer``: D2H on the offload stream, after
the decode steps that wrote them), and registers prompt + answer in the prefix cache; the next turn
then prefills only its new message (and the last answer token or two: the one never fed to a
decode step, and on a GPU those the host had not yet read).

It is skipped, and the next turn prefills the answer as before, when the pool cannot take the
answer's blocks without touching what admitted requests were promised, for aborted and failed
requests, for fp8 pools (a page-scaled pool writes a page's scale once, with the page; the
tail's codes carry token scales), and for a sparse decode whose page selection reaches a layer
below the top one (the answer's K/V above it were computed from attention to the selected pages,
not those a prefill of the answer computes: the next turn's tokens would depend on whether the
cache held the answer).
"""
from __future__ import annotations

import torch

from .base import _blocks, _to_device

__all__ = ["KeptAnswers"]


class KeptAnswers:
    """Mixin: :meth:`keep_answer`, for a store with ``self.eng`` (the offload runtime), ``self.cache``
    (a :class:`~xoffload.runtime.PrefixCache` or None), ``self.tail`` (the GPU tail
    :class:`~.base.RowPool`), ``self.block``, ``self.cap_blocks`` and ``self._reserved``."""

    #: answers appended to the pool and registered in the prefix cache (a counter for tests and stats)
    kept_answers = 0

    def keep_answer(self, seq, first_row: int, held: int) -> int:
        """Append ``seq``'s answer KV to its pool sequence and register prompt + answer in the prefix
        cache (module docstring); called by ``release`` before the pool sequence and the tail rows
        are freed. ``first_row``: the tail row (in ``seq.kv["tail"]``'s order) of the first
        generated token; ``held``: the pool blocks ``seq``'s admission reserved (in
        ``self._reserved``). Returns the answer tokens kept (0: skipped)."""
        kv = seq.kv
        sid = kv.get("sid")
        if self.cache is None or sid is None or getattr(self, "fp8", False) \
                or getattr(seq, "finish_reason", None) not in ("stop", "length"):
            return 0
        k = min(seq.n_out - 1, len(seq.tokens))  # fed to a decode step, and read by the host
        if k <= 0 or self.eng.seq_len(sid) != seq.prompt_len:
            return 0
        eng = self.eng
        have = eng.num_seq_blocks(sid)
        need = _blocks(seq.prompt_len + k, self.block) - have + 1  # (+1: a shared last block is copied)
        if self._reserved - held + have + need > self.cap_blocks:  # blocks promised to admitted requests
            return 0
        rows = torch.empty(k, dtype=torch.int64, device=self.device)
        _to_device(rows, self.tail.rows(kv["tail"], first_row + k, first_row))
        try:
            for layer in range(self.cfg.num_layers):
                kr = self.tail.k[layer].index_select(0, rows)
                vr = self.tail.v[layer].index_select(0, rows)
                eng.offload_layer(sid, layer, kr, vr)  # keeps kr / vr alive until the copy is done
        except ValueError:  # PoolExhaustedError: the pool sequence is freed with whatever it got
            return 0
        self.cache.insert(sid, list(seq.req.ids) + list(seq.tokens[:k]))
        self.kept_answers += 1
        return k
