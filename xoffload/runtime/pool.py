"""KV pools: K and V of every layer, layer-major, in (optionally pinned) host memory
(:class:`CpuKVPool`) or in device memory (:class:`DeviceKVPool`).

Layout (both): ``pool.k[layer]`` and ``pool.v[layer]`` are contiguous ``[num_blocks, block_size,
num_kv_heads, head_dim]`` tensors, so one layer's blocks are large contiguous pieces; ``k_rows`` /
``v_rows`` view them as token rows, ``close`` drops the memory, ``placement`` says where it is
(``"host"`` / ``"device"``) and ``label`` names it in messages.

FP8 pools (``dtype=torch.float8_e4m3fn``, ``scale_page=P``): the blocks hold e4m3 codes and each
layer has fp32 scales beside them, ``k_scale[layer]`` / ``v_scale[layer]`` ``[num_blocks,
block_size // P, Hkv]`` (one per ``P`` consecutive tokens of a block and KV head; ``P = 1``: one
per token), indexed by block like the codes, so whatever moves or shares a block (copy-on-write,
the prefix cache, staging) finds its scales at the same block id; ``k_scale_rows`` /
``v_scale_rows`` view them as ``[num_blocks * block_size // P, Hkv]``, the scales of a row store
of pages of ``P`` rows (:func:`xoffload.kernels.fp8.quantize_kv_fp8`'s layout). In a pinned pool
the scales share the codes' registered slabs (the GPU reads both over UVA). 16-bit pools have
``k_scale = v_scale = None``.

Pinning (DESIGN.md, Runtime): plain host memory is allocated in slabs (``torch.empty`` on the CPU,
page-aligned inside the allocation) and each slab is registered with
``torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)``; the exact size is pinned, where
``pin_memory=True`` rounds up to a power of two (5 GiB cost 8 GiB). Slabs are unregistered by
:meth:`CpuKVPool.close` (also on garbage collection).

Registering fresh memory costs ~0.37 s/GiB on an H200 host (pages faulted in, zeroed and pinned:
a 16 GiB pool takes ~6 s). Inside :func:`reuse_pinned_slabs` a closed pool's registered slabs
are kept and handed to the next pool asking for slabs of the same size (a benchmark building one
LLM after another with the same ``max_model_len``); they are unregistered when the context ends
(slabs still in a pool then: when that pool closes).
"""
from __future__ import annotations

import contextlib
import os

import torch

from ..kernels.checks import check_int

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
DEFAULT_SLAB_BYTES = 1 << 30


class PoolAllocationError(MemoryError):
    """Host memory for the pool could not be allocated or pinned (a MemoryError subclass)."""


def _err_code(ret) -> int:
    try:
        return int(ret)
    except (TypeError, ValueError):
        return int(getattr(ret, "value", 1))


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class PinnedSlabCache:
    """Registered slabs of closed pools, by size, for the next pool (:func:`reuse_pinned_slabs`).

    Attributes:
        hits, misses: slabs handed out again / registered fresh while the cache was active.
    """

    def __init__(self):
        self._free: dict[int, list] = {}  # span -> [(base, raw)], raw: the registered span
        self.closed = False
        self.hits = 0
        self.misses = 0

    @property
    def free_bytes(self) -> int:
        """Bytes registered and waiting in the cache."""
        return sum(span * len(v) for span, v in self._free.items())

    def take(self, span: int):
        """A cached ``(base, raw)`` slab of exactly ``span`` bytes, or None."""
        lst = self._free.get(span)
        if not lst:
            return None
        self.hits += 1
        return lst.pop()

    def give(self, span: int, base, raw) -> None:
        """A pool's slab back: kept, or unregistered when the cache is closed."""
        if self.closed:
            _unregister(raw.data_ptr())
        else:
            self._free.setdefault(span, []).append((base, raw))

    def close(self) -> None:
        """Unregister every cached slab; slabs still in pools are unregistered when they close."""
        self.closed = True
        free, self._free = self._free, {}
        for lst in free.values():
            for _base, raw in lst:
                _unregister(raw.data_ptr())


_ACTIVE_CACHE: PinnedSlabCache | None = None


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


@contextlib.contextmanager
def reuse_pinned_slabs():
    """Within the context, pinned pools reuse the registered slabs of pools closed before them
    (same slab size), instead of registering fresh memory; yields the :class:`PinnedSlabCache`.
    Host memory stays registered until the context ends (at most the largest set of pools open at
    once, per slab size). Unpinned pools are unaffected."""
    global _ACTIVE_CACHE
    prev, cache = _ACTIVE_CACHE, PinnedSlabCache()
    _ACTIVE_CACHE = cache
    try:
        yield cache
    finally:
        _ACTIVE_CACHE = prev
        cache.close()


