"""Run RULER-style samples under one or more LLM modes and collect scores, tables and agreement.

(Over 450 lines on purpose: the run loop, the result type with its table / JSON / PNG writers and
the peer agreement share the record format.)

Every prompt is built once (:func:`~.tasks.build_samples`, plus any loaded RULER data) and then
generated greedily under each mode, so modes see token-identical prompts. The result holds per-sample
predictions and scores, a task x length table per mode (RULER's task score: mean x 100), averages,
each mode's agreement with the first mode (the same generated token ids, the same score, the first
position where the answers differ) and, when the transformers peer (mode ``hf``,
:mod:`.hf_peer`) ran, every other mode's agreement with it.

Order of the runs: length by length (shortest first), and within a length mode by mode, so that a
run cut by a time limit has every mode's records of the shorter lengths. Finished records go to
``ruler.partial.jsonl`` as they come (:mod:`.partial`); ``resume=True`` reuses them.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from .hf_peer import HF_MODE
from .partial import PARTIAL_NAME, PartialLog, prompt_sha1, record_key, reusable_records, setup_of
from .scoring import score as _score
from .tasks import build_samples, parse_tasks
from .. import __version__

JSON_NAME = "ruler.json"
PNG_NAME = "ruler.png"
__all__ = ["EvalResult", "JSON_NAME", "PARTIAL_NAME", "PNG_NAME", "run_eval", "summarize"]


def _umask() -> int:
    """The process's umask (read without changing it where Linux reports it, else set and restored)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    m = os.umask(0o022)
    os.umask(m)
    return m


def _as_open_would(path: str) -> None:
    """Give ``path`` (a temporary file from ``mkstemp``, which makes it 0600) the permissions that
    ``open(path, "w")`` gives a new file, as ``xoffload needle``'s outputs have: 0o666 less the
    umask (0644 under the usual 022)."""
    os.chmod(path, 0o666 & ~_umask())


def _len_label(L) -> str:
    L = int(L)
    return f"{L // 1024}K" if L % 1024 == 0 else str(L)


