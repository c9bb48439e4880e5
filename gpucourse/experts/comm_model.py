"""What expert parallelism sends: two all-to-alls forward, the same two backward.

Rank ``me`` routes its ``T`` tokens to ``k`` experts each: ``T·k`` token copies of ``d_model``
numbers. ``send[r]`` of them go to experts on rank ``r``; ``recv[s]`` copies arrive from rank ``s``
for my experts. Per MoE layer and step, the rows that *leave* this rank (its own stay in memory)::

    forward   dispatch  Σ_{r≠me} send[r]     (my copies to their experts)
              return    Σ_{s≠me} recv[s]     (my experts' results to their tokens' ranks)
    backward  the same two exchanges reversed: the gradients of the returned results go back to
              the experts (Σ_{r≠me} send[r]), the gradients of the dispatched copies to their
              tokens (Σ_{s≠me} recv[s])

each row ``d_model · dtype_bytes`` bytes. With uniform routing a copy leaves with probability
``(world−1)/world``: ``send = recv ≈ T·k·(world−1)/world`` — so, unlike tensor parallelism's
all-reduce, the bytes per rank hardly shrink as ranks are added, and (unlike a ring) every rank
talks to every other: across nodes, most of them cross the slow network.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..cluster import AlphaBeta
from ..runtime import check_int, check_type

__all__ = ["ep_comm_bytes", "ep_comm_time"]


def _counts(name: str, counts, world_size: int) -> list[int]:
    if isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence):
        counts = list(counts) if hasattr(counts, "__iter__") else counts
    if not isinstance(counts, Sequence) or len(counts) != world_size:
        raise ValueError(f"{name} must be a sequence of {world_size} ints (one per rank), got {counts!r}")
    return [check_int(f"{name}[{i}]", int(c) if hasattr(c, "item") else c, 0) for i, c in enumerate(counts)]


def ep_comm_bytes(*, tokens: int, d_model: int, world_size: int, top_k: int, dtype_bytes: int = 4,
                  send_counts: Sequence[int] | None = None, rank: int | None = None,
                  recv_counts: Sequence[int] | None = None) -> dict[str, int]:
    """Bytes ONE rank sends for ONE MoE layer's token all-to-alls, forward and backward.

    Args:
        tokens: tokens on this rank (``T``).
        d_model: numbers per token.
        world_size: ranks in the expert-parallel group.
        top_k: experts per token.
        dtype_bytes: bytes per number (4 fp32, 2 bf16).
        send_counts: token copies this rank routes to each rank (``world_size`` ints), for the exact
            count; ``None``: the expectation under uniform routing, ``round(T·k·(world−1)/world)``
            copies leave the rank (rounded half up), and as many arrive.
        rank: this rank's index, required with ``send_counts`` (its own entry never leaves it).
        recv_counts: token copies this rank receives from each rank; ``None``: taken equal to
            ``send_counts`` (a balanced exchange). ``gc.expert_parallel`` records both
            (``.send_counts``, ``.recv_counts``).

    Returns:
        ``{"forward", "backward", "total"}`` in bytes. The small header each rank all-gathers first
        (its counts per expert) is **not** included; ``expert_parallel`` counts it apart.

    Example::

        >>> ep_comm_bytes(tokens=4096, d_model=4096, world_size=8, top_k=2, dtype_bytes=2)
        {'forward': 117440512, 'backward': 117440512, 'total': 234881024}
        >>> ep_comm_bytes(tokens=6, d_model=4, world_size=2, top_k=2, send_counts=[5, 7], rank=0,
        ...               recv_counts=[5, 3])
        {'forward': 160, 'backward': 160, 'total': 320}

    .. warning::
        The uniform expectation is what a balanced router gives. A skewed router sends more to
        the ranks of the popular experts — and the slowest (busiest) rank sets the pace.
    """
    check_int("tokens", tokens, 1)
    check_int("d_model", d_model, 1)
    check_int("world_size", world_size, 1)
    check_int("top_k", top_k, 1)
    check_int("dtype_bytes", dtype_bytes, 1)
    if send_counts is None:
        if recv_counts is not None or rank is not None:
            raise ValueError("recv_counts and rank go with send_counts (the exact count); without "
                             "send_counts the result is the uniform-routing expectation")
        out = (2 * tokens * top_k * (world_size - 1) + world_size) // (2 * world_size)   # round half up
        inn = out
    else:
        if rank is None:
            raise ValueError("pass rank= with send_counts: the copies to this rank itself never leave it")
        check_int("rank", rank, 0, maximum=world_size - 1, hint=" (ranks are 0 … world_size−1)")
        send = _counts("send_counts", send_counts, world_size)
        if sum(send) > tokens * top_k:
            raise ValueError(f"send_counts {send} add up to more than tokens·top_k = {tokens * top_k}")
        recv = send if recv_counts is None else _counts("recv_counts", recv_counts, world_size)
        out = sum(send) - send[rank]
        inn = sum(recv) - recv[rank]
    one_way = (out + inn) * d_model * dtype_bytes
    return {"forward": one_way, "backward": one_way, "total": 2 * one_way}


def ep_comm_time(*, tokens: int, d_model: int, world_size: int, top_k: int, link: AlphaBeta,
                 dtype_bytes: int = 2, ranks_per_node: int | None = None, intra: AlphaBeta | None = None) -> float:
    """α-β seconds of one MoE layer's four all-to-alls (uniform routing).

    An all-to-all is ``world−1`` messages per rank (one to every other rank), each
    ``1/(world−1)`` of the rank's bytes. Without ``ranks_per_node`` every message goes over
    ``link``: ``4 · ((world−1)·α + bytes_one_way/2 · β)``. With ``ranks_per_node = g``, the
    ``g−1`` messages to ranks of the same node go over ``intra`` (default ``gc.LINKS["NVLink"]``)
    and only the other ``world−g`` over ``link`` — ``(world−g)/(world−1)`` of the rows; the two
    links work at the same time, so each all-to-all takes the longer of the two parts.

    Args:
        tokens, d_model, world_size, top_k, dtype_bytes: as for :func:`ep_comm_bytes`.
        link: the link between ranks (between nodes when ``ranks_per_node`` is given).
        ranks_per_node: ranks that share a node (a divisor of ``world_size``); ``None``: every rank
            talks to every other over ``link``.
        intra: the link inside a node (default NVLink).

    Example::

        >>> from gpucourse.cluster import LINKS
        >>> nv = ep_comm_time(tokens=4096, d_model=4096, world_size=8, top_k=2, link=LINKS["NVLink"])
        >>> ib = ep_comm_time(tokens=4096, d_model=4096, world_size=8, top_k=2, link=LINKS["100 Gb InfiniBand"])
        >>> round(ib / nv)
        22
        >>> nodes = ep_comm_time(tokens=4096, d_model=4096, world_size=64, top_k=2, ranks_per_node=8,
        ...                      link=LINKS["100 Gb InfiniBand"])
        >>> round(nodes / ib, 2)        # 56/63 of the rows cross the network, a little more than 8 ranks' 7/8
        1.02

    .. warning::
        Uniform routing: a skewed router sends more to the popular experts' ranks, and their
        links set the pace.
    """
    check_type("link", link, AlphaBeta, "an AlphaBeta (e.g. gc.LINKS['NVLink'])")
    b = ep_comm_bytes(tokens=tokens, d_model=d_model, world_size=world_size, top_k=top_k, dtype_bytes=dtype_bytes)
    if world_size == 1:
        return 0.0
    per_all_to_all = b["forward"] / 2                    # dispatch and return: half the forward bytes each
    if ranks_per_node is None:
        return 4 * ((world_size - 1) * link.alpha + per_all_to_all * link.beta)
    check_int("ranks_per_node", ranks_per_node, 1, maximum=world_size)
    if world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide world_size ({world_size})")
    if intra is None:
        from ..cluster import LINKS
        intra = LINKS["NVLink"]
    check_type("intra", intra, AlphaBeta, "an AlphaBeta (e.g. gc.LINKS['NVLink'])")
    share = per_all_to_all / (world_size - 1)             # one message
    inside, outside = ranks_per_node - 1, world_size - ranks_per_node
    t_inside = inside * (intra.alpha + share * intra.beta)
    t_outside = outside * (link.alpha + share * link.beta)
    return 4 * max(t_inside, t_outside)
