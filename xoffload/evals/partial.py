"""The records of an eval run as they finish: ``ruler.partial.jsonl``, and resuming from it.

A long run (11 tasks x 2 lengths x 20 samples x several modes) may be cut by a time limit. Each
finished record is appended to ``<out>/ruler.partial.jsonl`` and flushed to disk at once, so a cut
run loses at most the prompt it was generating. The file is not a result and says so:

* line 1, a header: ``{"kind": "xoffload-eval-partial", "note": ..., "setup": {...}, ...}``;
* every further line: one record, as in ``ruler.json``'s ``records`` (without the comparisons that
  are computed at the end: ``same_tokens``, ``hf_first_diff``, ...).

``ruler.json`` and ``ruler.png`` are written only when every run has finished; then the partial file
is removed (``ruler.json`` holds every record). ``resume=True`` (``xoffload eval --resume``)
reuses the records of the partial file, or of a finished ``ruler.json`` when there is no partial
file, provided they were made with the same setup (:func:`setup_of`: model, dtype, device, engine
options, seed, samples, answer cap and the prompts' own token ids; keys of options that are gone,
:data:`RETIRED_SETUP_KEYS`, are ignored in the file's setup); any other setup is a ValueError.
"""
from __future__ import annotations

import hashlib
import json
import os

PARTIAL_NAME = "ruler.partial.jsonl"
HEADER_KIND = "xoffload-eval-partial"
NOTE = ("records of an unfinished `xoffload eval` run, one JSON object per line after this one; NOT a result: "
        "ruler.json is written when the run finishes, and this file is then removed; `xoffload eval --resume` "
        "with the same setup continues it")

#: meta keys that change what a record would be (the model and how it runs)
SETUP_META_KEYS = ("model", "arch", "dtype", "device", "sparse", "sparse_threshold", "kv_block_size",
                   "max_model_len", "hf_weights")
#: setup keys earlier versions wrote for options that are gone; ignored in a stored setup, so that
#: their files still resume (``num_kv_buffers``: the offload ring's GPU buffers, which no
#: configuration left reads, so it never changed a record that a run can still ask for)
RETIRED_SETUP_KEYS = ("num_kv_buffers",)
#: record keys computed at the end from all records (dropped when records are reused)
DERIVED_KEYS = ("same_tokens", "same_score", "first_diff", "hf_same_tokens", "hf_same_score", "hf_first_diff",
                "hf_top2_gap_at_diff", "hf_generated_ids", "hf_prediction")


def prompt_sha1(token_ids) -> str:
    """Short content hash of a prompt's token ids (16 hex digits)."""
    return hashlib.sha1(json.dumps([int(x) for x in token_ids]).encode()).hexdigest()[:16]


def setup_of(prompts, *, seed, samples, max_new_tokens, meta) -> dict:
    """What must be equal for two runs' records to be interchangeable: the meta keys of
    :data:`SETUP_META_KEYS` present in ``meta`` (the model by file name, so that the same file
    found under another path still matches), seed, samples, the answer cap, and a hash of every
    prompt (task, length, index, answer budget, token ids)."""
    s = {k: meta[k] for k in SETUP_META_KEYS if k in meta}
    if s.get("model"):
        s["model"] = os.path.basename(str(s["model"]))
    h = hashlib.sha1()
    for p in prompts:
        h.update(json.dumps([p.task, int(p.length), int(p.index), int(p.max_new_tokens),
                             prompt_sha1(p.token_ids)]).encode())
    s.update(seed=int(seed), samples=int(samples), max_new_tokens_cap=max_new_tokens, num_prompts=len(prompts),
             prompts_sha1=h.hexdigest()[:16])
    return s


def record_key(rec) -> tuple:
    """``(mode, task, length, index, prompt_sha1, max_new_tokens)`` of a record."""
    return (rec["mode"], rec["task"], int(rec["length"]), int(rec["index"]), rec.get("prompt_sha1"),
            int(rec["max_new_tokens"]))


