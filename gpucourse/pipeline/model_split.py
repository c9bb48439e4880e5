"""Model parallelism: cut a model into stages that live on different devices.

Data parallelism copies the *whole* model to every device, so a model whose weights, gradients and
optimizer state do not fit one device cannot be trained that way (:func:`training_state_bytes`
does the arithmetic). Model parallelism puts *different layers* on different devices:

1) cut an ``nn.Sequential`` into ``p`` consecutive stages (:func:`split_sequential`) — by layer
   count, by parameter count (memory balance) or by measured time (compute balance, which is what
   decides the pipeline's speed); :func:`balanced_partition` is the cutting algorithm;
2) run stage 0 on device 0, move its output (the *activation*) to device 1, run stage 1, …
   (:class:`ModelParallel`, and :class:`TwoDeviceToyModel` — the two-GPU example from the seeds and
   PyTorch's model-parallel tutorial).

Each device holds and updates only its own stage's parameters. But run like this, only one device
works at any moment: stage 1 waits for stage 0's forward, stage 0 waits for stage 1's backward.
Pipelining (:mod:`gpucourse.pipeline`) fixes that by cutting the batch into micro-batches.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from ..runtime import check_int

__all__ = ["training_state_bytes", "layer_costs", "balanced_partition", "split_sequential",
           "ModelParallel", "TwoDeviceToyModel"]

_OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}


def training_state_bytes(num_params: int, *, param_bytes: int = 4,
                         optimizer: str = "adam") -> dict[str, int]:
    """Bytes a device needs for a model's weights, gradients and optimizer state (not activations).

    Args:
        num_params: number of parameters (``sum(p.numel() for p in model.parameters())``).
        param_bytes: bytes per number: 4 for fp32, 2 for bf16/fp16.
        optimizer: ``"sgd"`` (no state), ``"sgd_momentum"`` (1 buffer), ``"adam"``/``"adamw"``
            (2 buffers: first and second moments).

    Example::

        >>> mem = training_state_bytes(7_000_000_000)     # a 7B-parameter model, fp32, Adam
        >>> {k: v / 1e9 for k, v in mem.items()}          # GB: 4 + 4 + 8 bytes per parameter
        {'weights': 28.0, 'gradients': 28.0, 'optimizer': 56.0, 'total': 112.0}

    .. warning::
        Activations come on top and grow with the batch size; for large batches they dominate.
        Cutting the model into ``p`` stages divides this state by ``p`` — but not a stage's
        activations, which is what micro-batching and 1F1B are about.
    """
    check_int("num_params", num_params, 0)
    if param_bytes not in (1, 2, 4, 8):
        raise ValueError(f"param_bytes must be 1, 2, 4 or 8, got {param_bytes!r}")
    if optimizer not in _OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(_OPTIMIZER_STATES)}, got {optimizer!r}")
    weights = grads = num_params * param_bytes
    states = num_params * param_bytes * _OPTIMIZER_STATES[optimizer]
    return {"weights": weights, "gradients": grads, "optimizer": states,
            "total": weights + grads + states}


def _check_sequential(model) -> None:
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model must be an nn.Sequential (a chain of layers), got {type(model).__name__}; "
                        "wrap your layers: nn.Sequential(layer1, layer2, ...)")


def layer_costs(model: nn.Sequential, by: str = "params",
                sample: torch.Tensor | None = None, repeats: int = 3) -> list[float]:
    """A cost per layer of ``model``, the input to :func:`balanced_partition`.

    Args:
        model: the chain of layers.
        by: ``"count"`` (1 per layer), ``"params"`` (parameter count — balances memory) or
            ``"time"`` (measured seconds of forward + backward on ``sample`` — balances compute).
        sample: an input batch; needed for ``by="time"``.
        repeats: timed repeats per layer for ``by="time"`` (the median is used).

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> layer_costs(model, by="params")
        [40.0, 0.0, 18.0]

    .. warning::
        Parameter count is not compute: a convolution has few parameters but many FLOPs, a big
        embedding the opposite. The pipeline runs at the pace of its slowest stage, so balance by
        ``"time"`` when speed matters.
    """
    _check_sequential(model)
    if by == "count":
        return [1.0] * len(model)
    if by == "params":
        return [float(sum(p.numel() for p in layer.parameters())) for layer in model]
    if by != "time":
        raise ValueError(f"by must be 'count', 'params' or 'time', got {by!r}")
    if not isinstance(sample, torch.Tensor):
        raise ValueError("by='time' measures each layer on an input: pass sample=<a batch tensor>")
    costs, x = [], sample
    for layer in model:
        x = x.detach().requires_grad_(x.is_floating_point())
        times = []
        for _ in range(repeats + 1):                    # the first run is a warm-up
            start = time.perf_counter()
            y = layer(x)
            if y.requires_grad:
                y.backward(torch.ones_like(y))
            times.append(time.perf_counter() - start)
        costs.append(sorted(times[1:])[len(times[1:]) // 2])
        x = y.detach()
    model.zero_grad(set_to_none=True)
    return costs


def balanced_partition(costs: Sequence[float], num_stages: int) -> list[int]:
    """Cut ``costs`` into ``num_stages`` consecutive groups so that the largest group sum is smallest.

    Args:
        costs: one non-negative cost per layer.
        num_stages: how many groups; each gets at least one layer.

    Returns:
        the number of layers in each stage (sums to ``len(costs)``), like torchgpipe's ``balance``.

    Example::

        >>> balanced_partition([4, 1, 1, 1, 1], 2)       # 4 | 1 1 1 1: max(4, 4) = 4
        [1, 4]
        >>> balanced_partition([1, 1, 1, 1, 1], 2)
        [3, 2]
        >>> balanced_partition([1, 1], 3)
        Traceback (most recent call last):
        ...
        ValueError: cannot cut 2 layers into 3 stages: every stage needs at least one layer

    .. warning::
        Only consecutive layers can form a stage (activations flow stage to stage), so one huge
        layer can make a good balance impossible: its stage sets the pace of the whole pipeline.
    """
    check_int("num_stages", num_stages, 1)
    costs = [float(c) for c in costs]
    if any(not c >= 0 for c in costs):
        raise ValueError(f"costs must be >= 0, got {costs}")
    n = len(costs)
    if num_stages > n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} stages: every stage needs at "
                         "least one layer")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest possible max-stage-cost for the first i layers in k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):                    # the last stage is layers j .. i-1
                if best[k - 1][j] == inf:
                    continue
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value <= best[k][i] + 1e-12 * max(1.0, abs(value)):  # ties: later cut
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def split_sequential(model: nn.Sequential, num_stages: int | None = None, *,
                     balance: Sequence[int] | None = None, by: str = "count",
                     sample: torch.Tensor | None = None) -> list[nn.Sequential]:
    """Cut ``model`` into consecutive stages. The stages share the layers (no copies).

    Args:
        model: the chain of layers to cut.
        num_stages: how many stages; with ``by="count"`` layers are spread as evenly as possible.
        balance: explicit layers per stage, e.g. ``[3, 2]`` (then ``num_stages``/``by`` are unused).
        by: ``"count"``, ``"params"`` or ``"time"`` — what to balance (see :func:`layer_costs`).
        sample: an input batch, for ``by="time"``.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> [len(stage) for stage in split_sequential(model, 2)]
        [3, 2]
        >>> stages = split_sequential(model, balance=[1, 4])
        >>> stages[0][0] is model[0]                       # same layer objects, same parameters
        True
        >>> split_sequential(model, 6)
        Traceback (most recent call last):
        ...
        ValueError: cannot cut 5 layers into 6 stages: every stage needs at least one layer

    .. warning::
        The stages run one after another: stage ``k + 1`` needs stage ``k``'s output. Split across
        devices without micro-batching (:class:`ModelParallel`), only one device works at a time.
    """
    _check_sequential(model)
    n = len(model)
    if balance is None:
        if num_stages is None:
            raise ValueError("pass num_stages=<int> or balance=[layers per stage]")
        if by == "count":
            check_int("num_stages", num_stages, 1)
            if num_stages > n:
                raise ValueError(f"cannot cut {n} layers into {num_stages} stages: every stage "
                                 "needs at least one layer")
            balance = [n // num_stages + (1 if s < n % num_stages else 0) for s in range(num_stages)]
        else:
            balance = balanced_partition(layer_costs(model, by, sample), num_stages)
    balance = list(balance)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in balance):
        raise ValueError(f"balance must be positive ints (layers per stage), got {balance}")
    if sum(balance) != n:
        raise ValueError(f"balance {balance} covers {sum(balance)} layers, but the model has {n}")
    # plain nn.Sequential stages that keep the model's layer names ("2.weight"), so the stages'
    # state_dicts together are the model's (model[a:b] would call a subclass's __init__)
    named = list(model._modules.items())
    stages, start = [], 0
    for size in balance:
        stages.append(nn.Sequential(OrderedDict(named[start:start + size])))
        start += size
    return stages


class ModelParallel(nn.Module):
    """Naive model parallelism: stage ``k`` lives on ``devices[k]``; activations are moved between.

    Args:
        stages: the parts of the model, in order (e.g. from :func:`split_sequential`).
        devices: one device per stage (``"cuda:0"``, ``"cuda:1"`` … or CPU devices). The stages
            are moved there.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> mp = ModelParallel(split_sequential(model, 2), ["cpu", "cpu"])
        >>> x = torch.randn(3, 4)
        >>> torch.allclose(mp(x), model(x))
        True

    .. warning::
        Correct, but slow: while one device computes, all others wait (the bubble is
        ``(p - 1) / p``). Use it when the model does not fit one device; pipeline it
        (:class:`~gpucourse.GPipe`) to keep the devices busy.
    """

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence):
        super().__init__()
        if len(stages) != len(devices):
            raise ValueError(f"need one device per stage: {len(stages)} stages, {len(devices)} devices")
        if len(stages) < 1:
            raise ValueError("need at least one stage")
        self.devices = [torch.device(d) for d in devices]
        self.stages = nn.ModuleList(stage.to(d) for stage, d in zip(stages, self.devices))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices):
            x = stage(x.to(device))               # the activation crosses to the next device
        return x


class TwoDeviceToyModel(nn.Module):
    """The seeds' (and PyTorch tutorial's) model-parallel example: ``net1`` on one device, ``net2`` on another.

    ``Linear(10, 10) → ReLU`` on ``dev0``, ``Linear(10, 5)`` on ``dev1``; ``forward`` moves the
    activation from ``dev0`` to ``dev1``. The output lives on ``dev1``, so the labels must too.

    Args:
        dev0, dev1: the two devices, e.g. ``"cuda:0"`` and ``"cuda:1"``; both ``"cpu"`` here.

    Example::

        >>> _ = torch.manual_seed(0)
        >>> model = TwoDeviceToyModel("cpu", "cpu")
        >>> model(torch.randn(20, 10)).shape
        torch.Size([20, 5])

    .. warning::
        The loss must be computed where the output is (``labels.to(dev1)``), and while ``net2``
        runs on ``dev1``, ``dev0`` has nothing to do.
    """

    def __init__(self, dev0="cuda:0", dev1="cuda:1"):
        super().__init__()
        self.dev0, self.dev1 = torch.device(dev0), torch.device(dev1)
        self.net1 = nn.Linear(10, 10).to(self.dev0)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5).to(self.dev1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x.to(self.dev0)))
        return self.net2(x.to(self.dev1))