@dataclass
class EvalResult:
    """What :func:`run_eval` returns.

    Attributes:
        modes: mode labels in run order (the first is the agreement reference).
        tasks: task names (synthetic tasks in the order asked, then data tasks as first seen).
        lengths: target lengths (tokens), sorted.
        records: one dict per (mode, sample): ``mode, task, index, length, prompt_tokens, depth,
            metric, outputs, prediction, score`` (0-100), ``generated_ids``, ``finish_reason``,
            ``timings``, ``peak_gpu_memory_bytes`` and, after the first mode, ``same_tokens`` /
            ``same_score`` (against the first mode's record of the same sample).
        table: ``{mode: {task: {length(str): score 0-100}}}`` (cells without samples are absent).
        average: ``{mode: mean of the table's cells}``.
        average_by_length: ``{mode: {length(str): mean over tasks}}``.
        agreement: ``{mode: {"token_identical", "same_score", "total", "token_identical_frac",
            "same_score_frac", "differing"}}`` for every mode after the first; ``differing`` lists the
            samples whose tokens differ (``task, length, index, first_diff``).
        peer: the peer mode's label (``"hf"``) when it ran, else None.
        peer_agreement: the same as ``agreement``, for every mode other than the peer, against the
            peer; each ``differing`` entry also has ``peer_top2_gap`` (the peer's largest minus
            second-largest logit at the first differing token: a small gap is a near tie that
            rounding decides). Their records carry ``hf_same_tokens``, ``hf_same_score``,
            ``hf_first_diff`` and, where the tokens differ, ``hf_generated_ids``, ``hf_prediction``
            and ``hf_top2_gap_at_diff``.
        meta: model, device, dtype, date, seed, settings, the setup fingerprint (``setup``), wall times.
    """

    modes: list
    tasks: list
    lengths: list
    records: list
    table: dict
    average: dict
    average_by_length: dict
    agreement: dict
    meta: dict = field(default_factory=dict)
    peer: str | None = None
    peer_agreement: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready dict: ``meta, modes, tasks, lengths, table, average, average_by_length,
        agreement, peer, peer_agreement, records``."""
        return {"meta": self.meta, "modes": self.modes, "tasks": self.tasks, "lengths": self.lengths,
                "table": self.table, "average": self.average, "average_by_length": self.average_by_length,
                "agreement": self.agreement, "peer": self.peer, "peer_agreement": self.peer_agreement,
                "records": self.records}

    def write_json(self, path: str) -> str:
        """Write :meth:`to_dict` to ``path`` atomically (a temporary file in the same folder, then
        ``os.replace``): no partial file is ever visible under ``path``. The file gets the permissions
        of a plain ``open(path, "w")`` (0644 under umask 022). Returns ``path``."""
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".ruler-", suffix=".json.tmp", dir=d)
        try:
            _as_open_would(tmp)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.to_dict(), f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return path

    def title(self) -> str:
        """Figure title: model, device (GPU name), dtype and date."""
        m = self.meta
        dev = m.get("gpu") or m.get("device") or "?"
        return (f"RULER-style eval: {os.path.basename(str(m.get('model', '?')))} on {dev}, "
                f"{str(m.get('dtype', '?')).replace('torch.', '')}, {m.get('date', '')[:10]}")

    def write_png(self, path: str, title: str | None = None) -> str:
        """Heatmap of the task x length table, one row-panel per mode, each cell annotated with its
        score (0-100) and an ``average`` row; written atomically, with the permissions of a plain
        ``open(path, "w")``. Needs matplotlib (ImportError)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = list(self.tasks) + ["average"]
        cols = [str(L) for L in self.lengths]
        nm = len(self.modes)
        fig, axes = plt.subplots(nm, 1, figsize=(2.6 + 1.0 * len(cols), 0.9 + (0.32 * len(rows) + 0.6) * nm),
                                 squeeze=False)
        im = None
        for ax, mode in zip(axes[:, 0], self.modes):
            grid = []
            for t in rows:
                src = self.average_by_length[mode] if t == "average" else self.table[mode].get(t, {})
                grid.append([src.get(c, float("nan")) for c in cols])
            im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
            ax.set_xticks(range(len(cols)), [_len_label(c) for c in cols])
            ax.set_yticks(range(len(rows)), rows, fontsize=8)
            ax.set_title(f"mode={mode}  (average {self.average[mode]:.1f})", fontsize=9)
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    if v == v:  # not NaN
                        ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7)
        axes[-1, 0].set_xlabel("context length (tokens)")
        fig.colorbar(im, ax=list(axes[:, 0]), fraction=0.04, label="score (0-100)")
        fig.suptitle(title or self.title(), fontsize=9)
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".ruler-", suffix=".png", dir=d)
        os.close(fd)
        try:
            _as_open_would(tmp)
            fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
            os.replace(tmp, path)
        finally:
            plt.close(fig)
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    def format_table(self) -> str:
        """The tables as text: per mode, tasks x lengths (scores 0-100), the average row, then the
        agreement lines."""
        cols = [str(L) for L in self.lengths]
        w = max([len(t) for t in self.tasks] + [8]) + 2
        lines = []
        for mode in self.modes:
            lines.append(f"mode={mode}: RULER score (0-100) per task and length")
            lines.append("task".ljust(w) + "".join(_len_label(c).rjust(8) for c in cols))
            for t in self.tasks:
                cells = self.table[mode].get(t, {})
                lines.append(t.ljust(w) + "".join((f"{cells[c]:.1f}" if c in cells else "-").rjust(8) for c in cols))
            avg = self.average_by_length[mode]
            lines.append("average".ljust(w) + "".join((f"{avg[c]:.1f}" if c in avg else "-").rjust(8) for c in cols)
                         + f"   overall {self.average[mode]:.1f}")
            lines.append("")
        ref = self.modes[0] if self.modes else None
        for mode, a in self.agreement.items():
            lines.append(_agreement_line(mode, ref, a))
        if self.peer is not None and self.peer != ref:  # (with the peer first, agreement says it all)
            for mode, a in self.peer_agreement.items():
                if mode != ref:  # ref vs peer is the line "peer vs ref" above
                    lines.append(_agreement_line(mode, self.peer, a))
        return "\n".join(lines).rstrip()


def _agreement_line(mode, ref, a, show: int = 6) -> str:
    frac = f" ({100.0 * a['token_identical_frac']:.1f}%)" if a.get("token_identical_frac") is not None else ""
    line = (f"{mode} vs {ref}: token-identical answers {a['token_identical']}/{a['total']}{frac}, "
            f"same score {a['same_score']}/{a['total']}")
    diff = a.get("differing") or []
    if diff:
        def one(d):
            gap = d.get("peer_top2_gap")
            return (f"{d['task']}@{_len_label(d['length'])}#{d['index']} at token {d['first_diff']}"
                    + (f" (gap {gap:.3g})" if gap is not None else ""))
        line += "; differ: " + ", ".join(one(d) for d in diff[:show]) + (f", +{len(diff) - show}" if len(diff) > show else "")
    return line


