"""tools/diag_softcap_ws.py without a GPU: its minimal TMA forward kernel computes attention
(under the interpreter, fp16, against the fp32 reference with the dtype's tolerance), and Triton
splits its loop into producer / consumer warp groups for sm_90 only with 4 warps (compiled here)."""
import os
import subprocess
import sys

import pytest
import torch

from helpers import assert_lse_match, attention_in_dtype, max_err, out_tol

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools")
sys.path.insert(0, TOOLS)


@pytest.mark.parametrize("causal,softcap", [(False, 0.0), (True, 0.0), (True, 5.0), (False, 5.0)])
def test_minimal_kernel_matches_reference(causal, softcap):
    if torch.cuda.is_available():
        pytest.skip("the interpreter run; the GPU run is the script itself")
    from diag_softcap_ws import ws_attn

    from xoffload.kernels.reference import attention_ref

    g = torch.Generator().manual_seed(0)
    s, hq, hkv, d = 64, 4, 2, 32
    q, k, v = (torch.randn(s, h, d, generator=g).half() for h in (hq, hkv, hkv))
    for ws in (False, True):  # the interpreter ignores warp_specialize: both must compute the same
        out, lse = ws_attn(q, k, v, causal, softcap, (32, 16, 4, 1), ws)
        ref_o, ref_l = attention_ref(q[None], k[None], v[None], causal=causal, softcap=softcap)
        allowed = torch.ones(s, s, dtype=torch.bool).tril() if causal else None
        base = attention_in_dtype(q, k, v, allowed, d ** -0.5, softcap)
        assert max_err(out[None], ref_o) <= out_tol(ref_o, base[None], q.dtype)
        assert_lse_match(lse[None], ref_l)


def test_warp_specialization_splits_only_four_warps():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys; sys.path.insert(0, %r); from diag_softcap_ws import sass; "
            "print(sass(64, (128, 64, 4, 2), True, False)['num_warps_compiled'], "
            "sass(64, (128, 64, 8, 2), True, False)['num_warps_compiled'], "
            "sass(64, (128, 64, 4, 2), False, True)['SETMAXNREG'])" % TOOLS)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0 and "ptxas" in p.stderr.lower() and "not found" in p.stderr.lower():
        pytest.skip("no ptxas in this Triton install")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[-3:] == ["12", "8", "0"]
