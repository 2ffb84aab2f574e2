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


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gather_skips_negative_ids(backend):
    """skip_negative: a negative id copies nothing, its output block keeps what it held."""
    if backend == "triton" and not (interpreter_on() or torch.cuda.is_available()):
        pytest.skip("needs Triton interpreter or GPU")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    src_k, src_v = (torch.randn(5, 16, 2, 8, generator=g).half().to(dev) for _ in range(2))
    ids = torch.tensor([3, -1, 0, -1], dtype=torch.int32, device=dev)
    out_k = torch.full((4, 16, 2, 8), 7.0, dtype=torch.float16, device=dev)
    out_v = out_k.clone()
    gather_blocks(src_k, src_v, ids, out_k, out_v, backend=backend, block=64, skip_negative=True)
    for o, s in ((out_k, src_k), (out_v, src_v)):
        assert torch.equal(o[0], s[3]) and torch.equal(o[2], s[0])
        assert bool((o[1] == 7).all()) and bool((o[3] == 7).all())
