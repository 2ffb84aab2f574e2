"""Fused split of the QKV projection output + rotary embedding (RoPE, Su et al. 2021) in the HF

(Over 450 lines on purpose: the fused QKV split + RoPE kernel and flash-attn's standalone
``apply_rotary`` share the rotation code and its checks.)
rotate-half layout, with Qwen3's optional per-head RMSNorm of q and k before the rotation.

One launch reads each token's ``qkv`` row once and writes q (rotated), k (rotated) and v (copied)
straight into their destination buffers (e.g. slices of a KV cache), so the split, the norm, the
rotation and the copy into the cache cost one read and one write of the projection output.

For a head vector ``x`` of ``D`` (even) elements at position ``p`` (``h = D/2``):

    out[:h] = x[:h] * cos[p, :h] - x[h:] * sin[p, :h]
    out[h:] = x[h:] * cos[p, h:] + x[:h] * sin[p, h:]

i.e. ``x * cos + rotate_half(x) * sin``, computed in fp32 and rounded once to the output dtype
(PyTorch's version in the model dtype rounds after every op; this one is at least as accurate).
With a norm weight, ``x`` is first replaced by ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``
(HF rounding order, see :mod:`xoffload.kernels.norm`) in the qkv dtype.

CUDA tensors run the Triton kernel; CPU tensors run :func:`qkv_rope_ref`, or the Triton code under
``TRITON_INTERPRET=1`` (see :mod:`xoffload.kernels.checks`).

:func:`apply_rotary` is flash-attn's rotary embedding (the one ``flash_attn_with_kvcache`` applies
to q and the new k): half tables ``cos/sin [N, R/2]`` over the first ``R = rotary_dim`` dims, in
the GPT-NeoX layout (pairs ``(i, i + R/2)``) or the GPT-J interleaved one (pairs ``(2i, 2i+1)``),
at per-sequence start positions read on the device (CUDA-graph safe).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .checks import MAX_HEAD_DIM, check_eps, check_int, check_out, check_tensor, next_pow2, use_triton

__all__ = ["apply_rotary", "apply_rotary_ref", "qkv_rope", "qkv_rope_ref"]


@triton.jit
def _norm_half_pair(x1, x2, W, cols, cmask, D, eps, DT: tl.constexpr):
    """Per-head RMSNorm of heads split in two halves ``[T, G, HALF]`` (fp32), HF rounding (to ``DT``)."""
    ms = (tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / D
    r = tl.math.rsqrt(ms + eps)[:, :, None]
    w1 = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, None, :]
    w2 = tl.load(W + (D // 2) + cols, mask=cmask, other=0.0).to(tl.float32)[None, None, :]
    y1 = (x1 * r).to(DT).to(tl.float32) * w1
    y2 = (x2 * r).to(DT).to(tl.float32) * w2
    return y1.to(DT).to(tl.float32), y2.to(DT).to(tl.float32)


@triton.jit
def _qkv_rope_kernel(
    QKV, COS, SIN, POS, QO, KO, VO, QW, KW,
    N, HQ, HKV, D, G, pos0, eps,
    s_qkv, s_cos, s_sin,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
    POS_FROM_PTR: tl.constexpr, POS_PER_ROW: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, HALF: tl.constexpr,
):
    """Program (token block, head group): ``G`` consecutive heads (``G`` divides ``HQ`` and
    ``HKV``, so a group lies inside the q, the k or the v section) of ``BLOCK_T`` tokens, tile
    ``[BLOCK_T, BLOCK_G, HALF]`` per half head; the cos/sin rows are loaded once per group."""
    pid_t = tl.program_id(0)
    h0 = tl.program_id(1) * G
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < N
    t64 = t.to(tl.int64)[:, None, None]
    g = tl.arange(0, BLOCK_G)
    gmask = g < G
    g64 = g.to(tl.int64)[None, :, None]
    half = D // 2
    cols = tl.arange(0, HALF)
    cmask = cols < half
    msk = tmask[:, None, None] & gmask[None, :, None] & cmask[None, None, :]
    c3 = cols[None, None, :]
    src = QKV + t64 * s_qkv + (h0.to(tl.int64) + g64) * D + c3
    x1 = tl.load(src, mask=msk, other=0.0)
    x2 = tl.load(src + half, mask=msk, other=0.0)
    DT = x1.dtype
    if h0 >= HQ + HKV:
        # v: copy
        dst = VO + t64 * sv_t + ((h0 - HQ - HKV).to(tl.int64) + g64) * sv_h + c3
        tl.store(dst, x1.to(VO.dtype.element_ty), mask=msk)
        tl.store(dst + half, x2.to(VO.dtype.element_ty), mask=msk)
    else:
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        if POS_PER_ROW:
            p = tl.load(POS + t, mask=tmask, other=0).to(tl.int64)
        elif POS_FROM_PTR:
            p = tl.load(POS).to(tl.int64) + t.to(tl.int64)
        else:
            p = pos0 + t.to(tl.int64)
        # rows of the tables [BLOCK_T, HALF], broadcast over the group's heads
        tm2 = tmask[:, None] & cmask[None, :]
        c_ptr = COS + p[:, None] * s_cos + cols[None, :]
        s_ptr = SIN + p[:, None] * s_sin + cols[None, :]
        c1 = tl.load(c_ptr, mask=tm2, other=0.0).to(tl.float32)[:, None, :]
        c2 = tl.load(c_ptr + half, mask=tm2, other=0.0).to(tl.float32)[:, None, :]
        s1 = tl.load(s_ptr, mask=tm2, other=0.0).to(tl.float32)[:, None, :]
        s2 = tl.load(s_ptr + half, mask=tm2, other=0.0).to(tl.float32)[:, None, :]
        if h0 < HQ:
            if Q_NORM:
                f1, f2 = _norm_half_pair(f1, f2, QW, cols, cmask, D, eps, DT)
            dst = QO + t64 * sq_t + (h0.to(tl.int64) + g64) * sq_h + c3
        else:
            if K_NORM:
                f1, f2 = _norm_half_pair(f1, f2, KW, cols, cmask, D, eps, DT)
            dst = KO + t64 * sk_t + ((h0 - HQ).to(tl.int64) + g64) * sk_h + c3
        o1 = f1 * c1 - f2 * s1
        o2 = f2 * c2 + f1 * s2
        tl.store(dst, o1.to(QO.dtype.element_ty), mask=msk)
        tl.store(dst + half, o2.to(QO.dtype.element_ty), mask=msk)


def _group(hkv: int, max_g: int = 8) -> int:
    """Heads per program: the largest divisor of ``hkv`` (which divides ``hq`` too) up to ``max_g``."""
    return max(g for g in range(1, min(hkv, max_g) + 1) if hkv % g == 0)


def launch_config(d: int, hkv: int = 8) -> dict:
    """Launch parameters for head_dim ``d`` and ``hkv`` KV heads: ``HALF`` = padded ``d/2``; ``G``
    heads per program (a divisor of ``hkv``, so of ``Hq`` too), padded to ``BLOCK_G``;
    ``BLOCK_T`` tokens per program (~2K elements per half-head tile, 16 per thread; grid
    ``(cdiv(N, BLOCK_T), (Hq + 2*Hkv) / G)``)."""
    half = next_pow2(max(d // 2, 8))
    g = _group(hkv)
    bg = next_pow2(g)
    bt = max(1, min(64, 2048 // (half * bg)))
    return {"G": g, "BLOCK_T": bt, "BLOCK_G": bg, "HALF": half, "num_warps": 4}


def _launch(qkv, cos, sin, pos, hq, hkv, d, q_out, k_out, v_out, q_norm, k_norm, eps, config=None):
    n = qkv.shape[0]
    cfg = dict(launch_config(d, hkv))
    if config:
        cfg.update(config)
        if "G" in config and "BLOCK_G" not in config:
            cfg["BLOCK_G"] = next_pow2(cfg["G"])
    g = cfg.pop("G")
    if hkv % g != 0:
        raise ValueError(f"G={g} heads per program must divide num_kv_heads={hkv}")
    pos_t = isinstance(pos, torch.Tensor)
    per_row = pos_t and pos.numel() > 1
    if per_row:
        pos = pos.reshape(-1)
        if pos.stride(0) != 1:
            pos = pos.contiguous()
    grid = (triton.cdiv(n, cfg["BLOCK_T"]), (hq + 2 * hkv) // g)
    _qkv_rope_kernel[grid](
        qkv, cos, sin, pos if pos_t else qkv, q_out, k_out, v_out,
        q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv,
        n, hq, hkv, d, g, 0 if pos_t else int(pos), float(eps),
        qkv.stride(0), cos.stride(0), sin.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
        POS_FROM_PTR=pos_t, POS_PER_ROW=per_row, Q_NORM=q_norm is not None, K_NORM=k_norm is not None, **cfg,
    )


def _norm_ref(x, w, eps):
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (xn.float() * w.float()).to(x.dtype)


def _rope_ref(x, cos, sin):
    """fp32 rotate-half RoPE of x ``[T, H, D]`` with cos/sin ``[T, D]``, rounded once."""
    h = x.shape[-1] // 2
    xf = x.float()
    rot = torch.cat((-xf[..., h:], xf[..., :h]), dim=-1)
    return (xf * cos.float()[:, None, :] + rot * sin.float()[:, None, :]).to(x.dtype)


def qkv_rope_ref(qkv, cos, sin, positions_start, num_heads, num_kv_heads, head_dim,
                 q_norm=None, k_norm=None, eps=1e-6):
    """PyTorch version with the kernel's rounding points. Returns ``(q, k, v)`` ``[N, H*, D]`` in
    ``qkv``'s dtype. cos/sin ``[n_max, 1, D]`` or ``[n_max, D]``; positions_start an int, an
    integer tensor of one element (the first token's position) or of ``N`` elements (one position
    per token row)."""
    n = qkv.shape[0]
    hq, hkv, d = num_heads, num_kv_heads, head_dim
    if isinstance(positions_start, torch.Tensor) and positions_start.numel() > 1:
        rows = positions_start.reshape(-1).to(device=cos.device, dtype=torch.int64)
        c = cos.reshape(cos.shape[0], d)[rows]
        s = sin.reshape(sin.shape[0], d)[rows]
    else:
        p0 = int(positions_start.reshape(-1)[0]) if isinstance(positions_start, torch.Tensor) else int(positions_start)
        c = cos.reshape(cos.shape[0], d)[p0:p0 + n]
        s = sin.reshape(sin.shape[0], d)[p0:p0 + n]
    q = qkv[:, : hq * d].reshape(n, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].reshape(n, hkv, d)
    v = qkv[:, (hq + hkv) * d:].reshape(n, hkv, d)
    if q_norm is not None:
        q = _norm_ref(q, q_norm, eps)
    if k_norm is not None:
        k = _norm_ref(k, k_norm, eps)
    return _rope_ref(q, c, s), _rope_ref(k, c, s), v.clone()


def _check_table(name, t, d, device):
    check_tensor(name, t)
    ok = (t.dim() == 3 and t.shape[1] == 1 and t.shape[2] == d) or (t.dim() == 2 and t.shape[1] == d)
    if not ok:
        raise ValueError(f"{name} must have shape [n_max, 1, D] or [n_max, D] with D={d}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but qkv is on {device}")


def _check_rope_args(qkv, cos, sin, positions_start, num_heads, num_kv_heads, head_dim):
    """Validate :func:`qkv_rope`'s input, tables and position; returns ``(N, Hq, Hkv, D)``."""
    check_tensor("qkv", qkv, ndim=2)
    hq = check_int("num_heads", num_heads, 1)
    hkv = check_int("num_kv_heads", num_kv_heads, 1)
    d = check_int("head_dim", head_dim, 1)
    if hq % hkv != 0:
        raise ValueError(f"num_heads ({hq}) must be a multiple of num_kv_heads ({hkv}) (GQA)")
    if d % 2 != 0 or d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be even and <= {MAX_HEAD_DIM} (rotate-half RoPE), got {d}")
    n, width = qkv.shape
    if width != (hq + 2 * hkv) * d:
        raise ValueError(
            f"qkv has shape {tuple(qkv.shape)} but num_heads={hq}, num_kv_heads={hkv}, head_dim={d} "
            f"need [N, (Hq + 2*Hkv) * D] = [N, {(hq + 2 * hkv) * d}]"
        )
    _check_table("cos", cos, d, qkv.device)
    _check_table("sin", sin, d, qkv.device)
    if cos.shape[0] != sin.shape[0]:
        raise ValueError(f"cos has shape {tuple(cos.shape)} but sin has {tuple(sin.shape)}; they must match")
    if isinstance(positions_start, torch.Tensor):
        if positions_start.dtype.is_floating_point or positions_start.dtype.is_complex or positions_start.dtype == torch.bool:
            raise TypeError(f"positions_start tensor must have an integer dtype, got {positions_start.dtype}")
        if positions_start.numel() not in (1, n):
            raise ValueError(f"positions_start tensor must have one element (the first position) or N={n} "
                             f"(one per row), got shape {tuple(positions_start.shape)}")
        if positions_start.device != qkv.device:
            raise ValueError(f"positions_start is on {positions_start.device} but qkv is on {qkv.device}")
    elif check_int("positions_start", positions_start, 0) + n > cos.shape[0]:
        raise ValueError(
            f"positions {positions_start}..{positions_start + n - 1} run past the RoPE tables "
            f"(cos/sin have {cos.shape[0]} positions, shape {tuple(cos.shape)})"
        )
    return n, hq, hkv, d


