"""Time of a training step, term by term: compute from FLOPs, each axis' communication from the
α-β model (chapter 05), the pipeline bubble (chapter 07).

Per device, one step::

    compute   = FLOPs this device does / peak FLOP/s                     (recomputation adds FLOPs;
                the busiest expert-parallel rank does expert_load × its mean expert work)
    tp        = 4 all-reduces of (b, s/cp, h) per layer and micro-batch   (chapter 09: tp_comm_time)
    cp        = ring attention's K/V traffic, minus the attention compute it hides behind (none
                hides without overlap)
    ep        = the expert all-to-alls (dispatch + combine, forward + backward), × expert_load
    pp        = one activation forward and one gradient backward per micro-batch (point to point)
    bubble    = (compute + tp + cp + ep + pp) · (pp − 1)/m               (bubble_fraction / (1 − it))
    dp        = gradient reduction (chapter 08: zero_comm_time), minus the last micro-batch's backward
                it overlaps with
    total     = the sum;   MFU = model FLOPs per device / (total · peak)
"""

from __future__ import annotations

from ..cluster import AlphaBeta
from ..pipeline import bubble_fraction
from ..runtime import check_number
from ..sharding import zero_comm_time
from ..tensor_parallel import tp_comm_time
from .communication import cp_comm_bytes, ep_comm_bytes
from .model_spec import ModelSpec

__all__ = ["step_flops", "expert_imbalance_flops", "compute_time", "dp_step_comm_time", "tp_step_comm_time", "pp_step_comm_time", "cp_step_comm_time",
           "ep_step_comm_time", "bubble_time", "exposed", "mfu"]


def step_flops(model: ModelSpec, tokens: int, recompute: str = "none") -> tuple[int, int]:
    """``(model FLOPs, hardware FLOPs)`` of a training step over ``tokens`` tokens.

    Model FLOPs are ``tokens · flops_per_token``. Recomputation adds work the model does not need:
    ``"full"`` repeats every layer's forward (a third of the layers' forward + backward),
    ``"selective"`` repeats the attention scores' forward (``4 · L · h · seq`` per token).

    Example::

        >>> m = ModelSpec(layers=2, hidden=64, heads=4, ffn=256, vocab=64, seq=32)
        >>> step_flops(m, 96)
        (63700992, 63700992)
        >>> step_flops(m, 96, "full")[1] > step_flops(m, 96, "selective")[1] > 63700992
        True
    """
    base = tokens * model.flops_per_token()
    attention_fwd = 4 * model.layers * model.hidden * model.seq
    if recompute == "full":
        layer_fwd = 2 * (model.matmul_params() - model.vocab * model.hidden) + attention_fwd
        return base, base + tokens * layer_fwd
    if recompute == "selective":
        return base, base + tokens * attention_fwd
    return base, base


def expert_imbalance_flops(model: ModelSpec, tokens: float, ep: int, recompute: str = "none") -> float:
    """The busiest expert-parallel rank's extra FLOPs over an even share of ``tokens`` tokens:
    ``(expert_load − 1) · tokens · expert FLOPs per token`` (full recomputation repeats the
    experts' forward: ``8/6`` of it).

    Example::

        >>> m = ModelSpec(layers=2, hidden=64, heads=4, ffn=256, vocab=64, seq=32, experts=2, capacity_factor=1.25)
        >>> expert_imbalance_flops(m, 1024, ep=2) == 0.25 * 1024 * m.expert_flops_per_token()
        True
        >>> expert_imbalance_flops(m, 1024, ep=1)
        0.0
    """
    load = model.expert_load(ep)
    per_token = model.expert_flops_per_token() * (8 / 6 if recompute == "full" else 1)
    return (load - 1) * tokens * per_token


def compute_time(flops: float, peak_flops: float) -> float:
    """``flops / peak_flops`` seconds.

    Example::

        >>> compute_time(989e12, 989e12)
        1.0
    """
    check_number("flops", flops, 0)
    check_number("peak_flops", peak_flops, 0)
    return flops / peak_flops


def dp_step_comm_time(grad_bytes: float, ranks: int, zero: int, link: AlphaBeta) -> float:
    """Gradient reduction (and ZeRO's parameter gathers) per step: chapter 08's ``zero_comm_time``.

    Example::

        >>> from gpucourse.cluster import LINKS
        >>> round(dp_step_comm_time(100e6, 2, 0, LINKS["1 GbE"]), 3)              # 100 MB of gradients
        0.8
    """
    if ranks == 1 or grad_bytes == 0:
        return 0.0
    return zero_comm_time(grad_bytes, ranks, zero, link.alpha, link.beta)


