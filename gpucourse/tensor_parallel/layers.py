"""Column- and row-parallel linear layers: one ``nn.Linear`` split across the ranks of a group.

``nn.Linear`` computes ``Y = X Wᵀ + b`` with ``W`` of shape ``(out, in)``. Split ``W``:

* **by output features** (column-parallel, Megatron's ``A``): rank ``r`` keeps rows ``W[o_r]`` and
  ``b[o_r]`` and computes ``Y[..., o_r] = X W[o_r]ᵀ + b[o_r]`` — the whole input, a slice of the
  output. In front: f (its backward sums the input's gradient over the ranks).
* **by input features** (row-parallel, Megatron's ``B``): rank ``r`` keeps columns ``W[:, i_r]``
  and computes the partial product ``X[..., i_r] W[:, i_r]ᵀ``; g sums the partials over the ranks,
  then the bias is added once.

Column then row is an MLP with one all-reduce forward (g) and one backward (f)::

    X (B, in) ──f──► column: (B, ffn/p) ──act──► row: (B, out) partial ──g──► Y (B, out)

Shards follow ``torch.tensor_split``: with ``n`` features and ``p`` ranks the first ``n % p`` ranks
get one feature more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import check_type
from .autograd_ops import (copy_to_tensor_parallel, gather_from_tensor_parallel, reduce_from_tensor_parallel,
                           scatter_to_tensor_parallel, tensor_split_sizes)
from .checks import agree_across_ranks, check_same_shape, group_layout

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "column_parallel", "row_parallel"]


class ColumnParallelLinear(nn.Module):
    """This rank's output features of a full ``nn.Linear`` (see :func:`column_parallel`)."""

    def __init__(self, linear: nn.Linear, group=None, *, gather_output: bool = False,
                 sizes: list[int] | None = None):
        super().__init__()
        check_type("linear", linear, nn.Linear, "a torch.nn.Linear")
        rank, _, self.sizes = _prepare("column_parallel", linear, group, linear.out_features, sizes)
        start = sum(self.sizes[:rank])
        rows = slice(start, start + self.sizes[rank])
        self.group, self.gather_output = group, gather_output
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())              # (out_r, in)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_same_shape(x, self.group, "the input of column_parallel")
        x = copy_to_tensor_parallel(x, self.group)           # f: identity; backward all-reduce
        y = F.linear(x, self.weight, self.bias)              # (..., out_r): this rank's columns
        if self.gather_output:
            y = gather_from_tensor_parallel(y, self.sizes, self.group)    # (..., out)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(this rank: {self.weight.shape[0]}), gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """This rank's input features of a full ``nn.Linear`` (see :func:`row_parallel`)."""

    def __init__(self, linear: nn.Linear, group=None, *, input_is_parallel: bool = True,
                 sizes: list[int] | None = None):
        super().__init__()
        check_type("linear", linear, nn.Linear, "a torch.nn.Linear")
        rank, _, self.sizes = _prepare("row_parallel", linear, group, linear.in_features, sizes)
        start = sum(self.sizes[:rank])
        cols = slice(start, start + self.sizes[rank])
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())           # (out, in_r)
        # the bias is added once, after the sum; every rank keeps the whole bias (replicated)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # input_is_parallel: the last dim is this rank's shard (widths may differ by one)
        check_same_shape(x if not self.input_is_parallel else x[..., 0], self.group,
                         "the input of row_parallel" + (" without its last dim" if self.input_is_parallel else ""))
        if not self.input_is_parallel:                       # (..., in) -> (..., in_r)
            x = scatter_to_tensor_parallel(x, self.sizes, self.group)
        elif x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"row_parallel expects this rank's {self.weight.shape[1]} input features "
                             f"(input_is_parallel=True), got {x.shape[-1]}")
        y = F.linear(x, self.weight)                         # (..., out): a partial sum
        y = reduce_from_tensor_parallel(y, self.group)       # g: all-reduce; backward identity
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}")


def column_parallel(linear: nn.Linear, group=None, *, gather_output: bool = False) -> ColumnParallelLinear:
    """Keep this rank's slice of ``linear``'s **output** features (Megatron's column-parallel ``A``).

    Args:
        linear: the full layer, identical on every rank (build it after the same ``torch.manual_seed``).
        group: the tensor-parallel process group (default: all ranks).
        gather_output: all-gather the output slices into the full ``(..., out_features)``; by
            default each rank returns its slice ``(..., out_r)``, ready for :func:`row_parallel`.

    Returns:
        a module whose ``weight`` is ``linear.weight[o_r]`` and ``bias`` is ``linear.bias[o_r]``,
        with ``o_r`` rank ``r``'s piece of ``torch.tensor_split(range(out_features), world)``.

    Example::

        >>> layer = torch.nn.Linear(4, 6)
        >>> col = column_parallel(layer)                   # one process: the whole layer
        >>> x = torch.randn(2, 4)
        >>> torch.allclose(col(x), layer(x))
        True

    Raises:
        ValueError: on every rank, when ``out_features`` is smaller than the group, or the ranks
            pass layers of different shapes or values, or different groups.

    .. warning::
        Every rank of the job must call it, in the same order (it checks the ranks agree with a
        collective over the default group) — also the ranks of other tensor-parallel groups.
    """
    return ColumnParallelLinear(linear, group, gather_output=gather_output)


def row_parallel(linear: nn.Linear, group=None, *, input_is_parallel: bool = True) -> RowParallelLinear:
    """Keep this rank's slice of ``linear``'s **input** features (Megatron's row-parallel ``B``).

    Args:
        linear: the full layer, identical on every rank.
        group: the tensor-parallel process group (default: all ranks).
        input_is_parallel: the input is already this rank's slice ``(..., in_r)`` (the output of
            :func:`column_parallel`); ``False`` takes the full input and keeps the slice itself.

    Returns:
        a module with ``weight = linear.weight[:, i_r]`` and the *whole* bias, added once after
        the all-reduce (adding it on every rank before the sum would count it ``world`` times).

    Example::

        >>> fc1, fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)
        >>> mlp = torch.nn.Sequential(column_parallel(fc1), torch.nn.ReLU(), row_parallel(fc2))
        >>> x = torch.randn(3, 4)
        >>> torch.allclose(mlp(x), fc2(torch.relu(fc1(x))))
        True

    Raises:
        ValueError: on every rank, like :func:`column_parallel`.

    .. warning::
        Every rank of the job must call it, in the same order, like :func:`column_parallel`.
    """
    return RowParallelLinear(linear, group, input_is_parallel=input_is_parallel)


def _prepare(name: str, linear, group, features: int, sizes):
    """Check (on every rank, together) and return ``(rank, world, shard sizes)``."""
    w = linear.weight.detach()
    agree_across_ranks(group, f"the layer passed to {name}", {
        "shape": tuple(w.shape), "bias": linear.bias is not None,
        "sum of the weights": round(float(w.double().sum()), 6)})
    rank, world, _ = group_layout(group)
    if sizes is None:
        if features < world:
            raise ValueError(f"{name}: the layer has {features} features to split, fewer than the "
                             f"{world} ranks of the group; each rank needs at least one")
        sizes = tensor_split_sizes(features, world)
    elif len(sizes) != world or sum(sizes) != features or min(sizes) < 1:
        raise ValueError(f"{name}: sizes {sizes} must give each of the {world} ranks >= 1 of the {features} features")
    return rank, world, list(sizes)
