"""One rank's shard of the weights for tensor parallelism (:mod:`xoffload.models.parallel`): the
shapes every rank gets (``check_divisible``, ``local_config``), slicing a loaded model
(``shard_layer``, ``shard_model``) and loaders that never hold the whole model — random presets
(drawn in ``random_model``'s order, so shards equal the unsharded weights bit for bit), HF
safetensors directories (slices read through ``get_slice``), GGUF (one tensor dequantized at a
time) — dispatched by ``load_sharded``.
"""
from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

import torch

from .config import PRESETS, ModelConfig, get_preset
from .llama import LayerWeights, LlamaModel, Weights

if TYPE_CHECKING:
    from .parallel import TensorParallel

__all__ = ["check_divisible", "local_config", "shard_layer", "shard_model", "random_sharded", "load_hf_sharded",
           "load_gguf_sharded", "load_sharded"]


def check_divisible(cfg: ModelConfig, n: int) -> None:
    """Raise ValueError naming the count when ``cfg``'s query heads, KV heads, intermediate size or
    vocabulary is not divisible by ``n`` ranks (KV heads are not replicated)."""
    for what, v in (("num_kv_heads", cfg.num_kv_heads), ("num_heads", cfg.num_heads),
                    ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
        if v % n:
            raise ValueError(f"{what}={v} of {cfg.name or 'the model'} is not divisible by "
                             f"tensor_parallel_size={n}")


def local_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The config one rank of ``n`` runs: ``num_heads/n``, ``num_kv_heads/n``,
    ``intermediate_size/n``; ``vocab_size`` stays the full vocabulary (ids are checked against it;
    the embedding / LM head shards have ``vocab_size/n`` rows). Raises ValueError if not divisible."""
    check_divisible(cfg, n)
    return cfg.replace(num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                       intermediate_size=cfg.intermediate_size // n)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy: the shard must not keep the full tensor's storage alive."""
    return t.clone(memory_format=torch.contiguous_format)


def shard_layer(lw: LayerWeights, cfg: ModelConfig, rank: int, n: int) -> LayerWeights:
    """Rank ``rank``'s slice of one full layer's weights (``cfg``: the full config): ``wqkv`` keeps
    its q rows, KV-head k rows and v rows (``[(Hq + 2 Hkv)/n * D, hidden]``), ``wo`` its input
    columns ``[hidden, Hq/n * D]``, ``w_gate_up`` its gate and up rows ``[2 I/n, hidden]``,
    ``w_down`` its columns ``[hidden, I/n]``; norms copied. Raises ValueError if not divisible."""
    check_divisible(cfg, n)
    d, hq, hkv, i = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    qs, ks, is_ = hq // n * d, hkv // n * d, i // n
    r = rank
    q0, k0, v0 = 0, hq * d, hq * d + hkv * d
    wqkv = torch.cat([lw.wqkv[q0 + r * qs:q0 + (r + 1) * qs], lw.wqkv[k0 + r * ks:k0 + (r + 1) * ks],
                      lw.wqkv[v0 + r * ks:v0 + (r + 1) * ks]])
    gu = torch.cat([lw.w_gate_up[r * is_:(r + 1) * is_], lw.w_gate_up[i + r * is_:i + (r + 1) * is_]])
    return LayerWeights(attn_norm=_own(lw.attn_norm), wqkv=wqkv, wo=_own(lw.wo[:, r * qs:(r + 1) * qs]),
                        mlp_norm=_own(lw.mlp_norm), w_gate_up=gu, w_down=_own(lw.w_down[:, r * is_:(r + 1) * is_]),
                        q_norm=None if lw.q_norm is None else _own(lw.q_norm),
                        k_norm=None if lw.k_norm is None else _own(lw.k_norm))


def _check_shard_shapes(lcfg: ModelConfig, w: Weights, n: int, source: str) -> None:
    h, d = lcfg.hidden_size, lcfg.head_dim
    vs = lcfg.vocab_size // n
    for name, t, s in (("embed", w.embed, (vs, h)), ("lm_head", w.lm_head, (vs, h)), ("norm", w.norm, (h,))):
        if tuple(t.shape) != s:
            raise ValueError(f"{source}: {name} shard has shape {tuple(t.shape)}, expected {s}")
    for li, lw in enumerate(w.layers):
        for name, t, s in (("wqkv", lw.wqkv, ((lcfg.num_heads + 2 * lcfg.num_kv_heads) * d, h)),
                           ("wo", lw.wo, (h, lcfg.num_heads * d)),
                           ("w_gate_up", lw.w_gate_up, (2 * lcfg.intermediate_size, h)),
                           ("w_down", lw.w_down, (h, lcfg.intermediate_size))):
            if tuple(t.shape) != s:
                raise ValueError(f"{source}: layer {li} {name} shard has shape {tuple(t.shape)}, expected {s}")


def _make(cfg, layers, embed, norm, lm_head, tp, tok, source, rope_freq_factors=None) -> LlamaModel:
    lcfg = local_config(cfg, tp.world_size)
    w = Weights(embed=embed, layers=layers, norm=norm, lm_head=lm_head, rope_freq_factors=rope_freq_factors)
    _check_shard_shapes(lcfg, w, tp.world_size, source)
    return LlamaModel(lcfg, w, tok, source=f"{source} [tp {tp.rank}/{tp.world_size}]", tp=tp)


def shard_model(model: LlamaModel, tp: TensorParallel) -> LlamaModel:
    """This rank's shard of an already loaded full ``model`` (copies of the slices; the caller's
    full model is untouched and may be dropped afterwards). Raises ValueError if the model is
    already sharded or a count is not divisible by ``tp.world_size``."""
    if getattr(model, "tp", None) is not None:
        raise ValueError(f"model {model.source} is already sharded ({model.tp})")
    cfg, n, r = model.cfg, tp.world_size, tp.rank
    check_divisible(cfg, n)
    dev, dt = tp.device, model.dtype
    layers = [_to(shard_layer(lw, cfg, r, n), dev, dt) for lw in model.w.layers]
    lo, hi = tp.vocab_range(cfg.vocab_size)
    embed = _own(model.w.embed[lo:hi]).to(dev)
    tied = model.w.lm_head.data_ptr() == model.w.embed.data_ptr()
    lm_head = embed if tied else _own(model.w.lm_head[lo:hi]).to(dev)
    rf = model.w.rope_freq_factors
    return _make(cfg, layers, embed, _own(model.w.norm).to(dev), lm_head, tp, model.tokenizer, model.source,
                 rope_freq_factors=rf)


def _to(lw: LayerWeights, device, dtype) -> LayerWeights:
    def m(t):
        return None if t is None else t.to(device=device, dtype=dtype)

    return LayerWeights(*(m(getattr(lw, f)) for f in ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down",
                                                       "q_norm", "k_norm")))


