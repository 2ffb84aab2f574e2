"""RULER's 11 synthetic tasks (Hsieh et al., 2024), generated locally with the model's own tokenizer.

(Over 450 lines on purpose: the 11 builders share one sizing loop, one chat wrapper and RULER's
template table; one file keeps them side by side, as RULER's own ``synthetic`` folder does.)

Each task has RULER's template, answer prefix, needle/value kinds, complexity settings of RULER's
``synthetic.yaml`` and generation length (``tokens_to_generate``):

==================  ========================================================  ======  ==========
task                what                                                      metric  new tokens
==================  ========================================================  ======  ==========
niah_single_1       repeated noise haystack, word key, 7-digit number          all     128
niah_single_2       essay haystack, word key, number                           all     128
niah_single_3       essay haystack, word key, UUID                             all     128
niah_multikey_1     essay haystack, 1 queried key + 3 distractor keys          all     128
niah_multikey_2     haystack made of key-value needles (word keys, numbers)    all     128
niah_multikey_3     haystack of needles, UUID keys and UUID values             all     128
niah_multivalue     essay haystack, one key with 4 values                      all     128
niah_multiquery     essay haystack, 4 keys asked at once                       all     128
vt                  variable tracking: 1 chain of 4 hops in noise (+1 example)  all     30
cwe                 common words extraction: top 10 of a numbered word list    all     120
fwe                 frequent words extraction: top 3 of a Zipf-coded text      all     50
==================  ========================================================  ======  ==========

``build(tokenizer, length, sample_index, seed) -> Sample``: ``token_ids`` is the chat-templated
prompt (one user turn holding RULER's task text, then the assistant turn opened with RULER's answer
prefix). Its haystack is sized by a search over the haystack size, tokenizing each candidate once,
so that ``len(token_ids) <= length - max_new_tokens`` and, for any length the task fits in, within
2% below it. Everything is drawn from ``random.Random`` seeded by (seed, task, length, index): the
same arguments give the same prompt on every machine.

Departures from RULER, all deliberate: the essay haystack is :class:`~xoffload.evals.haystack.Essay`
(generated) instead of Paul Graham's essays; NIAH needles of the queried key go to a depth on a grid
over sample indices (:func:`depth_for_index`) instead of a random depth; the repeated noise is sized
per sentence rather than per 5-sentence repeat, and a haystack of needles is topped up with noise
sentences (fewer tokens than one needle) so that the 2% bound holds at 1K; the answer prefix is
tokenized without its leading/trailing spaces (it directly follows the assistant header).
"""
from __future__ import annotations

import math
import random
import re
import string
import uuid
from dataclasses import dataclass, field

from . import haystack as hs

# RULER's generation lengths (``tokens_to_generate`` in its constants.py)
NIAH_TOKENS, VT_TOKENS, CWE_TOKENS, FWE_TOKENS, QA_TOKENS = 128, 30, 120, 50, 32

NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to "
                 "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
                 "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?")
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."

VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
               "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.")
# RULER's own spelling ("assgined") is kept so that the prompts match its data
VT_ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                    "variables are assgined the value {query}, they are: ")

CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\n"
                "Question: What are the 10 most common words in the above list?")
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three "
                "most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
                "Please ignore the dots '....'. What are the three most frequently appeared words in the "
                "above coded text?")
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

QA_TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and do not output "
               "any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question "
               "based on the given documents. Only give me the answer and do not output any other words."
               "\n\nQuestion: {query}")
QA_ANSWER_PREFIX = " Answer:"

# RULER's 40 needle depths (percent), used for needles that are not the queried one
RULER_DEPTHS = tuple(int(round(100 * i / 39)) for i in range(40))
# depth of the queried needle by sample index: 11 grid points, visited so that any first few are spread
DEPTH_GRID = (0.5, 0.0, 1.0, 0.3, 0.8, 0.1, 0.6, 0.9, 0.2, 0.7, 0.4)


def depth_for_index(sample_index: int) -> float:
    """Depth in [0, 1] of the queried needle of sample ``sample_index``: :data:`DEPTH_GRID` (0, 0.1,
    ..., 1 in a spread order: 0.5, 0, 1, 0.3, 0.8, ...), cycled."""
    return DEPTH_GRID[int(sample_index) % len(DEPTH_GRID)]


