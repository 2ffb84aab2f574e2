"""The option path of the prefill kernel (:mod:`xoffload.kernels.flash_attn`): sliding window,
softcap, ALiBi and paged K/V as compile-time branches of one tile loop.

(The option path's tile loop with the helpers it inlines — window tile bounds, the ALiBi tile
classes, softcap's tanh — is one unit; the public wrapper stays in flash_attn.py.)

ALiBi (Press et al., "Train Short, Test Long: Attention with Linear Biases Enables Input Length
Extrapolation", ICLR 2022), flash-attn's convention: the bias of query ``i`` (position ``pos = i +
Sk - Sq``, bottom-right aligned) and key ``j`` is ``-slope * |pos - j|``. The kernel never forms
``|pos - j|`` on most tiles. With ``base`` a reference position of the query block (its middle row)
it adds a per-row constant ``slope * (pos - base)`` to every score of the row (which changes no
softmax output) and subtracts it from the LSE at the end; then

- a tile whose keys all lie at or left of every row (``j <= pos``; under causal every tile, since
  keys past ``pos`` are masked anyway) gets ``s + slope * (j - base)``: one add per score (an FMA
  with the scale), the column term computed once per column;
- a tile whose keys all lie at or right of every row (non-causal only) gets
  ``s - slope * (j - base)`` plus ``2 * slope * (pos - base)``, a per-row term folded into the row
  max that the softmax subtracts anyway: one add per score as well;
- the few tiles that straddle the diagonal (non-causal) and every masked tile of a non-causal
  call (window edges, the Sk tail) use the full ``s - slope * |pos - j| + slope * (pos - base)``.

Distances stay relative to the block (``j - base``, ``pos - base``), never absolute positions, so
the bias keeps fp32 error proportional to the distance, as the direct formula does. The price: a
score carries the row shift, so its fp32 rounding is that of ``|s| + slope * log2(e) * BLOCK_M /
2``, and the LSE can be off by about one fp32 ulp of that (3.8e-6 at slope 0.5, BLOCK_M 128;
measured 4e-6 vs 5e-7 for the direct form at slope 1, BLOCK_M 128, within the tests' LSE
tolerance; not at large slopes: at slope 8, BLOCK_M 64, 3.1e-5 against a tolerance of 2.2e-5,
so a head whose shift passes :data:`ALIBI_SHIFT_MAX` takes the direct form on every tile:
``test_alibi_large_slope_lse_within_the_tests_tolerance``); outputs in 16 bits do not see it.
fp32 inputs, the accuracy path, keep the direct form.

Softcap (``softcap * tanh(s / softcap)``) costs two MUFU operations per score on the GPU
(``tanh.approx.f32`` and exp2) where the plain kernel has one. Cheaper forms (an fp16x2 tanh, a
polynomial exp2 on part of the columns; a static per-row reference instead of the running max,
with and without a hand-pipelined loop; a conditional rescale) were measured on the H200 and
removed, as was ALiBi's column term through the tensor cores (docs/CHANGELOG.md).
What lifted softcap at D=128 to 0.91-0.92x the plain kernel was the loads: through TMA (``USE_TMA``)
its 128x64 tile fits one warpgroup.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["ALIBI_SHIFT_MAX", "alibi_tile_classes"]

#: the largest per-row ALiBi shift, ``|slope| * log2(e) * BLOCK_M / 2`` in log2 units, of the
#: per-column form: a larger one would round the scores by more than an fp32 ulp of 2^-17 of
#: their own (so the LSE past the tests' tolerance at slope 8); such a (b, h) takes the direct
#: form on every tile (slower, exact). 96: slopes up to ~1.04 with the GPU's 128-row blocks (the
#: ALiBi paper's geometric slopes are at most 2^-0.25 for 32 heads)
ALIBI_SHIFT_MAX = tl.constexpr(96.0)


# ----------------------------------------------------------------------------------------------
# tanh
# ----------------------------------------------------------------------------------------------

@triton.jit
def _tanh(x, FAST: tl.constexpr):
    """tanh in fp32. ``FAST``: the GPU's ``tanh.approx.f32`` (one MUFU op, max relative error
    2^-11, what flash-attn uses); else ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` (the
    interpreter and fp32 inputs)."""
    if FAST:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)


# ----------------------------------------------------------------------------------------------
# tile bounds
# ----------------------------------------------------------------------------------------------

@triton.jit
def _window_tile_bounds(m0, seqlen_q, seqlen_k, diag_shift, win_left, win_right,
                        CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key-tile bounds ``(lo, full_lo, full_hi, hi)`` of the query block starting at row ``m0``:
    tiles in ``[lo, full_lo)`` and ``[full_hi, hi)`` need the mask, tiles in ``[full_lo,
    full_hi)`` are visible to every row of the block; keys outside ``[lo, hi)`` are seen by no row
    and are skipped. Mirrored in Python by :func:`window_tile_bounds` (tested against it)."""
    p_lo = m0 + diag_shift  # position of the block's first row (bottom-right aligned)
    p_hi = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1 + diag_shift  # of its last real row
    vis_hi = seqlen_k
    full_hi_key = seqlen_k
    if CAUSAL:
        vis_hi = tl.minimum(seqlen_k, tl.maximum(p_hi + 1, 0))
        full_hi_key = tl.minimum(seqlen_k, tl.maximum(p_lo + 1, 0))
    elif HAS_RIGHT:
        vis_hi = tl.minimum(seqlen_k, tl.maximum(p_hi + win_right + 1, 0))
        full_hi_key = tl.minimum(seqlen_k, tl.maximum(p_lo + win_right + 1, 0))
    lo = vis_hi * 0
    full_lo = lo
    if HAS_LEFT:
        vis_lo = tl.minimum(tl.maximum(p_lo - win_left, 0), vis_hi)
        lo = (vis_lo // BLOCK_N) * BLOCK_N
        full_lo_key = tl.maximum(p_hi - win_left, 0)
        full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo_key, BLOCK_N) * BLOCK_N, lo), vis_hi)
    full_hi = tl.maximum((full_hi_key // BLOCK_N) * BLOCK_N, full_lo)
    return lo, full_lo, full_hi, vis_hi


@triton.jit
def _diagonal_split(m0, seqlen_q, diag_shift, full_lo, full_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split the unmasked tiles ``[full_lo, full_hi)`` of a non-causal query block at its diagonal:
    ``(d_lo, d_hi)`` with every key of ``[full_lo, d_lo)`` at or left of the block's first row
    position (ALiBi's left class), every key of ``[d_hi, full_hi)`` at or right of its last real row
    (the right class) and the straddling tiles between; all three are multiples of ``BLOCK_N`` or
    clamped to the range (mirrored by :func:`alibi_tile_classes`)."""
    p_lo = m0 + diag_shift
    p_hi = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1 + diag_shift
    d_lo = (tl.maximum(p_lo + 1, 0) // BLOCK_N) * BLOCK_N  # tiles ending at or before key p_lo
    d_lo = tl.minimum(tl.maximum(d_lo, full_lo), full_hi)
    d_hi = tl.cdiv(tl.maximum(p_hi, 0), BLOCK_N) * BLOCK_N  # tiles starting at or after key p_hi
    d_hi = tl.minimum(tl.maximum(d_hi, d_lo), full_hi)
    return d_lo, d_hi


def alibi_tile_classes(m0: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, *, causal: bool = False,
                       window_size=(-1, -1)) -> list:
    """The key ranges the kernel walks for the query block of rows ``[m0, m0 + block_m)`` under
    ALiBi, with the bias form each uses: a list of ``(start, stop, masked, side)``, ``side`` 1 (keys
    at or left of every row: ``+slope * (j - base)``), 2 (at or right of every row) or 0 (the full
    ``|pos - j|`` form). Python mirror of the kernel's ranges and their forms (tested against brute
    force: each range's keys satisfy its side's condition for every real row), in the order of
    three loops; with the edges in one loop (:func:`flash_attn._edges_one_loop`) the kernel runs
    the two masked ranges first, and a head past :data:`ALIBI_SHIFT_MAX` takes the direct form on
    every range instead (not mirrored)."""
    from .flash_attn import _normalise_options, window_tile_bounds

    o = _normalise_options(causal, window_size, 0.0, None, None, None, batch=1, hq=1, device="cpu",
                           max_q=seqlen_q, max_k=seqlen_k)
    lo, full_lo, full_hi, hi = window_tile_bounds(m0, block_m, block_n, seqlen_q, seqlen_k, causal=causal,
                                                  window_size=window_size)
    if o.causal:
        return [(lo, full_lo, True, 1), (full_lo, full_hi, False, 1), (full_hi, hi, True, 1)]
    diag = seqlen_k - seqlen_q
    p_lo, p_hi = m0 + diag, min(m0 + block_m, seqlen_q) - 1 + diag
    d_lo = min(max((max(p_lo + 1, 0) // block_n) * block_n, full_lo), full_hi)
    d_hi = min(max(-(-max(p_hi, 0) // block_n) * block_n, d_lo), full_hi)
    return [(lo, full_lo, True, 0), (full_lo, d_lo, False, 1), (d_lo, d_hi, False, 0), (d_hi, full_hi, False, 2),
            (full_hi, hi, True, 0)]


# ----------------------------------------------------------------------------------------------
# the tile loop
# ----------------------------------------------------------------------------------------------

@triton.jit
def _attn_inner_opt(acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, K, V, k_desc, v_desc, bt_row, k_head, v_head,
                    offs_m, offs_n, offs_d, d_ok, lo, hi, jump_at, jump_by, seqlen_k, diag_shift, win_left, win_right,
                    qk_scale, cap_in, cap_out, slope2, alibi_base, max_entry,
                    stride_kn, stride_vn, stride_kp, stride_vp, stride_btn,
                    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr,
                    HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, ALIBI_SIDE: tl.constexpr,
                    FAST_TANH: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, EVEN_D: tl.constexpr, IS_FP32: tl.constexpr,
                    USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The online-softmax loop of the option path (window, softcap, ALiBi, paged K/V) over the key
    tiles ``[lo, hi)``. Scores are kept in log2 units: ``s = qk * scale * log2(e)``, or with
    ``SOFTCAP`` ``softcap * tanh(qk * scale / softcap) * log2(e)``. ALiBi (``slope2 = slope *
    log2(e)``) adds ``-slope2 * |j - pos| + slope2 * (pos - alibi_base)``, the per-row shift that
    the caller removes from the LSE, in the form ``ALIBI_SIDE`` picks (module docstring): 1 for
    tiles with every key ``<= pos`` (or masked), 2 for tiles with every key ``>= pos`` of the real
    rows, 0 anywhere; -1: ``-slope2 * |j - pos|`` without the row shift (fp32 inputs, whose
    tolerance the shift's rounding, an ulp of ``slope2 * BLOCK_M / 2``, would eat into). ``MASKED`` tiles mask keys past ``seqlen_k`` and outside the causal / window
    bounds. The tiles start at ``lo, lo + BLOCK_N, ... < hi``, each start at or past ``jump_at``
    moved on by ``jump_by``: one loop walks two ranges (both masked edges of a block, ``[lo,
    jump_at)`` then ``[jump_at + jump_by, hi + jump_by)``). ``PAGED``: key ``j`` is row ``j % PAGE`` of
    page ``bt_row[j // PAGE]`` (entries clamped to ``[0, max_entry]``); else key ``j`` of K / V is
    at ``k_base / v_base + j * stride``, reached by pointer increments (a pointer recomputed from
    ``start_n * stride`` each tile defeats Triton's load pipelining: waits after every wgmma,
    seen in the sm_90 SASS). ``USE_TMA`` (not paged): K / V tiles come from the descriptors
    ``k_desc`` / ``v_desc`` of the sequence's ``[seqlen_k, D]`` rows instead, zero past both."""
    pos = offs_m + diag_shift  # bottom-right aligned query positions
    if ALIBI:
        rel = pos - alibi_base  # the row's shift is slope2 * rel (not with ALIBI_SIDE -1)
        if ALIBI_SIDE == 2:
            row_add = 2.0 * slope2 * rel.to(tl.float32)
        if ALIBI_SIDE == 1 or ALIBI_SIDE == 2:
            # the column term slope2 * (j - base) = slope2 * offs_n + slope2 * (start_n - base): a
            # loop-invariant vector plus one scalar per tile (one add per column, not three)
            col_vec = slope2 * offs_n.to(tl.float32)
            if ALIBI_SIDE == 2:
                col_vec = -col_vec
    PAGE_TILE: tl.constexpr = PAGED and (PAGE % BLOCK_N == 0)
    if not PAGED:  # K / V of the first tile
        first = lo + tl.where(lo >= jump_at, jump_by, 0)
        k_base += first.to(tl.int64) * stride_kn
        v_base += first.to(tl.int64) * stride_vn
    for v_n in tl.range(lo, hi, BLOCK_N):
        start_n = v_n + tl.where(v_n >= jump_at, jump_by, 0)  # the keys [jump_at, jump_at + jump_by) skipped
        kidx = start_n + offs_n
        if MASKED:
            n_ok = kidx < seqlen_k
        if PAGED:
            if PAGE_TILE:  # the tile lies inside one page: one table entry
                blk = tl.load(bt_row + (start_n // PAGE) * stride_btn)
                blk = tl.minimum(tl.maximum(blk, 0), max_entry).to(tl.int64)
                rows = (start_n % PAGE) + offs_n
                k_ptrs = K + k_head + blk * stride_kp + (rows[:, None] * stride_kn + offs_d[None, :])
                v_ptrs = V + v_head + blk * stride_vp + (rows[:, None] * stride_vn + offs_d[None, :])
            else:  # pages smaller than a tile (or not a multiple of it): one entry per key
                if MASKED:
                    blk = tl.load(bt_row + (kidx // PAGE) * stride_btn, mask=n_ok, other=0)
                else:
                    blk = tl.load(bt_row + (kidx // PAGE) * stride_btn)
                blk = tl.minimum(tl.maximum(blk, 0), max_entry).to(tl.int64)
                rows = kidx % PAGE
                k_ptrs = K + k_head + (blk * stride_kp + rows * stride_kn)[:, None] + offs_d[None, :]
                v_ptrs = V + v_head + (blk * stride_vp + rows * stride_vn)[:, None] + offs_d[None, :]
        else:
            k_ptrs = k_base + k_offs
            v_ptrs = v_base + v_offs
        if USE_TMA:  # keys past seqlen_k and columns past D arrive as zeros
            k = k_desc.load([start_n, 0])
        elif MASKED:
            k = tl.load(k_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        if IS_FP32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        # s = raw * sc (log2 units), sc > 0: without ALiBi the row max is taken on raw and the
        # scale joins the exponent's FMA, as in the plain kernel (one multiply per score saved)
        if SOFTCAP:
            raw = _tanh(qk * cap_in, FAST_TANH)
            sc = cap_out
        else:
            raw = qk
            sc = qk_scale
        if ALIBI:
            if ALIBI_SIDE == 1:  # every key <= pos: -slope2 (pos - j) + slope2 (pos - base)
                tile_c = slope2 * (start_n - alibi_base).to(tl.float32)
                raw = tl.fma(raw, sc, (col_vec + tile_c)[None, :])
            elif ALIBI_SIDE == 2:  # every key >= pos: the row term 2 slope2 (pos - base) joins m below
                tile_c = slope2 * (start_n - alibi_base).to(tl.float32)
                raw = tl.fma(raw, sc, (col_vec - tile_c)[None, :])
            elif ALIBI_SIDE == 0:
                raw = tl.fma(raw, sc, slope2 * (rel[:, None] - tl.abs(kidx[None, :] - pos[:, None])).to(tl.float32))
            else:  # -1: the direct form, no row shift (fp32 inputs)
                raw = tl.fma(raw, sc, -slope2 * tl.abs(kidx[None, :] - pos[:, None]).to(tl.float32))
        if MASKED:
            ok = n_ok[None, :]
            if CAUSAL:
                ok = ok & (kidx[None, :] <= pos[:, None])
            elif HAS_RIGHT:
                ok = ok & (kidx[None, :] <= (pos + win_right)[:, None])
            if HAS_LEFT:
                ok = ok & (kidx[None, :] >= (pos - win_left)[:, None])
            raw = tl.where(ok, raw, float("-inf"))
        if ALIBI:
            row_max = tl.max(raw, 1)
            if ALIBI_SIDE == 2:
                row_max = row_max + row_add
        else:
            row_max = tl.max(raw, 1) * sc
        m_new = tl.maximum(m_i, row_max)
        if MASKED:
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        alpha = tl.exp2(m_i - m_sub)
        if ALIBI:
            if ALIBI_SIDE == 2:
                m_sub = m_sub - row_add
            x = raw - m_sub[:, None]
        else:
            x = tl.fma(raw, sc, -m_sub[:, None])
        p = tl.exp2(x)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_TMA:
            v = v_desc.load([start_n, 0])
        elif MASKED:
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        if IS_FP32:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
        if not PAGED:
            step = BLOCK_N + tl.where(v_n + BLOCK_N == jump_at, jump_by, 0)
            k_base += step.to(tl.int64) * stride_kn
            v_base += step.to(tl.int64) * stride_vn
    return acc, l_i, m_i


@triton.jit
def _attn_opt_loops(acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, K, V, k_desc, v_desc, bt_row, k_head, v_head,
                    offs_m, offs_n, offs_d, d_ok, m0, seqlen_q, seqlen_k, diag_shift, win_left, win_right,
                    qk_scale, cap_in, cap_out, slope2, max_entry,
                    stride_kn, stride_vn, stride_kp, stride_vp, stride_btn,
                    CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                    ALIBI: tl.constexpr, FAST_TANH: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, EVEN_D: tl.constexpr,
                    IS_FP32: tl.constexpr, EDGES_ONE_LOOP: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """All key tiles of one query block on the option path: the masked left edge of its window,
    the unmasked interior, the masked right edge (diagonal / window / Sk tail); tiles outside the
    window are never visited. ``EDGES_ONE_LOOP``: both masked edges run first, in one loop (one
    pipeline fill less per block; :func:`flash_attn._edges_one_loop` says where). Non-causal ALiBi
    splits the interior at the diagonal (:func:`_diagonal_split`) into the left class, the
    straddling tiles and the right class. Returns
    ``(acc, l_i, m_i, alibi_base, shift2)``: with ALiBi (16-bit inputs) ``m_i`` carries the per-row
    shift ``shift2 * (pos - alibi_base)``, which the caller subtracts from the LSE (``shift2`` is
    ``slope2``, or 0 for a slope past :data:`ALIBI_SHIFT_MAX`, which takes the direct form on every
    tile); fp32 inputs take the direct form on every tile (no shift, no split)."""
    lo, full_lo, full_hi, hi = _window_tile_bounds(m0, seqlen_q, seqlen_k, diag_shift, win_left, win_right,
                                                   CAUSAL, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
    alibi_base = m0 + diag_shift + BLOCK_M // 2  # the block's middle row: shifts within +-slope2 * BLOCK_M / 2
    # fp32 inputs (the accuracy path) keep the direct form (-1); causal: every visible key is <= pos
    EDGE: tl.constexpr = -1 if IS_FP32 else (1 if CAUSAL else 0)
    SHIFTED: tl.constexpr = ALIBI and not IS_FP32
    shift2 = slope2  # the slope of the per-row shift the caller takes out of the LSE (0: none)
    hi0 = hi
    d_from = hi  # big slopes: the tiles [d_from, hi0) in the direct form (else none)
    if SHIFTED:
        # a slope whose shift slope2 * BLOCK_M / 2 passes ALIBI_SHIFT_MAX (log2 units) would cost
        # the scores more than an fp32 ulp of 2^-17 of their own: that (b, h) takes the direct form
        # on every tile, masked (one loop; the others get empty ranges), and no shift
        big = tl.abs(slope2) * (BLOCK_M // 2) > ALIBI_SHIFT_MAX  # a negative slope shifts as far
        d_from = tl.where(big, lo, hi0)
        full_lo = tl.where(big, lo, full_lo)
        full_hi = tl.where(big, lo, full_hi)
        hi = tl.where(big, lo, hi)
        shift2 = tl.where(big, 0.0, slope2)
    if EDGES_ONE_LOOP:  # both masked edges in one loop: [lo, full_lo) then [full_hi, hi)
        edge_hi = full_lo + (hi - full_hi)
        edge_jump = full_hi - full_lo
    else:
        edge_hi = full_lo
        edge_jump = 0
    acc, l_i, m_i = _attn_inner_opt(
        acc, l_i, m_i, q, k_base, v_base,
        k_offs, v_offs, K, V, k_desc, v_desc, bt_row, k_head, v_head, offs_m, offs_n, offs_d, d_ok,
        lo, edge_hi, full_lo, edge_jump, seqlen_k, diag_shift, win_left, win_right, qk_scale, cap_in, cap_out, slope2,
        alibi_base, max_entry, stride_kn, stride_vn, stride_kp, stride_vp, stride_btn,
        True, CAUSAL, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, EDGE, FAST_TANH,
        PAGED, PAGE, EVEN_D, IS_FP32, USE_TMA, BLOCK_M, BLOCK_N)
    if ALIBI and not CAUSAL and not IS_FP32:
        d_lo, d_hi = _diagonal_split(m0, seqlen_q, diag_shift, full_lo, full_hi, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _attn_inner_opt(
            acc, l_i, m_i, q, k_base, v_base,
            k_offs, v_offs, K, V, k_desc, v_desc, bt_row, k_head, v_head, offs_m, offs_n, offs_d, d_ok,
            full_lo, d_lo, d_lo, 0, seqlen_k, diag_shift, win_left, win_right, qk_scale, cap_in, cap_out, slope2,
            alibi_base, max_entry, stride_kn, stride_vn, stride_kp, stride_vp, stride_btn,
            False, CAUSAL, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, 1, FAST_TANH,
            PAGED, PAGE, EVEN_D, IS_FP32, USE_TMA, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _attn_inner_opt(
            acc, l_i, m_i, q, k_base, v_base,
            k_offs, v_offs, K, V, k_desc, v_desc, bt_row, k_head, v_head, offs_m, offs_n, offs_d, d_ok,
            d_lo, d_hi, d_hi, 0, seqlen_k, diag_shift, win_left, win_right, qk_scale, cap_in, cap_out, slope2,
            alibi_base, max_entry, stride_kn, stride_vn, stride_kp, stride_vp, stride_btn,
            False, CAUSAL, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, 0, FAST_TANH,
            PAGED, PAGE, EVEN_D, IS_FP32, USE_TMA, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _attn_inner_opt(
            acc, l_i, m_i, q, k_base, v_base,
            k_offs, v_offs, K, V, k_desc, v_desc, bt_row, k_head, v_head, offs_m, offs_n, offs_d, d_ok,
            d_hi, full_hi, full_hi, 0, seqlen_k, diag_shift, win_left, win_right, qk_scale, cap_in, cap_out, slope2,
            alibi_base, max_entry, stride_kn, stride_vn, stride_kp, stride_vp, stride_btn,
            False, CAUSAL, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, 2, FAST_TANH,
            PAGED, PAGE, EVEN_D, IS_FP32, USE_TMA, BLOCK_M, BLOCK_N)
    else:
        acc, l_i, m_i = _attn_inner_opt(
            acc, l_i, m_i, q, k_base, v_base,
            k_offs, v_offs, K, V, k_desc, v_desc, bt_row, k_head, v_head, offs_m, offs_n, offs_d, d_ok,
            full_lo, full_hi, full_hi, 0, seqlen_k, diag_shift, win_left, win_right, qk_scale, cap_in, cap_out, slope2,
            alibi_base, max_entry, stride_kn, stride_vn, stride_kp, stride_vp, stride_btn,
            False, CAUSAL, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, EDGE, FAST_TANH,
            PAGED, PAGE, EVEN_D, IS_FP32, USE_TMA, BLOCK_M, BLOCK_N)
    if not EDGES_ONE_LOOP:
        acc, l_i, m_i = _attn_inner_opt(
            acc, l_i, m_i, q, k_base, v_base,
            k_offs, v_offs, K, V, k_desc, v_desc, bt_row, k_head, v_head, offs_m, offs_n, offs_d, d_ok,
            full_hi, hi, hi, 0, seqlen_k, diag_shift, win_left, win_right, qk_scale, cap_in, cap_out, slope2,
            alibi_base, max_entry, stride_kn, stride_vn, stride_kp, stride_vp, stride_btn,
            True, CAUSAL, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, EDGE, FAST_TANH,
            PAGED, PAGE, EVEN_D, IS_FP32, USE_TMA, BLOCK_M, BLOCK_N)
    if SHIFTED:
        acc, l_i, m_i = _attn_inner_opt(
            acc, l_i, m_i, q, k_base, v_base,
            k_offs, v_offs, K, V, k_desc, v_desc, bt_row, k_head, v_head, offs_m, offs_n, offs_d, d_ok,
            d_from, hi0, hi0, 0, seqlen_k, diag_shift, win_left, win_right, qk_scale, cap_in, cap_out,
            slope2, alibi_base, max_entry, stride_kn, stride_vn, stride_kp, stride_vp, stride_btn,
            True, CAUSAL, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, -1, FAST_TANH,
            PAGED, PAGE, EVEN_D, IS_FP32, USE_TMA, BLOCK_M, BLOCK_N)
    return acc, l_i, m_i, alibi_base, shift2
