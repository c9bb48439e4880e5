"""DataParallel from scratch — and the balanced variant that gives GPU 0 a smaller share.

``DataParallel`` is one process driving several devices. Its ``forward`` is the four steps of
:mod:`gpucourse.scatter_gather`, one overridable method each, as in PyTorch's own
``torch/nn/parallel/data_parallel.py``::

    inputs, kwargs, devices = self.scatter(inputs, kwargs, self.device_ids)   # 1) split the batch
    replicas = self.replicate(self.module, devices)                           # 2) copy the model
    outputs = self.parallel_apply(replicas, inputs, kwargs, devices)         # 3) run concurrently
    return self.gather(outputs, self.output_device)                           # 4) collect outputs

``BalancedDataParallel`` (from transformer-xl, popularised as Link-Li/Balanced-DataParallel)
overrides only step 1: device 0 gets ``gpu0_bsz`` rows and the others share the rest, because
device 0 also holds what DataParallel gathers there (outputs, loss) and the optimizer's state.

Runs on CPU virtual devices (``gc.virtual_devices(n)``: replicas in concurrent worker threads,
forward *and* backward) and unchanged on CUDA devices. For multi-GPU training today, prefer
DistributedDataParallel (chapter 04): one process per GPU, no GIL, no per-step replication.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Sequence

import torch
from torch import nn

from .device_workers import as_device, as_devices, device_context, span
from .scatter_gather import gather, parallel_apply, replicate, scatter_kwargs
from ..runtime import check_int, cpu_cores, virtual_devices

__all__ = ["DataParallel", "BalancedDataParallel", "balanced_chunk_sizes"]


class DataParallel(nn.Module):
    """Data parallelism in one process: split the batch, run a replica per device, gather outputs.

    The outputs, and the gradients that reach ``module``'s parameters, are those of running
    ``module`` on the whole batch (up to float rounding) — for any batch size, keyword arguments,
    tuple/dict outputs and any batch ``dim``. On CPU virtual devices the replicas run at the same
    time in forward *and* backward.

    Args:
        module: the model. For CUDA devices it must already be on ``device_ids[0]``; for virtual
            devices, on the CPU.
        device_ids: the devices to use: ints (CUDA ids where CUDA exists, else ``cpu:<i>``),
            ``"cuda:1"``/``"cpu:1"`` strings or ``torch.device``. Default: every visible GPU, or
            one virtual device per usable CPU core.
        output_device: where outputs are gathered (default ``device_ids[0]``).
        dim: the batch dimension that is split and concatenated.

    Example::

        >>> import torch, gpucourse as gc
        >>> torch.manual_seed(0) and None
        >>> model = gc.MLP(8, 16, 4)
        >>> dp = DataParallel(model, device_ids=["cpu:0", "cpu:1"])
        >>> x = torch.randn(6, 8)
        >>> torch.allclose(dp(x), model(x), atol=1e-6)
        True
        >>> dp(x).sum().backward()              # gradients arrive on model's own parameters
        >>> model[0].weight.grad.shape
        torch.Size([16, 8])
        >>> list(dp.state_dict())[:1]           # saved with a "module." prefix, like nn.DataParallel
        ['module.0.weight']

    .. warning::
        Batch statistics are per replica: a BatchNorm layer in training mode normalises each chunk
        with that chunk's mean and variance (outputs then differ from the whole batch; use
        SyncBatchNorm with DDP), and only the replica on ``device_ids[0]`` updates the original
        running statistics — the other replicas' buffer updates are thrown away, as in
        ``nn.DataParallel``. The module is replicated in every forward: per-step copying and the
        GIL make DataParallel slow for small models, and everything gathered lands on one device.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence | None = None,
                 output_device: int | str | torch.device | None = None, dim: int = 0):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        check_int("dim", dim)
        if device_ids is None:
            n = torch.cuda.device_count() if torch.cuda.is_available() else cpu_cores()
            device_ids = virtual_devices(max(1, n))
        self.module = module
        self.device_ids: list[torch.device] = as_devices(device_ids, what="device_ids")
        self.output_device: torch.device = as_device(
            self.device_ids[0] if output_device is None else output_device, what="output_device")
        if self.output_device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if self.output_device.index >= count:
                raise ValueError(
                    f"output_device {self.output_device} does not exist: this process sees {count} "
                    "CUDA device(s); pass one of device_ids (or leave output_device=None for "
                    "device_ids[0]); CUDA_VISIBLE_DEVICES renumbers the visible GPUs from 0")
        if (self.output_device.type == "cuda") != (self.device_ids[0].type == "cuda"):
            raise ValueError(f"output_device {self.output_device} and device_ids "
                             f"{[str(d) for d in self.device_ids]} must be of the same kind")
        self.dim = dim
        self.src_device = self.device_ids[0]

    def _check_module_device(self) -> None:
        for t in chain(self.module.parameters(), self.module.buffers()):
            if self.src_device.type == "cuda" and t.device != self.src_device:
                raise RuntimeError(
                    f"module must have its parameters and buffers on device {self.src_device} "
                    f"(device_ids[0]) but found one on {t.device}; call model.to('{self.src_device}') "
                    "before the forward (DataParallel copies the model from device_ids[0] to the others)")
            if self.src_device.type == "cpu" and t.device.type != "cpu":
                raise RuntimeError(
                    f"the devices {[str(d) for d in self.device_ids]} are CPU virtual devices, but the "
                    f"module has a parameter or buffer on {t.device}; move the model to the CPU "
                    "(model.cpu()) or pass CUDA device_ids")

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._check_module_device()
        with device_context(self.src_device):
            with span("scatter"):
                inputs, kwargs, devices = self.scatter(inputs, kwargs, self.device_ids)   # 1)
            if not inputs and not kwargs:               # a forward without arguments: one device
                inputs, kwargs, devices = [()], [{}], self.device_ids[:1]
            if devices == [self.src_device]:            # one device: no copies needed
                outputs = [self.module(*inputs[0], **kwargs[0])]
            else:
                with span("replicate"):
                    replicas = self.replicate(self.module, devices)                   # 2)
                outputs = self.parallel_apply(replicas, inputs, kwargs, devices)      # 3)
            with span("gather"):
                return self.gather(outputs, self.output_device)                       # 4)

    def scatter(self, inputs: tuple, kwargs: dict, device_ids: list[torch.device]):
        """Split positional and keyword arguments: ``(inputs per device, kwargs per device, devices)``."""
        inputs, kwargs = scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)
        return inputs, kwargs, device_ids[:len(inputs)]

    def replicate(self, module: nn.Module, device_ids: list[torch.device]) -> list[nn.Module]:
        return replicate(module, device_ids, detach=not torch.is_grad_enabled())

    def parallel_apply(self, replicas: list[nn.Module], inputs: list, kwargs: list,
                       device_ids: list[torch.device]) -> list:
        return parallel_apply(replicas, inputs, device_ids, kwargs_tup=kwargs)

    def gather(self, outputs: list, output_device: torch.device) -> Any:
        return gather(outputs, output_device, dim=self.dim)

    def extra_repr(self) -> str:
        return (f"device_ids={[str(d) for d in self.device_ids]}, output_device={self.output_device}, "
                f"dim={self.dim}")


