"""transformers' own model as a peer of the eval: the mode label ``hf``.

``xoffload eval --modes resident,hf,...`` runs every prompt also through transformers'
``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` (``attn_implementation="sdpa"``, greedy ``generate``
on the same prompt token ids, the same answer budget, stopping at the same EOS ids as our
:class:`~xoffload.engine.llm.LLM`), so the report says how often our answers are transformers'
answers, token for token.

Two ways to get transformers' model (``weights``):

* ``"ours"`` (default): a transformers model built from our :class:`~xoffload.models.config.ModelConfig`
  whose parameters *are* our already-loaded weight tensors (views of our fused q/k/v and gate/up
  matrices: no copy, no extra memory, no extra package such as ``gguf``). The weights are then
  identical by construction; what is compared is the computation.
* ``"source"``: transformers loads the model's source itself (``from_pretrained`` of a HF
  directory, or of a GGUF through transformers' GGUF loader, which needs the ``gguf`` package):
  transformers' dequantization and q/k un-permutation against ours.

Nothing in the engine or runtime imports this module; :mod:`xoffload.evals.cli` does, only when a
``hf`` mode is asked for.
"""
from __future__ import annotations

import os

HF_MODE = "hf"
HF_WEIGHTS = ("ours", "source")

__all__ = ["HF_MODE", "HF_WEIGHTS", "HFPeerLLM", "check_source", "first_diff", "hf_config", "hf_from_ours", "hf_from_source",
           "hf_peer_llm", "stop_token_ids"]


def first_diff(a, b):
    """First position where the token lists ``a`` and ``b`` differ (the shorter one's length when
    one is a prefix of the other), or None when they are equal."""
    a, b = list(a), list(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def stop_token_ids(model) -> tuple:
    """The ids that end a generation of ``model`` (a :class:`~xoffload.models.llama.LlamaModel`), by
    the rule :class:`~xoffload.engine.llm.LLM` uses: the config's ``eos_token_ids`` plus the
    tokenizer's ``eos_token_id``. Sorted tuple."""
    ids = set(int(x) for x in model.cfg.eos_token_ids)
    tok = model.tokenizer
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    return tuple(sorted(ids))


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def hf_config(cfg):
    """A transformers ``LlamaConfig`` / ``Qwen3Config`` of the same shape and numerics as our
    :class:`~xoffload.models.config.ModelConfig` ``cfg`` (RoPE theta and scaling, norm eps, tied
    embeddings, EOS ids)."""
    from transformers import LlamaConfig, Qwen3Config

    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
              max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
              bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids) or None,
              pad_token_id=(cfg.eos_token_ids[0] if cfg.eos_token_ids else 0))
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    if _transformers_major() >= 5:
        rp = {"rope_type": "default", **(scaling or {}), "rope_theta": float(cfg.rope_theta)}
        kw["rope_parameters"] = rp
    else:  # transformers 4.x: the legacy names
        kw.update(rope_theta=float(cfg.rope_theta), rope_scaling=scaling)
    cls = Qwen3Config if cfg.arch == "qwen3" else LlamaConfig
    return cls(**kw)


def _clean_generation_config(hf, stop_ids):
    """Greedy, no penalties, our EOS ids: whatever a checkpoint's generation_config.json says
    (temperature, top_p, repetition_penalty) does not reach the peer."""
    from transformers import GenerationConfig

    hf.generation_config = GenerationConfig(bos_token_id=hf.config.bos_token_id, eos_token_id=list(stop_ids) or None,
                                            pad_token_id=(stop_ids[0] if stop_ids else 0), do_sample=False)


