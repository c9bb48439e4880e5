"""All-reduce built from point-to-point messages: the naive way, and the ring that NCCL and gloo use.

Data-parallel training ends every backward pass with an **all-reduce** of the gradients: each rank
holds a tensor, and afterwards every rank holds the element-wise sum. Two ways to build it from
``send``/``recv`` alone:

* :func:`naive_all_reduce` — everybody sends to rank 0, rank 0 adds and sends the sum back. Rank 0's
  link carries ``2 (p - 1) N`` values while all other links idle: its time grows with ``p``.
* :func:`ring_all_reduce` — the ranks form a ring ``0 → 1 → … → p-1 → 0`` and the tensor is cut
  into ``p`` chunks.

  1) **reduce-scatter**, ``p - 1`` steps: each rank sends one chunk to its right neighbour and adds
     the chunk arriving from its left one. Afterwards rank ``r`` holds the full sum of chunk
     ``(r + 1) % p``.
  2) **all-gather**, ``p - 1`` steps: the finished chunks travel once around the ring, each rank
     overwriting its copy.

  Every rank sends ``2 (p - 1) / p · N`` values — *independent of p* — and all links are busy at
  once: that is why the ring scales.

Pipelining: each chunk is cut further into segments. A segment is forwarded as soon as it has
been reduced, so the network carries segment ``k + 1`` while the CPU (or GPU) adds segment ``k``,
instead of send, wait, add, send, wait, add.

:func:`ring_schedule` lists which chunk every rank sends and receives at each step; both the
implementation and the lesson's diagrams use it.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from ..runtime import check_int, group_info, same_on_every_rank

__all__ = ["ring_schedule", "ring_all_reduce", "naive_all_reduce"]

#: default segment size for pipelining the ring (bytes); a chunk is sent in equal pieces of at most
#: this size. Each piece is a message with a fixed cost; over gloo on CPUs 4 MB measured fastest
#: (1 MB: 0.78-0.88x gloo's speed at 16 MB per rank, 4 MB: 0.98-1.05x, benchmarks/all_reduce.py),
#: as in chapter 08's ring
DEFAULT_SEGMENT_BYTES = 4 << 20


def ring_schedule(rank: int, world_size: int) -> list[tuple[str, int, int, int]]:
    """The ring all-reduce's plan for one rank: ``(phase, step, chunk sent, chunk received)``.

    Rank ``r`` always sends to ``(r + 1) % world_size`` and receives from ``(r - 1) % world_size``.
    In the reduce-scatter the received chunk is *added* to the local copy; in the all-gather it
    *replaces* it.

    Args:
        rank: the rank whose plan to list, in ``[0, world_size - 1]``.
        world_size: number of ranks in the ring (``>= 1``; one rank has nothing to do).

    Example::

        >>> for step in ring_schedule(0, 3):
        ...     print(step)
        ('reduce-scatter', 0, 0, 2)
        ('reduce-scatter', 1, 2, 1)
        ('all-gather', 0, 1, 0)
        ('all-gather', 1, 0, 2)

    After its reduce-scatter, rank 0 owns the finished sum of chunk 1 — the first chunk it sends
    in the all-gather.

    .. warning::
        Every rank must follow its own plan in lock-step order: a rank that sends chunk ``i``
        while its neighbour expects chunk ``j`` adds the wrong numbers silently (same sizes) or
        waits forever (different sizes).
    """
    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {world_size - 1}]")
    p = world_size
    plan = [("reduce-scatter", s, (rank - s) % p, (rank - s - 1) % p) for s in range(p - 1)]
    plan += [("all-gather", s, (rank + 1 - s) % p, (rank - s) % p) for s in range(p - 1)]
    return plan


def _check_tensor(tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype == torch.bool:
        raise TypeError("tensor has dtype torch.bool, which has no sum; convert it first "
                        "(e.g. tensor.to(torch.int32))")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise TypeError(f"tensor must be a dense (strided) tensor, got layout {tensor.layout}")


def _flat_real_view(contiguous: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a contiguous tensor; complex numbers become pairs of reals (a sum is a sum)."""
    if contiguous.is_complex():
        contiguous = torch.view_as_real(contiguous)
    return contiguous.view(-1)


