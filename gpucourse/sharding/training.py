"""One training run, six ways: DDP, ZeRO-1/2/3 from scratch, torch's ZeroRedundancyOptimizer, FSDP2.

:func:`train_sharded` starts ``world_size`` gloo processes, builds the same model on each (same
seed), splits the global batch evenly over the ranks and trains it with the chosen strategy. It
returns the unsharded final parameters, the loss curve, step times and (optionally) the memory
this rank held, so that the lesson and ``benchmarks/sharding.py`` compare strategies side by side:

| strategy | model | optimizer |
|---|---|---|
| ``"ddp"`` | ``DistributedDataParallel(model)`` | ``optimizer_class`` (full replica) |
| ``"zero1"``, ``"zero2"`` | the plain model | :class:`ZeroOptimizer` stage 1 / 2 |
| ``"zero3"`` | :class:`FullyShardedModule` | ``optimizer_class`` on the shards |
| ``"torch_zero"`` | ``DistributedDataParallel(model)`` | torch's ``ZeroRedundancyOptimizer`` |
| ``"fsdp2"`` | ``fully_shard`` on every layer (inside a ``ModuleList``, not embeddings), then the root | ``optimizer_class`` on the DTensor shards |

Tied weights (GPT's head ``x @ tok_emb.weightᵀ``): a layer's parameters exist whole only while the
layer runs, so ``"zero3"`` and ``"fsdp2"`` keep every ``nn.Embedding`` gathered for the whole
forward (the root unit) — the head finds its weight, and its gradient adds to the embedding's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..runtime import default_backend, launch, rank_device, validate
from .fsdp import FullyShardedModule
from .memory_model import RankMemory, measure_step_memory
from .zero import ZeroOptimizer

__all__ = ["STRATEGIES", "ShardedRun", "train_sharded", "wrap_for"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "torch_zero", "fsdp2")


@dataclass
class ShardedRun:
    """What :func:`train_sharded` returns: rank 0's view plus per-rank times and memory."""

    strategy: str
    world_size: int
    state_dict: dict                         # the unsharded final parameters
    losses: list[float]                      # global-batch loss before each step
    step_times: list[list[float]] = field(default_factory=list)   # [rank][step] seconds
    memory: list[RankMemory | None] = field(default_factory=list)  # per rank (measure_memory=True)

    @property
    def step_time(self) -> float:
        """Median over steps of the slowest rank's step time (seconds)."""
        per_step = [max(ts) for ts in zip(*self.step_times)]
        return sorted(per_step)[len(per_step) // 2]


def wrap_for(strategy: str, model: torch.nn.Module, optimizer_class=torch.optim.AdamW, **optimizer_kwargs):
    """``(model, optimizer)`` for one strategy of :data:`STRATEGIES`, in a process group.

    The model must already be on this rank's device (:func:`~gpucourse.rank_device`: the CPU under
    gloo, ``cuda:<local rank>`` under NCCL); DDP gets ``device_ids`` and FSDP2 its mesh from it.

    Example::

        >>> import torch, gpucourse as gc
        >>> def demo(rank, world_size):
        ...     model, opt = gc.wrap_for("zero3", torch.nn.Linear(4, 2), lr=0.1)
        ...     return type(model).__name__, type(opt).__name__
        >>> gc.launch(demo, 2)[0]
        ('FullyShardedModule', 'AdamW')

    .. warning::
        ``"zero3"`` and ``"fsdp2"`` free a layer's parameters when its forward ends. A weight the
        model reads outside that forward — a head tied to the embedding — must sit in a unit that
        stays gathered for the whole forward: here every ``nn.Embedding`` does (the root unit);
        any other tied layer needs ``FullyShardedModule(keep_gathered=…)`` or your own wrapping.
    """
    validate.check_choice("strategy", strategy, STRATEGIES)
    if strategy in ("ddp", "torch_zero"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        device = rank_device()
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if strategy == "ddp":
            return model, optimizer_class(model.parameters(), **optimizer_kwargs)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class,
                                              **optimizer_kwargs)
    if strategy in ("zero1", "zero2"):
        return model, ZeroOptimizer(model.parameters(), optimizer_class, stage=int(strategy[-1]),
                                    **optimizer_kwargs)
    if strategy == "zero3":
        model = FullyShardedModule(model)
        return model, optimizer_class(model.parameters(), **optimizer_kwargs)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # the mesh on this rank's device: without it FSDP2 picks CUDA whenever the machine has a GPU,
    # also for a gloo group whose ranks compute on the CPU
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    for layer in _fsdp_layers(model):           # one FSDP unit per layer, then the root
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)               # the root: embeddings and whatever is left
    return model, optimizer_class(model.parameters(), **optimizer_kwargs)


def _fsdp_layers(module: torch.nn.Module):
    """The children ``fully_shard`` wraps one by one, before the root.

    A container without a forward (``ModuleList``, ``ModuleDict``) is looked into: its hooks would
    never run, since the parent calls its items. An ``nn.Embedding`` is left to the root unit,
    which stays gathered for the whole forward: a GPT head tied to it reads its weight *after*
    the embedding's own forward, when its unit would already be resharded.
    """
    for child in module.children():
        if isinstance(child, torch.nn.Embedding) or not any(True for _ in child.parameters()):
            continue
        if type(child).forward is torch.nn.Module.forward:      # a container: no forward of its own
            yield from _fsdp_layers(child)
        else:
            yield child