def tp_step_comm_time(model: ModelSpec, *, micro_batch: int, microbatches: int, tp: int, pp: int, cp: int,
                      link: AlphaBeta, dtype_bytes: int, recompute: str = "none") -> float:
    """Chapter 09's ``tp_comm_time`` for this stage's layers, once per micro-batch; full
    recomputation repeats the two forward all-reduces (× 1.5).

    Example::

        >>> from gpucourse.cluster import LINKS
        >>> m = ModelSpec(layers=32, hidden=4096, heads=32, ffn=16384, vocab=50000, seq=1024)
        >>> t = tp_step_comm_time(m, micro_batch=8, microbatches=1, tp=8, pp=1, cp=1, link=LINKS["NVLink"],
        ...                       dtype_bytes=2)
        >>> round(t * 1e3, 1)                                              # ms per step
        55.5
    """
    if tp == 1:
        return 0.0
    one = tp_comm_time(micro_batch, model.seq // cp, model.hidden, -(-model.layers // pp), tp, link, dtype_bytes)
    return microbatches * one * (1.5 if recompute == "full" else 1.0)


def pp_step_comm_time(model: ModelSpec, *, micro_batch: int, microbatches: int, pp: int, tp: int, cp: int,
                 sequence_parallel: bool, link: AlphaBeta, dtype_bytes: int) -> float:
    """``2 · m`` point-to-point messages of one micro-batch's activation ``(b, s/cp, h)`` (split over
    ``tp`` with sequence parallelism), forward and backward, per stage.

    Example::

        >>> from gpucourse.cluster import LINKS
        >>> m = ModelSpec(layers=4, hidden=1024, heads=8, ffn=4096, vocab=1000, seq=1000)
        >>> round(pp_step_comm_time(m, micro_batch=1, microbatches=4, pp=2, tp=1, cp=1, sequence_parallel=False,
        ...                    link=LINKS["1 GbE"], dtype_bytes=2), 3)       # 8 × 2 MB at 125 MB/s
        0.131
    """
    if pp == 1:
        return 0.0
    nbytes = micro_batch * (model.seq // cp) * model.hidden * dtype_bytes // (tp if sequence_parallel else 1)
    return 2 * microbatches * link.transfer_time(nbytes)


def cp_step_comm_time(model: ModelSpec, *, micro_batch: int, microbatches: int, cp: int, tp: int, pp: int,
                 link: AlphaBeta, dtype_bytes: int, peak_flops: float, overlap: bool = True) -> float:
    """Exposed ring-attention traffic: per layer and micro-batch, chapter 11's ``cp_comm_bytes`` over
    the link (``3(cp − 1)`` messages), minus the attention compute of that layer it overlaps with
    (``overlap=False``: nothing hides it — one CPU core per rank both computes and copies).

    Example::

        >>> from gpucourse.cluster import LINKS
        >>> m = ModelSpec(layers=2, hidden=4096, heads=32, ffn=14336, vocab=1000, seq=131072)
        >>> cp_step_comm_time(m, micro_batch=1, microbatches=1, cp=16, tp=8, pp=1, link=LINKS["NVLink"],
        ...              dtype_bytes=2, peak_flops=989e12)                  # hidden: long sequences
        0.0
    """
    if cp == 1:
        return 0.0
    nbytes = cp_comm_bytes(batch=micro_batch, heads=model.heads // tp, seq=model.seq, head_dim=model.head_dim,
                           world_size=cp, method="ring", causal=True, kv_heads=model.kv_heads // tp,
                           dtype_bytes=dtype_bytes)["total"]
    comm = 3 * (cp - 1) * link.alpha + nbytes * link.beta
    attention = 12 * model.hidden * model.seq * micro_batch * (model.seq // cp) / tp / peak_flops if overlap else 0.0
    return microbatches * (-(-model.layers // pp)) * exposed(comm, attention)


def ep_step_comm_time(model: ModelSpec, *, micro_batch: int, microbatches: int, ep: int, cp: int, pp: int,
                 link: AlphaBeta, dtype_bytes: int) -> float:
    """The expert all-to-alls: per MoE layer and micro-batch, chapter 11's ``ep_comm_bytes`` (uniform
    routing) over the link, ``4 (ep − 1)`` messages (dispatch and combine, forward and backward);
    the busiest rank receives ``model.expert_load(ep)`` times the even share.

    Example::

        >>> from gpucourse.cluster import LINKS
        >>> m = ModelSpec.preset("mixtral-8x7b")
        >>> round(ep_step_comm_time(m, micro_batch=1, microbatches=1, ep=8, cp=1, pp=1, link=LINKS["NVLink"],
        ...                    dtype_bytes=2) * 1e3, 1)                     # ms per step
        27.7
    """
    if ep == 1:
        return 0.0
    nbytes = ep_comm_bytes(tokens=micro_batch * (model.seq // cp), d_model=model.hidden, world_size=ep,
                           top_k=model.top_k, dtype_bytes=dtype_bytes)["total"] * model.expert_load(ep)
    return microbatches * (-(-model.layers // pp)) * (4 * (ep - 1) * link.alpha + nbytes * link.beta)


def bubble_time(busy: float, pp: int, microbatches: int) -> float:
    """Idle time of a 1F1B/GPipe pipeline: ``busy · f / (1 − f)`` with chapter 07's
    ``f = bubble_fraction(pp, m) = (pp − 1)/(m + pp − 1)``, i.e. ``busy · (pp − 1)/m``.

    Example::

        >>> round(bubble_time(1.0, 4, 8), 6)
        0.375
    """
    f = bubble_fraction(pp, microbatches)
    return busy * f / (1 - f)


def exposed(comm: float, hidden_behind: float) -> float:
    """The part of ``comm`` seconds that ``hidden_behind`` seconds of compute cannot cover.

    Example::

        >>> exposed(0.3, 0.2), exposed(0.1, 0.2)
        (0.09999999999999998, 0.0)
    """
    return max(0.0, comm - hidden_behind)


def mfu(model_flops: float, step_seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the model's FLOPs per device per second over the peak.

    Example::

        >>> mfu(400e12, 1.0, 989e12) > 0.4
        True
    """
    return model_flops / (step_seconds * peak_flops)