@dataclass
class Sample:
    """One evaluation prompt.

    Attributes:
        task: task name (``"niah_single_1"``, ..., or a RULER data file's task such as ``"qa_1"``).
        index: sample index within (task, length).
        length: target context length in tokens (prompt + ``max_new_tokens`` fit in it).
        token_ids: the full prompt, chat template and answer prefix included (list of int).
        outputs: reference strings; the score counts those found in the prediction.
        depth: relative depth in [0, 1] of the needle holding ``outputs[0]`` (None where none).
        metric: ``"all"`` (RULER's string_match_all) or ``"part"`` (string_match_part).
        max_new_tokens: generation length (RULER's per task).
        input: the user-turn text (RULER's ``input``, without the answer prefix).
        answer_prefix: RULER's answer prefix (as in its templates; tokenized stripped).
        meta: task details (needle depths, haystack size, ...), JSON-serializable.
    """

    task: str
    index: int
    length: int
    token_ids: list
    outputs: list
    depth: float | None
    metric: str
    max_new_tokens: int
    input: str = ""
    answer_prefix: str = ""
    meta: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------- tokenization
def chat_ids(tokenizer, user: str, answer_prefix: str = "") -> list:
    """Token ids of ``user`` as one user turn of ``tokenizer``'s chat template with the assistant
    turn opened, followed by ``answer_prefix`` (stripped; nothing when empty). A tokenizer without
    a chat template gets ``user + "\\n" + answer_prefix`` with its default special tokens."""
    ap = answer_prefix.strip()
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                            tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = [int(x) for x in ids]
        if ap:
            ids += [int(x) for x in tokenizer.encode(ap, add_special_tokens=False)]
        return ids
    return [int(x) for x in tokenizer.encode(user + "\n" + ap)]


def _fit(make, budget: int, guess: int = 64, n_max: int | None = None):
    """Largest ``n`` in ``[0, n_max]`` with ``len(make(n)[0]) <= budget``, for token lengths that grow
    (nearly) monotonically with ``n``. ``make(n) -> (ids, info)``. Interpolation steps with a bisection
    fallback: a handful of tokenizations. Returns ``(n, ids, info)``. Raises ValueError when even
    ``n = 0`` does not fit."""
    cache: dict = {}

    def get(n):
        if n not in cache:
            cache[n] = make(n)
        return cache[n]

    def ln(n):
        return len(get(n)[0])

    lo = 0
    if ln(0) > budget:
        raise ValueError(f"the prompt without any haystack already takes {ln(0)} tokens, more than the "
                         f"{budget} available")
    hi = max(1, int(guess))
    if n_max is not None:
        hi = min(hi, n_max)
    # bracket: grow hi until it does not fit
    while ln(hi) <= budget:
        lo = hi
        if n_max is not None and hi >= n_max:
            return hi, *get(hi)
        per = max(1e-3, (ln(hi) - ln(0)) / hi)
        nxt = max(hi + 1, int(hi + 1.1 * (budget - ln(hi)) / per) + 1)
        hi = nxt if n_max is None else min(nxt, n_max)
    step = 0
    while hi - lo > 1:
        step += 1
        if step % 3:  # interpolation between the bracket's ends
            a, b = ln(lo), ln(hi)
            mid = lo + int((budget - a) * (hi - lo) / max(1, b - a))
            mid = min(max(mid, lo + 1), hi - 1)
        else:
            mid = (lo + hi) // 2
        if ln(mid) <= budget:
            lo = mid
            if mid + 1 < hi and ln(mid + 1) > budget:
                hi = mid + 1
        else:
            hi = mid
            if mid - 1 > lo and ln(mid - 1) <= budget:
                lo = mid - 1
    return lo, *get(lo)


# ------------------------------------------------------------------------------- needles
def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return _number(rng)
    if kind == "uuids":
        return _uuid(rng)
    if kind == "words":
        return hs.key_word(rng)
    raise ValueError(f"unknown needle kind {kind!r}")


def _rng(seed, task, length, index, part="") -> random.Random:
    return random.Random(f"xoffload-ruler:{seed}:{task}:{length}:{index}:{part}")


@dataclass(frozen=True)
class _NiahSpec:
    haystack: str          # "repeat" | "essay" | "needle"
    key: str               # "words" | "uuids"
    value: str             # "numbers" | "uuids"
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


_NIAH = {
    "niah_single_1": _NiahSpec("repeat", "words", "numbers"),
    "niah_single_2": _NiahSpec("essay", "words", "numbers"),
    "niah_single_3": _NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": _NiahSpec("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": _NiahSpec("needle", "words", "numbers"),
    "niah_multikey_3": _NiahSpec("needle", "uuids", "uuids"),
    "niah_multivalue": _NiahSpec("essay", "words", "numbers", num_v=4),
    "niah_multiquery": _NiahSpec("essay", "words", "numbers", num_q=4),
}