def hf_from_ours(model, attn: str = "sdpa"):
    """transformers' ``LlamaForCausalLM`` (``Qwen3ForCausalLM`` for Qwen3) whose parameters are
    ``model``'s own weight tensors (views: no copy), on ``model``'s device and in its dtype, in eval
    mode with gradients off. ``attn``: transformers' ``attn_implementation``.

    Raises ValueError when the result still holds a tensor our weights did not fill.
    """
    import torch
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    c = model.cfg
    hc = hf_config(c)
    hc._attn_implementation = attn
    cls = Qwen3ForCausalLM if c.arch == "qwen3" else LlamaForCausalLM
    with torch.device("meta"):
        hf = cls(hc)
    w = model.w
    hq, hkv, i = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    sd = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.norm, "lm_head.weight": w.lm_head}
    for li, lw in enumerate(w.layers):
        p = f"model.layers.{li}."
        sd[p + "input_layernorm.weight"] = lw.attn_norm
        sd[p + "post_attention_layernorm.weight"] = lw.mlp_norm
        sd[p + "self_attn.q_proj.weight"] = lw.wqkv[:hq]
        sd[p + "self_attn.k_proj.weight"] = lw.wqkv[hq:hq + hkv]
        sd[p + "self_attn.v_proj.weight"] = lw.wqkv[hq + hkv:]
        sd[p + "self_attn.o_proj.weight"] = lw.wo
        sd[p + "mlp.gate_proj.weight"] = lw.w_gate_up[:i]
        sd[p + "mlp.up_proj.weight"] = lw.w_gate_up[i:]
        sd[p + "mlp.down_proj.weight"] = lw.w_down
        if c.qk_norm:
            sd[p + "self_attn.q_norm.weight"] = lw.q_norm
            sd[p + "self_attn.k_norm.weight"] = lw.k_norm
    hf.load_state_dict(sd, assign=True, strict=False)
    if c.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    # RoPE's inv_freq is a non-persistent buffer created on meta: rebuild the rotary module there
    rot_cls = type(hf.model.rotary_emb)
    try:
        rot = rot_cls(config=hc, device=model.device)
    except TypeError:  # the signature differs between transformers releases
        rot = rot_cls(config=hc).to(model.device)
    if w.rope_freq_factors is not None:  # a GGUF's rope_freqs: divide inv_freq as our model does
        f = w.rope_freq_factors.to(device=model.device, dtype=torch.float32)
        rot.inv_freq = rot.inv_freq / f
        if hasattr(rot, "original_inv_freq"):
            rot.original_inv_freq = rot.inv_freq.clone()
    hf.model.rotary_emb = rot
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"transformers model still has tensors our weights did not fill: {left[:5]}")
    hf.requires_grad_(False)
    _clean_generation_config(hf, stop_token_ids(model))
    return hf.eval()


def check_source(source) -> str:
    """``source`` as a string when transformers can load it itself (a HF model directory, or a
    ``.gguf`` file with the ``gguf`` package installed). Raises ValueError (e.g. a random-weight
    preset: use ``weights="ours"``) or ImportError naming the missing package."""
    import importlib.util

    s = str(source)
    if os.path.isdir(s):
        return s
    if os.path.isfile(s) and s.lower().endswith(".gguf"):
        if importlib.util.find_spec("gguf") is None:
            raise ImportError("the hf peer with weights 'source' on a GGUF needs the gguf package "
                              "(pip install gguf); weights 'ours' needs none")
        return s
    raise ValueError(f"the hf peer with weights 'source' needs a HF model directory or a .gguf file, got {s!r}; "
                     f"use weights 'ours'")


def hf_from_source(source, *, dtype, device, attn: str = "sdpa", stop_ids=()):
    """transformers' own loading of ``source``: a HF model directory (``from_pretrained``) or a
    ``.gguf`` file (transformers' GGUF loader; needs the ``gguf`` package, and without ``accelerate``
    the same loader function is called directly). In ``dtype`` on ``device``, eval mode.

    Raises what :func:`check_source` raises.
    """
    import importlib.util

    from transformers import AutoModelForCausalLM

    s = check_source(source)
    if os.path.isdir(s):
        hf = AutoModelForCausalLM.from_pretrained(s, dtype=dtype, attn_implementation=attn)
    else:
        d, f = os.path.dirname(os.path.abspath(s)), os.path.basename(s)
        if importlib.util.find_spec("accelerate") is not None:
            hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype, attn_implementation=attn)
        else:
            from transformers import AutoConfig
            from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

            cfg = AutoConfig.from_pretrained(d, gguf_file=f)
            hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
            sd = load_gguf_checkpoint(s, return_tensors=True, model_to_load=hf)["tensors"]
            _, unexpected = hf.load_state_dict(sd, strict=False)
            if unexpected:
                raise ValueError(f"{s}: transformers' GGUF loader gave unexpected tensors {unexpected[:5]}")
            hf.tie_weights()
    hf = hf.to(device=device, dtype=dtype)
    hf.requires_grad_(False)
    _clean_generation_config(hf, tuple(stop_ids))
    return hf.eval()


class _Steps:
    """A logits processor that leaves the scores alone and records, per generation step, a time
    mark (:class:`~xoffload.engine.request.Clock`) and the gap between the two largest logits
    (kept on the device until the end). The clock is made here, not inherited, so that importing
    this module (``xoffload eval --help``) needs no torch."""

    def __init__(self, device):
        from ..engine.request import Clock

        self._clock = Clock(device)
        self.mark, self.ms = self._clock.mark, self._clock.ms
        self.marks, self.gaps = [], []

    def __call__(self, input_ids, scores):
        top = scores[0].float().topk(2).values
        self.gaps.append(top[0] - top[1])
        self.marks.append(self.mark())
        return scores


