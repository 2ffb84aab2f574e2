"""Conversations in a batch: :class:`PrefixSession`, the session of an engine that decodes several
sequences together (``max_num_seqs > 1``).

Each turn is a plain request of the engine loop whose prompt is the whole conversation so far
plus the new message; automatic prefix caching (``prefix_caching=True``) finds the conversation's
KV (in the pinned pool in ``offload`` mode) and the turn prefills only the tokens past it, so many
conversations' turns share decode steps with each other and with plain requests (vLLM's way:
a conversation kept between turns is cached blocks). Under pool pressure the least recently used
cached blocks go first, never those of a running request; a conversation whose blocks were evicted
prefills the missing part again at its next turn, and its timings say how many tokens that was
(``history_recomputed_tokens``). The history is read whole (no ``history_budget``): the decode
policy (``sparse_decode``) still chooses what each decode step reads.

Without ``prefix_caching`` every turn prefills the whole conversation again (the answers are
the same). In ``resident`` mode the cached blocks live in the store's GPU pool, which holds them
while the engine is busy; a turn after the engine went idle prefills the conversation again.
"""
from __future__ import annotations

from .request import RequestOutput
from .sampling import SamplingParams
from .session import Session, _ids

__all__ = ["PrefixSession"]


class PrefixSession(Session):
    """A conversation over the engine's prefix cache (see the module docstring); the same methods
    as :class:`~.session.Session` (``generate``, ``chat``, ``append``, ``submit``, ``close``).

    Raises:
        ValueError: ``history_budget`` (the history is read whole), and as :class:`~.session.Session`.
    """

    def __init__(self, engine, *, history_budget: int | None = None, dense_layers=None, recent_pages: int = 4):
        if history_budget is not None:
            raise ValueError(f"history_budget={history_budget}: sessions with max_num_seqs="
                             f"{engine.config.max_num_seqs} read their history whole (their KV is the prefix "
                             f"cache's); use max_num_seqs=1 for a sparse history")
        super().__init__(engine, dense_layers=dense_layers, recent_pages=recent_pages, batched=True)

    @property
    def history_budget(self) -> None:
        """Always None: the history is read whole (setting a budget raises ValueError)."""
        return None

    @history_budget.setter
    def history_budget(self, value) -> None:
        if value is not None:
            raise ValueError(f"history_budget={value}: sessions with max_num_seqs="
                             f"{self.e.config.max_num_seqs} read their history whole (their KV is the prefix "
                             f"cache's); use max_num_seqs=1 for a sparse history")

    def submit(self, prompt, sampling_params: SamplingParams | None = None, *, request_id: str | None = None,
               close_after: bool = False, _answer: bool = True, _chunk: bool = False, _state=None) -> str:
        """Queue one turn (see :meth:`Session.submit`): a request whose prompt is the conversation
        so far plus ``prompt``."""
        from .inputs import prompt_ids, sampling_list

        self._check_open()
        e = self.e
        ids = prompt_ids(self.m, e.config.max_model_len, 0, prompt)
        tokens = (self._stored + ids) if _chunk else (self._stored + self._pending + ids)
        if len(tokens) > e.config.max_model_len:
            raise ValueError(f"the conversation would hold {len(tokens)} tokens, more than max_model_len="
                             f"{e.config.max_model_len}")
        sp = sampling_list(sampling_params, 1)[0] if _answer else SamplingParams(max_tokens=1)
        state = {} if _state is None else _state
        state.update(tokens=tokens, answer=_answer, close=close_after, stored=len(self._stored),
                     known=len(self._stored) + len(self._pending))
        return self._queue_turn(request_id, tokens, sp, state)

    def _finished(self, out: RequestOutput, state: dict) -> None:
        try:
            if out.finish_reason == "error" or (out.finish_reason == "abort" and not out.timings):
                return  # never prefilled: the conversation is as before
            tokens = state["tokens"]  # an abort after the prefill keeps the prompt and the partial answer
            self._stored, self._pending = list(tokens), (list(out.token_ids) if state["answer"] else [])
            t = out.timings
            reused = t.get("prefix_reused_tokens", 0)
            chunk = len(tokens) - reused
            t.update(history_tokens=reused, chunk_tokens=chunk, history_h2d_bytes=0, history_sparse_layers=0,
                     history_recomputed_tokens=max(0, state["stored"] - 1 - reused))
            out.prompt_token_ids = list(tokens[state["known"]:]) if state["answer"] else list(tokens)
            if state["answer"]:
                self.turns += 1
            else:
                state["result"] = dict(prefill_ms=t.get("prefill_ms"), chunk_tokens=chunk, history_tokens=reused,
                                       history_h2d_bytes=0, history_sparse_layers=0)
        finally:
            self.queued = False
            self.last_used = next(_ids)
            if state["close"]:
                self.close()

    def close(self) -> None:
        """Forget the conversation (its blocks stay in the prefix cache, evictable). Safe twice."""
        if self.closed:
            return
        self.closed = True
        self.e.sessions.pop(self.id, None)

    def _drop_kv(self) -> None:
        self._pending = self._stored + self._pending
        self._stored = []

    def blocks_held(self) -> int:
        """0: the conversation's blocks belong to the prefix cache."""
        return 0

    def evict(self) -> int:
        """Nothing to free (the prefix cache evicts the blocks itself); returns 0."""
        return 0
