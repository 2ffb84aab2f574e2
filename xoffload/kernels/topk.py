"""Exact top-k indices per row in one Triton program per row: sparse decode's page selection.

Sparse decode picks, per KV head and step, the ``k`` best of a few thousand page scores
(128K tokens in 32-token pages: 4096). ``torch.topk`` spends ~28 us per call on that
shape on an H200 (a radix select over several passes and launches; 30 layers a step: 0.84 ms of a
10 ms step). Here each row is held in registers and the k-th largest value is found on the scores'
order-preserving int32 keys without a sort; the chosen indices are then written in ascending index
order by a prefix sum. Ties at the k-th value go to the lowest indices, so the result is a
deterministic function of the scores (``torch.topk`` breaks ties arbitrarily). NaN counts as larger
than every number (as in ``torch.topk``), -0.0 as smaller than +0.0.

The k-th key is found by a multiway bisection that resolves ``bits_per_pass`` (``BITS``) bits of it
a pass: each pass counts, in ONE block-wide reduction, how many keys lie at or above each of the
``2^BITS - 1`` thresholds that split the current bracket into ``2^BITS`` equal parts, and keeps the
part holding the k-th key; ``ceil(32 / BITS)`` passes in all. The passes are sequential (each needs
the previous bracket) and each is a cross-warp reduction (shared memory and barriers), so they are
the kernel's cost on the decode shapes (~8.8 us for 8 x 2048 and ~23 us for 8 x 8192 at
``BITS=1`` on an H200).

- ``BITS=1`` (:data:`DEFAULT_BITS_PER_PASS`; the original kernel: its code, and its PTX but for line
  info, unchanged): 32 passes of one compare-and-count, then one more count and two prefix sums.
- ``BITS=2, 3, 4``: 16, 11, 8 passes. A key's digit is bits ``[shift, shift + BITS)`` of the key
  clamped into the current bracket (whose low end is a multiple of its width: keys below it get 0,
  keys above it ``2^BITS - 1``), and it adds a one to the 16-bit field of its digit in one of
  ``2^BITS / 4`` int64 words (1, 2, 4; a count never exceeds 16384 < 2^16, so fields never carry);
  the words of all keys are summed by one reduction (``tl.join``-ed into a
  ``[BLOCK_N, 2(, 2)]`` tensor whose word axis stays inside a thread, not one reduction a word),
  and suffix sums of the fields (scalar ops) give the threshold counts. The count of keys above the
  final bracket falls out of the passes, so the selection ends with ONE prefix sum (the "above"
  and "equal" flags packed into one int32 scan) instead of a count and two scans.

Block barriers a program executes on sm_90 (Triton 3.9, SASS): ``BITS=1``: 70 (2 a pass + 6);
``BITS=2``: 33; ``BITS=3``: 23; ``BITS=4``: 17 with 4 warps (rows <= 1024) but 33 with 8 / 16 warps,
whose reduction moves the four words through shared memory in two rounds. The price is arithmetic:
a thread executes ~1.9-3.4x the plain bisection's instructions at 1024 (``BITS`` 2..4), ~1.3-2x at
8192. Which wins, per row length, is for the GPU to say (``benchmarks/bench_topk.py --sweep``);
narrowing the first bracket to the row's [min, max] key was left out: it costs a reduction and
saves a pass only where the keys span few bits, and the pass count would no longer be static.

Rows longer than :data:`MAX_REGISTER_ROW`, and CPU tensors without the interpreter, run the
reference (:func:`~xoffload.kernels.reference.topk_ids_ref`: one stable sort, the same keys and
tie rule).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .checks import check_int, check_tensor, is_int, next_pow2, use_triton
from .reference import topk_ids_ref, topk_ids_rows_ref

__all__ = ["BITS_PER_PASS_CHOICES", "DEFAULT_BITS_PER_PASS", "MAX_REGISTER_ROW", "topk_ids"]

#: longest row held in one program's registers (16 warps x 32 lanes x 32 values)
MAX_REGISTER_ROW = 16384
#: bits of the k-th key resolved per reduction pass when ``topk_ids(bits_per_pass=None)``; 1 is the
#: plain 32-pass bisection (to be switched after a GPU measurement of the others)
DEFAULT_BITS_PER_PASS = 1
#: the values ``topk_ids(bits_per_pass=...)`` accepts
BITS_PER_PASS_CHOICES = (1, 2, 3, 4)
#: the most bits a pass for rows longer than 8192 (BLOCK_N = 16384, 16 warps: 32 keys a thread at the
#: 128-register limit). ptxas -v (sm_90a, Triton 3.9): BITS = 4 (four int64 count words a key) spills
#: ~120-130 bytes a thread, for no fewer barriers than BITS = 2 at 16 warps (33); BITS = 3 (two words)
#: spills ~60-75 bytes but saves 10 barriers (23), so it is kept for the GPU to judge; 1 and 2 do not
_MAX_BITS_16384 = 3


@triton.jit(do_not_specialize=["N", "K"])
def _topk_kernel(S, Out, Prefer, KR, N, K, s_sr, s_or, s_pr, bonus, BLOCK_N: tl.constexpr, HAS_PREFER: tl.constexpr,
                 HAS_KR: tl.constexpr, BITS: tl.constexpr):
    """Program r: the K largest of row r's N scores (``+ bonus`` where ``Prefer[r, j] >= 0``),
    their indices ascending into Out[r, :K]; ``HAS_KR``: row r takes ``min(KR[r], K)``. ``BITS``:
    bits of the k-th key found per reduction pass (1: the plain bisection; 2, 3, 4: multiway)."""
    r = tl.program_id(0).to(tl.int64)
    if HAS_KR:
        K = tl.minimum(tl.maximum(tl.load(KR + r), 0), K)
    n = tl.arange(0, BLOCK_N)
    m = n < N
    x = tl.load(S + r * s_sr + n, mask=m, other=0.0).to(tl.float32)
    if HAS_PREFER:
        pf = tl.load(Prefer + r * s_pr + n, mask=m, other=-1)
        x = tl.where(pf >= 0, x + bonus, x)
    b = x.to(tl.int32, bitcast=True)
    if BITS == 1:
        key = (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64)  # float order == signed int order
        key = tl.where(x != x, 2147483647, key)  # every NaN (either sign) above +inf
        # bisection: lo keeps count(key >= lo) >= K, hi keeps count(key >= hi) < K
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.full([], 2147483648, tl.int64)
        for _ in range(32):
            mid = lo + ((hi - lo) >> 1)
            cnt = tl.sum((m & (key >= mid)).to(tl.int32), axis=0)
            ok = cnt >= K
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        gt = m & (key > lo)  # strictly above the k-th value: all taken
        n_gt = tl.sum(gt.to(tl.int32), axis=0)
        eq = m & (key == lo)
        take = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= K - n_gt))  # the lowest-index ties
        pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(Out + r * s_or + pos, n.to(tl.int32), mask=take)
    else:
        key = b ^ ((b >> 31) & 0x7FFFFFFF)  # int32: float order == signed int order
        key = tl.where(x != x, 2147483647, key)  # every NaN (either sign) above +inf
        # the same order unsigned: u = key + 2^31. Lanes past N: 0, a key no score has (-inf is
        # 2^23 - 1; the NaN that would map there maps to 2^32 - 1): digit 0 in every pass, never
        # above or equal to the final lo (a real key when K > 0), so no mask is kept
        u = tl.where(m, key ^ -2147483648, 0).to(tl.uint32, bitcast=True)
        T: tl.constexpr = (1 << BITS) - 1  # thresholds a pass
        P: tl.constexpr = (32 + BITS - 1) // BITS  # passes
        K64 = K.to(tl.int64)
        # multiway bisection on the bracket [lo, top]: count(u >= lo) >= K and c_hi = count(u > top)
        # < K (or K == 0). Pass p cuts it at lo + i * step (i = 1 .. T, step = 2^shift) and keeps
        # the part holding the k-th key. lo is a multiple of the bracket's width 2^(shift + BITS), so
        # a key's digit (part) is bits [shift, shift + BITS) of the key clamped into the bracket:
        # keys below it get 0, keys above it T, and digit >= i <=> u >= lo + i * step, i = 1 .. T.
        # The shifts BITS * (P - 1 - p) end at 0; with BITS = 3 the first pass (shift 30) has only
        # 4 live parts of its 8 (its upper thresholds lie past every key and count 0).
        lo = tl.full([], 0, tl.int64)
        c_hi = tl.full([], 0, tl.int64)
        for p in tl.static_range(P):
            shift = BITS * (P - 1 - p)
            top = tl.minimum(lo + ((1 << (shift + BITS)) - 1), 4294967295)  # (BITS = 3's first pass; K == 0)
            uc = tl.minimum(tl.maximum(u, lo.to(tl.uint32)), top.to(tl.uint32))
            d = ((uc >> shift) & T).to(tl.int32)
            # block-wide counts of the digits in ONE reduction: digit i is counted in the 16-bit
            # field i % 4 of the int64 word i // 4 (a count never exceeds 16384 < 2^16: the fields
            # never carry into each other), a key adding 1 << 16 * (d % 4) to its word. The words
            # of a key are tl.join-ed into a [BLOCK_N, 2(, 2)] tensor; join keeps the new axes in a
            # thread, so one tl.sum over axis 0 is one cross-warp reduction of 1 / 2 / 4 values a
            # thread (not one a word), with no layout conversion, and tl.split takes the words
            # apart in registers. Two registers a word a key (a [BLOCK_N, T] compare would hold T
            # values a key): hence _MAX_BITS_16384. (Inline, not a helper: the interpreter pays
            # for every call of a jitted function.)
            if T == 3:
                h0 = tl.sum(tl.full([BLOCK_N], 1, tl.int64) << (d << 4).to(tl.int64), axis=0)
                h1 = h0
                h2 = h0
                h3 = h0
            else:
                v = tl.full([BLOCK_N], 1, tl.int64) << ((d & 3) << 4).to(tl.int64)
                w = d >> 2
                if T == 7:
                    h0, h1 = tl.split(tl.sum(tl.join(tl.where(w == 0, v, 0), tl.where(w == 0, 0, v)), axis=0))
                    h2 = h0
                    h3 = h0
                else:  # [n, a, b] = word a + 2 b of key n
                    c4 = tl.join(tl.join(tl.where(w == 0, v, 0), tl.where(w == 1, v, 0)),
                                 tl.join(tl.where(w == 2, v, 0), tl.where(w == 3, v, 0)))
                    h01, h23 = tl.split(tl.sum(c4, axis=0))
                    h0, h1 = tl.split(h01)
                    h2, h3 = tl.split(h23)
            # from the top digit down: c = count(digit >= i) = count(u >= lo + i * step); the part
            # kept is the largest i with c >= K (0 if none), and the new c_hi the count at i + 1
            c = tl.full([], 0, tl.int64)
            jk = tl.full([], T, tl.int32)
            c_next = c_hi
            for i in tl.static_range(T, 0, -1):
                if i // 4 == 0:
                    word = h0
                elif i // 4 == 1:
                    word = h1
                elif i // 4 == 2:
                    word = h2
                else:
                    word = h3
                c += (word >> ((i % 4) * 16)) & 0xFFFF
                below = c < K64
                c_next = tl.where(below, c, c_next)
                jk = tl.where(below, i - 1, jk)
            # (the min keeps lo < 2^32 when K == 0 passes every threshold: BITS = 3's first pass)
            lo = tl.minimum(lo + (jk.to(tl.int64) << shift), 4294967295)
            c_hi = c_next
        # lo: the k-th largest key; c_hi = count(u > lo). One scan for both the ranks among the
        # keys above lo (low 16 bits) and among the keys equal to it (high bits; counts <= 16384)
        lo_u = lo.to(tl.uint32)
        gt = u > lo_u  # strictly above the k-th value: all taken
        eq = u == lo_u
        cs = tl.cumsum(gt.to(tl.int32) | (eq.to(tl.int32) << 16), axis=0)
        c_eq = cs >> 16
        quota = K - c_hi.to(tl.int32)  # ties taken, the lowest indices first
        take = gt | (eq & (c_eq <= quota))
        pos = (cs & 0xFFFF) + tl.minimum(c_eq, quota) - 1  # = cumsum(take) - 1
        tl.store(Out + r * s_or + pos, n.to(tl.int32), mask=take)


def _check_bits(bits_per_pass) -> int:
    """``bits_per_pass`` (None: :data:`DEFAULT_BITS_PER_PASS`) as an int of :data:`BITS_PER_PASS_CHOICES`;
    ValueError otherwise."""
    bits = DEFAULT_BITS_PER_PASS if bits_per_pass is None else bits_per_pass
    if not is_int(bits) or int(bits) not in BITS_PER_PASS_CHOICES:
        raise ValueError(f"bits_per_pass must be one of {', '.join(map(str, BITS_PER_PASS_CHOICES))} or None, "
                         f"got {bits_per_pass!r}")
    return int(bits)


def topk_ids(scores: torch.Tensor, k: int, out: torch.Tensor | None = None, *,
             prefer: torch.Tensor | None = None, prefer_bonus: float = 0.0,
             k_rows: torch.Tensor | None = None, bits_per_pass: int | None = None) -> torch.Tensor:
    """Indices of the ``k`` largest scores of each row, ascending within a row.

    Args:
        scores: ``[R, N]`` fp32 / fp16 / bf16 (last dim contiguous), e.g. one page score per KV
            head (rows) and candidate page.
        k: ``0 <= k <= N``.
        out: optional int32 ``[R, k]`` destination (last dim contiguous), e.g. a CUDA graph's static
            buffer.
        prefer: optional int32 ``[R, >= N]`` (last dim contiguous, on scores' device): entries
            ``j`` with ``prefer[r, j] >= 0`` compete with ``scores[r, j] + prefer_bonus`` (in fp32),
            e.g. the page cache's ``slot_of`` (pages already on the GPU); the scores themselves are
            not changed.
        prefer_bonus: the finite amount added to preferred entries.
        k_rows: optional int32 ``[R]`` (on scores' device): row r takes only its
            ``min(k_rows[r], k)`` largest (clamped at 0; a batch of sequences whose plans read
            different page counts), written to its first entries; the rest of the row is left
            as it was. Not read on the host (no synchronisation).
        bits_per_pass: bits of the k-th largest key the kernel resolves per block-wide reduction
            pass, one of :data:`BITS_PER_PASS_CHOICES` (1, 2, 3, 4: 32, 16, 11, 8 passes); ``None``:
            :data:`DEFAULT_BITS_PER_PASS`. Rows longer than 8192 run at most 3 (register pressure).
            Only the speed depends on it: every value returns the same indices. Unused (but
            checked) where the reference runs.
    Returns:
        int32 ``[R, k]``: per row the indices of its ``k`` (or ``k_rows[r]``) largest scores (ties
        at the k-th value: the lowest indices; NaN above every number, -0.0 below +0.0), in
        ascending order.
    Raises:
        TypeError / ValueError: ``scores`` not 2-D fp32 / fp16 / bf16, ``k`` outside ``[0, N]``, a bad
        ``out``, ``prefer`` or ``k_rows``, a non-finite ``prefer_bonus``.
        ValueError: ``bits_per_pass`` neither None nor one of :data:`BITS_PER_PASS_CHOICES`.

    Runs on the current stream without host synchronisation (CUDA-graph safe).
    """
    bits = _check_bits(bits_per_pass)
    check_tensor("scores", scores, 2, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    rows, n = scores.shape
    k = check_int("k", k, 0, n)
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=scores.device)
    else:
        check_tensor("out", out, 2, dtypes=(torch.int32,))
        if tuple(out.shape) != (rows, k) or out.device != scores.device:
            raise ValueError(f"out must be int32 [{rows}, {k}] on {scores.device}, got {tuple(out.shape)} on {out.device}")
        if k > 1 and out.stride(1) != 1:
            raise ValueError(f"out must have a contiguous last dim, got strides {tuple(out.stride())}")
    if prefer is not None:
        check_tensor("prefer", prefer, 2, dtypes=(torch.int32,))
        if prefer.shape[0] != rows or prefer.shape[1] < n or prefer.device != scores.device:
            raise ValueError(f"prefer must be int32 [{rows}, >= {n}] on {scores.device}, got "
                             f"{tuple(prefer.shape)} on {prefer.device}")
        if isinstance(prefer_bonus, bool) or not isinstance(prefer_bonus, (int, float)) \
                or not math.isfinite(prefer_bonus):
            raise ValueError(f"prefer_bonus must be a finite number, got {prefer_bonus!r}")
    if k_rows is not None:
        check_tensor("k_rows", k_rows, 1, dtypes=(torch.int32,))
        if k_rows.shape[0] != rows or k_rows.device != scores.device:
            raise ValueError(f"k_rows must be int32 [{rows}] on {scores.device}, got {tuple(k_rows.shape)} on "
                             f"{k_rows.device}")
    if k == 0 or rows == 0:
        return out
    if prefer is not None and (not use_triton(scores) or n > MAX_REGISTER_ROW):  # the bonus, -0.0 kept
        scores = torch.where(prefer[:, :n] >= 0, scores.float() + float(prefer_bonus), scores.float())
    if k_rows is not None and (not use_triton(scores) or n > MAX_REGISTER_ROW):  # per row, on the device
        ids, mask = topk_ids_rows_ref(scores, k, k_rows)
        out.copy_(torch.where(mask, ids, out))
        return out
    if k == n and k_rows is None:
        out.copy_(torch.arange(n, dtype=torch.int32, device=scores.device).expand(rows, n))
        return out
    if not use_triton(scores) or n > MAX_REGISTER_ROW:
        out.copy_(topk_ids_ref(scores, k))
        return out
    block = max(16, next_pow2(n))
    warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    if block > 8192:  # 32 keys a thread at the 128-register limit (see _MAX_BITS_16384)
        bits = min(bits, _MAX_BITS_16384)
    _topk_kernel[(rows,)](scores, out, prefer if prefer is not None else out, k_rows if k_rows is not None else out,
                          n, k, scores.stride(0), out.stride(0), prefer.stride(0) if prefer is not None else 0,
                          float(prefer_bonus), BLOCK_N=block, HAS_PREFER=prefer is not None,
                          HAS_KR=k_rows is not None, BITS=bits, num_warps=warps)
    return out
