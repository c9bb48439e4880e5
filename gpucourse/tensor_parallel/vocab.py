"""Cross-entropy over a vocabulary split across ranks, without ever gathering the logits.

With the head split by vocabulary, rank ``r`` holds logits ``z[..., v_r]`` for its slice ``v_r`` of the
vocabulary. Gathering them would move ``(tokens × vocab)`` numbers — for GPT-sized vocabularies the
largest tensor of the model. The loss needs only three numbers per token::

    loss = log Σ_v exp(z_v − m) − (z_target − m),     m = max_v z_v

1) ``m``: each rank's max over its slice, then all-reduce **MAX**         (tokens,)
2) ``Σ exp(z − m)``: each rank's sum over its slice, then all-reduce SUM  (tokens,)
3) ``z_target − m``: the rank that owns the target's id has it, the others add 0: all-reduce SUM

Backward needs no communication: ``∂loss/∂z_v = softmax_v − [v = target]``, and each rank has
the softmax of its slice (its ``exp`` over the global sum).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..runtime import check_tensor
from .autograd_ops import tensor_split_sizes
from .checks import check_same_shape, group_layout
from .meter import record

__all__ = ["vocab_parallel_cross_entropy"]


def _all_reduce(x, op, group, site):
    dist.all_reduce(x, op=op, group=group)
    record("all_reduce", site, x)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, group):          # logits (N, V_r), target (N,)
        logits = logits.float()
        m = logits.max(dim=-1).values                              # 1) local max
        m = _all_reduce(m.contiguous(), dist.ReduceOp.MAX, group, "vocab.max")
        shifted = logits - m.unsqueeze(-1)                         # (N, V_r), all <= 0
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group, "vocab.sum_exp")   # 2)
        local = target - start                                     # the target's column here, if any
        mine = (local >= 0) & (local < logits.shape[-1])
        picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        picked = _all_reduce(torch.where(mine, picked, 0.0), dist.ReduceOp.SUM, group, "vocab.target")   # 3)
        loss = sum_exp.log() - picked                              # (N,)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local, mine)
        return loss.mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()                                        # softmax − one_hot(target)
        rows = mine.nonzero().squeeze(-1)
        g[rows, local[rows]] -= 1.0
        return g * (grad / len(g)), None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, group=None) -> torch.Tensor:
    """``F.cross_entropy`` (mean over tokens) of logits split along the last dim, without gathering them.

    Args:
        logits_shard: this rank's logits ``(..., V_r)``: columns ``v_r`` of the full ``(..., V)``,
            ``v_r`` rank ``r``'s piece of ``torch.tensor_split(range(V), world)``.
        target: the *global* class ids ``(...)``, the same on every rank.
        group: the tensor-parallel group (default: all ranks).

    Returns:
        the scalar loss, equal on every rank to ``F.cross_entropy(full_logits.flatten(0, -2),
        target.flatten())``; its gradient w.r.t. ``logits_shard`` is the matching slice of the
        full gradient.

    Example::

        >>> logits, target = torch.randn(5, 7), torch.randint(0, 7, (5,))
        >>> loss = vocab_parallel_cross_entropy(logits, target)      # one process: V_r = V
        >>> torch.allclose(loss, torch.nn.functional.cross_entropy(logits, target))
        True

    .. warning::
        The ranks learn the full vocabulary size from the shard widths: the shards must follow
        ``tensor_split`` (``vocab_sizes`` differing by at most one, larger first), as
        :func:`column_parallel` makes them. Other splits raise ``ValueError`` on every rank.
    """
    check_tensor("logits_shard", logits_shard, floating=True)
    check_tensor("target", target, dtypes=(torch.int64, torch.int32))
    if logits_shard.dim() < 1 or tuple(target.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(f"target must have the shape of logits_shard without its last dim, got logits_shard "
                         f"{tuple(logits_shard.shape)} and target {tuple(target.shape)}")
    rank, world, _ = group_layout(group)
    if world == 1:
        return F.cross_entropy(logits_shard.flatten(0, -2), target.flatten().long())
    # every rank learns every rank's (shard width, smallest and largest target), and the shapes
    check_same_shape(logits_shard[..., 0], group, "logits_shard without its last dim")
    flat, t = logits_shard.flatten(0, -2), target.flatten().long()
    mine = torch.tensor([flat.shape[-1], int(t.min()) if t.numel() else 0, int(t.max()) if t.numel() else 0],
                        device=logits_shard.device)
    views = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(views, mine, group=group)
    all_widths = [int(v[0]) for v in views]
    vocab = sum(all_widths)
    if all_widths != tensor_split_sizes(vocab, world):
        raise ValueError(f"logits_shard widths {all_widths} over the ranks are not torch.tensor_split's "
                         f"{tensor_split_sizes(vocab, world)} for a vocabulary of {vocab}")
    low, high = min(int(v[1]) for v in views), max(int(v[2]) for v in views)
    if low < 0 or high >= vocab:
        raise ValueError(f"target ids must be in [0, {vocab - 1}], got ids from {low} to {high}")
    start = sum(all_widths[:rank])
    return _VocabParallelCrossEntropy.apply(flat, t, start, group).to(logits_shard.dtype)
