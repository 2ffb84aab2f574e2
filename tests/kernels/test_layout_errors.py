"""q, k, v in PyTorch SDPA's [B, H, S, D] where flash-attn's [B, S, H, D] is expected: the shape
check names the expected layout and, when swapping dims 1 and 2 would make the shapes agree, the
tensor(s) that look transposed."""
import pytest
import torch

from xoffload.kernels.checks import FLASH_LAYOUT, check_qkv
from xoffload.kernels.decode import decode_attn_with_lse
from xoffload.kernels.flash_attn import flash_attn_with_lse

B, S, HQ, HKV, D = 2, 100, 8, 2, 16
LAYOUT = "[batch, seqlen, heads, head_dim] (flash-attn layout)"


def _bshd(s=S, h=HQ):
    return torch.randn(B, s, h, D)


def _t(x):
    return x.transpose(1, 2)


def test_layout_constant():
    assert FLASH_LAYOUT == LAYOUT


@pytest.mark.parametrize("which, hint", [
    ("v", "; v looks like [B, H, S, D]"),
    ("k", "; k looks like [B, H, S, D]"),
    ("kv", "; either q, or k and v, looks like [B, H, S, D]"),
])
def test_prefill_transposed_input_named(which, hint):
    q, k, v = _bshd(), _bshd(h=HKV), _bshd(h=HKV)
    k = _t(k) if "k" in which else k
    v = _t(v) if "v" in which else v
    with pytest.raises(ValueError) as e:
        flash_attn_with_lse(q, k, v)
    msg = str(e.value)
    assert "\n" not in msg and f"expected {LAYOUT}" in msg and hint in msg, msg
    assert "pass .transpose(1, 2)" in msg


def test_decode_transposed_inputs_named():
    q, kc, vc = _bshd(s=1), _bshd(s=64, h=HKV), _bshd(s=64, h=HKV)
    lens = torch.full((B,), 10, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"k_cache and v_cache look like \[B, H, S, D\]") as e:
        decode_attn_with_lse(q, _t(kc), _t(vc), lens)
    assert LAYOUT in str(e.value) and "either" not in str(e.value)
    with pytest.raises(ValueError, match=r"; q looks like \[B, H, S, D\]"):
        decode_attn_with_lse(_t(q), kc, vc, lens)
    with pytest.raises(ValueError, match=r"; q and k_cache and v_cache look like \[B, H, S, D\]"):
        decode_attn_with_lse(_t(q), _t(kc), _t(vc), lens)


def test_no_transpose_hint_when_swapping_does_not_help():
    """A plain GQA mismatch (6 query heads over 4 KV heads, seq 5 and 7): the layout is named, no
    tensor is blamed, since no swap of dims 1 and 2 makes the shapes agree."""
    q, k = torch.randn(1, 5, 6, D), torch.randn(1, 7, 4, D)
    with pytest.raises(ValueError, match=r"q heads \(6\) must be a multiple of k heads \(4\)") as e:
        check_qkv(q, k, k, 4)
    assert LAYOUT in str(e.value) and "looks like" not in str(e.value) and "look like" not in str(e.value)


def test_valid_shapes_pass_and_3d_errors_have_no_4d_hint():
    check_qkv(_bshd(), _bshd(h=HKV), _bshd(h=HKV), 4)
    with pytest.raises(ValueError) as e:
        check_qkv(torch.randn(10, 6, D), torch.randn(10, 4, D), torch.randn(10, 4, D), 3)
    assert "flash-attn layout" not in str(e.value)
