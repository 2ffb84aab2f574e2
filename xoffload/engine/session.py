"""Sessions: a conversation with one :class:`~.llm_engine.LLMEngine` (:meth:`LLM.session`).

Each turn is a plain request of the engine loop whose prompt is the whole conversation so far
(every earlier prompt and answer) plus the new message, for every ``max_num_seqs``. With
``prefix_caching=True`` automatic prefix caching finds the conversation's KV and the turn prefills
only the tokens past it, so the turns of many conversations share decode steps with each other
and with plain requests (vLLM's way: a conversation kept between turns is cached blocks). In
``offload`` mode the blocks live in the pinned pool for the engine's lifetime (each answer's KV
too, registered when its request finishes: :mod:`xoffload.kv.answers`); in ``resident``
mode in the open store's GPU pool, which holds them while the engine is busy (a turn after the
engine went idle prefills the conversation again). Under pool pressure the prefix cache evicts
the least recently used blocks that no running request holds (never a running turn's); a turn
whose conversation was evicted prefills the missing part again, and its timings say how many
tokens that was (``history_recomputed_tokens``). The conversation is read whole; the decode
policy (``sparse_decode``) chooses what each decode step reads.

Without prefix caching (``prefix_caching=False``, the default, or a configuration that cannot
cache prefixes, :meth:`~.config.EngineConfig._prefix_caching_refusal`) every turn prefills the
whole conversation again; the answers are the same, the prefill grows with the conversation.
"""
from __future__ import annotations

import itertools
import threading

from .inputs import apply_chat_template, prompt_ids, sampling_list
from .request import RequestOutput
from .sampling import SamplingParams
from .scheduler import RUNNING

__all__ = ["Session"]

_ids = itertools.count()
_submit_lock = threading.Lock()


def _no_history_budget(value) -> ValueError:
    return ValueError(f"history_budget={value!r} is not an option: a session's history is read whole through the "
                      f"prefix cache, and the decode policy (sparse_decode) chooses what each decode step reads")


