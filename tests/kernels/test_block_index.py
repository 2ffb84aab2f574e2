"""block_mask_to_indices (kernels/block_index.py): the index lists' order and counts, and the
Triton builder equal to the PyTorch one."""
import pytest
import torch

from helpers import rand_block_mask
from xoffload.kernels import block_index
from xoffload.kernels.block_index import block_mask_to_indices


def test_index_lists_order_full_first():
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    bi = block_mask_to_indices(mask, 32, 32, block_size=16, causal=True)
    # query block 0 sees only block 0 (diagonal, partial); block 1 sees 0 fully and 1 partially
    assert bi.n_total.tolist() == [[[1, 2]]] and bi.n_full.tolist() == [[[0, 1]]]
    assert bi.indices[0, 0, 1].tolist() == [0, 1]


@pytest.mark.parametrize(
    "bm,hm,sq,sk,bs,causal,density",
    [
        (1, 3, 100, 100, 16, True, 0.5),
        (2, 2, 37, 150, 32, True, 0.4),     # Sq < Sk (chunk at an offset), ragged
        (1, 2, 70, 40, 16, True, 0.7),      # Sq > Sk: leading blocks see nothing
        (1, 2, 64, 90, 16, False, 0.6),     # non-causal, ragged key tail
        (2, 1, 1, 70, 16, True, 1.0),       # one query row
        (1, 1, 48, 48, 16, True, 0.0),      # empty mask
        (1, 1, 16, 16 * 2100, 16, False, 0.3),  # nkb > 2048: two chunks per row
    ],
)
def test_index_builder_triton_equals_torch(bm, hm, sq, sk, bs, causal, density):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    mask = rand_block_mask(bm, hm, sq, sk, bs, density, seed=sq + sk, device=dev)
    want = block_index.mask_to_indices_torch(mask, sq, sk, bs, causal)
    got = block_index.mask_to_indices_triton(mask, sq, sk, bs, causal)
    for g, w in zip(got, want):
        assert g.dtype == torch.int32 and g.shape == w.shape and torch.equal(g.cpu(), w.cpu())
    # a strided (non-contiguous) mask view gives the same lists
    big = torch.zeros(bm, hm, mask.shape[2], 2 * mask.shape[3], dtype=torch.bool, device=dev)
    big[..., ::2] = mask
    for g, w in zip(block_index.mask_to_indices_triton(big[..., ::2], sq, sk, bs, causal), want):
        assert torch.equal(g.cpu(), w.cpu())
