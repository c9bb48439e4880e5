"""What tensor parallelism communicates per training step, and what that costs on a real link.

Each transformer block all-reduces the activations ``(batch, seq, hidden)`` four times per step:
twice forward (the g after attention's ``proj`` and after the MLP's ``fc2``) and twice backward
(the f in front of attention and of the MLP)::

    tp_comm_bytes = 4 · layers · batch · seq · hidden · dtype_bytes        (tp > 1; 0 for tp = 1)

It does not shrink as ``tp`` grows: each rank all-reduces the *whole* activation, whatever its
share of the weights. Data parallelism, by contrast, all-reduces the gradients (``params ·
bytes``) once per step, and a pipeline sends one activation per stage boundary and micro-batch.
The time comes from chapter 05's α-β model (``gc.ring_all_reduce_time``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..cluster import LINKS, AlphaBeta, ring_all_reduce_time
from ..runtime import check_int, check_type

__all__ = ["tp_comm_bytes", "tp_comm_time", "parallelism_comm", "tp_comm_widget"]


def tp_comm_bytes(batch: int, seq: int, hidden: int, layers: int, tp: int, dtype_bytes: int = 2) -> int:
    """Bytes all-reduced per training step by Megatron tensor parallelism (the blocks only).

    Args:
        batch, seq, hidden: the activation ``(batch, seq, hidden)`` each all-reduce carries
            (``batch`` is the batch of one tensor-parallel group).
        layers: transformer blocks (each: attention + MLP).
        tp: tensor-parallel degree; with 1 there is nothing to reduce.
        dtype_bytes: bytes per element (2 for bf16/fp16, 4 for fp32).

    Example::

        >>> tp_comm_bytes(batch=8, seq=1024, hidden=4096, layers=32, tp=8)    # bf16: 8 GiB per step
        8589934592
        >>> tp_comm_bytes(8, 1024, 4096, 32, tp=2) == tp_comm_bytes(8, 1024, 4096, 32, tp=8)
        True

    .. warning::
        This is the payload each rank hands to the all-reduces. What crosses the wire per rank in a
        ring is ``2(tp−1)/tp`` times that (``gc.ring_all_reduce_bytes``), and the embedding, the
        head and the vocabulary-parallel loss add a little more (not counted here).
    """
    for name, value in (("batch", batch), ("seq", seq), ("hidden", hidden), ("tp", tp), ("dtype_bytes", dtype_bytes)):
        check_int(name, value, 1)
    check_int("layers", layers, 0)
    return 0 if tp == 1 else 4 * layers * batch * seq * hidden * dtype_bytes


def tp_comm_time(batch: int, seq: int, hidden: int, layers: int, tp: int, link: AlphaBeta,
                 dtype_bytes: int = 2) -> float:
    """α-β seconds of the ``4 · layers`` ring all-reduces of one step over ``link``.

    Example::

        >>> t_nv = tp_comm_time(8, 1024, 4096, 32, 8, LINKS["NVLink"])
        >>> t_ib = tp_comm_time(8, 1024, 4096, 32, 8, LINKS["100 Gb InfiniBand"])
        >>> round(t_ib / t_nv)                   # why TP stays inside a node
        22
    """
    check_type("link", link, AlphaBeta, "an AlphaBeta (e.g. gc.LINKS['NVLink'])")
    if tp == 1:
        check_int("tp", tp, 1)
        return 0.0
    per = tp_comm_bytes(batch, seq, hidden, 1, tp, dtype_bytes) // 4        # one all-reduce
    return 4 * layers * ring_all_reduce_time(per, tp, link.alpha, link.beta)


def parallelism_comm(batch: int, seq: int, hidden: int, layers: int, params: int, degree: int, *,
                     microbatches: int = 8, dtype_bytes: int = 2,
                     links: Mapping[str, AlphaBeta] | None = None) -> list[dict]:
    """TP vs DP vs PP at the same degree: messages per step, bytes per rank, α-β time per link.

    * TP: ``4·layers`` all-reduces of the activations (``tp_comm_bytes``), on the critical path.
    * DP: one all-reduce of the gradients (``params · dtype_bytes``), can overlap with backward.
    * PP: ``2·microbatches`` point-to-point messages per stage boundary (activation forward,
      gradient backward) of ``batch/microbatches · seq · hidden`` each.

    Example::

        >>> rows = parallelism_comm(8, 1024, 4096, 32, params=6_700_000_000, degree=8,
        ...                         links={"NVLink": LINKS["NVLink"]})
        >>> [(r["strategy"], r["messages"]) for r in rows]
        [('TP', 128), ('DP', 1), ('PP', 16)]
    """
    check_int("params", params, 1)
    check_int("degree", degree, 2)
    check_int("microbatches", microbatches, 1)
    links = dict(LINKS) if links is None else dict(links)
    act = batch * seq * hidden * dtype_bytes
    grads = params * dtype_bytes
    p2p = act // microbatches
    rows = []
    for strategy, messages, nbytes in (("TP", 4 * layers, tp_comm_bytes(batch, seq, hidden, layers, degree, dtype_bytes)),
                                       ("DP", 1, grads), ("PP", 2 * microbatches, 2 * microbatches * p2p)):
        row = {"strategy": strategy, "messages": messages, "bytes": nbytes}
        for name, link in links.items():
            if strategy == "PP":
                row[name] = 2 * microbatches * link.transfer_time(p2p)
            else:
                row[name] = messages * ring_all_reduce_time(nbytes / messages, degree, link.alpha, link.beta)
        rows.append(row)
    return rows


def tp_comm_widget(batch: int = 8, seq: int = 2048, hidden: int = 4096, layers: int = 32, tp: int = 8):
    """Sliders over :func:`tp_comm_bytes` and :func:`tp_comm_time` on every link of ``gc.LINKS``.

    Returns an ``ipywidgets`` box (display it as a cell's last expression); its ``summary``
    attribute holds the text shown, recomputed when a slider moves.

    Example::

        >>> w = tp_comm_widget(batch=1, seq=1024, hidden=1024, layers=2, tp=2)
        >>> [c.description for c in w.children[:5]]
        ['batch', 'seq', 'hidden', 'layers', 'tp']
        >>> w.summary.splitlines()[0]
        'bf16, 2 layers: 8 all-reduces of 2.0 MiB = 16.0 MiB per step (payload per rank)'

    .. warning::
        Widgets need a live kernel; in a static view of the notebook the sliders do not move.
    """
    import ipywidgets as widgets

    sliders = [widgets.IntSlider(value=v, min=lo, max=hi, step=st, description=name, continuous_update=False)
               for name, v, lo, hi, st in (("batch", batch, 1, 64, 1), ("seq", seq, 128, 8192, 128),
                                           ("hidden", hidden, 256, 16384, 256), ("layers", layers, 1, 128, 1),
                                           ("tp", tp, 1, 16, 1))]
    text = widgets.HTML()
    box = widgets.VBox([*sliders, text])

    def redraw(change=None) -> None:
        b, s, h, n, p = (w.value for w in sliders)
        total = tp_comm_bytes(b, s, h, n, p)
        lines = [f"bf16, {n} layers: {4 * n if p > 1 else 0} all-reduces of {b * s * h * 2 / 2**20:.1f} MiB = "
                 f"{total / 2**20:.1f} MiB per step (payload per rank)"]
        for name, link in LINKS.items():
            lines.append(f"{name}: {tp_comm_time(b, s, h, n, p, link) * 1e3:.2f} ms of all-reduce per step")
        box.summary = "\n".join(lines)
        text.value = "<br>".join(lines)

    for w in sliders:
        w.observe(redraw, names="value")
    redraw()
    return box