# ---------------------------------------------------------------------------- loaders
def random_sharded(preset, tp: TensorParallel, *, dtype=None, seed: int = 0, std: float = 0.02) -> LlamaModel:
    """This rank's shard of :func:`~xoffload.models.loader.random_model` ``(preset, seed, std)``:
    each full tensor is drawn on the rank's device from the same generator, in the same order, and
    only the slice is kept before the next is drawn, so the shards equal slices of the unsharded
    model bit for bit and a rank's peak is its shard plus the largest single tensor (the
    embedding). Raises ValueError (unknown preset, not divisible)."""
    from .loader import random_draws, random_layer, resolve_dtype_device

    cfg = preset if isinstance(preset, ModelConfig) else get_preset(preset)
    n, r = tp.world_size, tp.rank
    check_divisible(cfg, n)
    dtype, device = resolve_dtype_device(dtype, tp.device)
    rnd, ones = random_draws(dtype, device, seed, std)
    h = cfg.hidden_size
    layers = []
    for _ in range(cfg.num_layers):  # random_model's draws, each layer sliced before the next is drawn
        full = random_layer(cfg, rnd, ones)
        layers.append(shard_layer(full, cfg, r, n))
        del full
    lo, hi = tp.vocab_range(cfg.vocab_size)
    embed = _own(rnd(cfg.vocab_size, h)[lo:hi])
    lm_head = embed if cfg.tie_word_embeddings else _own(rnd(cfg.vocab_size, h)[lo:hi])
    return _make(cfg, layers, embed, ones(h), lm_head, tp, None, f"random:{cfg.name or 'config'}")