def balanced_chunk_sizes(batch_size: int, gpu0_bsz: int, num_devices: int) -> list[int]:
    """Rows per device when device 0 takes ``gpu0_bsz`` and the others share the rest evenly.

    Args:
        batch_size: rows in the (micro-)batch.
        gpu0_bsz: rows for device 0, ``0 <= gpu0_bsz <= batch_size``; ``0`` leaves device 0 out.
        num_devices: devices in total, device 0 included.

    Returns:
        ``num_devices`` ints summing to ``batch_size``: ``[gpu0_bsz, …]``, the rest differing by at
        most one row (the extra rows go to the lowest-numbered devices after device 0).

    Example::

        >>> balanced_chunk_sizes(8, 2, 3)       # the seeds' example: 2 + 3 + 3
        [2, 3, 3]
        >>> balanced_chunk_sizes(9, 2, 3)
        [2, 4, 3]
        >>> balanced_chunk_sizes(8, 0, 3)       # device 0 only stores and gathers
        [0, 4, 4]
        >>> balanced_chunk_sizes(8, 9, 3)
        Traceback (most recent call last):
        ...
        ValueError: gpu0_bsz must be in [0, 8] (the batch size), got 9; lower gpu0_bsz or pass a bigger batch (a DataLoader's last batch can be short: use drop_last=True)

    .. warning::
        With gradient accumulation, ``gpu0_bsz`` is per *micro*-batch: for a batch of 16 in two
        micro-steps on 3 devices, pass ``gpu0_bsz=2`` (8 = 2+3+3 per step, 16 = 4+6+6 in total),
        which is why the seeds write ``BalancedDataParallel(gpu0_bsz // acc_grad, …)``.
    """
    check_int("batch_size", batch_size, 1)
    check_int("num_devices", num_devices, 1)
    check_int("gpu0_bsz", gpu0_bsz)
    if not 0 <= gpu0_bsz <= batch_size:
        raise ValueError(f"gpu0_bsz must be in [0, {batch_size}] (the batch size), got {gpu0_bsz}; "
                         "lower gpu0_bsz or pass a bigger batch (a DataLoader's last batch can be "
                         "short: use drop_last=True)")
    if num_devices == 1:
        if gpu0_bsz != batch_size:
            raise ValueError(f"with 1 device, device 0 takes the whole batch: gpu0_bsz must be "
                             f"{batch_size}, got {gpu0_bsz}")
        return [batch_size]
    base, extra = divmod(batch_size - gpu0_bsz, num_devices - 1)
    return [gpu0_bsz] + [base + (1 if i < extra else 0) for i in range(num_devices - 1)]


