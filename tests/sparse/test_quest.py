"""Quest page selection (xoffload.sparse.quest): the min/max bound, GQA group scores, the per-request
plan in every edge case, page rows through a block table, and bad values."""
import dataclasses
import math

import pytest
import torch

from xoffload.sparse.quest import DEFAULT_REUSE_BIAS, DecodePlan, PageSummaries, QuestDecode, page_scores, select_pages


def _summaries(k, P):
    """kmin/kmax [Hkv, n, D] of k [T, Hkv, D] through PageSummaries (fp32, CPU)."""
    T, hkv, d = k.shape
    s = PageSummaries(1, hkv, d, max_pages=T // P + 1, page_size=P, dtype=k.dtype, device=k.device)
    n = s.write(0, k)
    return s.kmin[0, :, :n], s.kmax[0, :, :n], n


def _true_page_max(q, k, P, hkv):
    """max over the group's query heads and the page's keys of q·k: [Hkv, n_pages] (fp64)."""
    hq, d = q.shape
    n = k.shape[0] // P
    kk = k[: n * P].double().unflatten(0, (n, P))  # [n, P, Hkv, D]
    g = hq // hkv
    qq = q.double().view(hkv, g, d)
    dots = torch.einsum("hgd,nphd->hgnp", qq, kk)  # [Hkv, g, n, P]
    return dots.amax(-1).amax(1)


@pytest.mark.parametrize("hq,hkv,d,P", [(4, 4, 16, 16), (8, 2, 64, 32), (9, 3, 40, 16)])
def test_bound_is_upper_bound_random(hq, hkv, d, P):
    g = torch.Generator().manual_seed(hq * 100 + d)
    T = 7 * P + 5  # a partial last page is left out of the summaries
    k = torch.randn(T, hkv, d, generator=g) * 3
    for _ in range(5):
        q = torch.randn(hq, d, generator=g)
        kmin, kmax, n = _summaries(k, P)
        assert n == 7
        bound = page_scores(q, kmin, kmax).double()
        true = _true_page_max(q, k, P, hkv)
        assert bound.shape == (hkv, n)
        assert bool((bound >= true - 1e-9 * (1 + true.abs())).all())


def test_bound_is_upper_bound_adversarial():
    """Mixed signs, one huge coordinate, a zero query, constant pages, +-large values: the bound
    holds and is tight for a page of identical keys."""
    P, hkv, hq, d = 16, 2, 4, 8
    k = torch.zeros(4 * P, hkv, d)
    k[:P] = torch.tensor([1e4, -1e4, 0, 0, 1, -1, 3, -3])  # constant page: bound = q·k exactly
    k[P:2 * P, :, 0] = torch.linspace(-1e3, 1e3, P)[:, None]
    k[2 * P:3 * P] = torch.randn(P, hkv, d) * 1e3
    k[3 * P:, :, 5] = -7.0
    kmin, kmax, n = _summaries(k, P)
    for q in (torch.zeros(hq, d), torch.randn(hq, d) * 10, -torch.ones(hq, d), torch.eye(d)[:hq] * 1e3):
        bound = page_scores(q, kmin, kmax).double()
        true = _true_page_max(q, k, P, hkv)
        assert bool((bound >= true - 1e-6 * (1 + true.abs())).all())
    q = torch.randn(hq, d)
    exact = (q.double().view(hkv, 2, d) @ k[0, 0].double()).amax(1)
    assert torch.allclose(page_scores(q, kmin, kmax)[:, 0].double(), exact, rtol=1e-5, atol=1e-3)


def test_gqa_score_is_group_max():
    """Each KV head's score is the max of its query heads' bounds, never another group's."""
    P, hkv, hq, d = 16, 2, 6, 8
    k = torch.randn(3 * P, hkv, d)
    kmin, kmax, _ = _summaries(k, P)
    q = torch.randn(hq, d)
    s = page_scores(q, kmin, kmax)
    for h in range(hkv):
        per = torch.stack([page_scores(q[h * 3 + j: h * 3 + j + 1].repeat(1, 1), kmin[h:h + 1], kmax[h:h + 1])[0]
                           for j in range(3)])
        assert torch.allclose(s[h], per.amax(0))


@pytest.mark.parametrize("hkv,hq", [(1, 1), (2, 8), (3, 9)])
def test_planted_key_is_always_selected(hkv, hq):
    """A key aligned with the query (dominating attention) lies in a chosen page at a small budget,
    for the KV head that holds it, wherever it is planted."""
    P, d, T = 16, 32, 64 * 16
    pol = QuestDecode(token_budget=96, page_size=P, sink_tokens=16, recent_tokens=32)
    plan = pol.plan(T)
    gen = torch.Generator().manual_seed(7)
    for trial in range(12):
        k = torch.randn(T, hkv, d, generator=gen)
        q = torch.randn(hq, d, generator=gen)
        h = trial % hkv
        pos = int(torch.randint(plan.sink_len, plan.tail_start, (1,), generator=gen))
        k[pos, h] = q[h * (hq // hkv)] * 4  # q·k* = 4|q|^2 >> any random q·k
        kmin, kmax, _ = _summaries(k, P)
        f, n = plan.first_page, plan.num_candidates
        s = page_scores(q, kmin[:, f:f + n], kmax[:, f:f + n])
        rows = select_pages(s, plan.pages_per_step, f, P, None, 1024)
        assert rows.shape == (1, hkv, plan.pages_per_step) and rows.dtype == torch.int32
        assert (pos // P) * P in rows[0, h].tolist()


def test_plan_edge_cases():
    P = 32
    pol = QuestDecode(token_budget=512, page_size=P, sink_tokens=32, recent_tokens=128)
    p = pol.plan(4096)
    assert (p.sink_len, p.tail_start, p.first_page) == (32, 4096 - 128, 1)
    assert p.num_candidates == (4096 - 128) // P - 1
    assert p.pages_per_step == (512 - 32 - 128) // P and not p.dense
    assert p.resident_prompt_tokens == 160
    # budget >= the context: every candidate page, dense
    assert pol.__class__(token_budget=8192, page_size=P).plan(4096).dense
    assert QuestDecode(token_budget=None, page_size=P).plan(4096).dense
    # budget smaller than sink + recent: no page read
    p = QuestDecode(token_budget=100, page_size=P, sink_tokens=32, recent_tokens=128).plan(4096)
    assert p.pages_per_step == 0 and p.num_candidates > 0
    # a context shorter than one page: nothing to select, everything resident
    for T in (1, 5, P - 1):
        p = pol.plan(T)
        assert p.num_candidates == 0 and p.pages_per_step == 0 and p.sink_len == 0 and p.tail_start == 0
        assert p.resident_prompt_tokens == T
    # a prompt of sink + recent tokens: resident, no candidate
    p = pol.plan(160)
    assert p.num_candidates == 0 and p.resident_prompt_tokens == 160
    # the tail is extended down to a page boundary: at least recent_tokens resident at the end
    p = pol.plan(1000)
    assert p.tail_start % P == 0 and 1000 - p.tail_start >= 128
    assert isinstance(p, DecodePlan)


@pytest.mark.parametrize("budget,P,sink,recent", [(96, 16, 16, 32), (100, 32, 5, 7), (None, 16, 0, 0),
                                                   (40, 64, 70, 200), (2048, 32, 32, 128), (1, 16, 16, 32)])
def test_largest_plan_is_the_most_of_every_shorter_prompt(budget, P, sink, recent):
    """largest_plan(T) equals the most candidates, pages per step and resident tokens over the
    plans of every prompt length 1..T (looked at directly), and a shorter prompt can read more
    pages per step than the longest (what a batched store must be sized for)."""
    pol = QuestDecode(token_budget=budget, page_size=P, sink_tokens=sink, recent_tokens=recent)
    most = [0, 0, 0]
    for T in range(1, 700):
        p = pol.plan(T)
        most = [max(most[0], p.num_candidates), max(most[1], p.pages_per_step), max(most[2], p.resident_prompt_tokens)]
        assert pol.largest_plan(T) == tuple(most), T
    q = QuestDecode(token_budget=96, page_size=16, sink_tokens=16, recent_tokens=32)
    assert q.plan(250).pages_per_step == 2 and q.plan(160).pages_per_step == 3 and q.largest_plan(250)[1] == 3
    with pytest.raises(ValueError, match="max_prompt_len"):
        pol.largest_plan(0)


def test_select_pages_through_block_table_and_out():
    """Rows go through the sequence's block table (pages inside pool blocks) and into out."""
    P, B = 16, 64
    scores = torch.tensor([[0.0, 5.0, 1.0, 9.0, 2.0, 3.0], [7.0, 0.0, 0.0, 0.0, 0.0, 8.0]])
    bt = torch.tensor([5, 2], dtype=torch.int32)  # logical block 0 -> pool block 5, 1 -> 2
    out = torch.full((1, 2, 2), -1, dtype=torch.int32)
    r = select_pages(scores, 2, first_page=1, page_size=P, block_table=bt, block_size=B, out=out)
    assert r is out
    # head 0: pages 1+3=4 (token 64 -> block 1 -> pool 2 -> row 128) and 1+1=2 (token 32 -> row 5*64+32)
    assert sorted(out[0, 0].tolist()) == sorted([2 * 64 + 0, 5 * 64 + 32])
    # head 1: candidates 5 (page 6: token 96 -> block 1, off 32 -> 2*64+32) and 0 (page 1: token 16 -> 5*64+16)
    assert sorted(out[0, 1].tolist()) == sorted([2 * 64 + 32, 5 * 64 + 16])
    allr = select_pages(scores, 6, 0, P, None, B)
    assert allr[0, 0].tolist() == [i * P for i in range(6)]
    with pytest.raises(ValueError, match="k must be in"):
        select_pages(scores, 7, 0, P, None, B)
    with pytest.raises(ValueError, match="multiple of page_size"):
        select_pages(scores, 1, 0, 32, bt, 48)


def test_summaries_write_and_bytes():
    s = PageSummaries(2, 2, 8, max_pages=4, page_size=16, dtype=torch.float32, device="cpu")
    assert s.nbytes == 2 * 2 * 2 * 4 * 8 * 4
    k = torch.randn(40, 2, 8)
    assert s.write(1, k) == 2  # 40 tokens: two whole pages, the partial third is left out
    assert torch.equal(s.kmax[1, :, 1], k[16:32].amax(0))
    assert torch.equal(s.kmin[1, :, 0], k[:16].amin(0))
    assert s.write(1, k[:32], first_page=2) == 2
    with pytest.raises(ValueError, match="max_pages"):
        s.write(0, torch.randn(80, 2, 8))


def test_policy_bad_values_and_layers():
    for kw, exc, msg in [(dict(token_budget=0), ValueError, "token_budget"),
                         (dict(token_budget=1.5), TypeError, "token_budget"),
                         (dict(page_size=24), ValueError, "power of two"),
                         (dict(page_size=8), ValueError, "page_size"),
                         (dict(sink_tokens=-1), ValueError, "sink_tokens"),
                         (dict(recent_tokens=True), TypeError, "recent_tokens"),
                         (dict(dense_layers="0,1"), TypeError, "dense_layers")]:
        with pytest.raises(exc, match=msg):
            QuestDecode(**kw)
    assert QuestDecode().sparse_layers(4) == (2, 3)
    assert QuestDecode(dense_layers=(-1,)).sparse_layers(4) == (0, 1, 2)
    assert QuestDecode(dense_layers=()).sparse_layers(3) == (0, 1, 2)
    with pytest.raises(ValueError, match="outside the model"):
        QuestDecode(dense_layers=(5,)).sparse_layers(4)
    with pytest.raises(ValueError, match="prompt_len"):
        QuestDecode().plan(0)


def test_softmax_group_score():
    """group="softmax": each query head's bounds through a softmax over the pages (scaled), summed
    over its group; equal to that computed by hand, one probability mass per head (sums to g), and
    still picks a planted key's page."""
    P, hkv, hq, d = 16, 2, 6, 8
    g = hq // hkv
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(6 * P, hkv, d, generator=gen)
    kmin, kmax, n = _summaries(k, P)
    q = torch.randn(hq, d, generator=gen)
    s = page_scores(q, kmin, kmax, group="softmax", scale=0.5)
    qq = q.view(hkv, g, d)
    bound = (qq.clamp(min=0) @ kmax.transpose(1, 2)) + (qq.clamp(max=0) @ kmin.transpose(1, 2))  # [Hkv, g, n]
    assert torch.allclose(s, torch.softmax(bound * 0.5, -1).sum(1), atol=1e-6)
    assert torch.allclose(s.sum(-1), torch.full((hkv,), float(g)), atol=1e-5)
    k[3 * P + 5, 1] = q[g] * 4  # a key aligned with KV head 1's first query head, in page 3
    kmin, kmax, _ = _summaries(k, P)
    assert int(page_scores(q, kmin, kmax, group="softmax").argmax(-1)[1]) == 3
    with pytest.raises(ValueError, match="group must be one of"):
        page_scores(q, kmin, kmax, group="mean")
    with pytest.raises(ValueError, match="group_score"):
        QuestDecode(group_score="sum")



def test_cache_options():
    with pytest.raises(ValueError, match="cache_pages"):
        QuestDecode(cache_pages=-1)
    assert QuestDecode(cache_pages=0).cache_slots(QuestDecode().plan(4096)) == 0
    with pytest.raises(ValueError, match="cache_bytes"):
        QuestDecode(cache_bytes=-1)
    for bad in (0.5, float("inf"), True, "2"):
        with pytest.raises(ValueError, match="reuse_bias"):
            QuestDecode(reuse_bias=bad)
    with pytest.raises(ValueError, match="needs group_score='max'"):
        QuestDecode(reuse_bias=2.0, group_score="softmax")
    assert QuestDecode(reuse_bias=2).reuse_bias == 2.0
    # the default: 8 with the max group score, off with softmax (a replace keeps it valid)
    assert QuestDecode().reuse_bias is None and QuestDecode().reuse_factor == DEFAULT_REUSE_BIAS == 8.0
    assert dataclasses.replace(QuestDecode(), group_score="softmax").reuse_factor == 1.0
    assert QuestDecode(reuse_bias=1).reuse_factor == 1.0
    assert QuestDecode().reuse_bonus(0.125) == pytest.approx(math.log(DEFAULT_REUSE_BIAS) / 0.125)
    assert QuestDecode(reuse_bias=1.0).reuse_bonus(0.125) == 0.0
    # top-k adds the bonus in fp32: a scale so small that ln(8) / scale is past fp32 is refused
    # (inf there would make a preferred -inf score NaN, ranked first); off, any scale is fine
    with pytest.raises(ValueError, match="past fp32"):
        QuestDecode().reuse_bonus(1e-39)
    assert QuestDecode(reuse_bias=1.0).reuse_bonus(1e-39) == 0.0


def test_cache_slots_follow_the_byte_budget():
    """Default slots: what cache_bytes holds, at least 4x a step's pages, at most the candidates."""
    p = QuestDecode().plan(131072)  # 4091 candidates, 59 pages a step
    k, n = p.pages_per_step, p.num_candidates
    assert (k, n) == (59, 4091)
    slot = 2 * 30 * 8 * 32 * 128 * 2  # the 8B shape: 30 sparse layers, 8 KV heads, bf16
    assert QuestDecode().cache_slots(p, slot) == (2 << 30) // slot == 546
    assert QuestDecode().cache_slots(p) == 4 * k  # no slot size: the 4x rule alone
    assert QuestDecode(cache_bytes=0).cache_slots(p, slot) == 4 * k
    assert QuestDecode(cache_bytes=1 << 40).cache_slots(p, slot) == n
    assert QuestDecode(cache_pages=10).cache_slots(p, slot) == k  # never below one step's pages
    from xoffload.kernels.page_cache import MAX_SLOTS
    long = QuestDecode(page_size=16).plan(1 << 20)
    assert QuestDecode(cache_bytes=1 << 50, page_size=16).cache_slots(long, slot) == MAX_SLOTS
    # a step reading more pages than MAX_SLOTS: no cache (a cache of MAX_SLOTS < K slots cannot
    # take one step's pages; page_cache_lookup refuses it)
    huge = QuestDecode(page_size=16, token_budget=1 << 19).plan(1 << 21)
    assert huge.pages_per_step > MAX_SLOTS
    assert QuestDecode(page_size=16, token_budget=1 << 19).cache_slots(huge, slot) == 0
    assert QuestDecode(page_size=16, token_budget=1 << 19, cache_pages=MAX_SLOTS).cache_slots(huge, slot) == 0


def _decoy_layer(fooled: bool, T=160, S=2, D=16, hq=2):
    """(q [S, Hq, D], k [T + S, 1, D]) with one needle key in candidate page 3 that every query
    head's softmax puts most of its mass on; ``fooled``: every other candidate page holds keys
    ``c (e_i - e_{i+1})`` with q·k = 0 but a min/max spread whose Quest bound (96) beats the
    needle's (48), so the bound picks a decoy while the exact mass says the needle."""
    g = torch.Generator().manual_seed(7)
    u = torch.ones(D) / D ** 0.5
    k = 0.01 * torch.randn(T + S, 1, D, generator=g)
    needle = 16 + 3 * 16 + 5
    k[needle, 0] = 16 * u
    if fooled:
        for p in range(8):
            if p == 3:
                continue
            for t in range(16):
                e = torch.zeros(D)
                e[t % D], e[(t + 1) % D] = 8.0, -8.0
                k[16 + p * 16 + t, 0] = e
    q = (3 * u).expand(S, hq, D).clone()
    return q, k


_DECOY_POLICY = dict(token_budget=48, page_size=16, sink_tokens=16, recent_tokens=16)


def test_selection_loss_decoy_pages_and_dense_plan():
    """The bound fooled by spread pages loses the needle's mass (the oracle keeps it); a plain layer
    loses nothing; a plan that reads every page loses nothing; bad shapes are one-line errors."""
    from xoffload.sparse.quest_calibrate import selection_loss

    pol = QuestDecode(dense_layers=(), **_DECOY_POLICY)
    assert pol.plan(160).pages_per_step == 1 and pol.plan(160).num_candidates == 8
    q, k = _decoy_layer(True)
    lost, olost = selection_loss(q, k, pol, 160, scale=0.25)
    assert lost > 0.5 and olost < 0.05, (lost, olost)
    q, k = _decoy_layer(False)
    lost, olost = selection_loss(q, k, pol, 160, scale=0.25)
    assert lost < 0.05 and olost < 0.05, (lost, olost)
    q, k = _decoy_layer(True)
    assert selection_loss(q, k, QuestDecode(token_budget=None, page_size=16, sink_tokens=16, recent_tokens=16),
                          160) == (0.0, 0.0)
    with pytest.raises(ValueError, match="need 162"):
        selection_loss(q, k[:161], pol, 160)
    with pytest.raises(ValueError, match=r"q must be \[S, Hq, D\]"):
        selection_loss(q[0], k, pol, 160)
    with pytest.raises(ValueError, match="do not fit"):
        selection_loss(q[..., :8], k, pol, 160)


def test_calibrate_dense_layers_adds_the_fooled_layer():
    """calibrate_dense_layers keeps the policy's dense layers and adds the sparse layer whose
    selection loses the most over the oracle's; bad extra / no records raise naming the value."""
    from xoffload.sparse.quest_calibrate import calibrate_dense_layers

    layers = [_decoy_layer(f) for f in (False, False, True, False)]
    rec = dict(q=torch.stack([q for q, _ in layers], 1), k=torch.stack([k for _, k in layers]), T=160, scale=0.25)
    pol = QuestDecode(dense_layers=(0,), **_DECOY_POLICY)
    dense, excess = calibrate_dense_layers([rec], pol, 1)
    assert dense == (0, 2) and set(excess) == {1, 2, 3} and excess[2] > 0.5 > max(excess[1], excess[3])
    assert calibrate_dense_layers([rec], pol, 0)[0] == (0,)
    with pytest.raises(ValueError, match="extra=4 is more than the 3 sparse layers"):
        calibrate_dense_layers([rec], pol, 4)
    with pytest.raises(ValueError, match="extra"):
        calibrate_dense_layers([rec], pol, -1)
    with pytest.raises(ValueError, match="no calibration records"):
        calibrate_dense_layers([], pol, 1)


def test_exact_channel_policy_values():
    """exact_channels / bound_scale: checked, bound_scale kept as a float."""
    for kw, exc, msg in [(dict(exact_channels=-1), ValueError, "exact_channels"),
                         (dict(exact_channels=65), ValueError, "exact_channels"),
                         (dict(exact_channels=2.0), TypeError, "exact_channels"),
                         (dict(bound_scale=1.5), ValueError, "bound_scale"),
                         (dict(bound_scale=-0.1), ValueError, "bound_scale"),
                         (dict(bound_scale=True), TypeError, "bound_scale"),
                         (dict(bound_scale="0.5"), TypeError, "bound_scale")]:
        with pytest.raises(exc, match=msg):
            QuestDecode(**kw)
    assert QuestDecode(bound_scale=0, exact_channels=4).bound_scale == 0.0
    with pytest.raises(ValueError, match="bound_scale=0.0 .*needs exact_channels > 0"):
        QuestDecode(bound_scale=0)
    with pytest.raises(ValueError, match="head_dim"):
        PageSummaries(1, 1, 8, 2, 16, torch.float32, "cpu", exact_channels=8)


def test_summaries_keep_the_loosest_channels_token_by_token():
    """With exact channels the first write of a layer picks, per KV head, the channels of widest
    range x magnitude (a planted wide channel is among them), keeps their values token by token,
    and later writes (first_page > 0) keep the channels and append their pages."""
    from xoffload.sparse.quest import choose_channels

    s = PageSummaries(2, 2, 16, max_pages=6, page_size=16, dtype=torch.float32, device="cpu", exact_channels=3)
    assert s.nbytes == 2 * 2 * 2 * 6 * 16 * 4 + 2 * 2 * 6 * 16 * 3 * 4 + 2 * 2 * 3 * 4
    g = torch.Generator().manual_seed(0)
    k = torch.randn(48, 2, 16, generator=g) * 0.1
    k[:, 0, 5] = torch.randn(48, generator=g) * 10  # a wide, large channel of head 0
    k[:, 1, 11] = torch.randn(48, generator=g) * 10
    assert s.write(1, k) == 3
    ch = s.channels[1]
    assert 5 in ch[0].tolist() and 11 in ch[1].tolist()
    assert torch.equal(ch, choose_channels(k.unflatten(0, (3, 16)), 3))
    for h in range(2):
        assert torch.equal(s.klab[1, h, :48], k[:, h, ch[h].long()])
    k2 = torch.randn(32, 2, 16, generator=g)
    s.write(1, k2, first_page=3)
    assert torch.equal(s.channels[1], ch)  # fixed after the first write
    assert torch.equal(s.klab[1, 0, 48:80], k2[:, 0, ch[0].long()])


def test_exact_channels_tighten_the_bound_and_find_a_planted_key():
    """page_scores with exact channels: alpha = 1 stays an upper bound of q·k, at most Quest's;
    with alpha = 0.25 a key aligned with the query still lies in a chosen page."""
    from xoffload.sparse.quest import choose_channels

    P, d, hkv, hq, T = 16, 32, 2, 8, 64 * 16
    pol = QuestDecode(token_budget=96, page_size=P, sink_tokens=16, recent_tokens=32, exact_channels=4,
                      bound_scale=0.25)
    plan = pol.plan(T)
    f, n = plan.first_page, plan.num_candidates
    gen = torch.Generator().manual_seed(11)
    for trial in range(8):
        k = torch.randn(T, hkv, d, generator=gen)
        q = torch.randn(hq, d, generator=gen)
        h = trial % hkv
        pos = int(torch.randint(plan.sink_len, plan.tail_start, (1,), generator=gen))
        k[pos, h] = q[h * (hq // hkv)] * 4
        kmin, kmax, _ = _summaries(k, P)
        kp = k.unflatten(0, (T // P, P))
        ch = choose_channels(k.unflatten(0, (T // P, P)), 4)
        kl = torch.gather(k[f * P:(f + n) * P].transpose(0, 1), 2, ch.long()[:, None, :].expand(-1, n * P, -1))
        for alpha in (1.0, 0.25):
            s = page_scores(q, kmin[:, f:f + n], kmax[:, f:f + n], channels=ch, klab=kl.contiguous(), alpha=alpha)
            if alpha == 1.0:
                true = torch.einsum("hgd,nphd->hgnp", q.view(hkv, hq // hkv, d), kp[f:f + n]).amax(3).amax(1)
                assert bool((s >= true - 1e-4).all())
                assert bool((s <= page_scores(q, kmin[:, f:f + n], kmax[:, f:f + n]) + 1e-4).all())
            else:
                rows = select_pages(s, plan.pages_per_step, f, P, None, 1024)
                assert (pos // P) * P in rows[0, h].tolist()
        # the softmax group score takes the same per-head scores
        sm = page_scores(q, kmin[:, f:f + n], kmax[:, f:f + n], group="softmax", channels=ch,
                         klab=kl.contiguous(), alpha=0.25)
        assert sm.shape == (hkv, n) and torch.allclose(sm.sum(-1), torch.full((hkv,), hq / hkv))


def test_exact_channel_arguments_checked_in_every_path(monkeypatch):
    """Found by adversarial testing: the softmax group score took any alpha (2, nan: NaN scores)
    and failed on bad channels with torch errors; PageSummaries took exact_channels=True, 2.7 and
    more than the kernel's 64; choose_channels failed inside topk; a page of 512 with exact
    channels was accepted and failed at the first decode step. Each is now refused up front,
    naming the value, and PageSummaries.scores (the decode step) skips the host check."""
    from xoffload.sparse.quest import choose_channels

    g = torch.Generator().manual_seed(5)
    k = torch.randn(20 * 16, 2, 32, generator=g)
    q = torch.randn(8, 32, generator=g)
    kmin, kmax, n = _summaries(k, 16)
    ch = choose_channels(k.unflatten(0, (20, 16)), 4)
    kl = torch.gather(k.transpose(0, 1), 2, ch.long()[:, None, :].expand(-1, 20 * 16, -1)).contiguous()
    for group in ("max", "softmax"):
        for kw, exc, msg in [(dict(alpha=2.0), ValueError, "alpha"), (dict(alpha=float("nan")), ValueError, "alpha"),
                             (dict(channels=ch), ValueError, "come together"),
                             (dict(channels=ch, klab=kl[:, :17]), ValueError, "klab must be"),
                             (dict(channels=ch + 30, klab=kl), ValueError, r"\[0, head_dim=32\)"),
                             (dict(channels=ch[:, [0, 0, 1, 2]], klab=kl), ValueError, "repeat")]:
            with pytest.raises(exc, match=msg):
                page_scores(q, kmin, kmax, group=group, **kw)
        # check=False: clamped, the same in both paths' references
        s = page_scores(q, kmin, kmax, group=group, channels=ch + 30, klab=kl, alpha=0.5, check=False)
        assert bool(torch.isfinite(s).all())
    for r, exc in ((True, TypeError), (2.7, TypeError), (65, ValueError), (96, ValueError)):
        with pytest.raises(exc, match="exact_channels"):
            PageSummaries(1, 1, 96, 2, 16, torch.float32, "cpu", exact_channels=r)
    for bad in (0, 33, True):
        with pytest.raises(ValueError, match="choose_channels: r must be"):
            choose_channels(k.unflatten(0, (20, 16)), bad)
    with pytest.raises(ValueError, match="n_pages >= 1"):
        choose_channels(k[:0].unflatten(0, (0, 16)), 4)
    with pytest.raises(ValueError, match="page_size <= 256"):
        QuestDecode(page_size=512, exact_channels=4)
    assert QuestDecode(page_size=512).page_size == 512 and QuestDecode(page_size=256, exact_channels=4).page_size == 256
    # the decode step's path: no host check (a device read there would sync every layer)
    s = PageSummaries(1, 2, 32, 20, 16, torch.float32, "cpu", exact_channels=4)
    s.write(0, k)
    pol = QuestDecode(page_size=16, exact_channels=4, bound_scale=0.5)
    import xoffload.kernels.channel_score as qs

    seen, orig = [], qs.check_channels
    monkeypatch.setattr(qs, "check_channels", lambda *a, **kw: seen.append(kw["check"]) or orig(*a, **kw))
    s.scores(0, q, 2, 10, pol)
    assert seen == [False]


def test_named_policy_fits_its_channels_to_the_model():
    """Found by adversarial testing: LLM('tiny-llama', sparse_decode='quest-ch') raised (16 exact
    channels, head_dim 16) although the user chose no channel count. The named policy now asks for
    at most head_dim // 2 channels (QuestDecode.fit_channels, applied by for_model when the engine
    is built); an explicit exact_channels stays exact and is refused when it does not fit."""
    from types import SimpleNamespace

    from xoffload.sparse import resolve_decode

    named = resolve_decode("quest-ch", 512)
    assert named.fit_channels and named.exact_channels == 16 and named.token_budget == 512
    cfg = lambda d: SimpleNamespace(num_layers=4, head_dim=d)  # noqa: E731
    assert named.for_model(cfg(16)).exact_channels == 8
    assert named.for_model(cfg(24)).exact_channels == 12
    assert named.for_model(cfg(64)) is named and named.for_model(cfg(128)) is named
    assert named.for_model(cfg(16)).fit_channels  # fitting again changes nothing
    explicit = QuestDecode(exact_channels=16)
    assert explicit.for_model(cfg(17)) is explicit
    with pytest.raises(ValueError, match="exact_channels=16 must be below the model's head_dim 16"):
        explicit.for_model(cfg(16))
    with pytest.raises(ValueError, match="outside"):
        QuestDecode(dense_layers=(9,)).for_model(cfg(64))
    with pytest.raises(TypeError, match="fit_channels"):
        QuestDecode(fit_channels=1)
    assert resolve_decode("quest").for_model(cfg(16)) == QuestDecode()