def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def _compare(records, ref_mode, modes, prefix=""):
    """Agreement of every mode in ``modes`` with ``ref_mode``, sample by sample; sets the comparison
    keys (``prefix`` + ``same_tokens`` / ``same_score`` / ``first_diff``) on the records compared."""
    from .hf_peer import first_diff

    ref = {(r["task"], r["length"], r["index"], r["sample"]): r for r in records if r["mode"] == ref_mode}
    out = {}
    for m in modes:
        n = same_t = same_s = 0
        differing = []
        for r in records:
            if r["mode"] != m:
                continue
            a = ref.get((r["task"], r["length"], r["index"], r["sample"]))
            if a is None:
                continue
            fd = first_diff(r["generated_ids"], a["generated_ids"])
            r[prefix + "same_tokens"] = fd is None
            r[prefix + "same_score"] = r["score"] == a["score"]
            r[prefix + "first_diff"] = fd
            n += 1
            same_t += fd is None
            same_s += r[prefix + "same_score"]
            if fd is not None:
                d = {"task": r["task"], "length": r["length"], "index": r["index"], "first_diff": fd}
                gaps = (a.get("timings") or {}).get("top2_gap")
                gap = gaps[fd] if gaps is not None and fd < len(gaps) else None
                if gaps is not None:  # the reference is the peer: its view of the token where they part
                    d["peer_top2_gap"] = gap
                if prefix:
                    r[prefix + "top2_gap_at_diff"] = gap
                    r[prefix + "generated_ids"] = list(a["generated_ids"])
                    r[prefix + "prediction"] = a["prediction"]
                differing.append(d)
        out[m] = {"token_identical": same_t, "same_score": same_s, "total": n,
                  "token_identical_frac": same_t / n if n else None,
                  "same_score_frac": same_s / n if n else None, "differing": differing}
    return out


def summarize(records: list, modes: list, tasks: list, lengths: list, peer: str | None = None) -> tuple:
    """``(table, average, average_by_length, agreement, peer_agreement)`` from per-sample records
    (see :class:`EvalResult`); also sets the comparison keys on the records of later modes (and,
    with ``peer`` among ``modes``, the ``hf_*`` keys on every other mode's records)."""
    table, average, by_len = {}, {}, {}
    for m in modes:
        rs = [r for r in records if r["mode"] == m]
        tab = {}
        for t in tasks:
            row = {}
            for L in lengths:
                v = _mean(r["score"] for r in rs if r["task"] == t and r["length"] == L)
                if v is not None:
                    row[str(L)] = v
            if row:
                tab[t] = row
        table[m] = tab
        by_len[m] = {}
        for L in lengths:
            v = _mean(tab[t][str(L)] for t in tab if str(L) in tab[t])
            if v is not None:
                by_len[m][str(L)] = v
        cells = [v for row in tab.values() for v in row.values()]
        average[m] = _mean(cells) if cells else 0.0
    agreement = _compare(records, modes[0], modes[1:]) if modes else {}
    peer_agreement = {}
    if peer is not None and peer in modes:
        peer_agreement = _compare(records, peer, [m for m in modes if m != peer], prefix="hf_")
    return table, average, by_len, agreement, peer_agreement


def _model_meta(llm) -> dict:
    m = {}
    try:
        import torch

        mdl = llm.model
        m.update(model=str(mdl.source), arch=mdl.cfg.arch, dtype=str(mdl.dtype), device=str(mdl.device))
        if mdl.device.type == "cuda":
            m["gpu"] = torch.cuda.get_device_name(mdl.device)
        m["torch"] = torch.__version__
    except Exception:  # a stand-in LLM without these attributes
        pass
    return m


