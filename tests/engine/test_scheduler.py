"""Scheduler (xoffload.engine.scheduler): FIFO admission under max_num_seqs, max_num_batched_tokens
and the store's capacity; refusal of a sequence that can never fit; finished sequences free their
place (continuous batching). Host logic only: a counting capacity stands in for a KV store."""
import pytest
import torch

from xoffload.engine import SamplingParams
from xoffload.engine.request import Request
from xoffload.engine.scheduler import FINISHED, RUNNING, WAITING, Scheduler, Sequence


class Tokens:
    """A capacity of ``total`` tokens; a sequence reserves its final length."""

    def __init__(self, total):
        self.total, self.used, self.log = total, 0, []

    def check(self, seq):
        if seq.final_len > self.total:
            raise ValueError(f"prompt {seq.index} needs {seq.final_len} tokens but the pool holds {self.total}")

    def can_admit(self, seq):
        return self.used + seq.final_len <= self.total

    def admit(self, seq):
        self.used += seq.final_len
        self.log.append(("admit", seq.index))

    def release(self, seq):
        self.used -= seq.final_len
        self.log.append(("release", seq.index))


def _seq(i, prompt_len, max_tokens=4):
    req = Request.make(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), max_model_len=10_000,
                       seed=0, stop_ids=(), device=torch.device("cpu"))
    return Sequence(i, req)


def test_fifo_max_num_seqs_and_continuous_batching():
    cap = Tokens(10_000)
    s = Scheduler(2, 10_000, cap)
    seqs = [_seq(i, 10) for i in range(5)]
    for q in seqs:
        s.add(q)
    assert [q.status for q in seqs] == [WAITING] * 5
    assert s.admit() == seqs[:2] and s.running == seqs[:2]
    assert s.admit() == []  # full
    s.finish(seqs[1], "length")  # a finished one leaves at once ...
    assert seqs[1].status == FINISHED and s.running == [seqs[0]]
    assert s.admit() == [seqs[2]]  # ... and the next waiting one takes its place
    s.finish(seqs[0], "stop")
    s.finish(seqs[2], "length")
    assert s.admit() == seqs[3:5] and not s.waiting
    for q in seqs[3:5]:
        s.finish(q, "length")
    assert s.done and cap.used == 0 and s.max_running == 2
    assert [q.finish_reason for q in seqs] == ["stop", "length", "length", "length", "length"]
    with pytest.raises(ValueError, match="not running"):
        s.finish(seqs[0], "length")


def test_batched_tokens_limit_exempts_the_first_admission():
    s = Scheduler(8, 100, Tokens(10_000))
    seqs = [_seq(0, 150), _seq(1, 30), _seq(2, 60), _seq(3, 50)]
    for q in seqs:
        s.add(q)
    assert s.admit() == [seqs[0]]  # longer than the limit, but first in its step: runs alone
    assert s.admit() == seqs[1:3]  # 30 + 60 <= 100; + 50 would pass it
    assert s.admit() == [seqs[3]]


def test_capacity_blocks_in_order_and_refuses_what_never_fits():
    cap = Tokens(100)
    s = Scheduler(8, 10_000, cap)
    a, b, c = _seq(0, 60, 1), _seq(1, 50, 1), _seq(2, 10, 1)  # final lengths 60, 50, 10
    for q in (a, b, c):
        s.add(q)
    # b does not fit beside a; c would, but does not overtake b (submission order)
    assert s.admit() == [a] and [q.status for q in (a, b, c)] == [RUNNING, WAITING, WAITING]
    s.finish(a, "length")
    assert s.admit() == [b, c] and cap.used == 60
    with pytest.raises(ValueError, match="prompt 7 needs 101 tokens but the pool holds 100"):
        s.add(_seq(7, 101, 1))
    assert len(s.waiting) == 0  # the refused one was not queued
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(0, 10, cap)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(1, 0, cap)


@pytest.mark.parametrize("chunked", [False, True])
def test_requests_behind_a_blocked_head_backfill_within_the_running_horizon(chunked):
    """The head cannot be held by this store (its check raises): the requests behind it that fit
    and need no more steps than the running one still may (50 - 10 = 40 here) are admitted past
    it in order (EASY backfilling); one asking more steps and one that does not fit beside the
    others stay queued, in order; with nothing running
    nothing is backfilled (the engine opens a store for the head)."""
    cap = Tokens(200)
    s = Scheduler(4, 10_000, cap)
    run = _seq(0, 20, 50)
    s.add(run)
    admit = (lambda: s.admit(short=64)) if chunked else s.admit
    assert admit() == [run]
    run.n_out = 10  # 40 more steps at most
    head, fits, long_steps, too_big, also = (_seq(1, 250, 4), _seq(2, 30, 40), _seq(3, 10, 41), _seq(4, 150, 4),
                                             _seq(5, 40, 8))
    for q in (head, fits, long_steps, too_big, also):
        s.add(q, check=False)
    assert s.blocked is head
    assert admit() == [fits, also] and cap.used == 69 + 69 + 47
    assert list(s.waiting) == [head, long_steps, too_big] and s.blocked is head
    for q in (run, fits, also):
        s.finish(q, "length")
    assert admit() == [] and s.blocked is head  # nothing running: no horizon, nothing overtakes


@pytest.mark.parametrize("chunked", [False, True])
def test_a_store_that_raises_at_admission_loses_no_sequence(chunked):
    """capacity.admit raising (e.g. a GPU allocation failing) leaves the sequence waiting, in
    order, with a long one held back by chunked admission still before it."""
    class Failing(Tokens):
        def admit(self, seq):
            if seq.index == 2:
                raise RuntimeError("no memory")
            super().admit(seq)

    s = Scheduler(4, 10_000, Failing(10_000))
    seqs = [_seq(0, 100), _seq(1, 100), _seq(2, 10)]
    for q in seqs:
        s.add(q)
    admit = (lambda: s.admit(short=50, long_busy=False)) if chunked else s.admit
    with pytest.raises(RuntimeError, match="no memory"):
        admit()
    assert seqs[2].status == WAITING and seqs[2] in s.waiting
    assert [q for q in s.running + list(s.waiting)] == seqs


@pytest.mark.parametrize("chunked", [False, True])
def test_a_failed_allocation_at_admission_ends_that_sequence_alone(chunked):
    """capacity.admit raising MemoryError / ValueError (a pool allocation that failed; the store is
    unchanged) finishes that sequence alone with its error (take_failed); the ones behind it
    are admitted in the same call."""
    class Short(Tokens):
        def admit(self, seq):
            if seq.index == 1:
                raise MemoryError("no tail block")
            super().admit(seq)

    cap = Short(10_000)
    s = Scheduler(4, 10_000, cap)
    seqs = [_seq(0, 10), _seq(1, 10), _seq(2, 10)]
    for q in seqs:
        s.add(q)
    admit = (lambda: s.admit(short=50, long_busy=False)) if chunked else s.admit
    assert admit() == [seqs[0], seqs[2]] and not s.waiting
    failed = s.take_failed()
    assert failed == [seqs[1]] and seqs[1].status == FINISHED and seqs[1].finish_reason == "error"
    assert isinstance(seqs[1].error, MemoryError) and s.take_failed() == []
    assert cap.used == 2 * seqs[0].final_len

