"""Which part of the sequence each rank holds, and which K/V block it sees at each ring step.

With a causal mask, query ``i`` looks at keys ``0 … i``: the rank holding the *end* of the
sequence does ``N`` blocks of work while the rank holding the start does one. The zig-zag layout
cuts the sequence into ``2N`` chunks and gives rank ``r`` chunks ``r`` and ``2N−1−r`` — one
cheap, one expensive — so every rank does the same work::

    N = 2, 4 chunks:   rank 0: [0, 3]    rank 1: [1, 2]
    N = 4, 8 chunks:   rank 0: [0, 7]    rank 1: [1, 6]    rank 2: [2, 5]    rank 3: [3, 4]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..runtime import check_choice, check_int, check_type

__all__ = ["ring_kv_chunks", "zigzag_chunks", "zigzag_merge", "zigzag_split"]

LAYOUTS = ("contiguous", "zigzag")


def zigzag_chunks(rank: int, world_size: int) -> tuple[int, int]:
    """The two of ``2·world_size`` sequence chunks rank ``rank`` holds: ``(rank, 2N−1−rank)``.

    Example::

        >>> [zigzag_chunks(r, 4) for r in range(4)]
        [(0, 7), (1, 6), (2, 5), (3, 4)]
    """
    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0, maximum=world_size - 1)
    return rank, 2 * world_size - 1 - rank


def zigzag_split(x: torch.Tensor, rank: int, world_size: int, *, dim: int = 2) -> torch.Tensor:
    """This rank's zig-zag shard of ``x``: chunks ``rank`` and ``2N−1−rank`` of ``2N``, concatenated.

    Args:
        x: the full tensor, e.g. ``(batch, heads, seq, head_dim)``.
        rank, world_size: this rank and the number of ranks ``N``.
        dim: the sequence dimension; its length must divide by ``2N``.

    Example::

        >>> x = torch.arange(8).view(1, 1, 8, 1)
        >>> zigzag_split(x, 0, 2).flatten().tolist(), zigzag_split(x, 1, 2).flatten().tolist()
        ([0, 1, 6, 7], [2, 3, 4, 5])

    .. warning::
        The result is a new contiguous tensor (a ``cat``), not a view: gradients flow back to
        ``x`` through autograd, but writing into the shard does not change ``x``.
    """
    check_type("x", x, torch.Tensor)
    first, second = zigzag_chunks(rank, world_size)
    chunks = _chunks(x, 2 * world_size, dim)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def zigzag_merge(shards: Sequence[torch.Tensor], *, dim: int = 2) -> torch.Tensor:
    """The inverse of :func:`zigzag_split`: the full tensor from every rank's shard, in rank order.

    Example::

        >>> x = torch.randn(2, 3, 12, 4)
        >>> torch.equal(zigzag_merge([zigzag_split(x, r, 3) for r in range(3)]), x)
        True
    """
    shards = list(shards)
    if not shards or not all(isinstance(s, torch.Tensor) for s in shards):
        raise TypeError("shards must be a non-empty list of tensors, one per rank in rank order")
    n = len(shards)
    halves = [_chunks(s, 2, dim) for s in shards]
    ordered = [halves[c][0] if c < n else halves[2 * n - 1 - c][1] for c in range(2 * n)]
    return torch.cat(ordered, dim=dim)


def ring_kv_chunks(rank: int, step: int, world_size: int, *, layout: str = "contiguous") -> tuple[int, ...]:
    """The global sequence chunks of the K/V block rank ``rank`` holds at ring step ``step``.

    Each step every rank sends its block to ``rank + 1`` and receives from ``rank − 1``, so at step
    ``t`` it holds the block rank ``(rank − t) mod N`` started with. Contiguous: chunk ``i`` of
    ``N``; zig-zag: chunks ``(i, 2N−1−i)`` of ``2N``.

    Example::

        >>> [ring_kv_chunks(1, t, 3) for t in range(3)]
        [(1,), (0,), (2,)]
        >>> [ring_kv_chunks(1, t, 3, layout="zigzag") for t in range(3)]
        [(1, 4), (0, 5), (2, 3)]
    """
    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0, maximum=world_size - 1)
    check_int("step", step, 0, maximum=world_size - 1)
    check_choice("layout", layout, LAYOUTS)
    source = (rank - step) % world_size
    return (source,) if layout == "contiguous" else zigzag_chunks(source, world_size)


def _chunks(x: torch.Tensor, n: int, dim: int):
    length = x.shape[dim]
    if length % n:
        raise ValueError(f"the sequence length (dim {dim}) must divide by {n}"
                         f"{' (2 · world_size)' if n > 2 else ''}, got {length}")
    return x.chunk(n, dim=dim)