FP8 = torch.float8_e4m3fn


def _check_scale_page(dtype, scale_page, block_size) -> int:
    """Tokens per scale of an fp8 pool (``scale_page``, dividing ``block_size``); 0 for a 16-bit pool
    (``scale_page`` must then be None). Raises ValueError naming the value."""
    if dtype != FP8:
        if scale_page is not None:
            raise ValueError(f"scale_page={scale_page!r} is given but the pool stores {dtype}: scales belong to "
                             f"float8_e4m3fn pools only")
        return 0
    check_int("scale_page", scale_page, 1, type_error=ValueError)
    if block_size % scale_page:
        raise ValueError(f"scale_page={scale_page} must divide block_size={block_size} (a block holds whole scale pages)")
    return int(scale_page)


def _check_shape(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype) -> int:
    """Validate a pool's shape and dtype; returns the element size in bytes."""
    for name, val, lo in (("num_layers", num_layers, 1), ("num_blocks", num_blocks, 0),
                          ("block_size", block_size, 1), ("num_kv_heads", num_kv_heads, 1),
                          ("head_dim", head_dim, 1)):
        check_int(name, val, lo, type_error=ValueError)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype (KV values), got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


class _PoolViews:
    """The row views both pools share (``k``, ``v``, ``num_kv_heads``, ``head_dim`` set by them)."""

    def k_rows(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K as flat token rows ``[num_blocks * block_size, Hkv, D]`` (a view)."""
        return self.k[layer].view(-1, self.num_kv_heads, self.head_dim)

    def v_rows(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V as flat token rows ``[num_blocks * block_size, Hkv, D]`` (a view)."""
        return self.v[layer].view(-1, self.num_kv_heads, self.head_dim)

    @property
    def fp8(self) -> bool:
        """Whether the blocks hold e4m3 codes with fp32 scales (``k_scale`` / ``v_scale``)."""
        return self.scale_page > 0

    def k_scale_rows(self, layer: int) -> torch.Tensor:
        """fp8 pools: layer ``layer``'s K scales ``[num_blocks * block_size // scale_page, Hkv]`` (a view)."""
        return self.k_scale[layer].view(-1, self.num_kv_heads)

    def v_scale_rows(self, layer: int) -> torch.Tensor:
        """fp8 pools: layer ``layer``'s V scales ``[num_blocks * block_size // scale_page, Hkv]`` (a view)."""
        return self.v_scale[layer].view(-1, self.num_kv_heads)

    def _scale_shape(self) -> tuple:
        return (self.num_blocks, self.block_size // max(self.scale_page, 1), self.num_kv_heads)

    @property
    def bytes_per_token(self) -> float:
        """Bytes one token takes in the pool, K and V of every layer (codes and scales)."""
        per = 2 * self.num_kv_heads * self.head_dim * self.itemsize
        if self.scale_page:
            per += 2 * self.num_kv_heads * 4 / self.scale_page
        return self.num_layers * per


class CpuKVPool(_PoolViews):
    """Layer-major host K/V storage for ``num_layers x num_blocks x block_size`` tokens.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: the shape (all ints; blocks
            may be 0, the others >= 1).
        dtype: element dtype (fp16/bf16/fp32, or ``torch.float8_e4m3fn`` with ``scale_page``).
        scale_page: fp8 pools only: tokens per fp32 scale (dividing ``block_size``; 1: a scale per
            token); see the module docstring.
        pin: register the memory with CUDA (page-locked, device-readable through UVA). Ignored
            (plain memory) when CUDA is not available.
        slab_bytes: target size of one allocation+registration; whole layers are grouped into a
            slab up to this size (a layer larger than it gets a slab of its own).

    Attributes:
        k, v: lists of ``[num_blocks, block_size, Hkv, D]`` host tensors, one per layer.
        k_scale, v_scale: fp8 pools: lists of fp32 ``[num_blocks, block_size // scale_page, Hkv]``
            host tensors in the same slabs; else None.
        nbytes: bytes asked for (K and V of every layer, scales included).
        allocated_bytes: bytes actually allocated (nbytes plus < 2 pages of alignment per slab).
        pinned: whether the memory is registered with CUDA.
        placement: ``"host"``; label: ``"CPU pool"``.

    Raises:
        ValueError: a non-positive dimension.
        PoolAllocationError: the host memory could not be allocated or registered; the message
            names the size asked and suggests fewer blocks or a smaller block size.
    """

    placement = "host"
    label = "CPU pool"

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.bfloat16, *, pin: bool = True,
                 slab_bytes: int = DEFAULT_SLAB_BYTES, scale_page: int | None = None):
        self.itemsize = _check_shape(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype)
        self.scale_page = _check_scale_page(dtype, scale_page, block_size)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.block_bytes = block_size * num_kv_heads * head_dim * self.itemsize  # one of K or V
        # fp32 scales of one block of K or V (after the codes of the layer, in its slab)
        self.scale_block_bytes = (block_size // self.scale_page) * num_kv_heads * 4 if self.scale_page else 0
        self.layer_bytes = 2 * num_blocks * (self.block_bytes + self.scale_block_bytes)
        self.nbytes = num_layers * self.layer_bytes
        self.pinned = bool(pin) and torch.cuda.is_available()
        self._slabs: list[torch.Tensor] = []
        self._registered: list[tuple[int, int]] = []
        self._cache = _ACTIVE_CACHE if self.pinned else None
        self._cached: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # slabs owned by self._cache
        self.allocated_bytes = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.k_scale = [] if self.scale_page else None
        self.v_scale = [] if self.scale_page else None

        if self.pinned:
            avail = _mem_available()
            if self._cache is not None and avail is not None:
                avail += self._cache.free_bytes
            if avail is not None and self.nbytes > avail:
                raise PoolAllocationError(self._fail_msg(f"only {avail / 2**30:.2f} GiB of host memory is available"))
        per_slab = max(1, slab_bytes // max(self.layer_bytes, 1))
        blk_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        try:
            for l0 in range(0, num_layers, per_slab):
                nl = min(per_slab, num_layers - l0)
                raw = self._alloc_slab(nl * self.layer_bytes)
                if raw is None:
                    empty = torch.empty(blk_shape, dtype=dtype)
                    for _ in range(nl):
                        self.k.append(empty)
                        self.v.append(empty)
                        if self.scale_page:
                            es = torch.empty(self._scale_shape(), dtype=torch.float32)
                            self.k_scale.append(es)
                            self.v_scale.append(es)
                    continue
                code_bytes = 2 * num_blocks * self.block_bytes
                for i in range(nl):
                    lay = raw[i * self.layer_bytes:(i + 1) * self.layer_bytes]
                    kv = lay[:code_bytes].view(dtype).view(2, *blk_shape)
                    self.k.append(kv[0])
                    self.v.append(kv[1])
                    if self.scale_page:  # codes bytes are a multiple of 16: the scales stay 4-byte aligned
                        sc = lay[code_bytes:].view(torch.float32).view(2, *self._scale_shape())
                        self.k_scale.append(sc[0])
                        self.v_scale.append(sc[1])
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ helpers
    def _fail_msg(self, reason: str) -> str:
        kind = "pinned " if self.pinned else ""
        return (
            f"could not allocate {self.nbytes / 2**30:.3f} GiB ({self.nbytes} bytes) of {kind}host memory "
            f"for the KV pool ({self.num_layers} layers x {self.num_blocks} blocks x {self.block_size} "
            f"tokens x {self.num_kv_heads} kv heads x {self.head_dim} x {self.itemsize} B x 2 for K and V): "
            f"{reason}. Hint: use fewer blocks (num_blocks / max_tokens) or a smaller block_size."
        )

    def _alloc_slab(self, nbytes: int):
        """A page-aligned uint8 view of ``nbytes`` inside a fresh allocation, registered if pinned."""
        if nbytes == 0:
            return None
        span = _round_up(nbytes, PAGE)
        if self._cache is not None:
            got = self._cache.take(span)
            if got is not None:
                base, raw = got
                self._slabs.append(base)
                self._cached.append((span, base, raw))
                self.allocated_bytes += span + PAGE
                return raw[:nbytes]
        try:
            base = torch.empty(span + PAGE, dtype=torch.uint8)
        except (RuntimeError, MemoryError) as e:
            raise PoolAllocationError(self._fail_msg(f"allocating a slab of {span + PAGE} bytes failed ({e})")) from None
        off = (-base.data_ptr()) % PAGE
        raw = base[off:off + nbytes]
        self._slabs.append(base)
        self.allocated_bytes += span + PAGE
        if self.pinned:
            ptr = raw.data_ptr()
            cudart = torch.cuda.cudart()
            ret = cudart.cudaHostRegister(ptr, span, 0)
            code = _err_code(ret)
            if code != 0:
                try:
                    why = cudart.cudaGetErrorString(ret)
                except Exception:  # noqa: BLE001 - message only
                    why = f"error {code}"
                raise PoolAllocationError(self._fail_msg(f"cudaHostRegister of {span} bytes failed: {why}"))
            if self._cache is not None:
                self._cache.misses += 1
                self._cached.append((span, base, base[off:off + span]))
            else:
                self._registered.append((ptr, span))
        return raw

    # --------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Unregister every slab and drop the memory. The caller must make sure no copy that
        reads or writes the pool is still in flight (the engine's ``close`` waits for its own)."""
        regs, self._registered = self._registered, []
        if regs:
            cudart = torch.cuda.cudart()
            for ptr, _ in regs:
                cudart.cudaHostUnregister(ptr)
        cached, self._cached = self._cached, []
        for span, base, raw in cached:  # back to the cache they came from (reuse_pinned_slabs)
            self._cache.give(span, base, raw)
        self.k, self.v, self._slabs = [], [], []
        if self.scale_page:
            self.k_scale, self.v_scale = [], []

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self):
        return (f"CpuKVPool(layers={self.num_layers}, blocks={self.num_blocks}, block_size={self.block_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"scale_page={self.scale_page or None}, nbytes={self.nbytes}, pinned={self.pinned})")


class DeviceKVPool(_PoolViews):
    """Layer-major K/V storage for ``num_layers x num_blocks x block_size`` tokens in device memory:
    :class:`CpuKVPool`'s interface (``k`` / ``v`` lists of ``[num_blocks, block_size, Hkv, D]``,
    ``k_rows`` / ``v_rows``, ``close``) with the blocks where attention reads them, so an
    :class:`~xoffload.runtime.OffloadRuntime` over it copies prefill's K/V device to device and
    its reads never cross PCIe (``mode="resident"`` with a decode policy). Zero-filled (one memset
    per layer). A CPU ``device`` gives plain host tensors with the same placement (tests).

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: the shape (ints; blocks may be
            0, the others >= 1).
        dtype: floating-point element dtype (``torch.float8_e4m3fn`` with ``scale_page``).
        scale_page: fp8 pools only: tokens per fp32 scale (see the module docstring).
        device: where the blocks live (``"cuda"``, ``"cuda:i"``, ``"cpu"`` or a torch.device).

    Attributes:
        k, v: lists of ``[num_blocks, block_size, Hkv, D]`` tensors on ``device``, one per layer.
        nbytes: bytes of K and V of every layer; pinned: False; placement: ``"device"``;
        label: ``"GPU pool"`` on CUDA, else ``"device pool"``.

    Raises:
        ValueError / TypeError: a bad dimension or dtype.
        PoolAllocationError (a MemoryError): the device could not hold it; the message names the
            size asked and suggests fewer blocks (``kv_cache_tokens``) or a smaller block size.
    """

    placement = "device"
    pinned = False

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.bfloat16, *, device="cuda", scale_page: int | None = None):
        self.itemsize = _check_shape(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype)
        self.scale_page = _check_scale_page(dtype, scale_page, block_size)
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.label = "GPU pool" if self.device.type == "cuda" else "device pool"
        self.block_bytes = block_size * num_kv_heads * head_dim * self.itemsize  # one of K or V
        self.scale_block_bytes = (block_size // self.scale_page) * num_kv_heads * 4 if self.scale_page else 0
        self.layer_bytes = 2 * num_blocks * (self.block_bytes + self.scale_block_bytes)
        self.nbytes = self.allocated_bytes = num_layers * self.layer_bytes
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.k_scale = [] if self.scale_page else None
        self.v_scale = [] if self.scale_page else None
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        try:
            for _ in range(num_layers):  # one allocation per layer: no single huge segment
                kv = torch.zeros(shape, dtype=dtype, device=self.device)
                self.k.append(kv[0])
                self.v.append(kv[1])
                if self.scale_page:
                    sc = torch.ones((2,) + self._scale_shape(), dtype=torch.float32, device=self.device)
                    self.k_scale.append(sc[0])
                    self.v_scale.append(sc[1])
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            self.close()
            why = (str(e).splitlines() or [type(e).__name__])[0]
            raise PoolAllocationError(
                f"could not allocate {self.nbytes / 2**30:.3f} GiB ({self.nbytes} bytes) on {self.device} for the KV "
                f"pool ({num_layers} layers x {num_blocks} blocks x {block_size} tokens x {num_kv_heads} kv heads x "
                f"{head_dim} x {self.itemsize} B x 2 for K and V): {why}. Hint: use fewer blocks (kv_cache_tokens) "
                f"or a smaller block_size.") from None

    def close(self) -> None:
        """Drop the memory (back to torch's caching allocator). The caller makes sure no kernel or
        copy that reads or writes the pool is still queued (the runtime's ``close`` waits)."""
        self.k, self.v = [], []
        if self.scale_page:
            self.k_scale, self.v_scale = [], []

    def __repr__(self):
        return (f"DeviceKVPool(layers={self.num_layers}, blocks={self.num_blocks}, block_size={self.block_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"device={self.device}, nbytes={self.nbytes})")