def _fuse_sharded(cfg: ModelConfig, take, rank: int, n: int, dtype, device) -> list:
    """Layers of one rank from ``take(layer, hf_name, dim, lo, hi)``: the rows (``dim=0``) or columns
    (``dim=1``) ``[lo, hi)`` of one tensor (``dim=None``: all of it), read one tensor at a time."""
    d = cfg.head_dim
    qs, ks, is_ = cfg.num_heads // n * d, cfg.num_kv_heads // n * d, cfg.intermediate_size // n
    r = rank
    layers = []
    for li in range(cfg.num_layers):
        def g(name, dim=None, size=0):
            t = take(li, name, dim, r * size, (r + 1) * size)
            return t.to(device=device, dtype=dtype)

        layers.append(LayerWeights(
            attn_norm=g("input_layernorm"),
            wqkv=torch.cat([g("q_proj", 0, qs), g("k_proj", 0, ks), g("v_proj", 0, ks)]),
            wo=g("o_proj", 1, qs), mlp_norm=g("post_attention_layernorm"),
            w_gate_up=torch.cat([g("gate_proj", 0, is_), g("up_proj", 0, is_)]), w_down=g("down_proj", 1, is_),
            q_norm=g("q_norm") if cfg.qk_norm else None, k_norm=g("k_norm") if cfg.qk_norm else None))
    return layers


def _piece(t, dim, lo, hi):
    if dim is None:
        return t[:]
    return t[lo:hi] if dim == 0 else t[:, lo:hi]


def load_hf_sharded(path, tp: TensorParallel, *, dtype=None, load_tokenizer: bool = True) -> LlamaModel:
    """This rank's shard of a HF directory (config.json + safetensors): each tensor's rows / columns
    are read with safetensors' ``get_slice`` (the rest of the tensor is never read). Raises as
    :func:`~xoffload.models.loader.load_hf_dir`, and ValueError if not divisible."""
    from safetensors import safe_open

    from .loader import _HF_LAYER_NAMES, _hf_tokenizer, read_hf_config, resolve_dtype_device

    dtype, device = resolve_dtype_device(dtype, tp.device)
    p, cfg, files = read_hf_config(path)
    n, r = tp.world_size, tp.rank
    check_divisible(cfg, n)
    index = {}
    for fpath in files:
        h = safe_open(str(fpath), framework="pt", device="cpu")
        for k in h.keys():
            index[k] = h

    def part(name, dim=None, lo=0, hi=0):
        h = index.get(name)
        if h is None:
            raise ValueError(f"{p}: tensor {name!r} missing from the safetensors files")
        return _piece(h.get_slice(name), dim, lo, hi)

    layers = _fuse_sharded(cfg, lambda li, nm, dim, lo, hi: part(f"model.layers.{li}.{_HF_LAYER_NAMES[nm]}", dim, lo, hi),
                           r, n, dtype, device)
    lo, hi = tp.vocab_range(cfg.vocab_size)
    embed = part("model.embed_tokens.weight", 0, lo, hi).to(device=device, dtype=dtype)
    if "lm_head.weight" in index and not cfg.tie_word_embeddings:
        lm_head = part("lm_head.weight", 0, lo, hi).to(device=device, dtype=dtype)
    else:
        lm_head = embed
    norm = part("model.norm.weight").to(device=device, dtype=dtype)
    tok = _hf_tokenizer(p) if load_tokenizer else None
    return _make(cfg, layers, embed, norm, lm_head, tp, tok, str(p))


