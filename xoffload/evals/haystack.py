"""Haystacks for the RULER-style tasks, all generated here (no file is read, nothing downloaded).

* :data:`NOISE` — RULER's repeated-noise haystack ("The grass is green. The sky is blue. ..."),
  offered sentence by sentence (:func:`noise_segments`) so that a prompt can be sized to a few tokens.
* :class:`Essay` — a varied natural-language haystack standing in for RULER's Paul Graham essays:
  sentences from a small seeded grammar over the ~2,500-word vocabulary of
  :mod:`xoffload.evals._words`. The same seed gives the same text on every machine (only Python's
  ``random.Random`` with an int or str seed is used, which is stable across platforms and versions).

A haystack is a list of *segments*: strings that each carry their own trailing separator (" " or
"\\n"). :func:`compose` inserts needles between segments at relative depths and joins the lot.
"""
from __future__ import annotations

import bisect
import functools
import random

from . import _words

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                   "There and back again.")


def _unique(text: str) -> tuple:
    seen, out = set(), []
    for w in text.split():
        if w not in seen:
            seen.add(w)
            out.append(w)
    return tuple(out)


NOUNS = _unique(_words.NOUNS)
ADJECTIVES = _unique(_words.ADJECTIVES)
VERBS = _unique(_words.VERBS)
ADVERBS = _unique(_words.ADVERBS)
PREPOSITIONS = _unique(_words.PREPOSITIONS)

# nouns whose plural is not the regular one (or that have none)
_PLURAL = {
    "person": "people", "wolf": "wolves", "scarf": "scarves", "tooth": "teeth", "sheep": "sheep",
    "fish": "fish", "species": "species", "series": "series", "analysis": "analyses", "axis": "axes",
    "crisis": "crises", "cactus": "cacti", "hero": "heroes", "potato": "potatoes", "tomato": "tomatoes",
    "volcano": "volcanoes", "tornado": "tornadoes", "buffalo": "buffaloes", "dwarf": "dwarves",
    "mosquito": "mosquitoes", "news": "news", "advice": "advice", "furniture": "furniture",
    "equipment": "equipment", "information": "information", "luggage": "luggage", "oxygen": "oxygen",
    "electricity": "electricity", "evidence": "evidence", "freedom": "freedom", "laundry": "laundry",
    "patience": "patience", "gravity": "gravity", "chemistry": "chemistry", "biology": "biology",
    "literature": "literature", "wealth": "wealth", "health": "health", "courage": "courage",
    "hunger": "hunger", "curiosity": "curiosity", "clarity": "clarity", "imagination": "imagination",
    "oatmeal": "oatmeal", "saffron": "saffron", "spinach": "spinach", "parsley": "parsley",
    "cocoa": "cocoa", "cosmos": "cosmos", "rhino": "rhinos", "moss": "mosses",
}
_AN_EXCEPT_CONSONANT = ("uni", "use", "usu", "uti", "eu", "one")  # vowel letter, consonant sound
_AN_EXCEPT_VOWEL = ("hour", "honest", "honor", "heir")  # consonant letter, vowel sound


def plural(noun: str) -> str:
    """English plural of a vocabulary noun (``"city"`` → ``"cities"``, ``"box"`` → ``"boxes"``)."""
    if noun in _PLURAL:
        return _PLURAL[noun]
    if noun.endswith(("s", "sh", "ch", "x", "z")):
        return noun + "es"
    if noun.endswith("y") and noun[-2:-1] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def third_person(verb: str) -> str:
    """Third person singular present of a vocabulary verb (``"carry"`` → ``"carries"``)."""
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2:-1] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def article(word: str) -> str:
    """``"a"`` or ``"an"`` for the word that follows."""
    w = word.lower()
    if w.startswith(_AN_EXCEPT_VOWEL):
        return "an"
    if w.startswith(_AN_EXCEPT_CONSONANT):
        return "a"
    return "an" if w[:1] in "aeiou" else "a"


def word_pool() -> tuple:
    """All distinct vocabulary words (nouns, adjectives, verbs), sorted: RULER's word list for the
    common-words task and its ``adj-noun`` needle keys come from the same three parts of speech."""
    return _word_pool()


