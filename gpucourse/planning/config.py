"""How a run is split: the five axes, ZeRO, micro-batches, recomputation, the number format."""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime import check_choice, check_int, check_type

__all__ = ["ParallelConfig", "DTYPE_BYTES"]

#: bytes per element of parameters, gradients and activations for each training dtype.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

#: mesh order, innermost (neighbouring ranks, fastest link) first — Megatron-LM's tp-cp-ep-dp-pp.
AXES = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class ParallelConfig:
    """One way to split a training step over ``dp · tp · pp · cp · ep`` devices.

    Args:
        dp: data parallel — replicas, each on its own part of the batch.
        tp: tensor parallel — every matrix split over ``tp`` ranks (Megatron; heads and MLP columns).
        pp: pipeline parallel — the layers cut into ``pp`` stages.
        cp: context parallel — each sequence cut into ``cp`` pieces (ring attention).
        ep: expert parallel — the experts of each MoE layer spread over ``ep`` ranks. The ``ep`` ranks
            also take different parts of the batch: dense weights are replicated over ``dp · ep`` (and
            ``cp``), each expert over ``dp`` (Megatron-LM's "EP inside DP" with ``dp_megatron = dp · ep``).
        zero: ZeRO stage 0-3 over the ranks that hold the same weights (chapter 08).
        microbatches: micro-batches per step (pipeline chunks, or gradient accumulation with ``pp = 1``).
        recompute: ``"none"``, ``"selective"`` (the attention core, Korthikanti et al. 2022) or ``"full"``.
        sequence_parallel: with ``tp > 1``, also split norms and dropouts along the sequence
            (default: on whenever ``tp > 1``).
        dtype: ``"bf16"``/``"fp16"`` (mixed precision Adam, 2 + 2 + 12 bytes per parameter) or ``"fp32"``
            (4 + 4 + 8).

    Example::

        >>> c = ParallelConfig(dp=2, tp=2, pp=2, microbatches=4)
        >>> c.world_size, c.sequence_parallel, str(c)
        (8, True, 'dp2·tp2·pp2 m4')
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    microbatches: int = 1
    recompute: str = "none"
    sequence_parallel: bool | None = None
    dtype: str = "bf16"

    def __post_init__(self):
        for axis in AXES:
            check_int(axis, getattr(self, axis), 1)
        check_choice("zero", self.zero, (0, 1, 2, 3))
        check_int("microbatches", self.microbatches, 1)
        check_choice("recompute", self.recompute, ("none", "selective", "full"))
        check_choice("dtype", self.dtype, tuple(DTYPE_BYTES))
        if self.sequence_parallel is None:
            object.__setattr__(self, "sequence_parallel", self.tp > 1)
        check_type("sequence_parallel", self.sequence_parallel, bool)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def stride(self, axis: str) -> int:
        """Distance in ranks between neighbours along ``axis`` (mesh order tp, cp, ep, dp, pp)."""
        check_choice("axis", axis, AXES)
        s = 1
        for a in AXES[:AXES.index(axis)]:
            s *= getattr(self, a)
        return s

    def __str__(self) -> str:
        parts = [f"{a}{getattr(self, a)}" for a in ("dp", "tp", "pp", "cp", "ep") if getattr(self, a) > 1]
        s = "·".join(parts) or "1 device"
        if self.zero:
            s += f" zero{self.zero}"
        if self.microbatches > 1:
            s += f" m{self.microbatches}"
        if self.recompute != "none":
            s += f" rc-{self.recompute}"
        if self.tp > 1 and not self.sequence_parallel:
            s += " no-sp"
        return s