def _differences(there: dict, here: dict) -> str:
    """What differs, keys set on both sides first (in ``here``'s order), then keys set on one side."""
    keys = list(here) + [k for k in there if k not in here]
    diff = [k for k in keys if there.get(k) != here.get(k)]
    diff.sort(key=lambda k: (k not in there or k not in here))
    return "; ".join(f"{k}: {there.get(k)!r} there, {here.get(k)!r} here" for k in diff[:4]) + \
        (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")


def read_partial(path: str) -> tuple:
    """``(header, records, good_bytes)`` of a partial file. A last line cut short (the process was
    killed while writing it) is ignored; ``good_bytes`` is where the intact lines end. Raises
    ValueError ``"<path>:<line>: ..."`` for a file that is not a partial file or a bad line before
    the last."""
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw.split(b"\n")
    header, records, pos = None, [], 0
    for n, line in enumerate(lines, start=1):
        end = pos + len(line) + 1
        last = n == len(lines) or (n == len(lines) - 1 and lines[-1] == b"")
        if not line.strip():
            pos = end
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
        except ValueError:
            if last and header is not None:  # cut short while being written: drop it
                break
            raise ValueError(f"{path}:{n}: not a JSON object (not an xoffload eval partial file?)") from None
        if header is None:
            if obj.get("kind") != HEADER_KIND or not isinstance(obj.get("setup"), dict):
                raise ValueError(f"{path}:1: not an xoffload eval partial file (no {HEADER_KIND} header)")
            header = obj
        else:
            if not all(k in obj for k in ("mode", "task", "length", "index", "max_new_tokens")):
                raise ValueError(f"{path}:{n}: not an eval record")
            records.append(obj)
        pos = min(end, len(raw))
    if header is None:
        raise ValueError(f"{path}: empty (no {HEADER_KIND} header)")
    return header, records, pos


def reusable_records(out_dir: str, setup: dict, json_name: str) -> tuple:
    """``(records, source_path)`` that a resumed run may reuse from ``out_dir``: the partial file's,
    else a finished ``json_name``'s, else ``([], None)``. The derived comparison keys are dropped.
    Raises ValueError (one line) when the file was made with another setup, naming what differs."""
    p = os.path.join(out_dir, PARTIAL_NAME)
    j = os.path.join(out_dir, json_name)
    if os.path.isfile(p):
        header, records, good = read_partial(p)
        there, src = header["setup"], p
        if good < os.path.getsize(p):  # drop the torn last line before appending to the file
            with open(p, "r+b") as f:
                f.truncate(good)
    elif os.path.isfile(j):
        try:
            with open(j, encoding="utf-8") as f:
                d = json.load(f)
        except ValueError as e:
            raise ValueError(f"--resume: {j} is not valid JSON ({e})") from None
        there, records, src = (d.get("meta") or {}).get("setup"), d.get("records") or [], j
        if not isinstance(there, dict):
            raise ValueError(f"--resume: {j} records no setup (written by an older xoffload); use another --out")
    else:
        return [], None
    there = {k: v for k, v in there.items() if k not in RETIRED_SETUP_KEYS}
    if there != setup:
        raise ValueError(f"--resume: {src} was made with a different setup ({_differences(there, setup)}); "
                         f"use another --out, or run without --resume to start afresh")
    out = []
    for r in records:
        r = {k: v for k, v in r.items() if k not in DERIVED_KEYS}
        out.append(r)
    return out, src


class PartialLog:
    """Appends records to ``<out_dir>/ruler.partial.jsonl`` as they finish, each line flushed and
    fsync'ed. The file is created (with its header) at the first record: a run that fails before
    any record leaves nothing. ``append=True`` continues an existing file (resume); otherwise an
    existing one is replaced."""

    def __init__(self, out_dir: str, header: dict, *, append: bool):
        self.path = os.path.join(out_dir, PARTIAL_NAME)
        self.header = {"kind": HEADER_KIND, "note": NOTE, **header}
        self.append = append and os.path.isfile(self.path)
        self.f = None
        self.written = 0

    def write(self, rec: dict) -> None:
        """Append one record (a JSON-serializable dict) and flush it to disk."""
        if self.f is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self.f = open(self.path, "a" if self.append else "w", encoding="utf-8")
            if not self.append:
                self.f.write(json.dumps(self.header) + "\n")
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.written += 1

    def close(self) -> None:
        """Close the file (kept on disk)."""
        if self.f is not None:
            self.f.close()
            self.f = None

    def remove(self) -> None:
        """Close and delete the file (the run finished and ``ruler.json`` holds every record)."""
        self.close()
        if os.path.exists(self.path):
            os.unlink(self.path)