@functools.lru_cache(maxsize=1)
def _word_pool() -> tuple:
    return tuple(sorted(set(NOUNS) | set(ADJECTIVES) | set(VERBS)))


def key_word(rng: random.Random) -> str:
    """A RULER-style needle key: ``adjective-noun`` (e.g. ``"quiet-harbor"``)."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


# ------------------------------------------------------------------------------------- noise
def noise_segments(n: int, sentence_level: bool = True) -> list:
    """The first ``n`` segments of RULER's repeated noise.

    ``sentence_level=True``: one segment per sentence (the noise cycles through its 5 sentences; a
    newline ends each full repeat, as RULER's lines do); ``False``: one segment per full repeat.
    """
    if not sentence_level:
        return [NOISE + "\n"] * int(n)
    k = len(NOISE_SENTENCES)
    return [NOISE_SENTENCES[i % k] + ("\n" if i % k == k - 1 else " ") for i in range(int(n))]


# ------------------------------------------------------------------------------------- essay
class _Grammar:
    """A small sentence grammar (essay register: claims, advice, questions, conditionals)."""

    _SING_DET = ("the", "the", "the", "this", "that", "every", "our", "your", "their", "one", "a")
    _PL_DET = ("the", "these", "those", "many", "some", "most", "our", "their", "several", "few")

    def __init__(self, rng: random.Random):
        self.r = rng

    def adj(self):
        return self.r.choice(ADJECTIVES)

    def noun(self):
        return self.r.choice(NOUNS)

    def verb(self):
        return self.r.choice(VERBS)

    def adv(self):
        return self.r.choice(ADVERBS)

    def np(self, adj_p=0.5):
        """Singular noun phrase."""
        r = self.r
        words = ([self.adj()] if r.random() < adj_p else []) + [self.noun()]
        det = r.choice(self._SING_DET)
        if det == "a":
            det = article(words[0])
        return det + " " + " ".join(words)

    def nps(self, adj_p=0.5, det_p=0.6):
        """Plural noun phrase (bare or with a determiner)."""
        r = self.r
        words = ([self.adj()] if r.random() < adj_p else []) + [plural(self.noun())]
        if r.random() < det_p:
            words.insert(0, r.choice(self._PL_DET))
        return " ".join(words)

    def obj(self):
        return self.np() if self.r.random() < 0.6 else self.nps()

    def pp(self):
        return f"{self.r.choice(PREPOSITIONS)} {self.obj()}"

    def sentence(self) -> str:
        r = self.r
        t = r.randrange(18)
        if t == 0:
            s = f"{self.np()} {third_person(self.verb())} {self.obj()}."
        elif t == 1:
            s = f"most {self.adj()} {plural(self.noun())} {self.verb()} {self.obj()} {self.pp()}."
        elif t == 2:
            s = f"if you want to {self.verb()} {self.obj()}, you have to {self.verb()} {self.obj()} first."
        elif t == 3:
            s = (f"it is {self.adv()} {self.adj()} to {self.verb()} {self.obj()} when {self.np()} "
                 f"{third_person(self.verb())} {self.obj()}.")
        elif t == 4:
            s = f"what {plural(self.noun())} really need is {self.np()}, not {self.obj()}."
        elif t == 5:
            s = (f"I think {self.np()} {third_person(self.verb())} {self.obj()} more often than "
                 f"{plural(self.noun())} {self.verb()} {self.obj()}.")
        elif t == 6:
            s = f"why do so many {plural(self.noun())} {self.verb()} {self.obj()}?"
        elif t == 7:
            s = f"{self.adv()}, {self.np()} {third_person(self.verb())} {self.obj()} {self.pp()}."
        elif t == 8:
            s = f"the {self.noun()} of {self.obj()} is {self.adv()} {self.adj()}."
        elif t == 9:
            a = self.adj()
            s = f"there is {article(a)} {a} {self.noun()} {self.pp()}, and {self.nps()} {self.verb()} it."
        elif t == 10:
            s = f"{self.np()} is {self.adj()} because {self.nps()} {self.verb()} {self.obj()}."
        elif t == 11:
            s = f"in {self.obj()}, {self.nps()} {self.adv()} {self.verb()} {self.obj()}."
        elif t == 12:
            s = f"the best way to {self.verb()} {self.obj()} is to {self.verb()} {self.obj()}."
        elif t == 13:
            s = (f"when {self.np()} {third_person(self.verb())} {self.obj()}, {self.nps()} "
                 f"{self.verb()} {self.obj()} too.")
        elif t == 14:
            s = f"nobody {third_person(self.verb())} {self.obj()} {self.pp()}."
        elif t == 15:
            s = f"{self.np()} {self.adv()} {third_person(self.verb())} {self.obj()}."
        elif t == 16:
            s = (f"{self.nps(det_p=0.0)} {self.verb()} {self.obj()} because they {self.verb()} "
                 f"{self.obj()}.")
        else:
            s = f"you can {self.verb()} {self.obj()}, but you cannot {self.verb()} {self.obj()} {self.pp()}."
        return s[0].upper() + s[1:]


class Essay:
    """A deterministic, lazily extended stream of essay sentences.

    ``Essay(seed).segments(n_words)`` gives the haystack of the first ``n_words`` words, one segment
    per sentence (the last one cut mid-sentence when ``n_words`` falls inside it, as RULER cuts its
    essays by word count). Paragraph breaks: none (RULER flattens its essays to one line).
    """

    def __init__(self, seed=0):
        self._g = _Grammar(random.Random(f"xoffload-essay:{seed}"))
        self._sents: list = []      # sentence strings
        self._cum: list = [0]       # cumulative word counts

    def _extend(self, n_words: int):
        while self._cum[-1] < n_words:
            s = self._g.sentence()
            self._sents.append(s)
            self._cum.append(self._cum[-1] + len(s.split()))

    def segments(self, n_words: int) -> list:
        """Segments (each ``sentence + " "``) holding exactly ``n_words`` words."""
        n_words = int(n_words)
        if n_words <= 0:
            return []
        self._extend(n_words)
        k = bisect.bisect_right(self._cum, n_words) - 1  # whole sentences
        segs = [s + " " for s in self._sents[:k]]
        rest = n_words - self._cum[k]
        if rest > 0:
            segs.append(" ".join(self._sents[k].split()[:rest]) + " ")
        return segs

    def text(self, n_words: int) -> str:
        """The first ``n_words`` words as one string."""
        return "".join(self.segments(n_words)).strip()


@functools.lru_cache(maxsize=8)
def essay(seed=0) -> Essay:
    """The shared :class:`Essay` of a seed (cached: a long prompt's sentences are made once)."""
    return Essay(seed)


# ------------------------------------------------------------------------------------- compose
def boundary_at(segments: list, depth: float) -> int:
    """Index of the segment boundary (0 = before the first, ``len(segments)`` = after the last) whose
    character offset is nearest to ``depth`` (in [0, 1]) of the haystack's characters."""
    if not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    cum = [0]
    for s in segments:
        cum.append(cum[-1] + len(s))
    target = float(depth) * cum[-1]
    i = bisect.bisect_left(cum, target)
    if i >= len(cum):
        return len(segments)
    if i > 0 and target - cum[i - 1] <= cum[i] - target:
        return i - 1
    return i


def compose(segments: list, inserts: list) -> str:
    """Join ``segments`` with ``inserts`` (a list of ``(depth, text)``) placed at the boundaries
    nearest their depths (:func:`boundary_at`); inserts at one boundary keep their list order. An
    insert is followed by a newline where the segment before it ended one (or at the very start of a
    haystack with line breaks), else by a space. Returns the text without trailing whitespace."""
    by_b: dict = {}
    for depth, text in inserts:
        by_b.setdefault(boundary_at(segments, depth), []).append(text)
    line_based = any(s.endswith("\n") for s in segments)
    out = []
    for b in range(len(segments) + 1):
        if b in by_b:
            prev_nl = segments[b - 1].endswith("\n") if b > 0 else line_based
            sep = "\n" if prev_nl else " "
            out.extend(t + sep for t in by_b[b])
        if b < len(segments):
            out.append(segments[b])
    return "".join(out).rstrip()
