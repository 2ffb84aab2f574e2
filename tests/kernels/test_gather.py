"""gather_blocks (kernels/gather.py): the Triton kernel equals index_select; the torch fallback."""
import pytest
import torch

from xoffload.kernels.checks import interpreter_on
from xoffload.kernels.gather import gather_blocks


@pytest.mark.skipif(not (interpreter_on() or torch.cuda.is_available()), reason="needs Triton interpreter or GPU")
@pytest.mark.parametrize("shape,dtype", [((6, 16, 2, 8), torch.float16), ((5, 3, 1, 5), torch.float32)])
def test_gather_kernel_matches_index_select(shape, dtype):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    src_k = torch.randn(shape, generator=g).to(dtype)
    src_v = torch.randn(shape, generator=g).to(dtype)
    ids = torch.tensor([4, 0, 4, 2], dtype=torch.int32, device=dev)
    out_k = torch.empty((4,) + shape[1:], dtype=dtype, device=dev)
    out_v = torch.empty_like(out_k)
    sk, sv = (src_k.to(dev), src_v.to(dev))
    gather_blocks(sk, sv, ids, out_k, out_v, backend="triton", block=64)
    idx = ids.long().cpu()
    assert torch.equal(out_k.cpu(), src_k[idx]) and torch.equal(out_v.cpu(), src_v[idx])
    gather_blocks(src_k, src_v, idx, out_k.cpu(), out_v.cpu(), backend="torch")
    with pytest.raises(ValueError):
        gather_blocks(sk, sv, ids, out_k[:3], out_v[:3])
