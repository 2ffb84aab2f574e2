"""Which sequences run: the waiting and running queues of one store epoch of the engine.

The split follows nano-vllm's (a *sequence* record, a *scheduler* of queues, and a KV store that
owns the memory and answers whether a sequence fits): :class:`Sequence` is one request's state
while it is served, :class:`Scheduler` admits waiting sequences in submission order (first in,
first out; a sequence that does not fit yet blocks the ones behind it, so none overtakes another,
except past a head the store can never hold: backfilling, below) while

* fewer than ``max_num_seqs`` run,
* the prompt tokens admitted since the last decode step stay within ``max_num_batched_tokens``
  (the tokens to prefill: ``capacity.prefill_tokens(seq)``, the prompt less a cached prefix; the
  first admission of a step is always allowed, so a prompt longer than the limit still runs,
  alone), and
* the KV store can reserve the sequence's whole KV (``capacity.can_admit``): its prompt and
  every token it may generate, so a running sequence never runs out of memory and nothing is
  preempted.

A sequence queued without a check (one that arrived after the store was sized) is checked when it
reaches the head of the queue; if the store cannot hold it (``capacity.check`` raises),
:attr:`Scheduler.blocked` names it: the engine opens a store sized for it once the running
sequences are done. Until then the sequences behind it are *backfilled* (EASY backfilling, Lifka
1995: a job may overtake the blocked head when it delays nothing the head waits for): one that the
store can hold and that needs no more decode steps than the longest of the running ones still
may (its ``max_new`` within their largest remaining ``max_new - n_out``) is admitted past the
head, so a short request does not wait for a long one to finish. The head keeps EASY's bound:
it starts no later than the running requests' ``max_tokens`` allow; a running request that
stops early or is aborted brings its start forward only as far as the backfilled ones have
ended (they run to their end: no preemption). Finished sequences leave at once
(:meth:`Scheduler.finish` returns their KV), and the next :meth:`Scheduler.admit` fills their
places: continuous batching. No tensors here: the scheduler is tested on the CPU with a
counting capacity.
"""
from __future__ import annotations

from collections import deque

from ..kernels.checks import check_int
from .request import Request

__all__ = ["Sequence", "Scheduler", "WAITING", "RUNNING", "FINISHED"]

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class Sequence:
    """One request while the engine serves it.

    Args:
        index: its place in the submission order (the output order).
        req: the :class:`~xoffload.engine.request.Request` (prompt ids, sampling, ``max_new``,
            generator, stop ids).

    Attributes:
        status: ``"waiting"``, ``"running"`` or ``"finished"``.
        n_out: tokens sampled so far (counted when sampled, before the host has read them).
        pos: position of the next token fed to a decode step (``len(prompt) + n_out - 1``).
        tokens: sampled token ids as the host has read them (on a GPU a few steps late).
        stopped: a stop id has been read among ``tokens``.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` once finished.
        last_tok: int64 ``[1]`` device tensor, the last sampled token (the next decode input).
        kv: what the KV store keeps for this sequence (the store's own record).
        key: an int unique in the engine (the store's key); ``index`` names it in messages.
        request_id: the engine's name of the request.
        reused, filled: prompt tokens taken from a cached prefix; the prompt tokens in its KV so
            far while it is prefilled in chunks (None before its first chunk).
        error: the exception that ended it (``finish_reason == "error"``), else None.
        sent: tokens already returned by the engine's step outputs.
        marks, steps, densities, h2d, stats: timestamps (:class:`~xoffload.engine.request.Clock`
            marks), decode steps taken, the sparse prefill's per-layer densities, the bytes a
            decode step reads from host memory and the store's decode figures, for the request's
            timings.
    """

    def __init__(self, index, req: Request, *, key: int | None = None, request_id: str | None = None):
        self.index, self.req = index, req
        self.key = index if key is None else key
        self.request_id = str(index) if request_id is None else request_id
        self.status = WAITING
        self.checked = False
        self.reused = 0
        self.filled = None
        self.error = None
        self.sent = 0
        self.on_finish = None
        self.n_out = 0
        self.tokens: list = []
        self.stopped = False
        self.finish_reason: str | None = None
        self.last_tok = None
        self.kv = None
        self.marks: dict = {}
        self.steps = 0
        self.densities = None
        self.h2d = None
        self.stats: dict = {}

    @property
    def prompt_len(self) -> int:
        return len(self.req.ids)

    @property
    def pos(self) -> int:
        return self.prompt_len + self.n_out - 1

    @property
    def final_len(self) -> int:
        """Tokens of KV the sequence may hold: its prompt and every new token but the last."""
        return self.req.final_len

    @property
    def done_sampling(self) -> bool:
        """True once it has all its tokens (``max_new``) or a stop id has been read."""
        return self.n_out >= self.req.max_new or self.stopped

    def __repr__(self):
        return f"Sequence({self.index}, prompt {self.prompt_len}, {self.n_out}/{self.req.max_new} out, {self.status})"


