"""Reduce-scatter and all-gather from point-to-point messages: the two halves of the ring.

Chapter 04's ring all-reduce is two phases glued together (see ``gc.ring_schedule``):

1) **reduce-scatter**, ``p - 1`` steps: each rank sends one chunk to its right neighbour and adds
   the chunk arriving from its left one. Afterwards each rank holds the *sum* of one chunk.
2) **all-gather**, ``p - 1`` steps: the finished chunks travel once around the ring.

Sharded data parallelism uses the halves on their own. ZeRO reduce-scatters the gradients (rank
``r`` only needs the sum of *its* shard to update *its* slice of the parameters) and all-gathers
the updated parameters (every rank needs all of them for the next forward). Each half sends
``(p - 1) / p · N`` values per rank — half an all-reduce, so the pair costs exactly what DDP's
all-reduce costs.

Chunk ``r`` must end on rank ``r`` (that is what ``dist.reduce_scatter_tensor`` does), while
``ring_schedule`` leaves chunk ``r + 1`` on rank ``r``; so the plan's chunk ``i`` is our chunk
``i - 1``: the same messages, renamed.

The tensor is flattened and zero-padded to ``p · ceil(N / p)`` elements, so any size works.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..distributed import ring_schedule
from ..runtime import group_info, same_on_every_rank, validate

__all__ = ["all_gather", "reduce_scatter", "shard_size"]


def shard_size(numel: int, world_size: int) -> int:
    """Elements per rank when ``numel`` elements are padded to split evenly: ``ceil(numel / p)``.

    Example::

        >>> shard_size(10, 3), shard_size(9, 3), shard_size(0, 4)
        (4, 3, 0)
    """
    return math.ceil(numel / world_size)


# --- the two phases, in place on a flat buffer of p equal chunks -------------------------------


#: chunks travel in segments of this many bytes: adding one segment overlaps receiving the next
SEGMENT_BYTES = 4 << 20


def _ring_phase(buf: torch.Tensor, group, phase: str, segment_bytes: int | None = None) -> torch.Tensor:
    """Run one phase of the ring on ``buf`` (1-D, contiguous, ``numel % p == 0``), in place.

    ``"reduce-scatter"``: afterwards chunk ``rank`` of ``buf`` holds the sum over ranks (the other
    chunks hold partial sums). ``"all-gather"``: chunk ``rank`` is sent around; afterwards every
    chunk holds its owner's values.
    """
    rank, p, global_rank = group_info(group)
    if p == 1 or buf.numel() == 0:
        return buf
    chunks = buf.view(p, -1)                              # (p, S): row i is chunk i
    right, left = global_rank((rank + 1) % p), global_rank((rank - 1) % p)
    segment_bytes = SEGMENT_BYTES if segment_bytes is None else segment_bytes
    seg = max(1, segment_bytes // buf.element_size())     # elements per segment
    reduce = phase == "reduce-scatter"
    incoming = torch.empty_like(chunks[0]) if reduce else None
    steps = [(s, (send - 1) % p, (recv - 1) % p)           # rename: chunk r must end on rank r
             for s, (ph, _, send, recv) in enumerate(ring_schedule(rank, p)) if ph == phase]
    for step, send, recv in steps:
        target = incoming if reduce else chunks[recv]
        pieces = range(0, chunks.shape[1], seg)
        # plain isend + irecv (batch_isend_irecv can hang on gloo): everything posted, then waited
        # on piece by piece, so adding piece k overlaps the transfer of piece k + 1
        recvs = [dist.irecv(target[i:i + seg], left, group=group, tag=step * len(pieces) + k)
                 for k, i in enumerate(pieces)]
        sends = [dist.isend(chunks[send][i:i + seg], right, group=group, tag=step * len(pieces) + k)
                 for k, i in enumerate(pieces)]
        for k, i in enumerate(pieces):
            recvs[k].wait()
            if reduce:
                chunks[recv][i:i + seg].add_(incoming[i:i + seg])
        for w in sends:
            w.wait()
    return buf


def _reduce_scatter_flat(buf: torch.Tensor, group=None) -> torch.Tensor:
    """In place on a padded flat buffer; returns this rank's chunk (a view, now the full sum)."""
    rank, p, _ = group_info(group)
    _ring_phase(buf, group, "reduce-scatter")
    return buf.view(p, -1)[rank]


