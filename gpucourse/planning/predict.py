"""``predict``: memory and step time of one configuration; ``plan``: every configuration, ranked.

The planner adds up the named formulas of ``memory.py`` and ``timing.py``, nothing else::

    predict(model, cluster, config, global_batch)
      ├─ per pipeline stage:  stage_params → model_state_bytes (ZeRO)  +  in-flight × activation bytes
      │                       memory = the busiest stage
      └─ compute + tp + cp + ep + pp + bubble + exposed dp  = step time;   MFU

    plan(model, cluster, global_batch)
      every dp·tp·pp·cp·ep = devices × zero × micro-batches × recompute
      → rejected (does not divide / does not fit, with the reason) or ranked by step time
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..runtime import check_choice, check_int, check_type
from .cluster_spec import ClusterSpec
from .config import ParallelConfig
from .memory import (inflight_microbatches, stage_layers, layer_activation_bytes, model_state_bytes, outside_activation_bytes,
                     split_problem, stage_params)
from .model_spec import ModelSpec
from .timing import (bubble_time, compute_time, expert_imbalance_flops, cp_step_comm_time, dp_step_comm_time, ep_step_comm_time, exposed, mfu,
                     pp_step_comm_time, step_flops, tp_step_comm_time)

__all__ = ["MemoryPrediction", "TimePrediction", "Prediction", "Plan", "predict", "plan"]


@dataclass(frozen=True)
class MemoryPrediction:
    """Bytes per device of the busiest stage; ``stages`` holds the same dict for every stage."""

    params: int
    grads: int
    optimizer: int
    activations: int
    stages: tuple = field(repr=False, default=())

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "total": self.total}


@dataclass(frozen=True)
class TimePrediction:
    """Seconds per step: ``compute``, the exposed communication of each axis, the ``bubble``."""

    compute: float
    dp: float
    tp: float
    pp: float
    cp: float
    ep: float
    bubble: float

    @property
    def communication(self) -> dict[str, float]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep}

    @property
    def total(self) -> float:
        return self.compute + sum(self.communication.values()) + self.bubble

    def as_dict(self) -> dict[str, float]:
        return {"compute": self.compute, **self.communication, "bubble": self.bubble, "total": self.total}


@dataclass(frozen=True)
class Prediction:
    """What :func:`predict` returns: ``.memory``, ``.time``, ``.mfu``, and whether it ``.fits``.

    ``.hfu`` (hardware FLOPs utilisation) counts recomputed FLOPs too, as Narayanan et al. 2021 do.
    """

    config: ParallelConfig
    memory: MemoryPrediction
    time: TimePrediction
    mfu: float
    memory_limit: int
    hfu: float = 0.0

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory_limit

    def __str__(self) -> str:
        return (f"{self.config}: {self.memory.total / 2**30:.1f} GiB/device, {self.time.total:.3g} s/step, "
                f"MFU {self.mfu:.0%}")


def predict(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *, global_batch: int,
            overlap: bool = True) -> Prediction:
    """Predicted memory per device and step time of ``config`` training ``model`` on ``cluster``.

    Args:
        model, cluster, config: what is trained, on what, split how.
        global_batch: sequences of ``model.seq`` tokens per optimizer step.
        overlap: the gradient reduction hides behind the last micro-batch's backward (DDP/FSDP do
            this) and ring attention's K/V traffic behind its attention; ``False`` adds both whole
            (a step that reduces after the backward; one CPU core per rank that computes and copies).

    Example::

        >>> m, c = ModelSpec.preset("llama3-8b"), ClusterSpec.preset("h100-sxm-8")
        >>> p = predict(m, c, ParallelConfig(dp=8, zero=1), global_batch=8)
        >>> p.fits, round(p.memory.activations / 2**30, 1)          # one 8192-token sequence per GPU
        (False, 45.1)
        >>> p = predict(m, c, ParallelConfig(dp=8, zero=1, recompute="full"), global_batch=8)
        >>> p.fits, round(p.memory.total / 2**30, 1), round(p.time.total, 3), round(p.mfu, 2)
        (True, 47.2, 0.631, 0.76)

    .. warning::
        Compute runs at ``cluster.peak_flops``: on real GPUs divide the MFU by the fraction of peak
        your kernels reach (0.5-0.75). Communication that overlaps (TP with compute, PP sends) is
        counted whole; tensors freed early or allocator fragmentation are not modelled.
    """
    check_type("model", model, ModelSpec)
    check_type("cluster", cluster, ClusterSpec)
    check_type("config", config, ParallelConfig)
    check_int("global_batch", global_batch, 1)
    c = config
    if c.world_size != cluster.devices:
        raise ValueError(f"config uses dp·tp·pp·cp·ep = {c.world_size} devices, the cluster has {cluster.devices}")
    problem = split_problem(model, c, global_batch)
    if problem:
        raise ValueError(problem)
    micro = global_batch // (c.dp * c.ep) // c.microbatches        # sequences per micro-batch
    e = c.dtype_bytes
    # --- memory, stage by stage ----------------------------------------------------------------
    act_args = dict(micro_batch=micro, tp=c.tp, sequence_parallel=c.sequence_parallel, cp=c.cp, dtype_bytes=e)
    layer = layer_activation_bytes(model, recompute=c.recompute, expert_load=model.expert_load(c.ep), **act_args)
    stages = []
    for s, (params, n_layers) in enumerate(zip(stage_params(model, c), stage_layers(model.layers, c.pp))):
        dense = model_state_bytes(params["dense"], c.dp * c.cp * c.ep, c.zero, c.dtype)
        expert = model_state_bytes(params["expert"], c.dp * c.cp, c.zero, c.dtype)
        inflight = inflight_microbatches(c.pp, s, c.microbatches)
        acts = inflight * (n_layers * layer + outside_activation_bytes(
            model, first=s == 0, last=s == c.pp - 1, **act_args))
        stages.append({**{k: dense[k] + expert[k] for k in dense}, "activations": acts})
    worst = max(stages, key=lambda d: sum(d.values()))
    memory = MemoryPrediction(worst["params"], worst["grads"], worst["optimizer"], worst["activations"],
                              tuple(stages))
    # --- time -------------------------------------------------------------------------------------
    model_flops, hw_flops = step_flops(model, global_batch * model.seq, c.recompute)
    model_flops, hw_flops = model_flops / c.world_size, hw_flops / c.world_size     # an even share
    hw_flops += expert_imbalance_flops(model, global_batch * model.seq / c.world_size, c.ep, c.recompute)
    compute = compute_time(hw_flops, cluster.peak_flops)
    common = dict(micro_batch=micro, microbatches=c.microbatches, dtype_bytes=e)
    tp = tp_step_comm_time(model, tp=c.tp, pp=c.pp, cp=c.cp, link=cluster.link_for(c.stride("tp"), c.tp),
                           recompute=c.recompute, **common)
    cp = cp_step_comm_time(model, cp=c.cp, tp=c.tp, pp=c.pp, link=cluster.link_for(c.stride("cp"), c.cp),
                      peak_flops=cluster.peak_flops, overlap=overlap, **common)
    ep = ep_step_comm_time(model, ep=c.ep, cp=c.cp, pp=c.pp, link=cluster.link_for(c.stride("ep"), c.ep), **common)
    pp = pp_step_comm_time(model, pp=c.pp, tp=c.tp, cp=c.cp, sequence_parallel=c.sequence_parallel,
                      link=cluster.link_for(c.stride("pp"), c.pp), **common)
    busiest = max(stage_params(model, c), key=lambda d: d["dense"] + d["expert"])
    dp_link = cluster.link_for(c.stride("cp"), c.cp * c.ep * c.dp)
    dp = (dp_step_comm_time(busiest["dense"] * e, c.dp * c.cp * c.ep, c.zero, dp_link)
          + dp_step_comm_time(busiest["expert"] * e, c.dp * c.cp, c.zero, dp_link))
    last_backward = compute * 2 / 3 / c.microbatches if overlap else 0.0
    busy = compute + tp + cp + ep + pp
    time = TimePrediction(compute=compute, dp=exposed(dp, last_backward), tp=tp, pp=pp, cp=cp, ep=ep,
                          bubble=bubble_time(busy, c.pp, c.microbatches))
    return Prediction(c, memory, time, mfu(model_flops, time.total, cluster.peak_flops), int(cluster.memory_bytes),
                      hfu=mfu(hw_flops, time.total, cluster.peak_flops))


@dataclass
class Plan:
    """What :func:`plan` returns: ``.ranked`` predictions (fastest first, the top ``top``), ``.rejected``
    ``[(config, reason), …]``, and ``.considered`` (how many configurations were tried)."""

    ranked: list
    rejected: list
    considered: int

    def __iter__(self):
        return iter(self.ranked)

    def __len__(self):
        return len(self.ranked)

    def __getitem__(self, i):
        return self.ranked[i]

    def best(self) -> Prediction:
        if not self.ranked:
            raise ValueError(f"no configuration fits; {len(self.rejected)} rejected, e.g. {self.rejected[:1]}")
        return self.ranked[0]

    def rank_of(self, config: ParallelConfig) -> int | None:
        """1-based place of ``config`` among all valid configurations (``None``: rejected or not tried)."""
        for i, p in enumerate(self._all, 1):
            if p.config == config:
                return i
        return None

    def place(self, prediction: Prediction) -> int:
        """Where ``prediction`` (any configuration, tried or not) would rank: 1 + the valid ones faster."""
        return 1 + sum(p.time.total < prediction.time.total for p in self._all)

    def table(self, n: int = 10) -> str:
        rows = [f"{'#':>3} {'configuration':<34} {'GiB/dev':>8} {'s/step':>9} {'MFU':>5}"]
        for i, p in enumerate(self.ranked[:n], 1):
            rows.append(f"{i:>3} {str(p.config):<34} {p.memory.total / 2**30:>8.1f} {p.time.total:>9.3g} "
                        f"{p.mfu:>5.0%}")
        return "\n".join(rows)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two_up_to(n: int) -> list[int]:
    out, m = [], 1
    while m <= n:
        out.append(m)
        m *= 2
    return out


def plan(model: ModelSpec, cluster: ClusterSpec, *, global_batch: int, top: int = 10, max_tp: int | None = None,
         max_cp: int = 16, max_microbatches: int = 64, recompute=("none", "selective", "full"),
         dtype: str = "bf16", overlap: bool = True) -> Plan:
    """Every way to split ``model`` over ``cluster``: the ones that fit, fastest first, and the rest
    with the reason each was rejected.

    Tried: every ``dp · tp · pp · cp · ep = devices`` with ``tp ≤ max_tp`` (default: one node) and
    ``cp ≤ max_cp``; ZeRO 0-3 when weights are replicated; micro-batches (powers of two up to
    ``max_microbatches``, at least ``pp`` when ``pp > 1``); each ``recompute`` choice.

    Example::

        >>> m = ModelSpec.preset("llama3-70b")
        >>> p = plan(m, ClusterSpec.preset("h100-sxm-8", nodes=8), global_batch=64, top=3)
        >>> print(p.best().config)
        pp8·cp8 zero2 m64
        >>> any("does not fit" in why for _, why in p.rejected)
        True

    .. warning::
        The ranking is only as good as the formulas: on a machine you own, check it against a
        measured run (``benchmarks/planner.py`` does on this laptop) before trusting a projection.
    """
    check_type("model", model, ModelSpec)
    check_type("cluster", cluster, ClusterSpec)
    check_int("global_batch", global_batch, 1)
    check_int("top", top, 1)
    n = cluster.devices
    max_tp = cluster.devices_per_node if max_tp is None else check_int("max_tp", max_tp, 1)
    for r in recompute:
        check_choice("recompute", r, ("none", "selective", "full"))
    valid, rejected, considered = [], [], 0
    for tp in [d for d in _divisors(n) if d <= max_tp]:
        for cp in [d for d in _divisors(n // tp) if d <= max_cp]:
            for ep in _divisors(n // (tp * cp)):
                for pp in _divisors(n // (tp * cp * ep)):
                    dp = n // (tp * cp * ep * pp)
                    base = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, dtype=dtype)
                    why = split_problem(model, base, global_batch)
                    if why:
                        considered += 1
                        rejected.append((base, why))
                        continue
                    local = global_batch // (dp * ep)
                    zeros = (0, 1, 2, 3) if dp * cp * ep > 1 else (0,)
                    ms = [m for m in _powers_of_two_up_to(min(local, max_microbatches))
                          if local % m == 0 and (pp == 1 or m >= pp)] or [local]
                    for zero in zeros:
                        for m in ms:
                            for rc in recompute:
                                cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, microbatches=m,
                                                     recompute=rc, dtype=dtype)
                                considered += 1
                                p = predict(model, cluster, cfg, global_batch=global_batch, overlap=overlap)
                                if p.fits:
                                    valid.append(p)
                                else:
                                    rejected.append((cfg, f"does not fit: {p.memory.total / 2**30:.1f} GiB > "
                                                          f"{cluster.memory_bytes / 2**30:.1f} GiB per device"))
    valid.sort(key=lambda p: (p.time.total, p.memory.total))
    result = Plan(valid[:top], rejected, considered)
    result._all = valid
    return result
