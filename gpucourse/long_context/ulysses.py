"""DeepSpeed-Ulysses: trade the sequence split for a head split, attend, and trade back.

Attention mixes positions but never heads. So instead of passing K/V around a ring, one
all-to-all turns "every rank has all heads of ``seq/N`` positions" into "every rank has ``H/N``
heads of all positions"; each rank runs ordinary full-sequence attention on its heads, and a
second all-to-all turns the output back::

    q, k, v  (B, H, S/N, D)  --all_to_all-->  (B, H/N, S, D)   # send head group j to rank j
    out = attention(q, k, v)                                   # any kernel, the whole sequence
    out      (B, H/N, S, D)  --all_to_all-->  (B, H, S/N, D)

Four all-to-alls forward, four backward (the gradients go the opposite way), each sending
``(N−1)/N`` of a shard. It needs ``heads % N == 0`` — the number of heads caps ``N``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..runtime import check_choice
from .blockwise import KERNELS, blockwise_attention
from .ring import _check_ring_input, _rank_size
from .transport import CPStep, record_message, record_step

__all__ = ["ulysses_attention"]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, causal: bool = False,
                      kernel: str = "fused") -> torch.Tensor:
    """Attention over the whole sequence from contiguous sequence shards, by two all-to-alls.

    Args:
        q, k, v: this rank's contiguous shard ``(batch, heads, seq / N, head_dim)`` (``k``/``v``
            may have fewer heads); ``heads`` and ``k``'s heads must divide by ``N``.
        group: the context-parallel group (``None``: the default group, or one process).
        causal: causal mask over the global positions.
        kernel: ``"fused"`` (``F.scaled_dot_product_attention``) or ``"readable"``
            (:func:`blockwise_attention`).

    Returns:
        this rank's shard of the output; differentiable (the all-to-all's backward is the
        reverse all-to-all).

    Example::

        >>> import torch, torch.nn.functional as F, gpucourse as gc
        >>> def run(rank, world, q):
        ...     mine = q.chunk(world, dim=2)[rank]
        ...     return gc.ulysses_attention(mine, mine, mine, causal=True)
        >>> q = torch.randn(1, 4, 8, 4)
        >>> out = torch.cat(gc.launch(run, 2, args=(q,)), dim=2)
        >>> torch.allclose(out, F.scaled_dot_product_attention(q, q, q, is_causal=True), atol=1e-5)
        True

    .. warning::
        ``heads % N != 0`` raises ``ValueError`` on every rank: Ulysses cannot split 8 heads over
        16 ranks, however long the sequence — a ring can.
    """
    size = _check_ring_input(q, k, v, group, causal, "contiguous", kernel, what="ulysses_attention")
    if q.shape[1] % size or k.shape[1] % size:
        raise ValueError(f"ulysses_attention splits heads over the {size} ranks: heads ({q.shape[1]}) and "
                         f"kv heads ({k.shape[1]}) must divide by {size}; use ring_attention instead")
    check_choice("kernel", kernel, KERNELS)
    if not dist.is_initialized():
        group = None
    qh, kh, vh = (_SeqToHeads.apply(x, group) for x in (q, k, v))     # (B, H/N, S, D)
    start, cpu = time.perf_counter(), time.thread_time()
    if kh.shape[1] != qh.shape[1]:
        kh, vh = (x.repeat_interleave(qh.shape[1] // x.shape[1], dim=1) for x in (kh, vh))
    if kernel == "fused":
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
    else:
        out = blockwise_attention(qh, kh, vh, block_size=max(1, q.shape[2]), causal=causal)
    end = time.perf_counter()
    s = qh.shape[2]
    record_step(CPStep("forward", 0, _rank_size(group)[0], qh.shape[0] * qh.shape[1] * (s * (s + 1) // 2 if causal else s * s),
                       start, end, time.thread_time() - cpu, end, end))
    return _HeadsToSeq.apply(out, group)                                 # (B, H, S/N, D)


def _seq_to_heads(x, group, phase):
    """(B, H, n, D) → (B, H/N, N·n, D): head group j goes to rank j, sequence shards come back."""
    size = _rank_size(group)[1]
    if size == 1:
        return x
    b, h, n, d = x.shape
    send = x.reshape(b, size, h // size, n, d).transpose(0, 1).contiguous()   # (N, B, H/N, n, D)
    recv = _all_to_all(send, group, phase)                                    # recv[i]: rank i's shard
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * n, d)


def _heads_to_seq(y, group, phase):
    """(B, H/N, S, D) → (B, H, S/N, D): sequence shard j goes to rank j, head groups come back."""
    size = _rank_size(group)[1]
    if size == 1:
        return y
    b, hn, s, d = y.shape
    send = y.reshape(b, hn, size, s // size, d).permute(2, 0, 1, 3, 4).contiguous()  # (N, B, H/N, n, D)
    recv = _all_to_all(send, group, phase)                                    # recv[i]: head group i
    return recv.transpose(0, 1).reshape(b, size * hn, s // size, d)


def _all_to_all(send: torch.Tensor, group, phase: str) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    size = send.shape[0]
    record_message(phase, "all_to_all", send[0].numel() * send.element_size() * (size - 1))  # not to itself
    return recv


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group, "backward"), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq(y, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group, "backward"), None