def _check_modes(llm_factory, modes, max_new_tokens):
    """``(modes, labels)`` of a run; ValueError / TypeError naming what is wrong."""
    if modes is None:
        modes = list(llm_factory) if isinstance(llm_factory, Mapping) else ["gpu"]
    modes = list(modes)
    labels = [str(m) for m in modes]
    if not modes or len(set(labels)) != len(modes):
        raise ValueError(f"modes must be a non-empty list of distinct labels, got {modes!r}")
    if isinstance(llm_factory, Mapping):
        missing = [m for m in modes if m not in llm_factory]
        if missing:
            raise ValueError(f"no LLM given for mode(s) {missing}")
    elif not callable(llm_factory):
        raise TypeError("llm_factory must be callable(mode) -> LLM or a mapping {mode: LLM}")
    if max_new_tokens is not None and int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
    return modes, labels


def _record(label, k, s, mt, o, tokenizer, mode_config=None) -> dict:
    pred = o.text if o.text is not None else (tokenizer.decode(o.token_ids, skip_special_tokens=True))
    t = o.timings or {}
    rec = {
        "mode": label, "task": s.task, "index": s.index, "sample": k, "length": s.length,
        "prompt_tokens": len(s.token_ids), "prompt_sha1": prompt_sha1(s.token_ids), "depth": s.depth,
        "metric": s.metric, "max_new_tokens": mt, "outputs": list(s.outputs), "prediction": pred,
        "score": 100.0 * _score(pred, s.outputs, s.metric),
        "generated_ids": list(o.token_ids), "finish_reason": o.finish_reason,
        "timings": {key: t.get(key) for key in ("prefill_tok_per_s", "ttft_ms", "decode_ms_per_token",
                                                "decode_steps", "total_ms", "mean_density", "cache_hit_rate",
                                                "h2d_bytes_per_token")},
        "peak_gpu_memory_bytes": o.peak_gpu_memory_bytes,
    }
    if t.get("top2_gap") is not None:  # the transformers peer's per-token top-2 logit gaps
        rec["timings"]["top2_gap"] = t["top2_gap"]
    if mode_config is not None:
        rec["mode_config"] = mode_config
    return rec


def _run_block(llm, label, todo, tokenizer, max_new_tokens, bar, on_record, mode_config=None) -> None:
    """The prompts ``todo`` (``[(sample number, Sample)]``) through one LLM, greedily; each record
    goes to ``on_record`` as soon as it is made."""
    from xoffload.engine.sampling import SamplingParams

    dev = getattr(getattr(llm, "model", None), "device", None)
    if dev is not None and getattr(dev, "type", None) == "cuda":  # compile kernels outside the measured runs
        llm.generate(todo[0][1].token_ids[:256], SamplingParams(max_tokens=2))
    session = getattr(llm, "eval_session", None)
    for k, s in todo:
        if bar is not None:
            bar.set_postfix(mode=label, task=s.task, length=s.length)
        mt = s.max_new_tokens if max_new_tokens is None else min(s.max_new_tokens, int(max_new_tokens))
        sp = SamplingParams(max_tokens=mt, temperature=0.0)
        if session is None:
            o = llm.generate(s.token_ids, sp)[0]
        else:
            o = ask_in_session(llm, s, tokenizer, sp)
        on_record(_record(label, k, s, mt, o, tokenizer, mode_config))
        if bar is not None:
            bar.update(1)


def question_start(sample, tokenizer) -> int:
    """Index of the first token of ``sample``'s question in its prompt: where the tokens of the
    user text's last line (RULER's templates end with the question) begin, searched from the end;
    64 tokens before the end when the line's tokens are not found (a tokenizer that merges across
    the line break)."""
    ids = sample.token_ids
    line = sample.input.rstrip().rsplit("\n", 1)[-1] if sample.input else ""
    q = tokenizer.encode(line, add_special_tokens=False) if line else []
    if q:
        for j in range(len(ids) - len(q), -1, -1):
            if ids[j:j + len(q)] == q:
                return j
        for cut in (1, 2):  # the line's first token merged with the one before it
            if len(q) > cut:
                t = q[cut:]
                for j in range(len(ids) - len(t), -1, -1):
                    if ids[j:j + len(t)] == t:
                        return max(1, j - cut)
    return max(1, len(ids) - 64)


def ask_in_session(llm, sample, tokenizer, sp):
    """Ask ``sample`` as the second turn of a session (:meth:`~xoffload.engine.llm.LLM.session`):
    turn one appends the prompt up to the question
    (:meth:`~xoffload.engine.session.Session.append`), turn two asks the rest (the same tokens as
    the one-shot prompt; with prefix caching it prefills only them). Returns the second turn's
    RequestOutput."""
    j = question_start(sample, tokenizer)
    with llm.session() as sess:
        sess.append(sample.token_ids[:j])
        return sess.generate(sample.token_ids[j:], sp)