class Session:
    """A conversation whose turns are requests of the engine loop (see the module docstring).

    Made by :meth:`LLM.session`. One turn at a time per session; turns may be submitted from
    several threads (:meth:`submit`, thread-safe), the loop serves them with every other request.
    Works in every mode and with every decode and prefill policy of the engine.

    Args:
        engine: the :class:`~.llm_engine.LLMEngine`.
        history_budget: only None; a value raises ValueError (the history is read whole).

    Attributes: ``tokens`` (every token of the conversation so far: the last turn's prompt + its
    answer), ``history_len`` (tokens of the conversation the last turn prefilled or found cached:
    its prompt), ``turns`` (answered turns), ``closed``, ``queued`` (a turn is queued or running),
    ``busy`` (its turn is running), ``last_used`` (increases with every finished turn).

    Raises:
        ValueError: a ``history_budget``, ``tensor_parallel_size > 1``, a closed engine.
    """

    def __init__(self, engine, *, history_budget=None):
        if history_budget is not None:
            raise _no_history_budget(history_budget)
        if engine.closed:
            raise ValueError("this LLM was closed; create a new one")
        cfg = engine.config
        if cfg.tensor_parallel_size != 1:
            raise ValueError(f"sessions run on one device; tensor_parallel_size={cfg.tensor_parallel_size} "
                             f"is not supported for them yet")
        self.e, self.m = engine, engine.model
        self.id = next(_ids)
        self._stored: list = []  # the last turn's prompt (its K/V computed or found cached by that turn)
        self._pending: list = []  # the last answer's tokens
        self._rid = None  # the queued or running turn's request id
        self._messages: list = []
        self.turns = 0
        self.closed = False
        self.queued = False
        self.last_used = 0
        engine.sessions[self.id] = self

    # ------------------------------------------------------------------ public
    @property
    def tokens(self) -> list:
        return self._stored + self._pending

    @property
    def history_len(self) -> int:
        """Tokens of the conversation the last turn prefilled or found cached (its prompt)."""
        return len(self._stored)

    @property
    def busy(self) -> bool:
        """Whether this session's turn is running (admitted: its KV blocks are held)."""
        rid = self._rid
        if rid is None:
            return False
        with self.e._lock:
            seq = self.e._requests.get(rid)
        return seq is not None and seq.status == RUNNING

    @property
    def history_budget(self) -> None:
        """Always None (setting a value raises ValueError: the history is read whole)."""
        return None

    @history_budget.setter
    def history_budget(self, value) -> None:
        if value is not None:
            raise _no_history_budget(value)

    def generate(self, prompt, sampling_params: SamplingParams | None = None) -> RequestOutput:
        """One turn: append ``prompt`` (a string, tokenized as it is, or token ids) to the
        conversation and answer it.

        Returns:
            a :class:`RequestOutput` whose ``prompt_token_ids`` are this turn's new tokens (the
            last answer's tokens first, then ``prompt``) and whose timings add ``history_tokens``
            (conversation tokens the prefix cache gave), ``chunk_tokens`` (tokens prefilled) and
            ``history_recomputed_tokens`` (tokens an earlier turn had prefilled that this one
            prefilled again: evicted from the cache, or no prefix caching).
        Raises:
            ValueError / TypeError: a bad prompt or parameters, a conversation that would pass
            ``max_model_len`` or never fit the KV pool, a closed session, a turn of this session
            queued; the session is unchanged then and keeps serving.
        """
        return self._wait(self.submit(prompt, sampling_params))

    def append(self, prompt) -> dict:
        """Add ``prompt`` (a string, tokenized as it is, or token ids) to the conversation without
        answering: its K/V are computed (and, with prefix caching, cached for the next turn; e.g.
        a document loaded once, asked about in later turns). Returns the turn's timings
        (``prefill_ms``, ``chunk_tokens``, ``history_tokens``, ``history_recomputed_tokens``).
        Same errors as :meth:`generate`."""
        state: dict = {}
        self._wait(self.submit(prompt, None, _answer=False, _state=state))
        return state.get("result", {})

    def chat(self, message: str, sampling_params: SamplingParams | None = None) -> RequestOutput:
        """One chat turn through the tokenizer's chat template: the user ``message`` (a string) is
        added to the conversation's messages, the template renders them all, and the rendering is
        the turn's prompt (the prefix cache finds what earlier turns computed of it); the answer's
        text joins the messages as the assistant's. Raises ValueError without a chat template, and
        as :meth:`generate`."""
        self._check_open()
        if not isinstance(message, str) or not message:
            raise ValueError(f"message must be a non-empty string, got {message!r}")
        if self.queued:
            raise ValueError(f"session {self.id} is in a turn; one turn at a time")
        msgs = self._messages + [{"role": "user", "content": message}]
        full = apply_chat_template(self.m, msgs, add_generation_prompt=True)
        n = len(self._stored)  # this turn's new tokens: past the last prompt (the template renders the answer)
        known = n if full[:n] == self._stored else 0
        if len(full) <= known:
            raise ValueError("the chat template added no tokens for this message")
        out = self._wait(self._queue_turn(None, full, sampling_list(sampling_params, 1)[0], known=known))
        self._messages = msgs + [{"role": "assistant", "content": out.text or ""}]
        return out

    def submit(self, prompt, sampling_params: SamplingParams | None = None, *, request_id: str | None = None,
               close_after: bool = False, _answer: bool = True, _state=None) -> str:
        """Queue one turn (``prompt`` answered, as :meth:`generate`) in the engine loop without
        waiting: a request whose prompt is the conversation so far plus ``prompt``. Returns its
        request id (the engine's :meth:`~.llm_engine.LLMEngine.step` returns its outputs;
        ``close_after``: the session closes when the turn ends). Raises as :meth:`generate`."""
        self._check_open()
        ids = prompt_ids(self.m, self.e.config.max_model_len, 0, prompt)
        sp = sampling_list(sampling_params, 1)[0] if _answer else SamplingParams(max_tokens=1)
        tokens = self.tokens + ids
        return self._queue_turn(request_id, tokens, sp, known=len(self._stored), answer=_answer, close=close_after,
                                state=_state)

    def close(self) -> None:
        """Forget the conversation (its blocks stay in the prefix cache, evictable; a turn in
        flight runs to its end). Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        self.e.sessions.pop(self.id, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):  # closes the session
        self.close()

    # ------------------------------------------------------------------ a turn
    def _check_open(self):
        if self.closed or self.e.closed:
            raise ValueError("this session was closed" if self.closed else "this session's LLM was closed")

    def _wait(self, rid: str) -> RequestOutput:
        out = self.e.wait(rid)
        if out.error is not None:
            raise out.error
        return out

    def _queue_turn(self, request_id, tokens: list, sp, *, known: int, answer: bool = True, close: bool = False,
                    state: dict | None = None) -> str:
        """Add the turn's request (one turn at a time: ValueError while one is queued)."""
        n = self.e.config.max_model_len
        if len(tokens) > n:
            raise ValueError(f"the conversation would hold {len(tokens)} tokens, more than max_model_len={n}")
        state = {} if state is None else state
        state.update(tokens=tokens, answer=answer, close=close, stored=len(self._stored), known=known)
        rid = request_id or f"session-{self.id}-{next(_ids)}"
        with _submit_lock:
            if self.queued:
                raise ValueError(f"session {self.id} is in a turn; one turn at a time")
            self.queued = True
        try:
            self._rid = rid
            self.e.add_request(rid, tokens, sp, on_finish=lambda out: self._finished(out, state))
        except BaseException:
            self._rid, self.queued = None, False
            raise
        return rid

    def _finished(self, out: RequestOutput, state: dict) -> None:
        """The turn's final output (the engine loop calls it): the prompt and answer join the
        conversation (an abort after the prefill keeps the partial answer); its timings name the
        tokens the prefix cache gave and those prefilled."""
        try:
            if out.finish_reason == "error" or (out.finish_reason == "abort" and not out.timings):
                return  # never prefilled: the conversation is as before
            tokens = state["tokens"]
            self._stored, self._pending = list(tokens), (list(out.token_ids) if state["answer"] else [])
            t = out.timings
            reused = t.get("prefix_reused_tokens", 0)
            chunk = len(tokens) - reused
            t.update(history_tokens=reused, chunk_tokens=chunk,
                     history_recomputed_tokens=max(0, state["stored"] - reused))
            out.prompt_token_ids = list(tokens[state["known"]:]) if state["answer"] else list(tokens)
            if state["answer"]:
                self.turns += 1
            else:
                state["result"] = {k: t.get(k) for k in ("prefill_ms", "chunk_tokens", "history_tokens",
                                                         "history_recomputed_tokens")}
        finally:
            self._rid, self.queued = None, False
            self.last_used = next(_ids)
            if state["close"]:
                self.close()
