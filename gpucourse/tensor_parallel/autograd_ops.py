"""Megatron's conjugate pair f and g: the only communication a tensor-parallel MLP needs.

Split an MLP ``Y = B(act(A(X)))`` across ``p`` ranks: ``A`` by output features (columns), ``B`` by
input features (rows). Every rank holds the whole input ``X`` and computes its slice of the hidden
layer; ``B``'s partial products are then summed over ranks. Two operations mark where the ranks
meet, and each is the other's transpose::

    f  (before A):  forward  identity              backward  all-reduce  (sum the input's gradient
                                                              over the ranks' slices of A)
    g  (after B):   forward  all-reduce            backward  identity    (the output is replicated,
                    (sum the partial products)                           so is its gradient)

So a split MLP costs one all-reduce in forward and one in backward. The two extra operations for
``gather_output=True`` / ``input_is_parallel=False`` come after f and g.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .meter import record

__all__ = ["copy_to_tensor_parallel", "reduce_from_tensor_parallel", "gather_from_tensor_parallel",
           "scatter_to_tensor_parallel", "tensor_split_sizes"]


def _all_reduce(x: torch.Tensor, group, site: str) -> torch.Tensor:
    x = x.contiguous().clone()            # gloo misreads non-contiguous tensors; never reduce autograd's input
    dist.all_reduce(x, group=group)
    record("all_reduce", site, x)
    return x


class _CopyToTensorParallel(torch.autograd.Function):        # f
    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return x.view_as(x)                                   # identity: every rank already has X

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.label), None, None    # dL/dX = Σ_r (dL/dX through A_r)


class _ReduceFromTensorParallel(torch.autograd.Function):    # g
    @staticmethod
    def forward(ctx, x, group, label):
        return _all_reduce(x, group, label)                   # Y = Σ_r (partial Y of rank r)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None                               # identity: dL/dY is the same everywhere


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def copy_to_tensor_parallel(x: torch.Tensor, group=None, *, label: str = "f") -> torch.Tensor:
    """Megatron's **f**: identity in forward, all-reduce (sum) of the gradient in backward.

    ``label`` names the all-reduce in a :func:`comm_meter`'s records.

    Example::

        >>> x = torch.randn(3, requires_grad=True)
        >>> copy_to_tensor_parallel(x).sum().backward()     # one process: a plain identity
        >>> x.grad
        tensor([1., 1., 1.])

    .. warning::
        Without f in front of a column-parallel layer each rank's input gradient holds only its
        own slice's contribution: the layers before it would train on a wrong gradient, silently.
    """
    return x if _world(group) == 1 else _CopyToTensorParallel.apply(x, group, label)


def reduce_from_tensor_parallel(x: torch.Tensor, group=None, *, label: str = "g") -> torch.Tensor:
    """Megatron's **g**: all-reduce (sum) in forward, identity in backward — f's conjugate.

    ``label`` names the all-reduce in a :func:`comm_meter`'s records.

    Example::

        >>> reduce_from_tensor_parallel(torch.ones(2))      # one process: nothing to add
        tensor([1., 1.])

    .. warning::
        Backward is the identity *because* everything after g is replicated: if ranks computed
        different things after g (a different loss per rank), the gradients would be wrong.
    """
    return x if _world(group) == 1 else _ReduceFromTensorParallel.apply(x, group, label)


# --------------------------------------------------------------------------------------------
# Gather and scatter along the last dim (for gather_output=True / input_is_parallel=False).
# Shards follow torch.tensor_split, so they may differ by one: gloo's all_gather wants equal
# sizes, so each shard is padded to the largest and the padding cut off again.
# --------------------------------------------------------------------------------------------

def tensor_split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``torch.tensor_split`` of ``n`` items into ``parts``: the first ``n % parts`` get one more.

    Example::

        >>> tensor_split_sizes(10, 4)
        [3, 3, 2, 2]
    """
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def _gather_last_dim(x: torch.Tensor, sizes: list[int], group, site: str) -> torch.Tensor:
    rank, width = dist.get_rank(group), max(sizes)
    padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    record("all_gather", site, padded, copies=len(sizes))
    parts[rank] = x                                       # own shard as is
    return torch.cat([p[..., :s] for p, s in zip(parts, sizes)], dim=-1)


def _own_slice(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    rank = dist.get_rank(group)
    start = sum(sizes[:rank])
    return x[..., start:start + sizes[rank]].contiguous()


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gather_last_dim(x, sizes, group, "gather")

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.sizes, ctx.group), None, None


class _ScatterToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _own_slice(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.sizes, ctx.group, "scatter"), None, None


def gather_from_tensor_parallel(x: torch.Tensor, sizes: list[int], group=None) -> torch.Tensor:
    """All-gather shards along the last dim (forward); keep this rank's slice of the gradient (backward).

    ``sizes[r]`` is rank ``r``'s shard width (``tensor_split_sizes``).

    Example::

        >>> gather_from_tensor_parallel(torch.ones(2, 3), [3])     # one process: nothing to gather
        tensor([[1., 1., 1.],
                [1., 1., 1.]])

    .. warning::
        It moves the whole ``(..., out_features)`` output to every rank — the traffic a following
        :func:`row_parallel` with ``input_is_parallel=True`` avoids.
    """
    return x if _world(group) == 1 else _GatherFromTensorParallel.apply(x, list(sizes), group)


def scatter_to_tensor_parallel(x: torch.Tensor, sizes: list[int], group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dim (forward); all-gather the gradient (backward).

    Example::

        >>> scatter_to_tensor_parallel(torch.arange(4.0), [4])     # one process: the whole tensor
        tensor([0., 1., 2., 3.])

    .. warning::
        Every rank must pass the same full tensor: the slices are taken, not checked.
    """
    return x if _world(group) == 1 else _ScatterToTensorParallel.apply(x, list(sizes), group)