def _pieces(chunk_elems: int, max_elems: int) -> int:
    """How many segments a chunk is cut into: the fewest of at most ``max_elems`` elements each.

        >>> _pieces(1_398_102, 1_048_576), _pieces(2_097_152, 1_048_576), _pieces(5, 1), _pieces(0, 4)
        (2, 2, 5, 1)
    """
    return max(1, -(-chunk_elems // max(1, max_elems)))


def _segments(chunk: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    """``chunk`` cut into ``pieces`` segments of *equal* size (they differ by at most one element).

    As gloo's own ring does: 4 MB pieces of a 5.3 MB chunk would be 4 MB + 1.3 MB, and the short
    tail leaves the pipeline uneven; two pieces of 2.7 MB are not (``benchmarks/all_reduce.py`` at
    3 ranks). The larger pieces come first, so a chunk one element shorter than another is cut into
    pieces no larger than the other's, index by index (the receive buffers rely on it).

        >>> [s.numel() for s in _segments(torch.zeros(10), 3)]
        [4, 3, 3]
        >>> [s.numel() for s in _segments(torch.zeros(2), 3)]
        [1, 1]
    """
    return [s for s in chunk.tensor_split(pieces) if s.numel() > 0]


#: receive buffers kept between ring all-reduces, per thread, dtype and device; at most this many bytes
_SCRATCH_LIMIT = 64 << 20
_scratch_buffers = threading.local()


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``numel`` elements of scratch memory: the kept buffer when it is large enough (memory that was
    touched before, so no page faults), else a new one — kept for next time below the limit."""
    kept = _scratch_buffers.__dict__.setdefault("by_kind", {})   # this thread's: calls never share one
    buf = kept.get((dtype, device))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        if numel * buf.element_size() <= _SCRATCH_LIMIT:
            kept[(dtype, device)] = buf
    return buf[:numel]


def ring_all_reduce(tensor: torch.Tensor, group=None, *,
                    segment_bytes: int = DEFAULT_SEGMENT_BYTES, check_shapes: bool = True,
                    _batched: bool | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks of ``group``, in place, with a pipelined ring of send/recv.

    Same result as ``dist.all_reduce(tensor)`` (up to floating-point rounding order), built only
    from ``dist.isend``/``dist.irecv``: a reduce-scatter and an all-gather around the ring, see
    :func:`ring_schedule`. Every rank must call it with a tensor of the same shape and dtype (the
    ranks compare them first, with one small round of send/recv, and all raise ``ValueError`` if
    they differ; ``dist.all_reduce`` does not check, and gloo aborts the process on a mismatch).

    Two transports for the same plan:

    * **gloo** — receives are posted one step ahead with ``irecv`` and messages are kept apart by
      their tags, so the next step's data can arrive while this step's is being added (measured
      fastest here; see ``benchmarks/all_reduce.py``).
    * **every other backend (NCCL)** — NCCL ignores tags and matches the messages between two ranks
      in posting order; an unbatched receive posted before the matching send can deadlock, above
      all at 2 ranks where the left and right neighbour are the same process. There each send is
      posted together with its receive in one ``dist.batch_isend_irecv`` (a NCCL group).

    Args:
        tensor: any shape (also 0-d, empty, non-contiguous), any numeric dtype (not bool); it is
            overwritten with the sum and returned.
        group: the process group (default: the default group). Ranks are the group's ranks.
        segment_bytes: chunks are sent in segments of at most this many bytes, so that sending one
            segment overlaps with adding the previous one; a chunk is cut into the fewest equal
            segments that fit (a 5.3 MB chunk into two of 2.7 MB, not 4 MB + 1.3 MB).
            ``segment_bytes >= chunk size`` turns the pipelining off (a plain ring). Every segment
            is a message with a fixed cost: the default, 4 MB, is what measured fastest over gloo
            on CPUs (lesson 04 measures the trade).
        check_shapes: compare every rank's shape and dtype first (one small message to every other
            rank, a round trip's latency). ``False`` skips it, as ``dist.all_reduce`` does: only for
            calls known to agree (a timing against ``dist.all_reduce`` compares like with like).

    Returns:
        ``tensor``, now holding the sum over the group.

    Example::

        >>> import torch, gpucourse as gc
        >>> def demo(rank, world_size):
        ...     t = torch.arange(5.0) + 10 * rank       # rank 0: 0..4, rank 1: 10..14, rank 2: 20..24
        ...     gc.ring_all_reduce(t)
        ...     return t.tolist()
        >>> gc.launch(demo, 3)[2]
        [30.0, 33.0, 36.0, 39.0, 42.0]

    .. warning::
        Like every collective it must be called by **every** rank of the group, the same number of
        times and in the same order. Calling it inside ``if rank == 0:`` leaves rank 0 waiting
        for a neighbour that never sends — until the group's timeout.
    """
    _check_tensor(tensor)
    check_int("segment_bytes", segment_bytes, 1)
    rank, p, global_rank = group_info(group)
    if p == 1:
        return tensor
    batched = dist.get_backend(group) != "gloo" if _batched is None else _batched
    if check_shapes:
        same_on_every_rank("ring_all_reduce: the tensor's shape and dtype",
                            (tuple(tensor.shape), str(tensor.dtype)), group,
                            lambda v: f"{v[0]} {v[1].replace('torch.', '')}",
                            point_to_point=(rank, p, global_rank, batched, tensor.device))
    if tensor.numel() == 0:
        return tensor
    contiguous = tensor if tensor.is_contiguous() else tensor.contiguous()
    work = _flat_real_view(contiguous)                      # (N,) a view of `contiguous`
    right, left = global_rank((rank + 1) % p), global_rank((rank - 1) % p)
    chunks = work.tensor_split(p)                            # p chunks, sizes differ by at most 1
    pieces = _pieces(chunks[0].numel(), segment_bytes // work.element_size())
    segs = [_segments(c, pieces) for c in chunks]            # segs[i]: the pieces of chunk i
    per_step = max(len(s) for s in segs)
    plan = ring_schedule(rank, p)
    steps = len(plan)                                        # 2 (p - 1)

    def tag(step: int, k: int) -> int:                      # one message id per (step, segment)
        return step * per_step + k

    # reduce-scatter receive buffers: two sets (step s uses set s % 2; one at 2 ranks), sized for the
    # largest chunk (chunk 0: tensor_split puts the extra elements first). Kept between calls: fresh
    # memory costs a page fault per 4 KB on its first touch, ~2 ms of a 16 MB all-reduce.
    scratch = _scratch(min(2, p - 1) * chunks[0].numel(), work.dtype, work.device)
    bufs = [_segments(half, pieces) for half in scratch.split(chunks[0].numel())]

    def exchange(step: int, k: int):
        """Post segment k of this step's send *and* receive as one batch; return the receive's work.

        Posting both halves of a step together (``batch_isend_irecv``, a NCCL group) is what makes
        this safe on NCCL, which ignores tags and matches a pair's messages in posting order: an
        unbatched receive posted before the matching send deadlocks there (at 2 ranks the left
        and right neighbour are the same process). On gloo the batch is simply isend + irecv.
        """
        _, _, send_chunk, recv_chunk = plan[step]
        ops = []
        if k < len(segs[send_chunk]):
            ops.append(dist.P2POp(dist.isend, segs[send_chunk][k], right, group, tag(step, k)))
        if k < len(segs[recv_chunk]):
            target = (bufs[step % 2][k][: segs[recv_chunk][k].numel()] if step < p - 1
                      else segs[recv_chunk][k])          # all-gather: straight into place
            ops.append(dist.P2POp(dist.irecv, target, left, group, tag(step, k)))
        works = dist.batch_isend_irecv(ops) if ops else []
        if ops and ops[-1].op is dist.irecv:
            # gloo: [isend, irecv]; NCCL: one work for the whole group. The caller waits for the
            # returned one exactly once (a second wait on a finished gloo irecv never returns).
            outstanding.extend(works[:-1])
            return works[-1]
        outstanding.extend(works)
        return None

    if not batched:     # gloo: receives posted one step ahead, tags keep the messages apart
        def post_receives(step: int) -> list:
            recv_chunk = plan[step][3]
            if step < p - 1:    # reduce-scatter: into a buffer, added afterwards
                targets = [bufs[step % 2][k][: s.numel()] for k, s in enumerate(segs[recv_chunk])]
            else:               # all-gather: straight into place
                targets = segs[recv_chunk]
            return [dist.irecv(t, left, group=group, tag=tag(step, k)) for k, t in enumerate(targets)]

        pending = post_receives(0)          # first: gloo sends only to a posted receive
        sends = [dist.isend(s, right, group=group, tag=tag(0, k)) for k, s in enumerate(segs[plan[0][2]])]
        for step in range(steps):
            arriving = pending
            if step + 1 < steps:
                pending = post_receives(step + 1)   # look ahead: the next step's messages may come early
            for k, segment in enumerate(segs[plan[step][3]]):
                arriving[k].wait()
                if step < p - 1:
                    segment.add_(bufs[step % 2][k][: segment.numel()])
                # the chunk received at this step is the one sent at the next: forward this piece now,
                # while the following pieces are still arriving (the pipelining)
                if step + 1 < steps:
                    sends.append(dist.isend(segment, right, group=group, tag=tag(step + 1, k)))
        for w in sends:
            w.wait()
    else:               # NCCL and others: every message in a send+receive batch
        outstanding = []
        arriving = [exchange(0, k) for k in range(per_step)]
        for step in range(steps):
            following = []
            for k, segment in enumerate(segs[plan[step][3]]):
                arriving[k].wait()
                if step < p - 1:
                    segment.add_(bufs[step % 2][k][: segment.numel()])
                # the chunk received at this step is the one sent at the next: forward this piece now,
                # while the following pieces are still arriving (the pipelining)
                if step + 1 < steps:
                    following.append(exchange(step + 1, k))
            if step + 1 < steps:               # segments of the next step that this one did not carry
                following += [exchange(step + 1, k) for k in range(len(following), per_step)]
            arriving = following
        for w in outstanding:
            w.wait()
    if contiguous is not tensor:
        tensor.copy_(contiguous)
    return tensor


def naive_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the group, in place, the naive way: all to rank 0, the sum back to all.

    The baseline the ring is measured against. Rank 0 receives ``p - 1`` tensors, adds them in
    rank order, and sends the result to each of the ``p - 1`` others: its link carries
    ``2 (p - 1) N`` values, the others' only ``2 N``.

    Args:
        tensor: any shape and numeric dtype (not bool); overwritten with the sum and returned.
        group: the process group (default: the default group); its rank 0 does the adding.

    Returns:
        ``tensor``, now holding the sum over the group.

    Example::

        >>> import torch, gpucourse as gc
        >>> def demo(rank, world_size):
        ...     return gc.naive_all_reduce(torch.tensor([rank + 1.0])).item()
        >>> gc.launch(demo, 3)
        [6.0, 6.0, 6.0]

    .. warning::
        Its cost grows linearly with the number of ranks (rank 0 is the bottleneck) — fine for
        a lesson, never for gradients. ``dist.all_reduce`` and :func:`ring_all_reduce` keep every
        link equally busy.
    """
    _check_tensor(tensor)
    rank, p, global_rank = group_info(group)
    if p == 1 or tensor.numel() == 0:
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    root = global_rank(0)
    if rank == 0:
        incoming = [torch.empty_like(work) for _ in range(p - 1)]
        recvs = [dist.irecv(buf, global_rank(r), group=group) for r, buf in enumerate(incoming, 1)]
        for w, buf in zip(recvs, incoming):      # add in rank order: the same result every run
            w.wait()
            work.add_(buf)
        for w in [dist.isend(work, global_rank(r), group=group) for r in range(1, p)]:
            w.wait()
    else:
        dist.send(work, root, group=group)
        dist.recv(work, root, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


