"""Do all ranks agree? One small exchange before a collective, so that mismatched calls raise the
same clear ``ValueError`` on every rank instead of aborting gloo (SIGABRT) or waiting forever."""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from .devices import rank_device

__all__ = ["same_on_every_rank"]


def same_on_every_rank(what: str, mine, group, describe=str, *, point_to_point=None) -> None:
    """Raise ``ValueError`` on *every* rank unless all ranks pass the same ``mine``.

    A collective over mismatched tensors does not fail cleanly: gloo aborts the process (SIGABRT)
    or a receive waits forever. One small exchange first lets every rank see every rank's value,
    so they all raise the same error instead: a 16-byte digest of ``repr(mine)`` from every rank
    (``dist.all_gather``), and only where one differs the values themselves, to name them
    (``dist.all_gather_object``). ``point_to_point``: ``(rank, world_size, global_rank, batched,
    device)`` to exchange with send/recv only (for ``gc.ring_all_reduce``, which uses no
    collective). ``describe`` formats one rank's value in the message.

    Example (on 2 ranks)::

        same_on_every_rank("the batch size", x.shape[0], group)
        # ValueError: the batch size must be the same on every rank, got rank 0: 32, rank 1: 30
    """
    # First a fixed-size digest of ``mine``, one small round: on the common path (all the same) that is
    # all, where the full values take two rounds and pickling (a ring all-reduce of 16 MB spent a
    # third of its time here). Only when a digest differs do the ranks swap the values, to say which.
    if (point_to_point[1] if point_to_point else dist.get_world_size(group)) == 1:
        return
    if _digests_agree(mine, group, point_to_point):
        return
    if point_to_point is None:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = _objects_by_point_to_point(mine, group, *point_to_point)
    if any(other != mine for other in everyone):
        if isinstance(mine, list):   # a long list (a model's tensors): show the first difference
            i = next(i for i in range(max(map(len, everyone))) if len({repr(v[i:i + 1]) for v in everyone}) > 1)
            what, everyone = f"{what} (entry {i})", [v[i] if i < len(v) else "nothing" for v in everyone]
        listed = ", ".join(f"rank {r}: {describe(v)}" for r, v in enumerate(everyone))
        raise ValueError(f"{what} must be the same on every rank, got {listed}")


def _digest(obj) -> list[int]:
    """128 bits of BLAKE2b over ``repr(obj)`` (shapes, dtype names, flags: a repr that is the same in
    every process, unlike ``hash`` of a string), as two signed 64-bit integers."""
    import hashlib

    raw = hashlib.blake2b(repr(obj).encode(), digest_size=16).digest()
    return [int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True)]


def _digests_agree(obj, group, point_to_point) -> bool:
    """Whether every rank's ``obj`` has this rank's digest (the same answer on every rank: each sees
    all the digests)."""
    if point_to_point is None:
        device = rank_device(group)
        mine = torch.tensor(_digest(obj), dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
    else:
        rank, p, global_rank, batched, device = point_to_point
        mine = torch.tensor(_digest(obj), dtype=torch.int64, device=device)
        everyone = [mine if r == rank else torch.empty_like(mine) for r in range(p)]
        _send_mine_receive_theirs(everyone, group, rank, global_rank, batched)
    return bool(torch.equal(torch.stack(everyone), mine.expand(len(everyone), -1)))


def _objects_by_point_to_point(obj, group, rank, p, global_rank, batched, device) -> list:
    """Every rank's ``obj`` (small, picklable), sent to every other rank with send/recv only:
    first the sizes of the pickled bytes, then the bytes."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    sizes = [torch.tensor([data.numel()], device=device) if r == rank
             else torch.zeros(1, dtype=torch.int64, device=device) for r in range(p)]
    _send_mine_receive_theirs(sizes, group, rank, global_rank, batched)
    parts = [data if r == rank else torch.empty(int(sizes[r].item()), dtype=torch.uint8, device=device)
             for r in range(p)]
    _send_mine_receive_theirs(parts, group, rank, global_rank, batched)
    return [pickle.loads(t.cpu().numpy().tobytes()) for t in parts]


def _send_mine_receive_theirs(bufs, group, rank, global_rank, batched) -> None:
    """``bufs[rank]`` goes to every other rank; ``bufs[q]`` is filled from rank ``q``."""
    peers = [q for q in range(len(bufs)) if q != rank]
    if batched:   # NCCL: all in one group, as in the ring itself
        ops = [dist.P2POp(dist.isend, bufs[rank], global_rank(q), group) for q in peers]
        ops += [dist.P2POp(dist.irecv, bufs[q], global_rank(q), group) for q in peers]
        works = dist.batch_isend_irecv(ops)
    else:     # receives first: gloo sends only to a posted receive, so each posted one saves a round trip
        works = [dist.irecv(bufs[q], global_rank(q), group=group) for q in peers]
        works += [dist.isend(bufs[rank], global_rank(q), group=group) for q in peers]
    for w in works:
        w.wait()