def _batch_size(obj: Any, dim: int) -> int | None:
    if isinstance(obj, torch.Tensor):
        return obj.shape[dim] if obj.dim() > 0 else None
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for value in values:
        size = _batch_size(value, dim)
        if size is not None:
            return size
    return None


class BalancedDataParallel(DataParallel):
    """:class:`DataParallel` whose device 0 gets ``gpu0_bsz`` rows and the others share the rest.

    Only the scatter step differs (:func:`balanced_chunk_sizes`); replicate, parallel_apply and
    gather are DataParallel's. Device 0 still holds the model, the gathered outputs, the loss, the
    gradients and the optimizer state; giving it fewer rows of activations evens out the memory.

    Args:
        gpu0_bsz: rows of every (micro-)batch that device 0 computes; ``0`` = device 0 only stores
            and gathers. Must not exceed the batch size.
        module, device_ids, output_device, dim: as for :class:`DataParallel`.

    Example::

        >>> import torch, gpucourse as gc
        >>> model = gc.MLP(4, 8, 2)
        >>> bdp = BalancedDataParallel(2, model, device_ids=["cpu:0", "cpu:1", "cpu:2"])
        >>> inputs, _, devices = bdp.scatter((torch.randn(8, 4),), {}, bdp.device_ids)
        >>> [a[0].shape[0] for a in inputs], [str(d) for d in devices]
        ([2, 3, 3], ['cpu:0', 'cpu:1', 'cpu:2'])
        >>> torch.allclose(bdp(torch.ones(8, 4)), model(torch.ones(8, 4)))
        True

    .. warning::
        ``gpu0_bsz`` counts rows of the batch that reaches ``forward``. With gradient accumulation
        over ``acc_grad`` micro-batches, pass the per-micro-batch value (``gpu0_bsz // acc_grad``).
        A ``gpu0_bsz`` larger than the batch raises ``ValueError`` — watch the last, shorter
        batch of a ``DataLoader`` (``drop_last=True`` avoids it). The original implementation
        silently fell back to DataParallel's even split whenever ``gpu0_bsz`` was at least the
        others' share (``gpu0_bsz >= bsz_unit``, equality included).
    """

    def __init__(self, gpu0_bsz: int, module: nn.Module, device_ids: Sequence | None = None,
                 output_device: int | str | torch.device | None = None, dim: int = 0):
        check_int("gpu0_bsz", gpu0_bsz, 0, hint=" (rows for device 0)")
        super().__init__(module, device_ids, output_device, dim)
        self.gpu0_bsz = gpu0_bsz

    def scatter(self, inputs: tuple, kwargs: dict, device_ids: list[torch.device]):
        batch = _batch_size((inputs, kwargs), self.dim)
        if batch is None:                           # nothing to split
            return super().scatter(inputs, kwargs, device_ids)
        sizes = balanced_chunk_sizes(batch, self.gpu0_bsz, len(device_ids))
        inputs, kwargs = scatter_kwargs(inputs, kwargs, device_ids, chunk_sizes=sizes, dim=self.dim)
        return inputs, kwargs, [d for d, s in zip(device_ids, sizes) if s > 0]

    def extra_repr(self) -> str:
        return f"gpu0_bsz={self.gpu0_bsz}, " + super().extra_repr()
