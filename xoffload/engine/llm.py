"""``LLM``: offline generation over the engine loop (:class:`~.llm_engine.LLMEngine`): a list of
prompts in, their outputs in order; conversations through :meth:`LLM.session`."""
from __future__ import annotations

import warnings

from tqdm.auto import tqdm

from . import inputs
from .llm_engine import LLMEngine
from .scheduler import Sequence

__all__ = ["LLM"]


class LLM:
    """Generate with a Llama/Qwen3 model, the KV cache resident on its device or offloaded to
    pinned CPU memory.

    Args:
        model: what :func:`~xoffload.models.loader.load_model` accepts — None / ``"smollm2"`` (the
            default SmolLM2-135M-Instruct GGUF), a ``.gguf`` path, a HF directory, a preset name
            (random weights), a ModelConfig, or a loaded :class:`LlamaModel` (weights shared).
        **options: the fields of :class:`~xoffload.engine.config.EngineConfig` (``mode``,
            ``sparse``, ``sparse_decode``, ``token_budget``, ``offload_decode``, ``max_num_seqs``,
            ``prefix_caching``, ``max_model_len``, ``kv_cache_tokens``, ...).

    With ``tensor_parallel_size=N > 1`` (one rank of a ``torchrun`` group) rank 0 checks the
    prompts and broadcasts them; every rank runs the same loop and returns the same outputs.

    Attributes: ``engine`` (the :class:`LLMEngine`), ``config``, ``model``, ``tokenizer``, ``mode``,
    ``policy`` (prefill), ``offload`` (the runtime's ``OffloadRuntime``; in resident mode None,
    except with a QuestDecode and ``max_num_seqs > 1``: its pool on the device),
    ``prefix_cache``, ``batch_stats`` (the last store epoch's figures: decode steps, prefills,
    tok/s, most sequences at once, captured CUDA-graph buckets, the store).

    On the CPU the kernels run their fp32 references. Raises ValueError / TypeError on bad options,
    FileNotFoundError when the model is missing.
    """

    def __init__(self, model=None, **options):
        self.engine = LLMEngine(model, **options)
        e = self.engine
        self.model, self.config, self.tp = e.model, e.config, e.tp
        self.cfg, self.device, self.dtype, self.tokenizer = e.model.cfg, e.model.device, e.model.dtype, e.model.tokenizer
        self.mode, self.max_model_len, self.policy = e.config.mode, e.config.max_model_len, e.config.policy
        self.sparse_layers = self.policy.layers(self.cfg.num_layers)
        self.batch_stats: dict = {}

    @property
    def offload(self):
        return self.engine.offload

    @property
    def prefix_cache(self):
        return self.engine.prefix_cache

    # ------------------------------------------------------------------ text
    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list:
        """Token ids of a chat (a user string or ``{"role", "content"}`` dicts) through the
        tokenizer's chat template. ValueError without a tokenizer or chat template."""
        return inputs.apply_chat_template(self.model, messages, add_generation_prompt)

    def encode(self, text: str) -> list:
        """Token ids of raw text (the tokenizer's default special tokens)."""
        return inputs.encode(self.model, text)

    def decode(self, ids) -> str | None:
        """Text of token ids (special tokens skipped); None without a tokenizer."""
        return inputs.decode(self.model, ids)

    # ------------------------------------------------------------------ generation
    def session(self, *, history_budget=None):
        """A conversation (:class:`~.session.Session`): ``s.generate(prompt, params)`` /
        ``s.chat(message, params)`` answer a turn, a plain request carrying the whole
        conversation, of which the prefix cache (``prefix_caching=True``) finds what earlier turns
        computed, so only the new tokens are prefilled (without it every turn prefills the whole
        conversation); ``s.close()`` forgets it. Raises ValueError for a ``history_budget`` (the
        history is read whole) and ``tensor_parallel_size > 1``."""
        from .session import Session

        return Session(self.engine, history_budget=history_budget)

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = False,
                 length_warning: str = "warn") -> list:
        """Generate for each prompt through the engine loop (decoded together up to
        ``max_num_seqs`` at a time, continuous batching).

        Args:
            prompts: a string, a list of token ids, or a list of strings / token-id lists (a 1-D /
                2-D int tensor works too). Strings are tokenized as they are (no chat template:
                see :meth:`apply_chat_template`).
            sampling_params: one :class:`SamplingParams` for every prompt (default greedy, 64
                tokens), or a list of them, one per prompt.
            use_tqdm: show a progress bar (finished requests, decode tok/s).
            length_warning: what to do when a prompt plus its ``max_tokens`` passes
                ``max_model_len`` (it would end early with ``finish_reason="length"``):
                ``"warn"`` (once per call), ``"raise"`` (ValueError) or ``"ignore"``.
        Returns:
            list of :class:`RequestOutput`, one per prompt, in the order of ``prompts``.
        Raises:
            ValueError / TypeError on an empty prompt, one longer than ``max_model_len``, ids
            outside the vocabulary, a string without a tokenizer, a list of sampling parameters
            of another length than the prompts, and a prompt whose KV can never fit (the sizes
            named). All prompts are checked before any runs; a failed call frees its KV and the
            LLM keeps serving.
        """
        if length_warning not in ("warn", "raise", "ignore"):
            raise ValueError(f"length_warning must be 'warn', 'raise' or 'ignore', got {length_warning!r}")
        batch, sps = self._inputs(prompts, sampling_params)
        over = [i for i, (ids, sp) in enumerate(zip(batch, sps)) if len(ids) + sp.max_tokens - 1 > self.max_model_len]
        if over and length_warning != "ignore":
            i = over[0]
            msg = (f"{len(over)} prompt(s) cannot get max_tokens new tokens within max_model_len="
                   f"{self.max_model_len} (prompt {i}: {len(batch[i])} tokens + max_tokens={sps[i].max_tokens}); "
                   f"they end early with finish_reason='length'")
            if length_warning == "raise":
                raise ValueError(msg)
            warnings.warn(msg, stacklevel=2)
        e = self.engine
        base = f"generate-{next(e._keys)}-"
        rids = []
        for i, (ids, sp) in enumerate(zip(batch, sps)):
            e._check_capacity(i, _request(e, ids, sp))
        for i, (ids, sp) in enumerate(zip(batch, sps)):
            rids.append(self._add(base + str(i), i, ids, sp))
        finals: dict = {}
        bar = tqdm(total=len(rids), desc="Generating", dynamic_ncols=True) if use_tqdm else None
        stream, e.stream_outputs = e.stream_outputs, False
        try:
            mine = set(rids)
            while len(finals) < len(rids):
                outs = e.step()
                e.keep_outputs([o for o in outs if o.request_id not in mine])  # other clients' outputs
                for o in outs:
                    if o.finished and o.request_id in mine:
                        if o.error is not None:
                            raise o.error
                        finals[o.request_id] = o
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            e.abort_request([r for r in rids if r not in finals])
            while any(e._holds(r) for r in rids if r not in finals):
                e.step()
            raise
        finally:
            e.stream_outputs = stream
            if bar is not None:
                bar.close()
        self.batch_stats = dict(e.stats)
        outs = [finals[r] for r in rids]
        for i, o in enumerate(outs):
            o.request_id = str(i)
        return outs

    def _add(self, rid: str, index: int, ids: list, sp) -> str:  # named ``index`` in messages
        e = self.engine
        if e.closed:
            raise ValueError("this LLM was closed; create a new one")
        seq = Sequence(index, _request(e, ids, sp), key=next(e._keys), request_id=rid)
        return e._submit(seq)

    def _inputs(self, prompts, sampling_params):
        """Checked prompt ids and sampling parameters; tensor parallel: rank 0 checks (and
        tokenizes) them and broadcasts them, or the error, so every rank runs or raises alike."""
        n = self.max_model_len
        if self.tp is None:
            batch = inputs.normalize_prompts(self.model, n, prompts)
            return batch, inputs.sampling_list(sampling_params, len(batch))
        msg = None
        if self.tp.is_driver:
            try:
                batch = inputs.normalize_prompts(self.model, n, prompts)
                msg = ("ok", batch, inputs.sampling_list(sampling_params, len(batch)))
            except (ValueError, TypeError) as e:
                msg = ("error", type(e).__name__, str(e))
        msg = self.tp.broadcast_object(msg)
        if msg[0] == "error":
            raise (ValueError if msg[1] == "ValueError" else TypeError)(msg[2])
        return msg[1], msg[2]

    def close(self):
        """Release what the requests share (the runtime's pool: offload's pinned pool and GPU ring, or
        resident + Quest batched's device pool); such an LLM cannot generate afterwards
        (ValueError), a resident one without a runtime keeps serving. Safe to call twice."""
        self.engine.close()


def _request(e: LLMEngine, ids: list, sp):
    from .request import Request

    c = e.config
    return Request.make(ids, sp, max_model_len=c.max_model_len, seed=c.seed, stop_ids=e.stop_ids,
                        device=e.model.device)