def qkv_rope(qkv, cos, sin, positions_start, num_heads, num_kv_heads, head_dim, q_out, k_out, v_out,
             q_norm=None, k_norm=None, eps=1e-6):
    """Split the fused QKV projection of ``N`` consecutive tokens, apply RoPE to q and k (after the
    optional Qwen3 per-head RMSNorm) and write q, k, v into the given buffers, in one launch.

    Equals ``apply_rope(rms_norm(q, q_norm) if q_norm is not None else q, cos, sin)`` (and the same
    for k; v copied) of ``xoffload.models.llama`` within the dtype's rounding: the rotation is
    computed in fp32 and rounded once.

    Args:
        qkv: ``[N, (Hq + 2*Hkv) * D]`` fp16/bf16/fp32, q heads then k heads then v heads along the
            last dim (``x @ wqkv.t()``); rows may be strided, the last dim must be contiguous.
        cos, sin: RoPE tables ``[n_max, 1, D]`` (as ``LlamaModel.rope_tables``) or ``[n_max, D]``,
            HF rotate-half layout, any supported float dtype, on ``qkv``'s device.
        positions_start: position of the first token (tokens are at ``positions_start ..
            positions_start + N - 1``): an int, or an integer tensor of one element on ``qkv``'s
            device (read by the kernel, not on the host: CUDA-graph safe, but then the caller
            guarantees ``positions_start + N <= n_max``; an int is checked); or an integer tensor
            of ``N`` elements (``N > 1``): row i is at position ``positions_start[i]`` (batched
            decode: one token of each of N sequences; every value must be in ``[0, n_max)``,
            not checked on the host).
        num_heads, num_kv_heads, head_dim: ``Hq``, ``Hkv`` (``Hq % Hkv == 0``), ``D`` (even, <= 256).
        q_out: ``[N, Hq, D]``; k_out, v_out: ``[N, Hkv, D]``; in ``qkv``'s dtype, on its device,
            last dim contiguous, other strides free (e.g. ``k_cache[s:e]``). Each may also be the
            matching slice of ``qkv`` viewed as ``[N, H*, D]`` (in place).
        q_norm, k_norm: optional ``[D]`` RMSNorm weights (Qwen3), applied per head before RoPE.
        eps: RMSNorm epsilon (finite, >= 0), used only with a norm weight.

    Returns:
        ``(q_out, k_out, v_out)``.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, an output dtype other than ``qkv``'s, a
            non-int head count or position, a non-integer position tensor.
        ValueError: shapes that disagree (named with the shapes), an odd or too large head_dim,
            ``Hq % Hkv != 0``, positions past the end of the tables, a negative position, tensors
            on different devices, a non-contiguous last dim.
    """
    n, hq, hkv, d = _check_rope_args(qkv, cos, sin, positions_start, num_heads, num_kv_heads, head_dim)
    for name, t, heads in (("q_out", q_out, hq), ("k_out", k_out, hkv), ("v_out", v_out, hkv)):
        check_out(name, t, (n, heads, d), qkv.dtype, qkv.device)
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None:
            check_tensor(name, w, ndim=1)
            check_out(name, w, (d,), w.dtype, qkv.device)
    check_eps(eps)
    if n == 0:
        return q_out, k_out, v_out
    if use_triton(qkv):
        _launch(qkv, cos, sin, positions_start, hq, hkv, d, q_out, k_out, v_out, q_norm, k_norm, eps)
    else:
        q, k, v = qkv_rope_ref(qkv, cos, sin, positions_start, hq, hkv, d, q_norm, k_norm, eps)
        q_out.copy_(q)
        k_out.copy_(k)
        v_out.copy_(v)
    return q_out, k_out, v_out



