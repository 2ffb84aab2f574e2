"""Model configuration for the Llama / Qwen3 family, parsed from HF ``config.json``
(:func:`config_from_hf`) or GGUF metadata (:func:`config_from_gguf`), plus named shape presets used
with random weights.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

SUPPORTED_ARCHS = ("llama", "qwen3")


@dataclass
class ModelConfig:
    """Shape and numerics of one decoder-only Llama/Qwen3 model.

    ``arch`` is ``"llama"`` or ``"qwen3"`` (Qwen3 adds a per-head RMSNorm on q and k).
    ``rope_scaling`` is None or a dict with ``rope_type`` in ``("llama3", "linear", "default")``
    and that type's parameters (HF names). ``eos_token_ids`` is the set of ids that stop generation.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    name: str = ""

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"config {k} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            rt = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rt not in ("default", "llama3", "linear"):
                raise ValueError(f"unsupported rope scaling type {rt!r}; supported: default, llama3, linear")
        self.eos_token_ids = tuple(int(e) for e in self.eos_token_ids)

    @property
    def qk_norm(self) -> bool:
        """Whether q and k get a per-head RMSNorm before RoPE (Qwen3)."""
        return self.arch == "qwen3"

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h + (2 * d if self.qk_norm else 0)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    def kv_bytes_per_token(self, dtype=torch.bfloat16) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def _eos_list(x):
    if x is None:
        return ()
    if isinstance(x, (list, tuple)):
        return tuple(int(e) for e in x)
    return (int(x),)


def config_from_hf(d: dict, name: str = "") -> ModelConfig:
    """Build a :class:`ModelConfig` from a HF ``config.json`` dict (transformers 4.x or 5.x layout).

    Raises ValueError for an architecture other than Llama/Qwen3 or unsupported options
    (attention/MLP bias, sliding window, other RoPE scalings).
    """
    if not isinstance(d, dict):
        raise TypeError(f"config must be a dict, got {type(d).__name__}")
    mt = d.get("model_type")
    archs = d.get("architectures") or []
    if mt not in SUPPORTED_ARCHS:
        raise ValueError(
            f"unsupported architecture: model_type={mt!r} architectures={archs}; "
            f"xoffload supports {', '.join(SUPPORTED_ARCHS)} (LlamaForCausalLM, Qwen3ForCausalLM)"
        )
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError("unsupported config: attention_bias/mlp_bias=True (Llama/Qwen3 without biases only)")
    if d.get("use_sliding_window"):
        raise ValueError("unsupported config: use_sliding_window=True")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
    rp = d.get("rope_parameters") or {}
    rs = d.get("rope_scaling") or None
    theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
    scaling = None
    src = rs if rs else rp
    rtype = (src or {}).get("rope_type", (src or {}).get("type", "default"))
    if rtype and rtype != "default":
        scaling = {k: v for k, v in src.items() if k != "rope_theta"}
        scaling["rope_type"] = rtype
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    head_dim = d.get("head_dim") or hidden // heads
    return ModelConfig(
        arch=mt,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos_list(d.get("eos_token_id")),
        name=name,
    )


def gguf_field(reader, key, default=None):
    """Value of GGUF metadata ``key`` (a ``gguf.GGUFReader``), or ``default`` when absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:  # older gguf: parse by hand
        v = f.parts[f.data[0]]
        if f.types and f.types[0].name == "STRING":
            return bytes(v).decode("utf-8")
        return v.tolist()[0] if hasattr(v, "tolist") else v


def config_from_gguf(reader, name: str = "") -> ModelConfig:
    """ModelConfig from GGUF metadata (``general.architecture`` must be llama or qwen3)."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported architecture in GGUF: {arch!r}; xoffload supports {', '.join(SUPPORTED_ARCHS)}")

    def f(key, default=None):
        return gguf_field(reader, f"{arch}.{key}", default)

    hidden = int(f("embedding_length"))
    heads = int(f("attention.head_count"))
    kv = f("attention.head_count_kv", heads)
    if isinstance(kv, list):
        kv = max(kv)
    head_dim = f("attention.key_length") or f("rope.dimension_count") or hidden // heads
    emb = [t for t in reader.tensors if t.name == "token_embd.weight"]
    vocab = f("vocab_size")
    if vocab is None:
        vocab = int(emb[0].shape[-1]) if emb else len(gguf_field(reader, "tokenizer.ggml.tokens", []))
    tied = all(t.name != "output.weight" for t in reader.tensors)
    scaling = None
    st = f("rope.scaling.type")
    if st == "linear":
        scaling = {"rope_type": "linear", "factor": float(f("rope.scaling.factor"))}
    elif st not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope.scaling.type {st!r}")
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    eot = gguf_field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(x) for x in (eos, eot) if x is not None))
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        arch=arch, vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(f("feed_forward_length")),
        num_layers=int(f("block_count")), num_heads=heads, num_kv_heads=int(kv), head_dim=int(head_dim),
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(f("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position_embeddings=int(f("context_length", 8192)), tie_word_embeddings=tied,
        bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids, name=name,
    )


def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Inverse RoPE frequencies ``[head_dim/2]`` fp32, with Llama-3 or linear scaling applied."""
    d = cfg.head_dim
    # fp32 exactly as transformers computes it, so greedy tokens match it bit for bit where possible
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    sc = cfg.rope_scaling
    if sc:
        rt = sc.get("rope_type", sc.get("type", "default"))
        if rt == "linear":
            inv = inv / float(sc["factor"])
        elif rt == "llama3":
            factor = float(sc["factor"])
            lo = float(sc.get("low_freq_factor", 1.0))
            hi = float(sc.get("high_freq_factor", 4.0))
            old = float(sc.get("original_max_position_embeddings", 8192))
            lo_wl, hi_wl = old / lo, old / hi
            wl = 2 * math.pi / inv
            scaled = torch.where(wl > lo_wl, inv / factor, inv)
            smooth = (old / wl - lo) / (hi - lo)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wl >= hi_wl) & (wl <= lo_wl)
            inv = torch.where(medium, smoothed, scaled)
    return inv


_LLAMA3_SCALING = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelConfig] = {
    "llama-3.1-8b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_SCALING, "factor": 8.0}, max_position_embeddings=131072,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
        name="llama-3.1-8b"),
    "llama-3.2-1b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_SCALING, "factor": 32.0}, max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
        name="llama-3.2-1b"),
    "qwen3-8b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, bos_token_id=None,
        eos_token_ids=(151645, 151643), name="qwen3-8b"),
    "qwen3-0.6b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, bos_token_id=None,
        eos_token_ids=(151645, 151643), name="qwen3-0.6b"),
    # tiny shapes for tests and smoke runs
    "tiny-llama": ModelConfig(
        arch="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_ids=(), name="tiny-llama"),
    "tiny-qwen3": ModelConfig(
        arch="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=4096, tie_word_embeddings=True, eos_token_ids=(), name="tiny-qwen3"),
}


def get_preset(name: str) -> ModelConfig:
    """The preset config called ``name``; ValueError listing the known names otherwise."""
    key = str(name).lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[key])