def _niah_templates(spec: _NiahSpec, query: str):
    tv = spec.value
    template, prefix = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX
    if spec.num_q * spec.num_v == 1:  # RULER's singular wording
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        prefix = prefix.replace("are", "is")
        tv = tv[:-1]
    return (template.replace("{type_needle_v}", tv).replace("{query}", query),
            prefix.format(type_needle_v=tv, query=query))


def _build_niah(name, tokenizer, length, index, seed) -> Sample:
    spec = _NIAH[name]
    rng = _rng(seed, name, length, index)
    num_k = max(spec.num_k, spec.num_q)
    keys: list = []
    while len(keys) < num_k:
        k = _value(spec.key, rng)
        if k not in keys:
            keys.append(k)
    values = [[_value(spec.value, rng) for _ in range(spec.num_v)] for _ in keys]
    queried = rng.sample(range(num_k), spec.num_q) if spec.num_q > 1 else [0]
    query = (", ".join(keys[i] for i in queried[:-1]) + ", and " + keys[queried[-1]]
             if len(queried) > 1 else keys[queried[0]])
    outputs = [v for i in queried for v in values[i]]
    # needles: the one holding outputs[0] at the grid depth, every other at one of RULER's depths
    depth0 = depth_for_index(index)
    needles = []  # (depth, text, key, value)
    for ki, k in enumerate(keys):
        for v in values[ki]:
            needles.append([None, NIAH_NEEDLE.format(type_needle_v=spec.value, key=k, value=v), k, v])
    first = next(i for i, n in enumerate(needles) if n[3] == outputs[0])
    others = [i for i in range(len(needles)) if i != first]
    other_depths = rng.sample(RULER_DEPTHS, len(others)) if others else []
    needles[first][0] = depth0
    for i, d in zip(others, other_depths):
        needles[i][0] = d / 100.0
    order = list(range(len(needles)))
    rng.shuffle(order)  # RULER shuffles its needles; equal depths then keep this order
    inserts = [(needles[i][0], needles[i][1]) for i in order]
    template, prefix = _niah_templates(spec, query)
    max_new = NIAH_TOKENS
    budget = int(length) - max_new

    fill_seg = None
    if spec.haystack == "repeat":
        def segs_of(n):
            return hs.noise_segments(n)
        guess = budget // 6
    elif spec.haystack == "essay":
        ess = hs.essay(f"{seed}:{index}")

        def segs_of(n):
            return ess.segments(n)
        guess = int(budget / 1.4)
    else:  # a haystack of other keys' needles, drawn from their own stream (the same for every n)
        drng = _rng(seed, name, length, index, "distractors")
        pool: list = []
        taken = set(keys)

        def segs_of(n):
            while len(pool) < n:
                k = _value(spec.key, drng)
                if k in taken:
                    continue
                taken.add(k)
                pool.append(NIAH_NEEDLE.format(type_needle_v=spec.value, key=k, value=_value(spec.value, drng)) + "\n")
            return pool[:n]
        guess = budget // (24 if spec.value == "numbers" else 60)
        fill_seg = True

    def make(n, extra=()):
        segs = segs_of(n) + list(extra)
        text = template.replace("{context}", hs.compose(segs, inserts))
        return chat_ids(tokenizer, text, prefix), (text, segs)

    n, ids, (text, segs) = _fit(make, budget, guess=max(1, guess))
    meta = {"haystack": spec.haystack, "haystack_units": n}
    if fill_seg:  # top up with noise sentences (each shorter than a needle)
        m, ids, (text, segs) = _fit(lambda m: make(n, hs.noise_segments(m)), budget, guess=4)
        meta["noise_fill_sentences"] = m
    meta["needle_depths"] = {needles[i][3]: needles[i][0] for i in range(len(needles))}
    meta["keys"] = keys
    meta["query_keys"] = [keys[i] for i in queried]
    return Sample(task=name, index=int(index), length=int(length), token_ids=ids, outputs=outputs,
                  depth=depth0, metric="all", max_new_tokens=max_new, input=text, answer_prefix=prefix,
                  meta=meta)


# ------------------------------------------------------------------------------- variable tracking
_VT_NOISE_WORDS = {w.upper() for w in re.findall(r"[A-Za-z]+", hs.NOISE)}


def _vt_chain(rng: random.Random, num_hops: int, name_len: int):
    names: list = []
    while len(names) < num_hops + 1:
        v = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        if v not in names and v not in _VT_NOISE_WORDS:
            names.append(v)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(num_hops)]
    return names, value, chain


def _vt_text(n_noise, chain, fracs, value, num_v):
    segs = hs.noise_segments(n_noise)
    ctx = hs.compose(segs, list(zip(fracs, chain)))
    return (VT_TEMPLATE.format(context=ctx, query=value),
            VT_ANSWER_PREFIX.format(num_v=num_v, query=value))


