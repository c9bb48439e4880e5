"""Ring attention: each rank keeps its queries; the K/V blocks travel around the ring of ranks.

Rank ``r`` holds the ``r``-th shard of the sequence (or, zig-zag, two chunks of it). At step
``t = 0 … N−1`` it holds the K/V block that rank ``r − t`` started with; it posts "send this block
to ``r + 1``, receive the next from ``r − 1``", computes attention of its queries on the block it
has while the message travels, and merges the partial result by log-sum-exp::

    out, lse = 0, −∞                               # (B, H, n, D), (B, H, n)    n = seq / N
    kv = stack(k, v)                               # this rank's block
    for t in range(N):
        pending = send kv → r+1, receive ← r−1     # (not at the last step)
        for each visible tile of (queries, block r−t):
            out, lse = merge(out, lse, attention(q_tile, k_tile, v_tile))
        kv = pending.wait()

Backward goes around the ring once more: K/V travel as in the forward, and so do the dK/dV
accumulators — each block's accumulator visits every rank, picks up that rank's share
(:func:`attention_block_backward` with the *final* ``out``/``lse``), and arrives home after ``N``
hops. Both directions are one ``autograd.Function``: no autograd through communication.

Causal: under the contiguous layout rank ``r`` sees blocks ``0 … r`` only — rank ``N−1`` works
``N`` times as much as rank 0. Zig-zag (:func:`zigzag_split`) gives every rank one early and one
late chunk, and every step then costs every rank the same half-block of work.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ..runtime import check_choice, group_info
from .blockwise import KERNELS, _check_qkv, attention_block, attention_block_backward, merge_attention
from .transport import CPStep, agree_on_shards, record_step, ring_exchange
from .zigzag import LAYOUTS

__all__ = ["ring_attention", "ring_tiles"]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, causal: bool = False,
                   layout: str = "contiguous", kernel: str = "fused") -> torch.Tensor:
    """Attention over the whole sequence from this rank's shards, K/V passed around a ring.

    Args:
        q, k, v: this rank's shards ``(batch, heads, seq / N, head_dim)`` (``k``/``v`` may have
            fewer heads, grouped-query attention); the same shape on every rank.
        group: the context-parallel process group (``None``: the default group; without a
            process group it runs as one rank).
        causal: causal mask over the *global* positions.
        layout: ``"contiguous"`` (rank ``r`` holds shard ``r`` of ``N``) or ``"zigzag"`` (chunks
            ``r`` and ``2N−1−r`` of ``2N``, as :func:`zigzag_split` cuts them).
        kernel: ``"fused"`` (the fused op returning the log-sum-exp) or ``"readable"`` (matmul + softmax).

    Returns:
        this rank's shard of the output, the layout of ``q``. Differentiable in ``q``, ``k``, ``v``.

    Example::

        >>> import torch, torch.nn.functional as F, gpucourse as gc
        >>> def run(rank, world, q, k, v):
        ...     shard = lambda x: gc.zigzag_split(x, rank, world)
        ...     return gc.ring_attention(shard(q), shard(k), shard(v), causal=True, layout="zigzag")
        >>> q, k, v = torch.randn(3, 1, 2, 8, 4).unbind(0)
        >>> out = gc.zigzag_merge(gc.launch(run, 2, args=(q, k, v)))
        >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
        True

    .. warning::
        Everything sent is made ``.contiguous()`` first: gloo reads a tensor in memory order, so
        a transposed view (``K.transpose(-1, -2)``, or a gradient arriving as one) is sent
        scrambled — with the right shape and no error.
    """
    size = _check_ring_input(q, k, v, group, causal, layout, kernel)
    if size == 1 and not dist.is_initialized():
        group = None
    return _RingAttention.apply(q, k, v, group, bool(causal), layout, kernel)


def ring_tiles(rank: int, source: int, world_size: int, n: int, *, causal: bool, layout: str):
    """The tiles rank ``rank`` computes with the K/V block of rank ``source``.

    A list of ``(query slice, key slice, causal)`` over the local shard of length ``n``; empty when
    the whole block lies in the future of every local query.

    Example::

        >>> ring_tiles(0, 1, 2, 4, causal=True, layout="zigzag")      # 2nd half of q sees all of k
        [(slice(2, 4, None), slice(0, 4, None), False)]
        >>> ring_tiles(0, 1, 2, 4, causal=True, layout="contiguous")   # the future: nothing
        []
    """
    whole = slice(0, n)
    if not causal:
        return [(whole, whole, False)]
    if source == rank:
        return [(whole, whole, True)]                       # the diagonal: top-left causal mask
    if layout == "contiguous":
        return [(whole, whole, False)] if source < rank else []
    half = n // 2                                           # zig-zag: chunks (r, 2N−1−r)
    if source < rank:
        return [(whole, slice(0, half), False)]             # its early chunk only, for all queries
    return [(slice(half, n), whole, False)]                 # our late chunk sees all of it


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, kernel):
        rank, size = _rank_size(group)
        n = q.shape[2]
        out = torch.zeros_like(q)                                       # (B, H, n, D)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)  # (B, H, n)
        kv = torch.stack([k, v])                                        # (2, B, Hkv, n, D)
        for step in range(size):
            pending = ring_exchange(kv, group, "forward", tag=0) if step < size - 1 else None
            source = (rank - step) % size
            start, cpu = time.perf_counter(), time.thread_time()
            work = 0
            for qs, ks, tile_causal in ring_tiles(rank, source, size, n, causal=causal, layout=layout):
                o, l = attention_block(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal=tile_causal,
                                       kernel=kernel)
                out[:, :, qs], lse[:, :, qs] = merge_attention(out[:, :, qs], lse[:, :, qs], o, l)
                work += _work(q, qs, ks, tile_causal)
            end, cpu = time.perf_counter(), time.thread_time() - cpu
            if pending is not None:
                kv = pending.wait()
            record_step(CPStep("forward", step, source, work, start, end, cpu,
                               pending.started if pending else end, pending.finished if pending else end))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.layout, ctx.kernel = group, causal, layout, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, layout, kernel = ctx.group, ctx.causal, ctx.layout, ctx.kernel
        rank, size = _rank_size(group)
        n = q.shape[2]
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv_pending = None
        for step in range(size):
            kv_pending = ring_exchange(kv, group, "backward", tag=0) if step < size - 1 else None
            source = (rank - step) % size
            start, cpu = time.perf_counter(), time.thread_time()
            dkv = torch.zeros_like(kv)                                  # this block's share, from this rank
            work = 0
            for qs, ks, tile_causal in ring_tiles(rank, source, size, n, causal=causal, layout=layout):
                dq_t, dk_t, dv_t = attention_block_backward(dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks],
                                                            kv[1][:, :, ks], out[:, :, qs], lse[:, :, qs],
                                                            causal=tile_causal, kernel=kernel)
                dq[:, :, qs] += dq_t
                dkv[0][:, :, ks] += dk_t
                dkv[1][:, :, ks] += dv_t
                work += _work(q, qs, ks, tile_causal)
            end, cpu = time.perf_counter(), time.thread_time() - cpu
            if dkv_pending is not None:
                dkv += dkv_pending.wait()                               # the shares of the ranks before
            dkv_pending = ring_exchange(dkv, group, "backward", tag=1) if size > 1 else None
            if kv_pending is not None:
                kv = kv_pending.wait()
            record_step(CPStep("backward", step, source, work, start, end, cpu,
                               kv_pending.started if kv_pending else end, kv_pending.finished if kv_pending else end))
        if dkv_pending is not None:
            dkv = dkv_pending.wait()                                    # our block, home after N hops
        return dq, dkv[0], dkv[1], None, None, None, None


def _work(q, qs, ks, causal) -> int:
    rows = len(range(*qs.indices(q.shape[2])))
    cols = len(range(*ks.indices(q.shape[2])))
    per_head = rows * (rows + 1) // 2 if causal else rows * cols
    return q.shape[0] * q.shape[1] * per_head


def _rank_size(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    rank, size, _ = group_info(group)
    return rank, size


def _check_ring_input(q, k, v, group, causal, layout, kernel, what="ring_attention") -> int:
    """Check locally, then agree across the group; returns the group size."""
    problem, facts = None, [0] * 7
    try:
        _check_qkv(q, k, v)
        check_choice("layout", layout, LAYOUTS)
        check_choice("kernel", kernel, KERNELS)
        if k.shape[2] != q.shape[2]:
            raise ValueError(f"q and k shards must have the same length, got {q.shape[2]} and {k.shape[2]}")
        if layout == "zigzag" and q.shape[2] % 2:
            raise ValueError(f"a zig-zag shard holds two equal chunks, so its length must be even, got {q.shape[2]}")
        facts = [*q.shape, k.shape[1], int(bool(causal)), LAYOUTS.index(layout)]
    except (TypeError, ValueError) as error:
        problem = str(error)
    if not dist.is_initialized() and group is not None:
        raise ValueError("a process group was given but torch.distributed is not initialised")
    agree_on_shards(facts, problem, group, what)
    return _rank_size(group)[1]
