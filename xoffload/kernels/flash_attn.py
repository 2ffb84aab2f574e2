"""Dense prefill attention that also returns the log-sum-exp (LSE) of each query row.

FlashAttention-2 style forward pass (Dao, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning", 2023): each program owns one block of query rows of one head
and walks the key/value blocks with an online softmax (running row max ``m``, running row sum
``l``, fp32 accumulator), in base 2 (``exp2`` with the scale folded into ``log2(e)``). The LSE it
returns lets partial attentions over disjoint key sets merge exactly
(:func:`xoffload.kernels.merge_attention_states`).

Conventions (DESIGN.md): q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``; query head ``h`` reads KV
head ``h // (Hq // Hkv)``; only the last dim must be contiguous; LSE natural log, fp32,
``[B, Hq, Sq]`` (varlen ``[Hq, total_q]``); causal is bottom-right aligned (query ``i`` sees key
``j`` iff ``j <= i + Sk - Sq``); a row that sees no key gives output 0 and LSE -inf.

One Triton kernel serves the padded-batch and the varlen (packed, ``cu_seqlens``) forms. Under
causal masking each query block runs two loops: the key blocks every row of the block sees, with
no masking, then the few blocks on the diagonal, masked. Programs are ordered so that the query
blocks with the most keys (the last ones, under causal) start first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_bool, check_cu_seqlens, check_int, check_qkv, default_scale, next_pow2, use_triton
from .launch import LaunchConfig, override_for
from .reference import attention_ref, varlen_attention_ref

__all__ = ["flash_attn_with_lse", "flash_attn_varlen_with_lse"]


def _check_max_seqlen(name: str, value, cu: torch.Tensor, cu_name: str) -> int:
    value = check_int(name, value, 0)
    lens = cu.cpu().diff()
    longest = int(lens.max()) if lens.numel() else 0
    if value < longest:
        raise ValueError(f"{name} = {value} is smaller than the longest sequence in {cu_name} ({longest})")
    return value


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _online_softmax_step(qk, m_i, l_i, acc, start_n, offs_n, offs_m, seqlen_k, diag_shift, qk_scale,
                         MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """One online-softmax update (FlashAttention-2) for a tile of raw scores ``qk`` [M, N].

    Returns ``(p, m_new, l_i, acc)``: the tile's unnormalised probabilities (base 2, scale
    folded in), the new row max, and l_i / acc rescaled to it. With ``MASKED`` keys at or past
    ``seqlen_k`` (and, with ``CAUSAL``, keys after ``offs_m + diag_shift``) get probability 0; a
    row that has seen no key yet keeps m = -inf and subtracts 0 instead (no NaN). Shared by the
    dense and block-sparse kernels (inlined by Triton).
    """
    if MASKED:
        ok = ((start_n + offs_n) < seqlen_k)[None, :]
        if CAUSAL:
            ok = ok & ((start_n + offs_n)[None, :] <= (offs_m[:, None] + diag_shift))
        qk = tl.where(ok, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return p, m_new, l_i, acc


@triton.jit
def _attn_inner(acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, offs_m, offs_n,
                d_ok, lo, hi, seqlen_k, diag_shift, qk_scale,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
                IS_FP32: tl.constexpr, BLOCK_N: tl.constexpr, stride_kn, stride_vn):
    for start_n in tl.range(lo, hi, BLOCK_N):
        if MASKED:
            n_ok = (start_n + offs_n) < seqlen_k
            k = tl.load(k_base + k_offs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            k = tl.load(k_base + k_offs)
        else:
            k = tl.load(k_base + k_offs, mask=d_ok[None, :], other=0.0)
        if IS_FP32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        p, m_new, l_i, acc = _online_softmax_step(qk, m_i, l_i, acc, start_n, offs_n, offs_m, seqlen_k,
                                                  diag_shift, qk_scale, MASKED, CAUSAL)
        if MASKED:
            v = tl.load(v_base + v_offs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            v = tl.load(v_base + v_offs)
        else:
            v = tl.load(v_base + v_offs, mask=d_ok[None, :], other=0.0)
        if IS_FP32:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
        k_base += BLOCK_N * stride_kn
        v_base += BLOCK_N * stride_vn
    return acc, l_i, m_i

@triton.jit(do_not_specialize=["Sq", "Sk"])
def _attn_fwd(Q, K, V, O, LSE, CU_Q, CU_K,
              stride_qb, stride_qm, stride_qh,
              stride_kb, stride_kn, stride_kh,
              stride_vb, stride_vn, stride_vh,
              stride_ob, stride_om, stride_oh,
              stride_lb, stride_lh, stride_lm,
              Sq, Sk, n_bh, n_heads, group, num_m_blocks, qk_scale,
              D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
              IS_FP32: tl.constexpr):
    # 1-D grid: the (batch, head) index varies fastest, so the first programs launched are
    # the last query block of every head (the longest rows under causal) and programs that
    # run together share K/V heads (GQA) in L2.
    pid = tl.program_id(0)
    bh = pid % n_bh
    mb = num_m_blocks - 1 - pid // n_bh
    b = bh // n_heads
    h = bh % n_heads
    h_kv = h // group
    if VARLEN:
        q_start = tl.load(CU_Q + b)
        seqlen_q = tl.load(CU_Q + b + 1) - q_start
        k_start = tl.load(CU_K + b)
        seqlen_k = tl.load(CU_K + b + 1) - k_start
        q_row0 = q_start.to(tl.int64)
        k_row0 = k_start.to(tl.int64)
    else:
        seqlen_q = Sq
        seqlen_k = Sk
        q_row0 = 0
        k_row0 = 0
    m0 = mb * BLOCK_M
    if m0 < seqlen_q:
        EVEN_D: tl.constexpr = D == BLOCK_D
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        m_ok = offs_m < seqlen_q
        # int64 bases: batch / head / row products can pass 2^31 elements
        q_base = (Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
                  + (q_row0 + m0.to(tl.int64)) * stride_qm)
        k_base = (K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
                  + k_row0 * stride_kn)
        v_base = (V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
                  + k_row0 * stride_vn)
        rows = tl.arange(0, BLOCK_M)
        q = tl.load(q_base + rows[:, None] * stride_qm + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        k_offs = offs_n[:, None] * stride_kn + offs_d[None, :]
        v_offs = offs_n[:, None] * stride_vn + offs_d[None, :]

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        diag_shift = seqlen_k - seqlen_q
        if CAUSAL:
            hi = tl.minimum(seqlen_k, tl.maximum(m0 + BLOCK_M + diag_shift, 0))
            # keys < m0 + diag_shift + 1 are visible to every row of the block
            full = tl.minimum(tl.maximum(m0 + diag_shift + 1, 0), seqlen_k)
            full = (full // BLOCK_N) * BLOCK_N
        else:
            hi = seqlen_k
            full = (seqlen_k // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attn_inner(
            acc, l_i, m_i, q, k_base, v_base, k_offs, v_offs, offs_m, offs_n, d_ok,
            0, full, seqlen_k, diag_shift, qk_scale,
            False, CAUSAL, EVEN_D, IS_FP32, BLOCK_N, stride_kn, stride_vn)
        acc, l_i, m_i = _attn_inner(
            acc, l_i, m_i, q, k_base + full.to(tl.int64) * stride_kn,
            v_base + full.to(tl.int64) * stride_vn, k_offs, v_offs, offs_m, offs_n,
            d_ok, full, hi, seqlen_k, diag_shift, qk_scale,
            True, CAUSAL, EVEN_D, IS_FP32, BLOCK_N, stride_kn, stride_vn)

        empty = l_i == 0.0
        l_div = tl.where(empty, 1.0, l_i)
        out = acc / l_div[:, None]
        # m_i is in log2 units (scores scaled by log2(e)); convert back to natural log
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_div)) * 0.6931471805599453)
        o_base = (O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                  + (q_row0 + m0.to(tl.int64)) * stride_om)
        tl.store(o_base + rows[:, None] * stride_om + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
        l_base = (LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
                  + (q_row0 + m0.to(tl.int64)) * stride_lm)
        tl.store(l_base + rows * stride_lm, lse, mask=m_ok)


_INTERP_CFG = LaunchConfig(64, 32, 4, 1)  # BLOCK_M != BLOCK_N, as on the GPU


def _gpu_config(block_d: int, dtype: torch.dtype) -> LaunchConfig:
    """Launch configuration on a CUDA device (chosen from timings on an H200).

    fp32 runs the exact (non-tf32) product, which Hopper's tensor cores do not do: small tiles
    that keep register spills low; it is an accuracy path, not a fast one.
    """
    if dtype == torch.float32:
        return LaunchConfig(32, 16, 4, 2) if block_d <= 128 else LaunchConfig(16, 16, 4, 1)
    # H200, bf16, causal, 32K (benchmarks/results/attention.json, sweep): D=64 9/3 heads:
    # 128x64 8 warps 486 TFLOP/s (128x128: 375-452, 64x64: 463); D=128 32/8 heads: 128x128
    # 8 warps 3 stages 508 (TMA loads: the same, so the kernel has none; warp specialization:
    # 479; 128x64: 477-501; 2 stages: 445).
    if block_d <= 64:
        return LaunchConfig(128, 64, 8, 3)
    if block_d <= 128:
        return LaunchConfig(128, 128, 8, 3)
    return LaunchConfig(64, 32, 4, 2)


def _launch(q, k, v, out, lse, *, varlen, cu_q, cu_k, batch, sq, sk, max_sq, causal, scale):
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-2]
    block_d = max(16, next_pow2(d))
    cfg = override_for("flash_attn") or (_gpu_config(block_d, q.dtype) if q.is_cuda else _INTERP_CFG)
    if cfg.tma:
        raise ValueError(f"flash_attn has no TMA variant (it lost the sweep), got {cfg!r}")
    block_m, block_n = cfg.block_m, cfg.block_n
    num_m = triton.cdiv(max_sq, block_m)
    n_bh = batch * hq
    grid = (num_m * n_bh,)
    if grid[0] == 0:
        return
    if varlen:
        sqb = skb = svb = sob = 0
        sqm, sqh = q.stride(0), q.stride(1)
        skn, skh = k.stride(0), k.stride(1)
        svn, svh = v.stride(0), v.stride(1)
        som, soh = out.stride(0), out.stride(1)
        slb, slh, slm = 0, lse.stride(0), lse.stride(1)
    else:
        sqb, sqm, sqh = q.stride(0), q.stride(1), q.stride(2)
        skb, skn, skh = k.stride(0), k.stride(1), k.stride(2)
        svb, svn, svh = v.stride(0), v.stride(1), v.stride(2)
        sob, som, soh = out.stride(0), out.stride(1), out.stride(2)
        slb, slh, slm = lse.stride(0), lse.stride(1), lse.stride(2)
    dummy = cu_q if varlen else lse
    _attn_fwd[grid](
        q, k, v, out, lse, cu_q if varlen else dummy, cu_k if varlen else dummy,
        sqb, sqm, sqh, skb, skn, skh, svb, svn, svh, sob, som, soh, slb, slh, slm,
        sq, sk, n_bh, hq, hq // hkv, num_m, scale * 1.4426950408889634,
        D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, VARLEN=varlen,
        IS_FP32=q.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------

def flash_attn_with_lse(q, k, v, *, causal=False, softmax_scale=None):
    """Scaled dot-product attention over a padded batch, returning the output and its LSE.

    Args:
        q: ``[B, Sq, Hq, D]`` fp16 / bf16 / fp32; only the last dim must be contiguous.
        k, v: ``[B, Sk, Hkv, D]``, same dtype and device as ``q``; ``Hq % Hkv == 0`` (GQA: query
            head ``h`` reads KV head ``h // (Hq // Hkv)``); ``D <= 256``.
        causal: bottom-right aligned mask: query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq``.
        softmax_scale: multiplies ``q @ k^T`` before the softmax; default ``1/sqrt(D)``.

    Returns:
        ``(out, lse)``: out ``[B, Sq, Hq, D]`` in q's dtype (contiguous); lse ``[B, Hq, Sq]`` fp32,
        natural log of the softmax denominator of the scaled scores. Rows that see no key
        (``Sk == 0``, or ``i + Sk - Sq < 0`` under causal) give out 0 and lse -inf.

    Runs the Triton kernel for CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``), the
    fp32 PyTorch reference otherwise.

    Raises:
        TypeError: non-tensor inputs, unsupported or mismatched dtypes, non-bool ``causal``.
        ValueError: wrong ranks, non-contiguous last dim, devices differ, k/v shapes disagree,
            batch sizes or head dims differ, ``Hq % Hkv != 0``, ``D > 256``, bad ``softmax_scale``.
    """
    causal = check_bool("causal", causal)
    check_qkv(q, k, v, 4, "[B, Sk, Hkv, D]", same_batch=True)
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    scale = default_scale(d, softmax_scale)
    if not use_triton(q):
        out, lse = attention_ref(q, k, v, causal=causal, softmax_scale=scale)
        return out.to(q.dtype), lse
    out = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    _launch(q, k, v, out, lse, varlen=False, cu_q=None, cu_k=None, batch=b, sq=sq, sk=sk,
            max_sq=sq, causal=causal, scale=scale)
    return out, lse


def flash_attn_varlen_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                               causal=False, softmax_scale=None):
    """Attention over packed variable-length sequences (flash-attn's varlen layout), with LSE.

    Args:
        q: ``[total_q, Hq, D]``; k, v: ``[total_k, Hkv, D]`` (fp16 / bf16 / fp32, last dim
            contiguous, same dtype and device; ``Hq % Hkv == 0``; ``D <= 256``).
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]`` on the inputs' device, starting at 0,
            non-decreasing, ending at ``total_q`` / ``total_k``; sequence ``b`` owns query rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.
        max_seqlen_q, max_seqlen_k: ints at least the longest query / key sequence (the grid is
            sized from ``max_seqlen_q``).
        causal: bottom-right aligned within each sequence (``j <= i + Sk_b - Sq_b``).
        softmax_scale: default ``1/sqrt(D)``.

    Returns:
        ``(out, lse)``: out ``[total_q, Hq, D]`` in q's dtype; lse ``[Hq, total_q]`` fp32 natural
        log; rows that see no key give out 0 and lse -inf.

    Validation reads ``cu_seqlens_*`` on the host.

    Raises:
        TypeError: as :func:`flash_attn_with_lse`; cu_seqlens not int32; max_seqlen not an int.
        ValueError: as :func:`flash_attn_with_lse`; cu_seqlens of different lengths, not starting
            at 0, decreasing, not ending at the packed length, on another device; a max_seqlen
            smaller than the longest sequence.
    """
    causal = check_bool("causal", causal)
    check_qkv(q, k, v, 3, "[total_k, Hkv, D]")
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
            "must have the same length (batch + 1)"
        )
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q, "cu_seqlens_q")
    max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_seqlens_k, "cu_seqlens_k")
    total_q, hq, d = q.shape
    scale = default_scale(d, softmax_scale)
    if not use_triton(q):
        out, lse = varlen_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal,
                                        softmax_scale=scale)
        return out.to(q.dtype), lse
    out = torch.empty((total_q, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((hq, total_q), dtype=torch.float32, device=q.device)
    batch = cu_seqlens_q.numel() - 1
    # the kernel indexes cu_seqlens as CU + b: strided views are made contiguous
    _launch(q, k, v, out, lse, varlen=True, cu_q=cu_seqlens_q.contiguous(), cu_k=cu_seqlens_k.contiguous(), batch=batch,
            sq=0, sk=0, max_sq=max_seqlen_q, causal=causal, scale=scale)
    return out, lse
