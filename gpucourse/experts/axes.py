"""The five axes of parallel training side by side, each computed by the chapter that teaches it.

For one mixture-of-experts transformer and ``degree`` ranks along ONE axis at a time:

| axis | splits | communicates | formula (chapter) |
|---|---|---|---|
| DP / ZeRO | the batch (ZeRO: also the model states) | gradients (ZeRO-3: + parameters) | ``zero_comm_bytes``, ``zero_memory`` (08) |
| TP | every weight matrix (heads, features) | activations, all-reduce 4× per layer | ``tp_comm_bytes`` (09) |
| PP | the layers (depth) | activations/gradients at stage boundaries | ``parallelism_comm``, ``bubble_fraction`` (07, 09) |
| CP | the sequence | K/V blocks around a ring, ``3N−2`` messages per layer | ``cp_comm_bytes`` (11) |
| EP | the experts | token copies, all-to-all 4× per MoE layer | ``ep_comm_bytes`` (11) |

Time per link comes from chapter 05's α-β model (``gc.LINKS``). Model states are
mixed-precision Adam's 16 bytes per parameter (``zero_memory``).
"""

from __future__ import annotations

from ..cluster import LINKS, ring_all_reduce_bytes
from ..pipeline import bubble_fraction
from ..runtime import check_choice, check_int
from ..sharding import zero_comm_bytes, zero_comm_time, zero_memory
from ..tensor_parallel import parallelism_comm, tp_comm_bytes, tp_comm_time
from .comm_model import ep_comm_bytes, ep_comm_time

__all__ = ["parallelism_axes"]

_LINKS = ("NVLink", "100 Gb InfiniBand")


class AxesTable(list):
    """The rows of :func:`parallelism_axes` (dicts); printed as a table."""

    def __str__(self) -> str:
        head = (f"{'axis':<10}{'splits':<22}{'communicates':<26}{'how often (per step)':<34}"
                f"{'GiB sent':>9}{'NVLink s':>9}{'IB s':>7}{'states GiB':>11}  activations")
        lines = [head, "-" * len(head)]
        for r in self:
            gib = "—" if r["bytes"] is None else f"{r['bytes'] / 2**30:.2f}"
            t = ["—" if r[k] is None else f"{r[k]:.3g}" for k in _LINKS]
            lines.append(f"{r['axis']:<10}{r['splits']:<22}{r['communicates']:<26}{r['how_often']:<34}{gib:>9}"
                         f"{t[0]:>9}{t[1]:>7}{r['states'] / 2**30:>11.1f}  {r['activations']}")
        return "\n".join(lines)

    __repr__ = __str__