# ----------------------------------------------------------------------------------------------
# flash-attn's rotary embedding (flash_attn_with_kvcache's rotary_cos / rotary_sin)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _rotary_kernel(
    X, COS, SIN, POS, OUT,
    S, H, D, N, HALF_R, pos0,
    s_xb, s_xs, s_xh, s_ob, s_os, s_oh, s_cos, s_sin,
    POS_PTR: tl.constexpr, SAME_POS: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (token b*S + s, head block): ``[BLOCK_H, BLOCK_D]`` of x rotated at position
    ``POS[b] (+ s)``: ``y[d] = x[d] * cos[c(d)] + sign(d) * x[partner(d)] * sin[c(d)]`` for
    ``d < 2 * HALF_R``, ``y[d] = x[d]`` beyond. All loads precede the stores (in place is safe)."""
    pid = tl.program_id(0)
    b = (pid // S).to(tl.int64)
    s = pid % S
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    if POS_PTR:
        p = tl.load(POS + b).to(tl.int64)
    else:
        p = pos0 + 0 * b
    if not SAME_POS:
        p = p + s
    p = tl.minimum(tl.maximum(p, 0), N - 1)
    rot = d < 2 * HALF_R
    if INTERLEAVED:
        partner = d ^ 1
        ci = d // 2
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    else:
        first = d < HALF_R
        partner = tl.where(first, d + HALF_R, d - HALF_R)
        ci = tl.where(first, d, d - HALF_R)
        sign = tl.where(first, -1.0, 1.0)
    m2 = hmask[:, None] & dmask[None, :]
    src = X + b * s_xb + s * s_xs + h[:, None].to(tl.int64) * s_xh
    x = tl.load(src + d[None, :], mask=m2, other=0.0).to(tl.float32)
    xp = tl.load(src + partner[None, :], mask=m2 & rot[None, :], other=0.0).to(tl.float32)
    c = tl.load(COS + p * s_cos + ci, mask=rot & dmask, other=1.0).to(tl.float32)
    sn = tl.load(SIN + p * s_sin + ci, mask=rot & dmask, other=0.0).to(tl.float32)
    y = x * c[None, :] + sign[None, :] * xp * sn[None, :]
    dst = OUT + b * s_ob + s * s_os + h[:, None].to(tl.int64) * s_oh + d[None, :]
    tl.store(dst, y.to(OUT.dtype.element_ty), mask=m2)


def apply_rotary_ref(x, cos, sin, seqlen_offsets, *, interleaved=False, same_position=False):
    """PyTorch version of :func:`apply_rotary` (fp32, rounded once to x's dtype; positions clamped
    to ``[0, N - 1]`` as in the kernel)."""
    b, sq, h, d = x.shape
    r = 2 * cos.shape[1]
    if isinstance(seqlen_offsets, torch.Tensor):
        off = seqlen_offsets.to(device=x.device, dtype=torch.int64).reshape(-1).expand(b)
    else:
        off = torch.full((b,), int(seqlen_offsets), dtype=torch.int64, device=x.device)
    steps = torch.zeros(sq, dtype=torch.int64, device=x.device) if same_position else torch.arange(sq, device=x.device)
    pos = (off[:, None] + steps[None, :]).clamp(0, cos.shape[0] - 1)  # [B, S]
    c = cos.float()[pos][:, :, None, :]  # [B, S, 1, R/2]
    s_ = sin.float()[pos][:, :, None, :]
    xf = x.float()
    xr = xf[..., :r]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        y = torch.stack((x1 * c - x2 * s_, x2 * c + x1 * s_), dim=-1).reshape(b, sq, h, r)
    else:
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        y = torch.cat((x1 * c - x2 * s_, x2 * c + x1 * s_), dim=-1)
    return torch.cat((y, xf[..., r:]), dim=-1).to(x.dtype)


def check_rotary_tables(cos, sin, head_dim: int, device) -> int:
    """flash-attn's rotary tables: ``cos`` and ``sin`` of one shape ``[N, R/2]`` (``R =
    rotary_dim``, ``0 < R <= head_dim``), a supported float dtype, on ``device``, last dim
    contiguous. Returns R. Raises TypeError / ValueError naming the table and its shape."""
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        check_tensor(name, t, ndim=2)
        if t.device != torch.device(device):
            raise ValueError(f"{name} is on {t.device} but q is on {device}")
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"rotary_cos has shape {tuple(cos.shape)} but rotary_sin has {tuple(sin.shape)}; they must match")
    r = 2 * cos.shape[1]
    if r == 0 or r > head_dim:
        raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {r} must be in [2, head_dim={head_dim}] "
                         f"(rotary_cos {tuple(cos.shape)})")
    if cos.shape[0] == 0:
        raise ValueError(f"rotary_cos has no position (shape {tuple(cos.shape)})")
    return r


def apply_rotary(x, cos, sin, seqlen_offsets, *, interleaved=False, same_position=False, out=None):
    """flash-attn's rotary embedding of ``x``, computed in fp32 and rounded once (one launch).

    Token i of item b sits at position ``seqlen_offsets[b] + i`` (or ``seqlen_offsets[b]`` for
    every token with ``same_position``, flash-attn's convention for a non-causal q in
    ``flash_attn_with_kvcache``). With ``R = rotary_dim = 2 * cos.shape[1]`` and ``p`` the
    position, the first R dims are rotated, the rest copied:

    * non-interleaved (GPT-NeoX, ``rotate_half``): ``y[i] = x[i] cos[p,i] - x[i+R/2] sin[p,i]``,
      ``y[i+R/2] = x[i+R/2] cos[p,i] + x[i] sin[p,i]`` for ``i < R/2``;
    * interleaved (GPT-J): ``y[2i] = x[2i] cos[p,i] - x[2i+1] sin[p,i]``,
      ``y[2i+1] = x[2i+1] cos[p,i] + x[2i] sin[p,i]``.

    Args:
        x: ``[B, S, H, D]`` fp16/bf16/fp32, last dim contiguous (other strides free).
        cos, sin: ``[N, R/2]`` tables (any supported float dtype), on x's device, ``R <= D``.
        seqlen_offsets: an int, or an integer tensor ``[B]`` (or of one element) on x's device,
            read by the kernel (no host sync). Positions past ``N - 1`` are clamped to it; the
            caller guarantees ``offset + S <= N`` (flash-attn: the tables cover the cache).
        interleaved: the GPT-J layout (flash-attn's default in ``flash_attn_with_kvcache``).
        same_position: every token of item b at ``seqlen_offsets[b]``.
        out: optional ``[B, S, H, D]`` buffer in x's dtype (may be x itself: in place).

    Returns:
        ``out`` (a new tensor when not given).

    Raises:
        TypeError: non-tensors, unsupported dtypes, a non-integer offset tensor.
        ValueError: x not 4-D, tables of the wrong shape (rotary_dim odd, 0 or > D), tensors on
            another device, a negative int offset, a non-contiguous last dim.
    """
    check_tensor("x", x, ndim=4)
    b, sq, h, d = x.shape
    r = check_rotary_tables(cos, sin, d, x.device)
    if isinstance(seqlen_offsets, torch.Tensor):
        t = seqlen_offsets
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"seqlen_offsets tensor must have an integer dtype, got {t.dtype}")
        if t.numel() not in (1, b):
            raise ValueError(f"seqlen_offsets tensor must have shape [B] = [{b}] or one element, got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"seqlen_offsets is on {t.device} but x is on {x.device}")
    else:
        check_int("seqlen_offsets", seqlen_offsets, 0)
    if out is None:
        out = torch.empty_like(x)
    else:
        check_out("out", out, tuple(x.shape), x.dtype, x.device)
    if out.numel() == 0:
        return out
    if not use_triton(x):
        out.copy_(apply_rotary_ref(x, cos, sin, seqlen_offsets, interleaved=interleaved, same_position=same_position))
        return out
    pos_t = isinstance(seqlen_offsets, torch.Tensor)
    pos = seqlen_offsets.reshape(-1).expand(b).contiguous() if pos_t else x
    block_d = next_pow2(max(d, 2))
    block_h = max(1, min(next_pow2(h), 2048 // block_d))  # <= 16 fp32 elements per thread and tensor
    grid = (b * sq, triton.cdiv(h, block_h))
    _rotary_kernel[grid](
        x, cos, sin, pos, out,
        sq, h, d, cos.shape[0], r // 2, 0 if pos_t else int(seqlen_offsets),
        x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
        cos.stride(0), sin.stride(0),
        POS_PTR=pos_t, SAME_POS=bool(same_position), INTERLEAVED=bool(interleaved),
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )
    return out
