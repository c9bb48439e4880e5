"""The transport of expert parallelism: a differentiable all-to-all with uneven splits, counted.

``all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send)`` sends rows
``send[0]`` of ``x`` to rank 0, the next ``send[1]`` to rank 1, …, and receives ``recv[s]`` rows
from each rank ``s``, in rank order. Its backward is the same exchange the other way round: the
gradient of what I received goes back to whoever sent it (splits swapped).

Before the tokens move, the ranks exchange a small header with ``all_gather`` — each rank's token
width, dtype, whether it needs a backward, and how many copies it sends to each expert. Every
rank checks every header the same way, so bad input raises the same ``ValueError`` on every rank
instead of leaving the others waiting in the all-to-all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import rank_device

__all__ = ["all_to_all", "exchange_headers"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group, meter):
        ctx.send, ctx.recv, ctx.group, ctx.meter = send, recv, group, meter
        return _exchange(x, send, recv, group, meter, "forward")

    @staticmethod
    def backward(ctx, grad):                      # the gradient travels back the way the rows came
        return _exchange(grad, ctx.recv, ctx.send, ctx.group, ctx.meter, "backward"), None, None, None, None


def _exchange(x, send, recv, group, meter, phase):
    x = x.contiguous()                            # gloo reads memory order: never hand it a view
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=list(recv), input_split_sizes=list(send), group=group)
    if meter is not None:
        me = dist.get_rank(group)
        row = x.shape[1:].numel() * x.element_size()                     # bytes per row
        sent = sum(n for r, n in enumerate(send) if r != me) * row     # what leaves this rank
        meter[phase] += sent
        meter["total"] += sent
    return out


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group=None, meter: dict | None = None) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0 with uneven splits.

    ``meter`` (a dict with ``"forward"`` and ``"backward"`` keys) collects the bytes this rank
    sends to *other* ranks (its own rows stay in memory), in each direction.
    """
    return _AllToAll.apply(x, list(send), list(recv), group, meter)


def exchange_headers(group, *, d_model: int, layer_dtype: torch.dtype, shape: tuple, dtype, needs_grad: bool,
                     counts: torch.Tensor) -> torch.Tensor:
    """All-gather ``[ndim, width, dtype, needs_grad, counts per expert…]`` from every rank; check them all.

    Returns the ``(world, E)`` matrix of counts: row ``s`` = copies rank ``s`` sends to each expert.
    Raises the same ``ValueError`` on every rank when any rank's input is wrong or they disagree.
    """
    code = _DTYPES.index(dtype) if dtype in _DTYPES else -1
    ndim, width = len(shape), (shape[-1] if shape else -1)
    mine = torch.cat([torch.tensor([ndim, width, code, int(needs_grad)]), counts.to(torch.int64).cpu()])
    mine = mine.to(rank_device(group))                               # NCCL gathers CUDA tensors only
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).cpu()                                 # (world, 4 + E)
    problems = []
    for s, (n, w, c, g) in enumerate(table[:, :4].tolist()):
        if n != 2 or w != d_model:
            problems.append(f"rank {s} passed x of {n} dimensions and width {w}; every rank must pass "
                            f"(tokens, {d_model})")
        if c < 0 or _DTYPES[c] != layer_dtype:
            problems.append(f"rank {s} passed x of dtype {_DTYPES[c] if c >= 0 else 'other'}, the layer's "
                            f"parameters are {layer_dtype}")
    if len(set(table[:, 3].tolist())) > 1:
        problems.append("some ranks need a backward and some do not (x.requires_grad / torch.no_grad "
                        "must be the same on every rank, or the backward all-to-all would wait forever): "
                        + ", ".join(f"rank {s}: {bool(g)}" for s, g in enumerate(table[:, 3].tolist())))
    if problems:
        raise ValueError("expert_parallel: " + "; ".join(problems))
    return table[:, 4:]
