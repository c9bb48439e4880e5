"""Attention one block at a time: the online softmax behind FlashAttention and ring attention.

Softmax needs the maximum and the sum over a *whole* row of scores, yet we want to see the keys a
block at a time (a block is all a device holds, or all that fits in fast memory). Keep per query
row a running maximum ``m``, a running sum ``l`` of ``exp(s - m)`` and a running output ``acc``;
when a new block raises the maximum, rescale what was accumulated by ``exp(m_old - m_new)``::

    for each K/V block j:                        # s_j = q k_jᵀ / √d        (rows, block)
        m_new = max(m, rowmax(s_j))
        acc   = acc · exp(m - m_new) + exp(s_j - m_new) v_j
        l     = l   · exp(m - m_new) + rowsum(exp(s_j - m_new))
        m     = m_new
    out = acc / l ;   lse = m + log(l)           # lse = log Σ_j exp(s_ij), the row's log-sum-exp

Two partial results over disjoint key sets merge by their log-sum-exps alone
(:func:`merge_attention`) — which is all a ring of devices needs to exchange besides K and V.
"""

from __future__ import annotations

import math

import torch

from ..runtime import check_choice, check_int, check_tensor

__all__ = ["attention_block", "attention_block_backward", "blockwise_attention", "merge_attention"]

