"""What context parallelism sends per attention layer, and what that costs on a real link.

With ``n = seq / N`` positions per rank, a K or V shard is ``b = batch · kv_heads · n · head_dim``
elements. Per rank and layer:

    ring     forward   (N−1) messages of K and V                      (N−1) · 2b
             backward  (N−1) of K and V,  N of the dK/dV accumulators  (2N−1) · 2b
    ulysses  forward   all-to-all of q, k, v, out: each keeps 1/N      (2·heads + 2·kv_heads)/kv_heads · b · (N−1)/N
             backward  the same four, reversed                          the same

The ring's volume does not depend on the mask (every block still travels — the ranks after you
need it) and grows with ``N``; Ulysses' stays about constant but needs ``heads % N == 0``, and
each all-to-all is ``N−1`` messages instead of one. The α-β time (chapter 05's model,
``gc.AlphaBeta``) says which wins on which link (:func:`cp_comm_time`).
"""

from __future__ import annotations

from ..cluster import AlphaBeta
from ..runtime import check_choice, check_int, check_type

__all__ = ["cp_comm_bytes", "cp_comm_time"]


def cp_comm_bytes(*, batch: int, heads: int, seq: int, head_dim: int, world_size: int, method: str = "ring",
                  causal: bool = False, kv_heads: int | None = None, dtype_bytes: int = 4) -> dict[str, int]:
    """Bytes ONE rank sends for ONE attention layer, forward and backward.

    Equal, exactly, to what :func:`ring_attention` / :func:`ulysses_attention` send (``gc.cp_meter``
    counts them); the small one-off exchange of shard shapes before the first message is not counted.

    Args:
        batch, heads, seq, head_dim: ``seq`` is the *full* sequence length, divisible by ``world_size``.
        world_size: ranks in the context-parallel group.
        method: ``"ring"`` or ``"ulysses"``.
        causal: accepted for symmetry; neither method sends less under a causal mask.
        kv_heads: heads of K/V (grouped-query attention); default ``heads``.
        dtype_bytes: 4 for fp32, 2 for bf16.

    Returns:
        ``{"forward": int, "backward": int, "total": int}``.

    Example::

        >>> cp_comm_bytes(batch=1, heads=8, seq=8192, head_dim=64, world_size=2)
        {'forward': 16777216, 'backward': 50331648, 'total': 67108864}
        >>> cp_comm_bytes(batch=1, heads=8, seq=8192, head_dim=64, world_size=2, method="ulysses")["forward"]
        16777216

    .. warning::
        These are bytes *sent* by one rank; every rank sends as much, at the same time. Ulysses
        with ``heads % world_size != 0`` raises ``ValueError`` — it cannot run there at all.
    """
    for name, value in (("batch", batch), ("heads", heads), ("seq", seq), ("head_dim", head_dim),
                        ("world_size", world_size), ("dtype_bytes", dtype_bytes)):
        check_int(name, value, 1)
    check_choice("method", method, ("ring", "ulysses"))
    check_type("causal", causal, bool)
    kv_heads = heads if kv_heads is None else check_int("kv_heads", kv_heads, 1, maximum=heads)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    n = world_size
    if seq % n:
        raise ValueError(f"seq ({seq}) must divide by world_size ({n}): every rank holds seq / world_size positions")
    shard = batch * kv_heads * (seq // n) * head_dim * dtype_bytes          # one K (or V) shard, bytes
    if method == "ring":
        forward, backward = (n - 1) * 2 * shard, (2 * n - 1) * 2 * shard if n > 1 else 0
    else:
        if heads % n or kv_heads % n:
            raise ValueError(f"ulysses splits heads over ranks: heads ({heads}) and kv_heads ({kv_heads}) "
                             f"must divide by world_size ({n})")
        q_shard = batch * heads * (seq // n) * head_dim * dtype_bytes
        forward = (2 * q_shard + 2 * shard) // n * (n - 1)                  # q, out + k, v; 1/N stays
        backward = forward
    return {"forward": forward, "backward": backward, "total": forward + backward}


def cp_comm_time(link: AlphaBeta, *, batch: int, heads: int, seq: int, head_dim: int, world_size: int,
                 method: str = "ring", kv_heads: int | None = None, dtype_bytes: int = 2) -> dict[str, float]:
    """α-β seconds of one layer's forward + backward communication over ``link`` (no overlap).

    Ring: ``3N − 2`` messages (``N−1`` forward, ``2N−1`` backward), each ``α + β·size``.
    Ulysses: 8 all-to-alls, each ``N − 1`` messages of ``1/N`` of a tensor. A ring hides its
    messages behind the computation of the current block when compute time per step is larger.

    Returns:
        ``{"messages": int, "bytes": int, "seconds": float}`` for one rank.

    Example::

        >>> import gpucourse as gc
        >>> ring = cp_comm_time(gc.LINKS["NVLink"], batch=1, heads=32, seq=131072, head_dim=128, world_size=8)
        >>> ring["messages"], ring["bytes"] == cp_comm_bytes(batch=1, heads=32, seq=131072, head_dim=128,
        ...                                                  world_size=8, dtype_bytes=2)["total"]
        (22, True)
    """
    check_type("link", link, AlphaBeta, "a gc.AlphaBeta (e.g. gc.LINKS['NVLink'])")
    total = cp_comm_bytes(batch=batch, heads=heads, seq=seq, head_dim=head_dim, world_size=world_size,
                          method=method, kv_heads=kv_heads, dtype_bytes=dtype_bytes)["total"]
    n = world_size
    messages = (3 * n - 2 if n > 1 else 0) if method == "ring" else 8 * (n - 1)
    seconds = messages * link.alpha + total * link.beta
    return {"messages": messages, "bytes": total, "seconds": seconds}