class Scheduler:
    """Waiting and running queues with continuous batching (see the module docstring).

    Args:
        max_num_seqs: most sequences running at once (>= 1).
        max_num_batched_tokens: most prompt tokens admitted between two decode steps (>= 1; the
            first admission of a step is exempt).
        capacity: the KV store's admission interface: ``check(seq)`` (raise ValueError when the
            sequence alone can never fit), ``can_admit(seq) -> bool``, ``admit(seq)`` (reserve its
            KV), ``release(seq)`` (return it); optionally ``prefill_tokens(seq)`` (the tokens
            its prefill would compute, counted against ``max_num_batched_tokens``; default its
            prompt length).
    Raises:
        ValueError: a limit below 1.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, capacity):
        self.max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1, type_error=ValueError)
        self.max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, 1,
                                                type_error=ValueError)
        self.capacity = capacity
        self.waiting: deque = deque()
        self.running: list = []
        self.num_finished = 0
        self.max_running = 0
        self.failed: list = []

    def add(self, seq: Sequence, check: bool = True) -> None:
        """Queue ``seq`` (status waiting); with ``check``, ValueError (from ``capacity.check``)
        when it alone can never fit this store. Without, it is checked at the head of the queue."""
        if check:
            self.capacity.check(seq)
            seq.checked = True
        seq.status = WAITING
        self.waiting.append(seq)

    @property
    def blocked(self) -> Sequence | None:
        """The head of the queue when this store cannot hold it at all (see the module
        docstring), else None."""
        if self.waiting and not self.waiting[0].checked:
            try:
                self.capacity.check(self.waiting[0])
                self.waiting[0].checked = True
            except ValueError:
                return self.waiting[0]
        return None

    def admit(self, short: int | None = None, long_busy: bool = False) -> list:
        """Move waiting sequences to running, in submission order, while they fit (see the module
        docstring); returns the admitted ones (to be prefilled before the next decode step).

        With chunked prefill (``short``: the most tokens a prompt prefilled whole may have) the
        token count does not apply; instead at most one *long* sequence (more than ``short``
        tokens to prefill) is admitted, and none while ``long_busy`` (one is still being
        prefilled in chunks): a long one held back keeps its place and the short ones behind it
        are admitted past it, so a follow-up question does not wait for a document's prefill."""
        if short is not None:
            return self._admit_chunked(short, long_busy)
        new, tokens = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs and self.blocked is None:
            seq = self.waiting[0]
            n = self._prefill_tokens(seq)
            if new and tokens + n > self.max_num_batched_tokens:
                break
            if not self.capacity.can_admit(seq):
                break
            if self._start(seq):
                new.append(seq)
                tokens += n
        new += self._backfill(tokens if new else None)
        self.max_running = max(self.max_running, len(self.running))
        return new

    def _backfill(self, tokens: int | None, short: int | None = None) -> list:
        """Admit, in order, the waiting sequences behind a :attr:`blocked` head that the store can
        hold and that finish within the running ones' largest remaining decode steps (module
        docstring); ``tokens``: the prompt tokens admitted since the last decode step (None:
        none yet); ``short``: with chunked prefill, only prompts of at most that many tokens."""
        if self.blocked is None or not self.running:
            return []
        horizon = max(s.req.max_new - s.n_out for s in self.running)
        new = []
        for seq in list(self.waiting)[1:]:
            if len(self.running) >= self.max_num_seqs:
                break
            if seq.req.max_new > horizon:
                continue
            if not seq.checked:
                try:
                    self.capacity.check(seq)
                except ValueError:
                    continue
                seq.checked = True
            n = self._prefill_tokens(seq)
            if short is not None and n > short:
                continue
            if short is None and tokens is not None and tokens + n > self.max_num_batched_tokens:
                continue
            if not self.capacity.can_admit(seq):
                continue
            if self._start(seq):
                new.append(seq)
                tokens = n if tokens is None else tokens + n
        return new

    def _prefill_tokens(self, seq: Sequence) -> int:
        """The tokens ``seq``'s prefill would compute now (``capacity.prefill_tokens``, else its prompt)."""
        f = getattr(self.capacity, "prefill_tokens", None)
        return f(seq) if f is not None else seq.prompt_len

    def _start(self, seq: Sequence) -> bool:
        """Admit waiting ``seq``: the store reserves its KV first. A ValueError / TypeError /
        MemoryError from it (a pool allocation that failed; the store is left as it was) finishes
        ``seq`` alone with ``error`` set (:meth:`take_failed`) and returns False; anything else
        propagates with ``seq`` still waiting (the engine ends the epoch with it): no sequence
        is lost."""
        try:
            self.capacity.admit(seq)
        except (ValueError, TypeError, MemoryError) as e:
            seq.error = e
            self.finish(seq, "error")
            self.failed.append(seq)
            return False
        self.waiting.remove(seq)
        seq.status = RUNNING
        self.running.append(seq)
        return True

    def take_failed(self) -> list:
        """The sequences whose admission failed since the last call (finished, ``error`` set)."""
        out, self.failed = self.failed, []
        return out

    def _admit_chunked(self, short: int, long_busy: bool) -> list:
        new, held = [], []
        try:
            while self.waiting and len(self.running) < self.max_num_seqs and self.blocked is None:
                seq = self.waiting[0]
                n = self._prefill_tokens(seq)
                if n > short and long_busy:
                    held.append(self.waiting.popleft())  # its place is kept (put back below)
                    continue
                if not self.capacity.can_admit(seq):
                    break
                if self._start(seq):
                    new.append(seq)
                    long_busy = long_busy or n > short
        finally:
            self.waiting.extendleft(reversed(held))
        new += self._backfill(None, short)
        self.max_running = max(self.max_running, len(self.running))
        return new

    def finish(self, seq: Sequence, reason: str) -> None:
        """``seq`` is done (``reason``: ``"stop"``, ``"length"``, ``"abort"``, ``"error"``): it leaves
        its queue and, if it was running, its KV is released."""
        if seq.status == RUNNING:
            self.running.remove(seq)
            seq.finish_reason = reason  # the store may keep a finished answer's KV (kv.answers)
            self.capacity.release(seq)
        elif seq.status == WAITING:
            self.waiting.remove(seq)
        else:
            raise ValueError(f"finish: {seq!r} is not running or waiting (already finished)")
        seq.status, seq.finish_reason = FINISHED, reason
        self.num_finished += 1

    @property
    def done(self) -> bool:
        """No sequence waits or runs."""
        return not self.waiting and not self.running