KERNELS = ("readable", "fused")


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int,
                        causal: bool = False, kernel: str = "readable", return_lse: bool = False):
    """Attention computed one ``block_size`` block of queries and keys at a time (online softmax).

    Equals ``F.scaled_dot_product_attention(q, k, v, is_causal=causal)`` for any length (the last
    block may be shorter) while never holding more than a ``block_size × block_size`` tile of scores.

    Args:
        q, k, v: ``(batch, heads, seq, head_dim)``, the same ``seq`` for all three.
        block_size: rows and columns of one tile of scores (≥ 1).
        causal: query ``i`` sees keys ``0 … i`` only; tiles above the diagonal are skipped.
        kernel: ``"readable"`` (matmul + running max/sum, differentiable by autograd) or
            ``"fused"`` (each tile by the fused op that returns its log-sum-exp,
            ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` on CPU; forward only).
        return_lse: also return the log-sum-exp per query row, ``(batch, heads, seq)``.

    Returns:
        the output ``(batch, heads, seq, head_dim)``, or ``(output, lse)`` with ``return_lse``.

    Example::

        >>> import torch, torch.nn.functional as F
        >>> q, k, v = torch.randn(3, 1, 2, 10, 8).unbind(0)
        >>> out, lse = blockwise_attention(q, k, v, block_size=4, causal=True, return_lse=True)
        >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
        True
        >>> lse.shape
        torch.Size([1, 2, 10])

    .. warning::
        Subtracting the running maximum is what keeps ``exp`` from overflowing; a row whose block
        is entirely masked has maximum ``-inf`` and ``exp(-inf - (-inf))`` is NaN — such tiles are
        skipped, never computed.
    """
    _check_qkv(q, k, v)
    check_int("block_size", block_size, 1)
    check_choice("kernel", kernel, KERNELS)
    seq = q.shape[2]
    if k.shape[2] != seq:
        raise ValueError(f"q and k must have the same sequence length, got {seq} and {k.shape[2]}")
    outs, lses = [], []
    for i in range(0, seq, block_size):                         # 1) one block of query rows
        qi = q[:, :, i:i + block_size]                          # (B, H, bq, D)
        out = torch.zeros_like(qi)
        lse = torch.full(qi.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)  # (B, H, bq)
        for j in range(0, seq, block_size):                     # 2) one block of keys at a time
            if causal and j > i:
                break                                           #    above the diagonal: all masked
            kj, vj = k[:, :, j:j + block_size], v[:, :, j:j + block_size]
            o, l = attention_block(qi, kj, vj, causal=causal and i == j, kernel=kernel)
            out, lse = merge_attention(out, lse, o, l)          # 3) rescale and add
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    return (out, lse) if return_lse else out


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge attention over key set A and over a disjoint key set B into attention over A ∪ B.

    ``lse = log(e^lse_a + e^lse_b)``; each output is weighted by the share of the softmax mass
    its keys hold, ``exp(lse_x - lse)``. An empty part has ``lse = -inf`` and weight 0.

    Example::

        >>> import torch, torch.nn.functional as F
        >>> q, k, v = torch.randn(3, 1, 1, 4, 8).unbind(0)
        >>> a = attention_block(q, k[:, :, :2], v[:, :, :2])
        >>> b = attention_block(q, k[:, :, 2:], v[:, :, 2:])
        >>> out, lse = merge_attention(*a, *b)
        >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-6)
        True

    .. warning::
        Write the weights as ``exp(lse_x − lse)``, never ``exp(lse_x) / (exp(lse_a) + exp(lse_b))``:
        with scores in the hundreds ``exp(lse_x)`` overflows fp32 and the merge returns NaN.
    """
    lse = torch.logaddexp(lse_a, lse_b)                          # (B, H, rows)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - lse_safe).unsqueeze(-1)              # (B, H, rows, 1)
    w_b = torch.exp(lse_b - lse_safe).unsqueeze(-1)
    return out_a * w_a + out_b * w_b, lse


def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    kernel: str = "readable"):
    """``(out, lse)`` of ``q`` attending to one block of keys (``causal``: top-left aligned mask).

    Args:
        q: ``(batch, heads, rows, head_dim)``.
        k, v: ``(batch, kv_heads, cols, head_dim)``; ``kv_heads`` divides ``heads`` (grouped-query).
        causal: mask ``col > row`` (top-left aligned: right for a diagonal tile of equal sides).
        kernel: ``"readable"`` (matmul + softmax) or ``"fused"`` (the fused op that also returns
            the log-sum-exp).

    Returns:
        ``(out (batch, heads, rows, head_dim), lse (batch, heads, rows))``.

    Example::

        >>> import torch, torch.nn.functional as F
        >>> q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)
        >>> (o1, l1), (o2, l2) = attention_block(q, k, v), attention_block(q, k, v, kernel="fused")
        >>> torch.allclose(o1, o2, atol=1e-6), torch.allclose(l1, l2, atol=1e-5)
        (True, True)
    """
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    if kernel == "fused":
        return _fused_forward(q, k, v, causal)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])        # (B, H, rows, cols)
    if causal:
        s = s.masked_fill(_causal_mask(s), -math.inf)
    lse = torch.logsumexp(s, dim=-1)                             # (B, H, rows)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def attention_block_backward(dout, q, k, v, out, lse, *, causal: bool = False, kernel: str = "readable"):
    """``(dq, dk, dv)`` of one block, given the *final* ``out`` and ``lse`` of the query rows.

    With the final log-sum-exp, ``P = exp(S - lse)`` is the block's slice of the full softmax, so
    the block's gradients are its exact share of the full gradients (FlashAttention's backward)::

        dV = Pᵀ dO ;  dP = dO Vᵀ ;  dS = P ∘ (dP − rowsum(dO ∘ O)) ;  dQ = dS K / √d ;  dK = dSᵀ Q / √d

    Args:
        dout, q, out: the gradient of the output, the queries and the *final* output of these rows.
        k, v: the block's keys and values (``kv_heads`` may divide ``heads``).
        lse: the *final* log-sum-exp of these rows, ``(batch, heads, rows)``.
        causal, kernel: as in :func:`attention_block`.

    Example::

        >>> import torch, torch.nn.functional as F
        >>> q, k, v = (torch.randn(3, 1, 1, 4, 8)).unbind(0)
        >>> out, lse = attention_block(q, k, v)
        >>> dq, dk, dv = attention_block_backward(torch.ones_like(out), q, k, v, out, lse)
        >>> qq = q.clone().requires_grad_(); F.scaled_dot_product_attention(qq, k, v).sum().backward()
        >>> torch.allclose(dq, qq.grad, atol=1e-5)
        True
    """
    heads_kv = k.shape[1]
    ke, ve = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    if kernel == "fused" and not q.is_cuda:          # CUDA: the readable maths below (no fused op wired)
        dq, dk, dv = _fused_backward(dout, q, ke, ve, out, lse, causal)
    else:
        scale = 1.0 / math.sqrt(q.shape[-1])
        s = q @ ke.transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(_causal_mask(s), -math.inf)
        p = torch.exp(s - lse.unsqueeze(-1))                     # (B, H, rows, cols)
        dv = p.transpose(-1, -2) @ dout
        dp = dout @ ve.transpose(-1, -2)
        ds = p * (dp - (dout * out).sum(-1, keepdim=True))
        dq, dk = ds @ ke * scale, ds.transpose(-1, -2) @ q * scale
    return dq, _reduce_kv(dk, heads_kv), _reduce_kv(dv, heads_kv)


# ------------------------------------------------------------------------------ plumbing
def _causal_mask(s: torch.Tensor) -> torch.Tensor:
    rows, cols = s.shape[-2:]
    return torch.ones(rows, cols, dtype=torch.bool, device=s.device).triu(1)


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _reduce_kv(dx: torch.Tensor, heads_kv: int) -> torch.Tensor:
    b, h, s, d = dx.shape
    return dx if h == heads_kv else dx.view(b, heads_kv, h // heads_kv, s, d).sum(2)


def _fused_forward(q, k, v, causal):
    if q.is_cuda and q.dtype == torch.float64:   # CUDA's fused kernels take fp32, fp16 and bf16 only
        return attention_block(q, k, v, causal=causal, kernel="readable")
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[:2]
        return out, lse[..., :q.shape[2]]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def _fused_backward(dout, q, k, v, out, lse, causal):
    c = [t.contiguous() for t in (dout, q, k, v, out, lse)]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*c, 0.0, causal)


def _check_qkv(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=4, floating=True)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, h, _, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or h % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head_dim, "
                         "and q's heads must be a multiple of k's (batch, heads, seq, head_dim)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
