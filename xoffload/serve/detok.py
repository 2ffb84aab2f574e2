"""Incremental detokenization: :class:`IncrementalText` turns the growing token ids of one request
into text deltas whose concatenation is exactly the text of the finished request.

Each update decodes all tokens so far (no cleanup of spaces, so decoding is prefix-stable) and
sends what lies past the text already sent, holding back a trailing U+FFFD (the first bytes of a
character whose other bytes have not come yet) and, with stop strings, a tail that could begin
one. The first stop string found cuts the text there (it is not part of the output).
"""
from __future__ import annotations

__all__ = ["IncrementalText", "make_decoder"]

REPLACEMENT = "\ufffd"


def make_decoder(tokenizer):
    """``decode(ids) -> str`` for ``tokenizer`` (special tokens skipped, spaces not cleaned up so
    that the text of a prefix of the ids is a prefix of the text), or None without a tokenizer."""
    if tokenizer is None:
        return None

    def decode(ids) -> str:
        try:
            return tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        except TypeError:  # a tokenizer without that keyword
            return tokenizer.decode(list(ids), skip_special_tokens=True)
    return decode


class IncrementalText:
    """The text of one request, handed out in deltas.

    Args:
        decode: ``decode(ids) -> str`` (:func:`make_decoder`), or None: no text (every delta "").
        stop_strings: strings that end the output at their first occurrence (excluded).
        stop_ids: token ids that end generation; the ids from the first of them on are not
            decoded (the engine keeps the stop token in ``token_ids``).

    Attributes: ``text`` (all sent so far), ``stopped`` (a stop string was found), ``num_tokens``
    (token ids seen, the stop token included).
    """

    def __init__(self, decode, stop_strings=(), stop_ids=()):
        self.decode = decode
        self.stops = [s for s in stop_strings if s]
        self.stop_ids = set(stop_ids)
        self.text = ""
        self.stopped = False
        self.num_tokens = 0

    def update(self, token_ids, final: bool = False) -> str:
        """The delta for ``token_ids`` (all ids generated so far); ``final``: nothing more comes,
        send everything. After a stop string is found every later update returns ""."""
        if self.stopped:
            return ""
        self.num_tokens = len(token_ids)
        if self.decode is None:
            return ""
        ids = list(token_ids)
        cut = next((j for j, t in enumerate(ids) if t in self.stop_ids), None)
        if cut is not None:
            ids = ids[:cut]
        full = self.decode(ids)
        if self.stops:
            hit = self._find_stop(full)
            if hit is not None:
                full, final, self.stopped = full[:hit], True, True
        end = len(full)
        if not final:
            while end > len(self.text) and full[end - 1] == REPLACEMENT:
                end -= 1
            end -= self._stop_prefix_len(full[:end])
        if end <= len(self.text) or not full.startswith(self.text):
            return ""
        delta = full[len(self.text):end]
        self.text += delta
        return delta

    def _find_stop(self, full: str):
        start = max(0, len(self.text) - max(len(s) for s in self.stops) + 1)
        hits = [i for i in (full.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _stop_prefix_len(self, s: str) -> int:
        """Length of the longest tail of ``s`` (past the sent text) that begins a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(s) - len(self.text)), best, -1):
                if s.endswith(stop[:k]):
                    best = k
                    break
        return best