def _build_vt(name, tokenizer, length, index, seed, num_chains=1, num_hops=4) -> Sample:
    if num_chains != 1:
        raise ValueError("vt: only RULER's default of one chain is implemented")
    rng = _rng(seed, name, length, index)
    max_new = VT_TOKENS
    budget = int(length) - max_new
    # RULER's one in-context example: 3-letter variables, a short noise (about 500 tokens in all)
    ex_names, ex_value, ex_chain = _vt_chain(rng, num_hops, 3)
    ex_fracs = sorted(rng.random() for _ in ex_chain)
    names, value, chain = _vt_chain(rng, num_hops, 5)
    while set(names) & set(ex_names):
        names, value, chain = _vt_chain(rng, num_hops, 5)
    fracs = sorted(rng.random() for _ in chain)

    def ex_make(n):
        t, p = _vt_text(n, ex_chain, ex_fracs, ex_value, num_hops + 1)
        full = t + p + " " + " ".join(ex_names)
        return tokenizer.encode(full, add_special_tokens=False), full

    _, _, example = _fit(ex_make, 500 - VT_TOKENS, guess=60)

    def make(n):
        t, p = _vt_text(n, chain, fracs, value, num_hops + 1)
        user = example + "\n\n" + t
        return chat_ids(tokenizer, user, p), (user, p)

    n, ids, (user, prefix) = _fit(make, budget, guess=max(1, (budget - 500) // 6))
    return Sample(task=name, index=int(index), length=int(length), token_ids=ids, outputs=list(names),
                  depth=None, metric="all", max_new_tokens=max_new, input=user, answer_prefix=prefix,
                  meta={"noise_sentences": n, "value": value, "chain": chain,
                        "example_value": ex_value, "example_outputs": ex_names})


# ------------------------------------------------------------------------------- common words
def _cwe_pool(n_needed: int) -> list:
    """The vocabulary words, then (only past them, for very long contexts) ``adjective-noun``
    compounds, deterministic."""
    pool = list(hs.word_pool())
    if n_needed > len(pool):
        r = random.Random("xoffload-cwe-compounds")
        seen = set(pool)
        while len(pool) < n_needed:
            w = hs.key_word(r)
            if w not in seen:
                seen.add(w)
                pool.append(w)
    return pool


def _numbered(words) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _build_cwe(name, tokenizer, length, index, seed, num_cw=10, freq_cw=30, freq_ucw=3) -> Sample:
    rng = _rng(seed, name, length, index)
    max_new = CWE_TOKENS
    budget = int(length) - max_new
    if int(length) < 4096:  # RULER's settings below 4K
        ex_n, ex_cw, ex_ucw, cw_rep, ucw_rep = 20, 3, 1, 6, 1
    else:
        ex_n, ex_cw, ex_ucw, cw_rep, ucw_rep = 40, 10, 3, freq_cw, freq_ucw
    # enough words for the longest list that could fit (a list entry is >= 3 tokens)
    n_cap = budget // (3 * ucw_rep) + num_cw + ex_n
    pool = _cwe_pool(n_cap)
    perm = pool[:]
    rng.shuffle(perm)
    ex_words = perm[-ex_n:]  # the example's words: disjoint from the question's
    words = perm[:-ex_n]
    ex_common = ex_words[:num_cw]
    ex_list = ex_common * ex_cw + ex_words[num_cw:] * ex_ucw
    rng.shuffle(ex_list)
    example = (CWE_TEMPLATE.format(context=_numbered(ex_list)) + CWE_ANSWER_PREFIX + " "
               + _numbered(ex_common))
    common = words[:num_cw]
    order_seed = rng.getrandbits(64)

    def make(n):
        lst = common * cw_rep + words[num_cw:num_cw + n] * ucw_rep
        random.Random(order_seed).shuffle(lst)
        user = example + "\n" + CWE_TEMPLATE.format(context=_numbered(lst))
        return chat_ids(tokenizer, user, CWE_ANSWER_PREFIX), user

    n, ids, user = _fit(make, budget, guess=max(1, (budget - 600) // (5 * ucw_rep)), n_max=len(words) - num_cw)
    return Sample(task=name, index=int(index), length=int(length), token_ids=ids, outputs=list(common),
                  depth=None, metric="all", max_new_tokens=max_new, input=user, answer_prefix=CWE_ANSWER_PREFIX,
                  meta={"uncommon_words": n, "common_repeats": cw_rep, "uncommon_repeats": ucw_rep})


# ------------------------------------------------------------------------------- frequent words
def _zeta(alpha: float) -> float:
    """Riemann zeta(alpha) for alpha > 1 (RULER's normalizer of the Zipf counts)."""
    if alpha == 2.0:
        return math.pi ** 2 / 6
    if alpha <= 1.0:
        raise ValueError(f"alpha must be > 1, got {alpha!r}")
    n = 10_000  # partial sum + Euler-Maclaurin tail
    return sum(k ** -alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1) + 0.5 * n ** -alpha


def _build_fwe(name, tokenizer, length, index, seed, alpha=2.0, coded_wordlen=6) -> Sample:
    rng = _rng(seed, name, length, index)
    max_new = FWE_TOKENS
    budget = int(length) - max_new
    vocab_size = max(8, budget // 50)  # RULER: (max_seq_length - tokens_to_generate) // 50
    vocab: set = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = "..."  # the most frequent "word" is noise, as in RULER
    zeta = _zeta(alpha)
    order_seed = rng.getrandbits(64)

    def text_of(n):
        lst = []
        for k, w in enumerate(vocab, start=1):
            lst += [w] * int(n * k ** -alpha / zeta)
        random.Random(order_seed).shuffle(lst)
        return FWE_TEMPLATE.format(context=" ".join(lst))

    def make(n):
        user = text_of(n)
        return chat_ids(tokenizer, user, FWE_ANSWER_PREFIX), user

    n, ids, user = _fit(make, budget, guess=max(1, budget // 3))
    return Sample(task=name, index=int(index), length=int(length), token_ids=ids, outputs=vocab[1:4],
                  depth=None, metric="all", max_new_tokens=max_new, input=user, answer_prefix=FWE_ANSWER_PREFIX,
                  meta={"num_words": n, "vocab_size": vocab_size, "alpha": alpha})


# ------------------------------------------------------------------------------- registry
TASKS = tuple(_NIAH) + ("vt", "cwe", "fwe")
MAX_NEW_TOKENS = {**{t: NIAH_TOKENS for t in _NIAH}, "vt": VT_TOKENS, "cwe": CWE_TOKENS, "fwe": FWE_TOKENS}


def build(task: str, tokenizer, length: int, sample_index: int = 0, seed: int = 0) -> Sample:
    """Build sample ``sample_index`` of ``task`` for a ``length``-token context.

    Args:
        task: one of :data:`TASKS`.
        tokenizer: a transformers tokenizer (its chat template is used when it has one).
        length: target context in tokens: ``len(token_ids) + max_new_tokens <= length``.
        sample_index: >= 0; picks the needle depth (:func:`depth_for_index`) and the random draws.
        seed: int; the same (task, length, sample_index, seed) always gives the same sample.
    Returns:
        :class:`Sample`.
    Raises:
        ValueError: unknown task, negative index, or ``length`` too short for the task's template.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    if int(sample_index) < 0:
        raise ValueError(f"sample_index must be >= 0, got {sample_index!r}")
    length = int(length)
    try:
        if task in _NIAH:
            return _build_niah(task, tokenizer, length, sample_index, seed)
        if task == "vt":
            return _build_vt(task, tokenizer, length, sample_index, seed)
        if task == "cwe":
            return _build_cwe(task, tokenizer, length, sample_index, seed)
        return _build_fwe(task, tokenizer, length, sample_index, seed)
    except ValueError as e:
        raise ValueError(f"{task} at length {length}: {e}") from None


def build_samples(tokenizer, tasks, lengths, samples: int, seed: int = 0) -> list:
    """All samples of ``tasks`` x ``lengths`` x ``range(samples)`` (that order), see :func:`build`."""
    if int(samples) < 1:
        raise ValueError(f"samples must be >= 1, got {samples!r}")
    return [build(t, tokenizer, L, i, seed) for t in tasks for L in lengths for i in range(int(samples))]


def parse_tasks(spec) -> list:
    """``"all"`` (or None) → every task; ``"niah"`` → the 8 NIAH tasks; else a comma-separated list
    of names (or groups). Keeps order, drops repeats. Raises ValueError naming the known tasks."""
    if spec is None:
        return list(TASKS)
    items = spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
    out: list = []
    for it in (str(x).strip() for x in items):
        if not it:
            continue
        names = list(TASKS) if it == "all" else list(_NIAH) if it == "niah" else [it]
        for n in names:
            if n not in TASKS:
                raise ValueError(f"unknown task {n!r}; known tasks: all, niah, {', '.join(TASKS)}")
            if n not in out:
                out.append(n)
    if not out:
        raise ValueError("no task given")
    return out