def parallelism_axes(*, layers: int = 32, hidden: int = 4096, ffn_hidden: int = 14336, heads: int = 32,
                     seq: int = 4096, batch: int = 8, num_experts: int = 8, top_k: int = 2, degree: int = 8,
                     microbatches: int = 8, zero_stage: int = 3, dtype_bytes: int = 2) -> AxesTable:
    """DP/ZeRO, TP, PP, CP and EP for one MoE transformer, ``degree`` ranks along each axis alone.

    The model: ``layers`` blocks of attention (``4·hidden²`` parameters) and an MoE layer of
    ``num_experts`` experts ``hidden → ffn_hidden → hidden`` (top-``top_k``); ``batch`` sequences
    of ``seq`` tokens per step for the whole group; embeddings left out. Each row says what the
    axis splits, what it sends, how often, the bytes one rank sends per step (on the wire: a ring
    all-reduce sends ``2(p−1)/p`` of its payload), their α-β time on NVLink and 100 Gb
    InfiniBand, the model states per rank (16 B/parameter) and what happens to activations.

    Returns:
        an ``AxesTable`` (a list of dicts with keys ``axis, splits, communicates, how_often,
        messages, bytes, NVLink, 100 Gb InfiniBand, states, states_saved, activations``);
        ``print`` it for the table.

    Example::

        >>> rows = parallelism_axes(degree=8)
        >>> [r["axis"] for r in rows]
        ['DP/ZeRO-3', 'TP', 'PP', 'CP', 'EP']
        >>> [round(r["states_saved"], 2) for r in rows]      # share of the replicated states saved
        [0.88, 0.88, 0.88, 0.0, 0.82]

    .. warning::
        One axis at a time, for orders of magnitude: real runs combine them (TP inside a node,
        EP and CP inside or across, PP and DP across nodes), and overlap hides part of the time.
    """
    for name, v in (("layers", layers), ("hidden", hidden), ("ffn_hidden", ffn_hidden), ("heads", heads),
                    ("seq", seq), ("batch", batch), ("num_experts", num_experts), ("degree", degree),
                    ("microbatches", microbatches), ("dtype_bytes", dtype_bytes)):
        check_int(name, v, 1)
    check_int("top_k", top_k, 1, maximum=num_experts)
    check_choice("zero_stage", zero_stage, (0, 1, 2, 3))
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    n, act = degree, batch * seq * hidden * dtype_bytes                  # one (B, S, H) activation
    experts = layers * num_experts * 2 * hidden * ffn_hidden
    params = layers * (4 * hidden * hidden + hidden * num_experts) + experts
    replicated = zero_memory(params, 1, 0)

    def times(messages, nbytes):
        return {k: (None if nbytes is None else messages * LINKS[k].alpha + nbytes * LINKS[k].beta) for k in _LINKS}

    rows = []
    # DP / ZeRO (chapters 04, 08): gradients once per step; ZeRO-3 gathers parameters twice more
    dp_bytes = zero_comm_bytes(params * dtype_bytes, n, zero_stage)
    rows.append(dict(axis=f"DP/ZeRO-{zero_stage}" if zero_stage else "DP", splits="batch" + (" + model states" if zero_stage else ""),
                     communicates="gradients" + (" + parameters" if zero_stage == 3 else ""),
                     how_often=("3 per layer, prefetched" if zero_stage == 3 else "once; overlaps the backward"),
                     messages=3 * layers if zero_stage == 3 else 1, bytes=dp_bytes,
                     **{k: zero_comm_time(params * dtype_bytes, n, zero_stage, LINKS[k].alpha, LINKS[k].beta) for k in _LINKS},
                     states=zero_memory(params, n, zero_stage), activations="÷N (its batch share)"))
    # TP (chapter 09): 4 all-reduces of the activation per layer, on the critical path
    tp_payload = tp_comm_bytes(batch, seq, hidden, layers, n, dtype_bytes)
    rows.append(dict(axis="TP", splits="each weight matrix", communicates="activations, all-reduce",
                     how_often=f"4 per layer = {4 * layers}, blocking", messages=4 * layers,
                     bytes=ring_all_reduce_bytes(tp_payload, n),
                     **{k: tp_comm_time(batch, seq, hidden, layers, n, LINKS[k], dtype_bytes) for k in _LINKS},
                     states=zero_memory(-(-params // n), 1, 0), activations="÷N in blocks (+SP: all)"))
    # PP (chapters 07, 09): one activation forward and one gradient backward per micro-batch and boundary
    pp = next(r for r in parallelism_comm(batch, seq, hidden, layers, params, max(n, 2), microbatches=microbatches,
                                          dtype_bytes=dtype_bytes, links={k: LINKS[k] for k in _LINKS}) if r["strategy"] == "PP")
    rows.append(dict(axis="PP", splits="layers (depth)", communicates="activations, send/recv",
                     how_often=f"2 per micro-batch = {2 * microbatches}; bubble {bubble_fraction(n, microbatches):.0%}",
                     messages=pp["messages"], bytes=pp["bytes"], **{k: pp[k] for k in _LINKS},
                     states=zero_memory(-(-params // n), 1, 0), activations=f"its layers, {microbatches} micro-batches"))
    # CP (chapter 11, part A): K and V blocks around the ring, forward and backward, every layer
    try:
        from ..long_context import cp_comm_bytes
        cp = layers * cp_comm_bytes(batch=batch, heads=heads, seq=seq, head_dim=hidden // heads, world_size=n,
                                    method="ring", dtype_bytes=dtype_bytes)["total"]
    except ImportError:             # chapter 11's context-parallel part is not installed
        cp = None
    cp_msgs = layers * (3 * n - 2 if n > 1 else 0)          # cp_comm_time's count: N−1 forward, 2N−1 backward
    rows.append(dict(axis="CP", splits="sequence", communicates="K/V blocks, ring",
                     how_often=f"3N−2 ring messages/layer = {cp_msgs}", messages=cp_msgs, bytes=cp,
                     **times(cp_msgs, cp), states=replicated, activations="÷N (its sequence share)"))
    # EP (chapter 11, part B): 2 all-to-alls forward and 2 backward per MoE layer
    ep = layers * ep_comm_bytes(tokens=-(-batch * seq // n), d_model=hidden, world_size=n, top_k=top_k,
                                dtype_bytes=dtype_bytes)["total"]
    rows.append(dict(axis="EP", splits="experts", communicates="token copies, all-to-all",
                     how_often=f"4 per MoE layer = {4 * layers}", messages=4 * layers, bytes=ep,
                     **{k: layers * ep_comm_time(tokens=-(-batch * seq // n), d_model=hidden, world_size=n, top_k=top_k,
                                                 link=LINKS[k], dtype_bytes=dtype_bytes) for k in _LINKS},
                     states=zero_memory(params - experts + -(-experts // n), 1, 0),
                     activations="÷N (EP ranks are also DP)"))
    for r in rows:
        r["states_saved"] = 1 - r["states"] / replicated
    return AxesTable(rows)