def _full_state_dict(strategy, model) -> dict:
    if strategy == "zero3":       # back to the launcher: CPU tensors (the model may be on a GPU)
        return {k: v.to("cpu", copy=True) for k, v in model.full_state_dict().items()}
    if strategy in ("ddp", "torch_zero"):
        model = model.module
    out = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v      # FSDP2: DTensor -> tensor
        out[k] = v.detach().to("cpu", copy=True)          # back to the launcher: CPU tensors
    return out


def _worker(rank, world_size, strategy, model_fn, x, y, steps, optimizer_class, optimizer_kwargs,
            accumulation, measure_memory, loss_fn):
    torch.manual_seed(0)
    device = rank_device()                      # the CPU under gloo, cuda:<rank> under NCCL
    model, opt = wrap_for(strategy, model_fn().to(device), optimizer_class, **optimizer_kwargs)
    xs, ys = x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]   # this rank's batch
    xs, ys = xs.to(device), ys.to(device)
    losses, times, memory = [], [], None
    for step in range(steps):
        if step == 0 and measure_memory:
            with torch.no_grad():
                loss = loss_fn(model(xs), ys)
            memory = measure_step_memory(model, opt, xs, ys, loss_fn)
        else:
            start = time.perf_counter()
            loss = 0.0
            for i, (xm, ym) in enumerate(zip(xs.tensor_split(accumulation), ys.tensor_split(accumulation))):
                last = i == accumulation - 1
                sync = model.no_sync() if (strategy == "ddp" and not last) else _nothing()
                with sync:
                    micro = loss_fn(model(xm), ym) / accumulation
                    micro.backward()
                loss = loss + micro.detach()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
        total = torch.as_tensor(loss, dtype=torch.float32, device=device).detach().reshape(1).clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return {"state_dict": _full_state_dict(strategy, model), "losses": losses, "times": times,
            "memory": memory}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def train_sharded(strategy: str, model_fn, x: torch.Tensor, y: torch.Tensor, *, world_size: int = 2,
                  steps: int = 5, optimizer_class=torch.optim.AdamW, accumulation: int = 1,
                  measure_memory: bool = False, loss_fn=F.mse_loss, timeout: float = 120.0,
                  backend: str | None = None, **optimizer_kwargs) -> ShardedRun:
    """Train ``model_fn()`` on ``(x, y)`` for ``steps`` steps with one strategy on ``world_size`` ranks.

    Every rank seeds ``torch.manual_seed(0)`` before ``model_fn()``, so all strategies start from
    the same weights; rank ``r`` trains on ``x.tensor_split(world_size)[r]``.

    Args:
        strategy: one of :data:`STRATEGIES` (see the module docstring).
        model_fn: builds the model (a picklable function, e.g. defined in a notebook cell).
        x, y: the global batch; ``loss_fn(model(x), y)``.
        world_size: number of processes.
        steps: optimizer steps.
        optimizer_class: the optimizer (default AdamW).
        **optimizer_kwargs: its keyword arguments.
        accumulation: micro-batches per step (gradient accumulation; DDP uses ``no_sync``).
        measure_memory: make the first step a :func:`measure_step_memory` step (not timed).
        timeout: seconds for the whole run.
        backend: ``"gloo"`` (the ranks compute on the CPU) or ``"nccl"`` (rank ``r`` on ``cuda:r``);
            default :func:`~gpucourse.default_backend` for ``world_size`` ranks: NCCL when the
            machine has a GPU per rank, else gloo.

    Returns:
        :class:`ShardedRun`.

    Example::

        >>> import torch, gpucourse as gc
        >>> x, y = torch.randn(8, 4), torch.randn(8, 2)
        >>> make = lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> ddp = gc.train_sharded("ddp", make, x, y, steps=3, lr=0.01)
        >>> zero = gc.train_sharded("zero2", make, x, y, steps=3, lr=0.01)
        >>> all(torch.allclose(zero.state_dict[k], v, atol=1e-6) for k, v in ddp.state_dict.items())
        True

    .. warning::
        Step times measured while other programs run are noise; compare strategies as ratios
        measured at the same moment, and never on the memory-measuring first step.
    """
    validate.check_choice("strategy", strategy, STRATEGIES)
    validate.check_int("world_size", world_size, 1)
    validate.check_int("steps", steps, 1)
    validate.check_int("accumulation", accumulation, 1)
    if accumulation > 1 and strategy in ("torch_zero", "fsdp2"):
        raise ValueError(f"accumulation > 1 is supported for ddp, zero1, zero2 and zero3, not {strategy!r}")
    backend = default_backend(world_size) if backend is None else backend
    results = launch(_worker, world_size, args=(strategy, model_fn, x, y, steps, optimizer_class,
                                                optimizer_kwargs, accumulation, measure_memory, loss_fn),
                     backend=backend, timeout=timeout)
    return ShardedRun(strategy, world_size, results[0]["state_dict"], results[0]["losses"],
                      [r["times"] for r in results], [r["memory"] for r in results])



