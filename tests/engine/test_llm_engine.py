"""The step loop (xoffload.engine.llm_engine.LLMEngine): requests join and leave between steps and
give the tokens they give alone; step outputs stream each request's tokens; abort frees a request's
KV at once; submission from several threads (requests and session turns); bad input leaves the
engine serving; a long mixed run (requests, aborts, session turns) leaks no block. CPU, tiny
random model, greedy: token for token."""
import random
import threading

import pytest
import torch

from xoffload import LLMEngine
from xoffload.engine import LLM, SamplingParams

from .llm_helpers import tiny_random

SDPA = {"prefill_attn": "sdpa"}
SP = SamplingParams(max_tokens=6, ignore_eos=True)
MODES = [("gpu", {}), ("offload", {"kv_block_size": 32})]


def _prompts(lens, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def _alone(prompts, sp=SP):
    llm = LLM(tiny_random(), mode="gpu", max_model_len=512, **SDPA)
    return [llm.generate(p, sp)[0].token_ids for p in prompts]


def _run(engine, finals=None):
    """Step until idle; returns {request_id: final output} and checks every output's shape."""
    finals = {} if finals is None else finals
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id not in finals, "an output after the final one"
            if o.finished:
                finals[o.request_id] = o
            else:
                assert o.finish_reason is None and o.text is None  # no tokenizer on the random model
    return finals


@pytest.mark.parametrize("mode,kw", MODES)
def test_requests_join_mid_run_and_stream(mode, kw):
    """B joins after A has decoded a few steps, C after B (both run beside A: the store is sized
    for max_num_seqs requests like A); D, longer than A, waits for a store sized for it. Each
    gives its one-request tokens, and the unfinished outputs of a request grow token by token up
    to its final ones."""
    prompts = _prompts([130, 40, 90, 300], seed=1)
    ref = _alone(prompts)
    e = LLMEngine(tiny_random(), mode=mode, max_model_len=512, max_num_seqs=4, **SDPA, **kw)
    seen, finals, most = {}, {}, 0
    e.add_request("a", prompts[0], SP)
    for step in range(40):
        if step == 2:
            e.add_request("b", prompts[1], SP)
        if step == 3:
            e.add_request("c", prompts[2], SP)
            e.add_request("d", prompts[3], SP)
        for o in e.step():
            prev = seen.get(o.request_id, [])
            assert o.token_ids[:len(prev)] == prev and len(o.token_ids) >= len(prev)
            seen[o.request_id] = o.token_ids
            if o.finished:
                finals[o.request_id] = o
        if e._runner is not None:
            most = max(most, len(e._runner.sched.running))
    _run(e, finals)
    assert [finals[r].token_ids for r in "abcd"] == ref
    assert all(finals[r].finish_reason == "length" for r in "abcd")
    assert most == 3


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("mode,kw", MODES)
def test_abort_mid_decode_frees_blocks_at_once(mode, kw, n):
    """A request aborted mid-decode between steps, from the thread that drives the loop, gives its
    blocks back at once: alone (max_num_seqs=1) the free blocks return to what they were before it
    (the pinned pool's, offload; the open store's whole GPU pool, resident); beside another
    request (2) they grow and the other one gives its one-request tokens."""
    e = LLMEngine(tiny_random(), mode=mode, max_model_len=512, max_num_seqs=n, **SDPA, **kw)
    p = _prompts([100, 70], seed=2)
    start = e.num_free_blocks
    if n > 1:
        e.add_request("keep", p[1], SP)
    e.add_request("x", p[0], SamplingParams(max_tokens=50, ignore_eos=True))
    e.step()
    e.step()
    free_running = e.num_free_blocks
    if mode == "gpu":
        start = e._runner.store.pool.num_blocks  # the store opened for them: all of its pool was free
    e.abort_request("x")  # between steps, from the thread that drives the loop: freed now
    assert e.num_free_blocks > free_running
    if n == 1:
        assert e.num_free_blocks == start
    if mode == "offload":
        assert len(e.offload.sequences()) == n - 1
    e.abort_request(["x", "unknown"])  # finished and unknown ids are ignored
    finals = _run(e)
    assert finals["x"].finish_reason == "abort" and finals["x"].finished
    if n > 1:
        assert finals["keep"].token_ids == _alone([p[1]])[0]
    if mode == "offload":
        assert e.num_free_blocks == e.offload.allocator.num_blocks and e.offload.sequences() == []
        e.offload.allocator.check()
    else:
        assert e.num_free_blocks is None  # idle: no store open


def test_abort_a_waiting_request_and_bad_input_leave_the_engine_serving():
    e = LLMEngine(tiny_random(), mode="offload", kv_block_size=32, max_model_len=512, kv_cache_tokens=256,
                  max_num_seqs=1, **SDPA)
    p = _prompts([50, 60], seed=3)
    e.add_request("a", p[0], SP)
    e.add_request("b", p[1], SP)
    e.step()  # a runs, b waits (one at a time)
    e.abort_request("b")
    with pytest.raises(ValueError, match="already in use"):
        e.add_request("a", p[0], SP)
    with pytest.raises(ValueError, match=r"prompt big needs 288 tokens of KV in the CPU pool .*holds 256"):
        e.add_request("big", _prompts([270], seed=4)[0], SP)
    with pytest.raises(ValueError, match="token id 999"):
        e.add_request("bad", [1, 999], SP)
    with pytest.raises(TypeError, match="request_id"):
        e.add_request(7, p[0], SP)
    finals = _run(e)
    assert finals["b"].finish_reason == "abort" and finals["b"].token_ids == []
    assert finals["a"].token_ids == _alone([p[0]])[0]
    assert e.num_free_blocks == e.offload.allocator.num_blocks


def test_threads_submit_while_one_loop_drives_the_device():
    """Four threads add requests while the main thread steps; every request gets its one-request tokens."""
    e = LLMEngine(tiny_random(), mode="offload", kv_block_size=32, max_model_len=512, max_num_seqs=4, **SDPA)
    prompts = _prompts([30 + 7 * i for i in range(16)], seed=5)
    ref = _alone(prompts)
    go = threading.Barrier(5)

    def submit(t):
        go.wait()
        for i in range(t, 16, 4):
            e.add_request(f"r{i}", prompts[i], SP)

    threads = [threading.Thread(target=submit, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    go.wait()
    finals = {}
    while any(t.is_alive() for t in threads) or e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                finals[o.request_id] = o
    for t in threads:
        t.join()
    assert [finals[f"r{i}"].token_ids for i in range(16)] == ref


@pytest.mark.parametrize("n", [1, 3])
def test_session_turns_from_threads_equal_serial_turns(n):
    """Three threads each hold a conversation of two turns (its turns plain requests of the loop,
    the prefix cache giving each follow-up its conversation) while they drive the loop through
    wait(); every answer equals the conversation run alone without caching, at max_num_seqs 1 and 3;
    no pool sequence is left and, the cache cleared, every block is free."""
    m = tiny_random()
    p = _prompts([60, 20, 80, 25, 40, 15], seed=6)
    want = _serial_conversations([p[0:2], p[2:4], p[4:6]])
    llm = LLM(m, mode="offload", kv_block_size=32, max_model_len=512, max_num_seqs=n, prefix_caching=True, **SDPA)
    got, cached = [None] * 3, [None] * 3

    def talk(i):
        with llm.session() as s:
            a, b = s.generate(p[2 * i], SP), s.generate(p[2 * i + 1], SP)
            got[i], cached[i] = [a.token_ids, b.token_ids], b.num_cached_tokens

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    assert cached == [65, 85, 45]  # each follow-up found its first turn's prompt and answer (less its last token)
    assert llm.offload.sequences() == []
    llm.prefix_cache.clear()
    assert llm.offload.num_free_blocks == llm.offload.allocator.num_blocks


def _serial_conversations(convs, sp=SP):
    """Each conversation's answers from a session holding its KV, one turn after another."""
    llm = LLM(tiny_random(), mode="offload", kv_block_size=32, max_model_len=512, **SDPA)
    out = []
    for turns in convs:
        with llm.session() as s:
            out.append([s.generate(t, sp).token_ids for t in turns])
    return out


def test_conversations_share_decode_steps_and_keep_their_kv():
    """Four conversations of two turns each, submitted turn by turn from one thread: each turn of
    all four runs in the same decode steps; the second turn prefills only its new tokens (the first
    turn's prompt comes from the prefix cache) and every answer equals a held-KV session's."""
    prompts = _prompts([70, 20, 90, 15, 40, 33, 120, 9], seed=11)
    convs = [prompts[2 * i:2 * i + 2] for i in range(4)]
    want = _serial_conversations(convs)
    llm = LLM(tiny_random(), mode="offload", kv_block_size=32, max_model_len=512, max_num_seqs=4,
              prefix_caching=True, **SDPA)
    e, sessions = llm.engine, [llm.session() for _ in convs]
    got = [[] for _ in convs]
    for turn in range(2):
        rids = {s.submit(c[turn], SP): i for i, (s, c) in enumerate(zip(sessions, convs))}
        finals = _run(e)
        assert e.stats["max_running"] == 4
        for rid, i in rids.items():
            got[i].append(finals[rid].token_ids)
            t = finals[rid].timings
            if turn == 1:
                # the first turn's prompt and answer come from the prefix cache, but the answer's
                # last token (never fed to a decode step)
                assert t["history_tokens"] == len(convs[i][0]) + len(SP_ANSWER) - 1
                assert t["chunk_tokens"] == 1 + len(convs[i][1])
                assert finals[rid].num_cached_tokens == t["history_tokens"]  # what a server reports as cached
    assert got == want
    for s in sessions:
        s.close()
    assert e.offload.sequences() == []
    e.offload.allocator.check()


SP_ANSWER = [0] * SP.max_tokens


def test_evicted_conversation_prefills_its_history_again():
    """A pool that holds two of three documents: the least recently used conversation's blocks go,
    its next turn says how many history tokens it computed again, and its answer is unchanged."""
    prompts = _prompts([200, 10, 200, 10, 200, 10], seed=12)
    convs = [prompts[2 * i:2 * i + 2] for i in range(3)]
    want = _serial_conversations(convs)
    llm = LLM(tiny_random(), mode="offload", kv_block_size=32, max_model_len=512, max_num_seqs=2,
              kv_cache_tokens=16 * 32, prefix_caching=True, **SDPA)
    ss = [llm.session() for _ in convs]
    first = [s.generate(c[0], SP).token_ids for s, c in zip(ss, convs)]
    last = ss[2].generate(convs[2][1], SP)  # the most recent document: still cached
    oldest = ss[0].generate(convs[0][1], SP)  # evicted by the third document
    assert [[first[0], oldest.token_ids], [first[2], last.token_ids]] == [want[0], want[2]]
    assert last.timings["history_recomputed_tokens"] == 0 and last.timings["history_tokens"] == 200 + 5
    assert oldest.timings["history_recomputed_tokens"] > 0 and oldest.timings["history_tokens"] < 200 + 5
    assert llm.offload.sequences() == []
    llm.offload.allocator.check()


@pytest.mark.slow
def test_200_mixed_requests_aborts_and_turns_leak_nothing():
    """200 requests of random lengths and max_tokens through 4 slots, one in ten aborted at a
    random step, conversation turns in between; afterwards every pool block is free (or held by
    the prefix cache only) and the allocator's books balance; the requests not aborted give their
    one-request tokens (checked on a sample)."""
    rnd = random.Random(7)
    m = tiny_random()
    e = LLMEngine(m, mode="offload", kv_block_size=32, max_model_len=256, kv_cache_tokens=2048,
                  max_num_seqs=4, prefix_caching=True, **SDPA)
    from xoffload.engine.session import Session
    convs = [Session(e) for _ in range(3)]
    prompts = _prompts([rnd.randint(1, 150) for _ in range(200)], seed=8)
    sps = [SamplingParams(max_tokens=rnd.randint(1, 8), ignore_eos=True) for _ in range(200)]
    aborted, finals, turns = set(), {}, set()
    for i in range(200):
        e.add_request(f"r{i}", prompts[i], sps[i])
        if rnd.random() < 0.1:
            aborted.add(f"r{i}")
        if i % 5 == 4:
            for o in e.step():
                if o.finished:
                    finals[o.request_id] = o
            e.abort_request([r for r in aborted if r not in finals])
        if i % 20 == 10:
            c = convs[(i // 20) % 3]
            if not c.queued:
                turns.add(c.submit(_prompts([rnd.randint(1, 20)], seed=i)[0], SP))
    _run(e, finals)
    assert len(finals) == 200 + len(turns) and turns <= set(finals)
    assert sum(c.turns for c in convs) == len(turns) >= 3
    for r in aborted:
        assert finals[r].finish_reason in ("abort", "length")
    ref_llm = LLM(m, mode="gpu", max_model_len=256, **SDPA)
    for i in rnd.sample([i for i in range(200) if f"r{i}" not in aborted], 10):
        assert finals[f"r{i}"].token_ids == ref_llm.generate(prompts[i], sps[i])[0].token_ids
    assert e.offload.sequences() == []
    assert e.num_free_blocks + e.prefix_cache.evictable_blocks() == e.offload.allocator.num_blocks
    e.prefix_cache.clear()
    assert e.num_free_blocks == e.offload.allocator.num_blocks
    e.offload.allocator.check()


def test_resident_engine_keeps_serving_after_close_and_offload_refuses():
    p = _prompts([20], seed=9)[0]
    for mode, kw in MODES:
        e = LLMEngine(tiny_random(), mode=mode, max_model_len=128, **SDPA, **kw)
        e.add_request("a", p, SP)
        e.close()
        if mode == "gpu":
            assert not e.has_unfinished_requests() or _run(e)["a"].finish_reason in ("abort", "error", "length")
            e.add_request("b", p, SP)
            assert _run(e)["b"].token_ids == _alone([p])[0]
        else:
            with pytest.raises(ValueError, match="closed"):
                e.add_request("b", p, SP)


def test_close_ends_queued_requests_and_wait_returns():
    """close() ends every request, queued ones too: their final outputs say so (offload refuses
    new requests afterwards, resident keeps serving)."""
    for mode, kw in MODES:
        e = LLMEngine(tiny_random(), mode=mode, max_model_len=512, max_num_seqs=4, **SDPA, **kw)
        e.add_request("a", [1, 2, 3], SP)
        e.close()
        out = e.wait("a")
        assert out.finished and out.finish_reason == "error" and "closed" in str(out.error)
        assert not e.has_unfinished_requests()


def test_wait_keeps_only_other_requests_latest_outputs():
    """A session's turns (wait) leave no progress outputs behind; a request another client added
    keeps its final output for whoever steps next, also across LLM.generate."""
    llm = LLM(tiny_random(), mode="offload", kv_block_size=32, max_model_len=512, max_num_seqs=4, **SDPA)
    e = llm.engine
    e.add_request("mine", _prompts([30], seed=13)[0], SP)
    s = llm.session()
    for t in range(2):
        s.generate(_prompts([10], seed=14 + t)[0], SamplingParams(max_tokens=12, ignore_eos=True))
    llm.generate(_prompts([20], seed=16)[0], SP)
    kept = e.step()
    assert [o.request_id for o in kept if o.finished] == ["mine"]
    assert all(o.request_id == "mine" for o in kept) and len(kept) == 1


def test_queued_turns_through_a_small_pool_and_aborted_turns_stay():
    """Turns of two sessions queued together through a pool that holds one conversation at a time
    both complete; an aborted turn after its prefill keeps its prompt and partial answer in the
    conversation, at max_num_seqs 1 and 4."""
    llm = LLM(tiny_random(), mode="offload", kv_block_size=32, max_model_len=512, max_num_seqs=1,
              kv_cache_tokens=128, **SDPA)
    e, a, b = llm.engine, llm.session(), llm.session()
    a.generate(list(range(1, 80)), SP)
    b.generate(list(range(2, 81)), SP)
    ra, rb = a.submit([5, 6, 7], SP), b.submit([8, 9], SP)
    assert e.wait(ra).error is None and e.wait(rb).error is None
    for n in (1, 4):
        llm = LLM(tiny_random(), mode="offload", kv_block_size=32, max_model_len=512, max_num_seqs=n,
                  prefix_caching=True, **SDPA)
        e, s = llm.engine, llm.session()
        s.generate(list(range(1, 40)), SP)
        rid = s.submit(list(range(50, 70)), SamplingParams(max_tokens=50, ignore_eos=True))
        for _ in range(4):
            e.step()
        e.abort_request(rid)
        out = _run(e)[rid]
        assert out.finish_reason == "abort" and out.timings["decode_steps"] >= 1
        assert len(s.tokens) == 39 + 6 + 20 + len(out.token_ids), n


def test_bad_arguments_are_one_line_errors():
    e = LLMEngine(tiny_random(), mode="offload", kv_block_size=32, max_model_len=512, max_num_seqs=1,
                  prefix_caching=True, **SDPA)
    for bad in (5, None, b"ab"):
        with pytest.raises(TypeError, match="abort_request takes"):
            e.abort_request(bad)
    with pytest.raises(TypeError, match="1-D tensor"):
        e.add_request("t", torch.tensor(5), SP)
    for kw in (dict(stop_token_ids="12"), dict(stop_token_ids=None), dict(seed="a"), dict(top_p="0.5")):
        with pytest.raises(TypeError):
            SamplingParams(**kw)
    e.add_request("d", [1, 2, 3], SP)
    for _ in range(3):
        with pytest.raises(ValueError, match="already in use"):
            e.add_request("d", [1, 2, 3], SP)
    _run(e)
    assert e.sessions == {}


def test_generate_warns_once_when_max_tokens_passes_max_model_len():
    llm = LLM(tiny_random(), mode="gpu", max_model_len=64, **SDPA)
    prompts = _prompts([40, 50], seed=17)
    with pytest.warns(UserWarning, match=r"2 prompt\(s\) cannot get max_tokens") as rec:
        outs = llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    assert len(rec) == 1 and [o.finish_reason for o in outs] == ["length", "length"]
    assert [len(o.token_ids) for o in outs] == [64 - 40 + 1, 64 - 50 + 1]
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.generate(prompts, SamplingParams(max_tokens=30), length_warning="raise")
    with pytest.raises(ValueError, match="length_warning"):
        llm.generate(prompts, length_warning="loud")


def test_a_short_request_behind_one_the_store_cannot_hold_is_not_held_up():
    """A long answer opens the store for its 20-token prompt; a 40-token prompt then waits for a
    store sized for it, but the 5-token, 2-token request behind it is backfilled and finishes at
    once, with its tokens alone; the 40-token one runs after the long answer, with its own."""
    from xoffload.models import random_model

    m = random_model("tiny-llama", dtype=torch.float32, device="cpu", seed=1, std=0.15)
    g = torch.Generator().manual_seed(3)
    p_long, p_x, p_y = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 40, 5))
    kw = dict(mode="offload", kv_block_size=32, max_model_len=512, prefill_attn="sdpa")
    llm = LLM(m, max_num_seqs=3, **kw)
    eng, done, step = llm.engine, {}, 0
    eng.add_request("long", p_long, SamplingParams(max_tokens=60, ignore_eos=True))
    eng.step()
    eng.add_request("x", p_x, SamplingParams(max_tokens=6, ignore_eos=True))
    eng.add_request("y", p_y, SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_unfinished_requests():
        step += 1
        done.update({o.request_id: (step, o.token_ids) for o in eng.step() if o.finished})
    assert done["y"][0] <= 2 and done["x"][0] > done["long"][0]
    alone = LLM(m, **kw)
    for rid, p, n in (("x", p_x, 6), ("y", p_y, 2)):
        assert done[rid][1] == alone.generate(p, SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids


def test_a_store_that_raises_at_admission_ends_the_call_and_keeps_serving(monkeypatch):
    """The store's admit raising (a GPU allocation failing) ends the call with that error instead
    of leaving the request in no queue (the call then never returned); the next call runs and no
    block is leaked."""
    from xoffload.kv.offload import OffloadBatchKV

    llm = LLM(tiny_random(), mode="offload", kv_block_size=32, max_model_len=256, max_num_seqs=2)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    real = OffloadBatchKV.admit

    def failing(self, seq):
        raise RuntimeError("no memory for the tail")

    monkeypatch.setattr(OffloadBatchKV, "admit", failing)
    with pytest.raises(RuntimeError, match="no memory for the tail"):
        llm.generate([[1, 2, 3], [4, 5, 6]], sp)
    monkeypatch.setattr(OffloadBatchKV, "admit", real)
    assert [len(o.token_ids) for o in llm.generate([[1, 2, 3], [4, 5, 6]], sp)] == [3, 3]
    assert llm.offload.sequences() == [] and llm.offload.num_free_blocks == llm.offload.allocator.num_blocks


def test_a_failed_allocation_at_admission_ends_that_request_alone(monkeypatch):
    """A pool allocation failing while a request joins (ValueError from the store's admit) ends
    that request with the error; the one already running goes on to its last token, and a session
    whose turn failed so takes its next turn."""
    from xoffload.kv.offload import OffloadBatchKV

    llm = LLM(tiny_random(), mode="offload", kv_block_size=32, max_model_len=256, max_num_seqs=2)
    eng, sp = llm.engine, SamplingParams(max_tokens=6, ignore_eos=True)
    real = OffloadBatchKV.admit

    def failing(self, seq):
        if seq.request_id == "b":
            raise ValueError("the tail pool is out of blocks")
        return real(self, seq)

    monkeypatch.setattr(OffloadBatchKV, "admit", failing)
    eng.add_request("a", [1, 2, 3], sp)
    eng.step()
    eng.add_request("b", [4, 5, 6], sp)
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done["a"].finish_reason == "length" and len(done["a"].token_ids) == 6
    assert done["b"].finish_reason == "error" and "out of blocks" in str(done["b"].error)
    monkeypatch.setattr(OffloadBatchKV, "admit", lambda self, seq: (_ for _ in ()).throw(RuntimeError("boom")))
    with llm.session() as s:
        with pytest.raises(RuntimeError, match="boom"):
            s.generate([7, 8, 9], sp)
        monkeypatch.setattr(OffloadBatchKV, "admit", real)
        assert len(s.generate([7, 8, 9], sp).token_ids) == 6  # not left "in a turn"
    assert llm.offload.sequences() == [] and llm.offload.num_free_blocks == llm.offload.allocator.num_blocks



def test_a_tail_reservation_that_fails_leaves_no_pool_sequence(monkeypatch):
    """The offload store's admit: the GPU tail's reservation failing (after the pool sequence was
    opened, no prefix cache) frees that sequence; the request ends with the error."""
    from xoffload.kv.base import RowPool

    llm = LLM(tiny_random(), mode="offload", kv_block_size=32, max_model_len=256)
    real = RowPool.reserve
    monkeypatch.setattr(RowPool, "reserve", lambda *a, **k: (_ for _ in ()).throw(ValueError("no tail block")))
    with pytest.raises(ValueError, match="no tail block"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    monkeypatch.setattr(RowPool, "reserve", real)
    assert llm.offload.sequences() == []
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