def _all_gather_flat(buf: torch.Tensor, group=None) -> torch.Tensor:
    """In place on a padded flat buffer whose chunk ``rank`` is this rank's shard."""
    return _ring_phase(buf, group, "all-gather")


def _check_input(name: str, tensor) -> None:
    validate.check_tensor(name, tensor)
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise TypeError(f"{name} must have a real numeric dtype, got {tensor.dtype}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {tensor.layout}")


# --- the public collectives -----------------------------------------------------------------------

def reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the group and return only this rank's slice of the sum, from send/recv.

    The tensor is flattened and zero-padded to ``p · S`` elements with ``S = ceil(numel / p)``;
    rank ``r`` gets elements ``[r·S, (r+1)·S)`` of the sum. When ``numel`` divides by ``p`` this
    is ``dist.reduce_scatter_tensor(out, tensor.flatten())``.

    Args:
        tensor: any shape, real numeric dtype; the same shape and dtype on every rank (checked:
            a mismatch raises ``ValueError`` on every rank). Not modified.
        group: the process group (default: the default group).

    Returns:
        A new 1-D tensor of ``S`` elements (padding positions, if any, are 0).

    Example::

        >>> import torch, gpucourse as gc
        >>> def demo(rank, world_size):
        ...     t = torch.arange(5.0) + 10 * rank     # rank 0: 0..4, rank 1: 10..14, rank 2: 20..24
        ...     return gc.reduce_scatter(t).tolist()
        >>> gc.launch(demo, 3)                        # sums 30 33 36 39 42, padded to 6 = 3 x 2
        [[30.0, 33.0], [36.0, 39.0], [42.0, 0.0]]

    .. warning::
        Every rank must call it, with the same shape: a rank that skips it leaves its neighbours
        waiting until the group's timeout.
    """
    _check_input("tensor", tensor)
    _, p, _ = group_info(group)
    same_on_every_rank("tensor shape and dtype", (tuple(tensor.shape), str(tensor.dtype)), group)
    n, s = tensor.numel(), shard_size(tensor.numel(), p)
    buf = torch.zeros(p * s, dtype=tensor.dtype, device=tensor.device)   # (p·S,) padded copy
    buf[:n] = tensor.reshape(-1)
    return _reduce_scatter_flat(buf, group).clone()


def all_gather(shard: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's ``shard`` along dim 0, in rank order, from send/recv.

    Same result as ``dist.all_gather_into_tensor(out, shard)``. A 0-d shard counts as one element.

    Args:
        shard: this rank's piece; the same shape and dtype on every rank (checked: a mismatch
            raises ``ValueError`` on every rank — pad uneven pieces, as :func:`reduce_scatter` does).
        group: the process group (default: the default group).

    Returns:
        A new tensor of shape ``(p · shard.shape[0], *shard.shape[1:])``.

    Example::

        >>> import torch, gpucourse as gc
        >>> def demo(rank, world_size):
        ...     full = torch.arange(5.0) + 10 * rank
        ...     return gc.all_gather(gc.reduce_scatter(full))[:5].tolist()  # = all-reduce
        >>> gc.launch(demo, 3)[0]
        [30.0, 33.0, 36.0, 39.0, 42.0]

    .. warning::
        gloo reads the memory of what it sends as-is: a non-contiguous view would be sent in
        storage order. The shard is copied into a contiguous buffer first.
    """
    _check_input("shard", shard)
    rank, p, _ = group_info(group)
    same_on_every_rank("shard shape and dtype", (tuple(shard.shape), str(shard.dtype)), group)
    piece = shard.reshape(1) if shard.dim() == 0 else shard
    out = torch.empty((p * piece.shape[0], *piece.shape[1:]), dtype=shard.dtype, device=shard.device)
    out.view(p, -1)[rank].copy_(piece.reshape(-1))
    _all_gather_flat(out.view(-1), group)
    return out