class HFPeerLLM:
    """The ``generate`` interface of :class:`~xoffload.engine.llm.LLM`, served by a transformers model.

    Args:
        hf: a transformers causal LM (from :func:`hf_from_ours` or :func:`hf_from_source`).
        tokenizer: decodes the answers (``skip_special_tokens=True``, as the LLM does).
        stop_ids: ids that end a generation (:func:`stop_token_ids` of our model).
        max_model_len: the answer is capped so that prompt + answer <= ``max_model_len + 1``, as the LLM does.
        info: what to record about the peer (weights, attention, transformers version).

    Each result's ``timings`` hold ``ttft_ms``, ``decode_ms_per_token``, ``decode_steps``, ``total_ms``
    and ``top2_gap`` (per generated token: largest minus second-largest logit, transformers' own, so
    a reader sees where its greedy choice was a near tie).
    """

    def __init__(self, hf, tokenizer, stop_ids, *, max_model_len: int | None = None, info: dict | None = None):
        self.model = hf
        self.tokenizer = tokenizer
        self.stop_ids = tuple(int(x) for x in stop_ids)
        self.max_model_len = max_model_len
        self.info = dict(info or {})

    def generate(self, prompts, sampling_params=None) -> list:
        """Greedy generation for one prompt (a list of token ids) or a list of them. Returns a list
        of :class:`~xoffload.engine.request.RequestOutput`. Raises ValueError for a sampling
        temperature other than 0 (the peer is greedy only) or an empty prompt."""
        import torch
        from transformers import LogitsProcessorList

        from xoffload.engine.request import RequestOutput
        from xoffload.engine.sampling import SamplingParams

        sp = sampling_params or SamplingParams()
        if float(sp.temperature) != 0.0:
            raise ValueError("the hf peer generates greedily only (temperature 0)")
        if prompts and all(isinstance(x, int) for x in prompts):
            prompts = [prompts]
        dev = self.model.device
        stop = set() if sp.ignore_eos else set(self.stop_ids)
        stop.update(int(x) for x in sp.stop_token_ids)
        outs = []
        for ids in prompts:
            ids = [int(x) for x in ids]
            if not ids:
                raise ValueError("prompt is empty (0 tokens)")
            max_new = int(sp.max_tokens)
            if self.max_model_len is not None:
                max_new = max(1, min(max_new, self.max_model_len - len(ids) + 1))
            steps = _Steps(dev)
            x = torch.tensor([ids], dtype=torch.long, device=dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            t0 = steps.mark()
            kw = {"min_new_tokens": max_new} if not stop else {"eos_token_id": sorted(stop)}
            with torch.no_grad():
                y = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                        do_sample=False, num_beams=1,
                                        pad_token_id=(self.stop_ids[0] if self.stop_ids else 0),
                                        logits_processor=LogitsProcessorList([steps]), **kw)
            t1 = steps.mark()
            if dev.type == "cuda":
                t1.synchronize()  # the timings below read events up to this one
            gen = [int(t) for t in y[0, len(ids):].tolist()]
            cut = next((k for k, t in enumerate(gen) if t in stop), None)
            if cut is not None:
                gen = gen[:cut + 1]
            reason = "stop" if cut is not None else "length"
            n = len(steps.marks)
            timings = {"prompt_tokens": len(ids), "decode_steps": max(0, n - 1),
                       "ttft_ms": steps.ms(t0, steps.marks[0]) if n else None,
                       "decode_ms_per_token": steps.ms(steps.marks[0], steps.marks[-1]) / (n - 1) if n > 1 else None,
                       "total_ms": steps.ms(t0, t1),
                       "top2_gap": [round(float(g), 5) for g in torch.stack(steps.gaps).tolist()] if n else []}
            peak = int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None
            text = self.tokenizer.decode(gen, skip_special_tokens=True) if self.tokenizer is not None else None
            outs.append(RequestOutput(prompt_token_ids=ids, token_ids=gen, text=text, finish_reason=reason,
                                      timings=timings, peak_gpu_memory_bytes=peak))
        return outs

    def close(self):
        """Drop the transformers model (its tensors are ours with ``weights="ours"``: nothing is freed
        that our model still uses)."""
        self.model = None


def hf_peer_llm(model, *, weights: str = "ours", attn: str = "sdpa", max_model_len: int | None = None) -> HFPeerLLM:
    """The ``hf`` mode's LLM for our loaded ``model`` (a :class:`~xoffload.models.llama.LlamaModel`):
    transformers' model from our tensors (``weights="ours"``) or from ``model.source``
    (``weights="source"``), in ``model``'s dtype and device, with ``model``'s tokenizer and stop ids.
    Raises ValueError for an unknown ``weights``."""
    import transformers

    if weights not in HF_WEIGHTS:
        raise ValueError(f"unknown hf weights {weights!r}; use one of {', '.join(HF_WEIGHTS)}")
    stop = stop_token_ids(model)
    if weights == "ours":
        hf = hf_from_ours(model, attn=attn)
    else:
        hf = hf_from_source(model.source, dtype=model.dtype, device=model.device, attn=attn, stop_ids=stop)
    info = {"hf_weights": weights if weights == "ours" else f"source:{os.path.basename(str(model.source))}",
            "hf_class": type(hf).__name__, "hf_attn_implementation": attn, "transformers": transformers.__version__,
            "hf_stop_token_ids": list(stop)}
    return HFPeerLLM(hf, model.tokenizer, stop, max_model_len=max_model_len, info=info)