def load_gguf_sharded(path, tp: TensorParallel, *, dtype=None, load_tokenizer: bool = True) -> LlamaModel:
    """This rank's shard of a Llama/Qwen3 GGUF: one tensor at a time is dequantized (on the CPU;
    quantized blocks run along rows, so a whole tensor is the unit), llama.cpp's q/k permutation
    undone, and only this rank's slice kept. Raises as :func:`~xoffload.models.loader.load_gguf`,
    and ValueError if not divisible."""
    from gguf.quants import dequantize

    from .config import config_from_gguf
    from .loader import _GGUF_LAYER_NAMES, _open_gguf, load_gguf_tokenizer, resolve_dtype_device, unpermute_qk

    dtype, device = resolve_dtype_device(dtype, tp.device)
    path = str(path)
    reader = _open_gguf(path)
    cfg = config_from_gguf(reader, name=os.path.basename(path))
    n, r = tp.world_size, tp.rank
    check_divisible(cfg, n)
    tensors = {t.name: t for t in reader.tensors}

    def full(name):
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{path}: tensor {name!r} missing")
        try:
            a = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"{path}: tensor {name!r} has unsupported type {t.tensor_type.name}") from e
        return torch.from_numpy(a.copy()).float()

    permute = cfg.arch == "llama"

    def take(li, nm, dim, lo, hi):
        w = full(f"blk.{li}.{_GGUF_LAYER_NAMES[nm]}.weight")
        if permute and nm == "q_proj":
            w = unpermute_qk(w, cfg.num_heads)
        elif permute and nm == "k_proj":
            w = unpermute_qk(w, cfg.num_kv_heads)
        return _own(_piece(w, dim, lo, hi))

    layers = _fuse_sharded(cfg, take, r, n, dtype, device)
    lo, hi = tp.vocab_range(cfg.vocab_size)
    embed = _own(full("token_embd.weight")[lo:hi]).to(device=device, dtype=dtype)
    lm_head = embed if cfg.tie_word_embeddings else _own(full("output.weight")[lo:hi]).to(device=device, dtype=dtype)
    rf = full("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
    norm = full("output_norm.weight").to(device=device, dtype=dtype)
    tok = None
    if load_tokenizer and "tokenizer.ggml.tokens" in reader.fields:
        try:
            tok = load_gguf_tokenizer(path)
        except Exception as e:
            warnings.warn(f"{path}: no tokenizer ({type(e).__name__}: {e}); pass token ids", stacklevel=2)
    return _make(cfg, layers, embed, norm, lm_head, tp, tok, path, rope_freq_factors=rf)


def load_sharded(model, tp: TensorParallel, *, dtype=None, seed: int = 0, load_tokenizer: bool = True) -> LlamaModel:
    """This rank's shard of what :func:`~xoffload.models.loader.load_model` accepts: a preset name
    or ModelConfig (random weights, :func:`random_sharded`), a ``.gguf`` path / ``"smollm2"``
    (:func:`load_gguf_sharded`), a HF directory (:func:`load_hf_sharded`), a loaded full
    :class:`LlamaModel` (:func:`shard_model`), or an already sharded one of this group (returned as
    is). Raises ValueError / TypeError / FileNotFoundError as load_model, and ValueError for a
    count not divisible by ``tp.world_size`` or a model sharded for another group size."""
    from .loader import find_smollm2_gguf

    if isinstance(model, LlamaModel):
        if model.tp is not None:
            if model.tp.world_size != tp.world_size or model.tp.rank != tp.rank:
                raise ValueError(f"model is sharded for {model.tp}, this rank is {tp}")
            return model
        return shard_model(model, tp)
    if isinstance(model, ModelConfig):
        return random_sharded(model, tp, dtype=dtype, seed=seed)
    if model is None or (isinstance(model, str) and model.lower() in ("smollm2", "default", "smollm2-135m-instruct")):
        return load_gguf_sharded(find_smollm2_gguf(), tp, dtype=dtype, load_tokenizer=load_tokenizer)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path, preset name, ModelConfig or LlamaModel, got {type(model).__name__}")
    s = str(model)
    if s.lower() in PRESETS:
        return random_sharded(s, tp, dtype=dtype, seed=seed)
    if os.path.isdir(s):
        return load_hf_sharded(s, tp, dtype=dtype, load_tokenizer=load_tokenizer)
    if os.path.isfile(s):
        return load_gguf_sharded(s, tp, dtype=dtype, load_tokenizer=load_tokenizer)
    raise ValueError(f"unknown model {s!r}: not an existing path, and not a preset ({', '.join(PRESETS)}) nor 'smollm2'")
