"""LayerRing (runtime/ring.py): a slot in use is never overwritten."""
import pytest
import torch

from xoffload.runtime import LayerRing


def test_layer_ring_refuses_overwrite_in_use():
    ring = LayerRing(2, 8, 1, 2, dtype=torch.float32, device="cpu")
    seen = []

    def fill(layer):
        def f(k, v):
            k.fill_(layer)
            v.fill_(-layer)
            seen.append(layer)
        return f

    ring.load(0, fill(0))
    ring.load(1, fill(1))
    k0, v0 = ring.acquire(0)
    assert bool((k0 == 0).all()) and bool((v0 == 0).all())
    with pytest.raises(RuntimeError, match="in use"):
        ring.load(2, fill(2))  # slot 0 still being read
    with pytest.raises(RuntimeError, match="not loaded"):
        ring.acquire(2)
    ring.release(0)
    ring.load(2, fill(2))
    k1, _ = ring.acquire(1)
    assert bool((k1 == 1).all())
    ring.release(1)
    k2, v2 = ring.acquire(2)
    assert bool((k2 == 2).all()) and bool((v2 == -2).all())
    with pytest.raises(RuntimeError):
        ring.release(1)
    assert seen == [0, 1, 2] and ring.in_use() == [2]
    with pytest.raises(ValueError):
        LayerRing(0, 8, 1, 2)