def _check_samples_by_mode(samples_by_mode, labels) -> dict:
    out = {}
    for m, n in dict(samples_by_mode or {}).items():
        if str(m) not in labels:
            continue
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"samples_by_mode[{m!r}] must be a positive int, got {n!r}")
        out[str(m)] = n
    return out


def run_eval(llm_factory, tokenizer, tasks="all", lengths=(4096,), samples: int = 1, modes=None, seed: int = 0, *,
             data=(), max_new_tokens: int | None = None, out_dir: str | None = None, meta: dict | None = None,
             progress: bool = True, resume: bool = False, samples_by_mode: dict | None = None,
             peer: str | None = HF_MODE, mode_configs: dict | None = None) -> EvalResult:
    """Build the prompts once and generate every one of them under each mode, greedily.

    Runs go length by length (shortest first) and, within a length, mode by mode in the order
    given, so that a run cut short has every mode's records of its shorter lengths.

    Args:
        llm_factory: ``callable(mode) -> LLM`` (called once per mode and length that has prompts left
            to run; the LLM is closed after them), or a mapping ``{mode: LLM}`` (used as given, not
            closed). An LLM needs ``generate(token_ids, SamplingParams) -> [RequestOutput]``.
        tokenizer: the model's tokenizer (prompts are sized and chat-templated with it).
        tasks: ``"all"``, a comma-separated string or a list of task names (:data:`~.tasks.TASKS`);
            empty (``()``/``None`` with ``data``) for data only.
        lengths: target context lengths in tokens (prompt + generation), for the synthetic tasks.
        samples: samples per (task, length), >= 1.
        modes: mode labels, passed to ``llm_factory`` (e.g. ``["gpu", "offload"]``); default the
            mapping's keys, else ``["gpu"]``. The first is the agreement reference.
        seed: int; seeds every prompt.
        data: extra :class:`~.tasks.Sample` s, e.g. from :func:`~.ruler_data.load_ruler_data`
            (their ``token_ids`` are filled with ``tokenizer`` when empty: RULER's raw prompt,
            :func:`~.ruler_data.prompt_ids`). They must fit the LLMs' ``max_model_len``
            (:func:`~.ruler_data.split_fitting` sorts out those that do not).
        max_new_tokens: optional cap on every sample's generation length (default: RULER's per task).
        out_dir: when given, each finished record is appended to ``ruler.partial.jsonl`` there at
            once (:mod:`.partial`), and ``ruler.json`` and ``ruler.png`` are written after all runs
            finished (JSON atomically; none when a run fails), the partial file then removed.
        meta: extra metadata for the JSON (model name etc.; filled from the first LLM otherwise);
            its keys in :data:`~.partial.SETUP_META_KEYS` are part of the setup a resume checks.
        progress: show a tqdm bar (stderr).
        resume: reuse the records of ``out_dir``'s partial file (or of its finished ``ruler.json``)
            made with the same setup; run only the rest. Nothing to reuse: a fresh run.
        samples_by_mode: ``{mode: N}``: that mode runs only the samples of index < N of each task
            and length (e.g. a slow peer on a subset); agreement counts the samples both ran.
        peer: label of the mode every other mode is also compared with (default ``"hf"``, the
            transformers peer), when it is among ``modes``.
        mode_configs: optional ``{mode: str}``, what each label means (e.g. the repr of its resolved
            engine options): stored in every record as ``mode_config``; a resume reuses a record
            only when it matches, so a label whose meaning changed (a new library default) runs again.
    Returns:
        :class:`EvalResult`.
    Raises:
        ValueError: bad tasks / samples / lengths / modes, a length too short for a task's template,
            ``resume`` without ``out_dir`` or against a file of another setup.
    """
    modes, labels = _check_modes(llm_factory, modes, max_new_tokens)
    per_mode = _check_samples_by_mode(samples_by_mode, labels)
    if resume and out_dir is None:
        raise ValueError("resume needs out_dir (the folder of ruler.partial.jsonl)")
    task_list = parse_tasks(tasks) if tasks else []
    lengths = sorted(set(int(L) for L in lengths)) if task_list else []
    if any(L < 1 for L in lengths):
        raise ValueError(f"lengths must be positive, got {lengths}")
    t0 = time.perf_counter()
    prompts = build_samples(tokenizer, task_list, lengths, samples, seed) if task_list else []
    data = list(data or ())
    if data:
        from .ruler_data import tokenize_samples

        tokenize_samples([s for s in data if not s.token_ids], tokenizer)
    prompts += data
    if not prompts:
        raise ValueError("nothing to run: no tasks and no data")
    build_s = time.perf_counter() - t0
    all_tasks = list(task_list) + [t for t in dict.fromkeys(s.task for s in data) if t not in task_list]
    all_lengths = sorted(set(s.length for s in prompts))

    info = dict(meta or {})
    setup = setup_of(prompts, seed=seed, samples=samples, max_new_tokens=max_new_tokens, meta=info)
    done, resumed_from = {}, None
    if resume:
        old, resumed_from = reusable_records(out_dir, setup, JSON_NAME)
        done = {record_key(r): r for r in old if r["mode"] in labels}
    # the plan: (length, mode) blocks in order, each with its prompts not yet done
    plan, records, stale = [], [], 0
    for L in all_lengths:
        for mode, label in zip(modes, labels):
            todo = []
            for k, s in enumerate(prompts):
                if s.length != L or (label in per_mode and s.index >= per_mode[label]):
                    continue
                mt = s.max_new_tokens if max_new_tokens is None else min(s.max_new_tokens, int(max_new_tokens))
                key = (label, s.task, int(s.length), int(s.index), prompt_sha1(s.token_ids), int(mt))
                if key in done and (mode_configs or {}).get(label) != done[key].get("mode_config"):
                    stale += 1  # made with another meaning of the label: run again
                    todo.append((k, s))
                elif key in done:
                    r = dict(done[key])
                    r["sample"] = k
                    records.append(r)
                else:
                    todo.append((k, s))
            if todo:
                plan.append((L, mode, label, todo))
    reused = len(records)
    log = None
    if out_dir is not None:
        log = PartialLog(out_dir, {"setup": setup, "modes": labels, "xoffload": __version__,
                                   "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds")},
                         append=resumed_from is not None and resumed_from.endswith(PARTIAL_NAME))

    def on_record(rec):
        records.append(rec)
        if log is not None:
            log.write(rec)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(b[3]) for b in plan), desc="eval", unit="prompt", file=sys.stderr)
    wall = {}
    try:
        for L, mode, label, todo in plan:
            owned = not isinstance(llm_factory, Mapping)
            llm = llm_factory(mode) if owned else llm_factory[mode]
            if not info.get("model"):
                info.update({k: v for k, v in _model_meta(llm).items() if k not in info})
            tm = time.perf_counter()
            try:
                _run_block(llm, label, todo, tokenizer, max_new_tokens, bar, on_record, (mode_configs or {}).get(label))
            finally:
                if owned and hasattr(llm, "close"):
                    llm.close()
            wall[label] = wall.get(label, 0.0) + time.perf_counter() - tm
    finally:
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
    order = {(lab, L): i for i, (L, lab) in enumerate((L, lab) for L in all_lengths for lab in labels)}
    records.sort(key=lambda r: (order[(r["mode"], r["length"])], r["sample"]))
    table, average, by_len, agreement, peer_agreement = summarize(records, labels, all_tasks, all_lengths, peer)
    info.update({
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), "seed": int(seed),
        "samples": int(samples), "tasks": all_tasks, "lengths": all_lengths, "modes": labels,
        "max_new_tokens_cap": max_new_tokens, "num_prompts": len(prompts), "build_s": build_s,
        "wall_s_by_mode": wall, "data_files": sorted(set(s.meta["source"] for s in data if s.meta.get("source"))),
        "samples_by_mode": per_mode, "setup": setup, "records_reused": reused, "records_stale": stale,
        "resumed_from": os.path.basename(resumed_from) if resumed_from else None,
    })
    info.setdefault("xoffload", __version__)
    res = EvalResult(modes=labels, tasks=all_tasks, lengths=all_lengths, records=records,
                     table=table, average=average, average_by_length=by_len, agreement=agreement, meta=info,
                     peer=peer if peer in labels else None, peer_agreement=peer_agreement)
    if out_dir is not None:
        res.write_json(os.path.join(out_dir, JSON_NAME))
        try:
            res.write_png(os.path.join(out_dir, PNG_NAME))
        except ImportError:
            print("matplotlib not installed: no heatmap (pip install matplotlib)", file=sys.stderr)
        log.remove()
    return res
