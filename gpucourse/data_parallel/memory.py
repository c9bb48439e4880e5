"""Memory per device during a DataParallel step — why GPU 0 fills up first, measured.

With ``nn.DataParallel`` every device holds its chunk of the batch, a copy of the model and the
activations of its chunk. Device 0 holds more: the original parameters and their gradients, the
optimizer state, the whole input batch, the gathered outputs and the loss, and — during backward —
the gradients of every replica on their way to being summed. :func:`dp_step_memory` runs one
training step step by step and records what each stage adds on each device.

How the bytes are counted:

* **CUDA**: ``torch.cuda.memory_allocated(d)`` before and after each stage, and
  ``torch.cuda.max_memory_allocated(d)`` for the peak — the caching allocator's own numbers.
* **CPU virtual devices**: all virtual devices share one RAM, so :class:`MemoryTracker` counts
  instead. A ``TorchDispatchMode`` sees every tensor an operator creates; a new storage is charged
  to the current virtual device of the thread that created it (a device's worker thread, or the
  device a ``device_context`` names) and credited back when the storage is freed. That gives live
  and peak bytes per virtual device, for the tensors PyTorch ops allocate (library-internal scratch
  space, e.g. inside a convolution kernel, is not seen).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree as pytree

from .data_parallel import BalancedDataParallel, DataParallel
from .device_workers import _push_hook, as_devices, current_device_index, device_context

__all__ = ["MemoryTracker", "MemoryReport", "dp_step_memory", "format_bytes"]


def format_bytes(n: float) -> str:
    """Human-readable bytes (powers of 1024).

    Example::

        >>> format_bytes(512), format_bytes(1536), format_bytes(3 * 2**20)
        ('512 B', '1.5 KiB', '3.0 MiB')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


class _AllocationMode(TorchDispatchMode):
    """Charges every storage an op creates to the thread's current virtual device."""

    def __init__(self, tracker: "MemoryTracker"):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        existing = {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if storage._cdata not in existing:
                    self.tracker._allocated(storage)
        return out


class MemoryTracker:
    """Live and peak bytes allocated per device since the tracker was entered.

    Args:
        devices: the devices to report (CUDA devices, or CPU virtual devices ``cpu:<i>``).

    On CUDA it reads the caching allocator's statistics; on CPU virtual devices it counts the
    storages PyTorch ops create, charged to the virtual device of the thread that creates them
    (see the module docstring). Work in DataParallel's worker threads is tracked automatically.

    Example::

        >>> import torch
        >>> with MemoryTracker(["cpu:0", "cpu:1"]) as mt:
        ...     a = torch.zeros(256)                          # 1 KiB on cpu:0 (this thread's device)
        ...     with device_context("cpu:1"):
        ...         b = torch.zeros(512)                      # 2 KiB on cpu:1
        ...     del a
        >>> mt.live(), mt.peak()
        ({'cpu:0': 0, 'cpu:1': 2048}, {'cpu:0': 1024, 'cpu:1': 2048})

    .. warning::
        Counts are *net bytes allocated since entering*: tensors that existed before (the model,
        the batch) are not included, and on CPU only tensors created by PyTorch operators are seen.
    """

    def __init__(self, devices: Sequence):
        self.devices = as_devices(devices, what="devices")
        self.cuda = self.devices[0].type == "cuda"
        self._lock = threading.Lock()
        self._local = threading.local()
        self._live = {str(d): 0 for d in self.devices}
        self._peak = dict(self._live)
        self._sizes: dict[int, tuple[str, int]] = {}
        self._base: dict[str, int] = {}
        self._stack = None

    # -- virtual devices: the allocation log -----------------------------------------------------
    def _allocated(self, storage) -> None:
        key = storage._cdata
        nbytes = storage.nbytes()
        device = f"cpu:{current_device_index()}"
        with self._lock:
            if key in self._sizes:
                return
            self._sizes[key] = (device, nbytes)
            live = self._live.get(device, 0) + nbytes
            self._live[device] = live
            self._peak[device] = max(self._peak.get(device, 0), live)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        with self._lock:
            entry = self._sizes.pop(key, None)
            if entry is not None:
                self._live[entry[0]] -= entry[1]

    @contextlib.contextmanager
    def thread_context(self, device, label):
        """Follow work into another thread (called by the device workers)."""
        if self.cuda or getattr(self._local, "active", False):
            yield
            return
        self._local.active = True
        try:
            with _AllocationMode(self):
                yield
        finally:
            self._local.active = False

    # -- public ------------------------------------------------------------------------------------
    def __enter__(self) -> "MemoryTracker":
        if self._stack is not None:
            raise RuntimeError("this MemoryTracker is already active; create a new one per measurement")
        self._stack = contextlib.ExitStack()
        if self.cuda:
            for d in self.devices:
                torch.cuda.synchronize(d)
                torch.cuda.reset_peak_memory_stats(d)
                self._base[str(d)] = torch.cuda.memory_allocated(d)
        self._stack.enter_context(_push_hook(self))
        self._stack.enter_context(self.thread_context(None, "main"))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._stack = None

    def live(self) -> dict[str, int]:
        """Net bytes allocated per device since entering, now."""
        if self.cuda:
            return {str(d): torch.cuda.memory_allocated(d) - self._base[str(d)] for d in self.devices}
        with self._lock:
            return {str(d): self._live.get(str(d), 0) for d in self.devices}

    def peak(self) -> dict[str, int]:
        """Highest :meth:`live` value per device since entering (or since :meth:`reset_peak`)."""
        if self.cuda:
            return {str(d): torch.cuda.max_memory_allocated(d) - self._base[str(d)] for d in self.devices}
        with self._lock:
            return {str(d): self._peak.get(str(d), 0) for d in self.devices}

    def reset_peak(self) -> None:
        if self.cuda:
            for d in self.devices:
                torch.cuda.reset_peak_memory_stats(d)
        with self._lock:
            self._peak = dict(self._live)


# --- one DataParallel step, stage by stage ---------------------------------------------------------

#: the parts of a device's memory, in stacking order
PARTS = ("parameters", "optimizer state", "batch", "input chunk", "replica", "activations",
         "outputs + loss", "gradients")


@dataclass
class MemoryReport:
    """Bytes per device and part for one DataParallel training step (see :func:`dp_step_memory`)."""

    devices: list[str]
    chunk_sizes: list[int]
    parts: dict[str, list[int]] = field(default_factory=dict)
    peak: list[int] = field(default_factory=list)

    def total(self, device: int | str) -> int:
        i = device if isinstance(device, int) else self.devices.index(device)
        return sum(values[i] for values in self.parts.values())

    def __str__(self) -> str:
        width = max(len(p) for p in PARTS) + 2
        lines = [f"{'':<{width}}" + "".join(f"{d:>12}" for d in self.devices),
                 f"{'rows of the batch':<{width}}" + "".join(f"{n:>12}" for n in self.chunk_sizes)]
        for part in PARTS:
            lines.append(f"{part:<{width}}" + "".join(f"{format_bytes(v):>12}" for v in self.parts[part]))
        lines.append(f"{'sum of parts':<{width}}"
                     + "".join(f"{format_bytes(self.total(i)):>12}" for i in range(len(self.devices))))
        lines.append(f"{'measured peak':<{width}}" + "".join(f"{format_bytes(v):>12}" for v in self.peak))
        return "\n".join(lines)


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in seen:
            seen.add(t.untyped_storage()._cdata)
            total += t.untyped_storage().nbytes()
    return total


def dp_step_memory(model: nn.Module, inputs: torch.Tensor, target: torch.Tensor, device_ids: Sequence,
                   *, gpu0_bsz: int | None = None, output_device=None,
                   loss_fn: Callable = F.cross_entropy,
                   optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """Measure what each part of a (Balanced)DataParallel training step takes on each device.

    Runs the step as DataParallel does — scatter, replicate, parallel_apply, gather, loss,
    backward, optimizer step — reading the memory per device after each stage (see
    :class:`MemoryTracker`). With an optimizer, an untracked step runs first so that its state
    exists, as in the middle of training; both steps update ``model``.

    Args:
        model: the model, on ``device_ids[0]`` (CPU for virtual devices).
        inputs, target: one batch (on ``device_ids[0]``, as ``inputs.cuda()`` puts it).
        device_ids: CUDA devices or CPU virtual devices.
        gpu0_bsz: rows for device 0 as in :class:`~gpucourse.BalancedDataParallel`; ``None`` =
            DataParallel's even split.
        output_device: where outputs and loss go (default ``device_ids[0]``).
        loss_fn: ``loss_fn(outputs, target)`` → scalar loss.
        optimizer: for the optimizer-state part (e.g. ``torch.optim.Adam(model.parameters())``).

    Returns:
        A :class:`MemoryReport`: bytes per device for ``parameters, optimizer state, batch`` (on
        device 0, measured from the tensors), ``input chunk, replica, activations, outputs + loss``
        (what each stage added), ``gradients`` and the measured peak of the whole step.

    Example::

        >>> import torch
        >>> model = torch.nn.Linear(16, 8, bias=False)
        >>> r = dp_step_memory(model, torch.randn(6, 16), torch.randint(0, 8, (6,)), ["cpu:0", "cpu:1"])
        >>> r.chunk_sizes, r.parts["replica"], r.parts["input chunk"]    # 8*16*4 and 3*16*4 bytes
        ([3, 3], [0, 512], [0, 192])

    .. warning::
        On virtual devices the counts are of tensors created by PyTorch ops; on a GPU the caching
        allocator rounds sizes up and libraries add workspaces, so real numbers are somewhat larger.
        The *shape* of the picture — device 0 carries more — is the same.
    """
    devices = as_devices(device_ids, what="device_ids")
    dp = (DataParallel(model, devices, output_device) if gpu0_bsz is None
          else BalancedDataParallel(gpu0_bsz, model, devices, output_device))
    dp._check_module_device()
    src = devices[0]
    names = [str(d) for d in devices]
    index = {name: i for i, name in enumerate(names)}

    def one_step(tracker=None):
        stages = {}

        def snap(name):
            if tracker is not None:
                if src.type == "cuda":
                    for d in devices:
                        torch.cuda.synchronize(d)
                stages[name] = tracker.live()

        snap("start")
        args, kwargs, used = dp.scatter((inputs,), {}, dp.device_ids)
        sizes = [0] * len(devices)
        for d, a in zip(used, args):
            sizes[devices.index(d)] = a[0].shape[dp.dim]
        snap("input chunk")
        replicas = dp.replicate(model, used)
        snap("replica")
        outputs = dp.parallel_apply(replicas, args, kwargs, used)
        del args, kwargs
        snap("activations")
        loss = loss_fn(dp.gather(outputs, dp.output_device), target)
        del outputs
        snap("outputs + loss")
        loss.backward()
        del loss, replicas
        snap("backward")
        if optimizer is not None:
            optimizer.step()
        return stages, sizes

    if optimizer is not None:            # create the optimizer state first (steady state)
        optimizer.zero_grad(set_to_none=True)
        with device_context(src):
            one_step()
    model.zero_grad(set_to_none=True)

    with device_context(src), MemoryTracker(devices) as tracker:
        stages, sizes = one_step(tracker)
        peak = tracker.peak()

    report = MemoryReport(names, sizes)
    zeros = [0] * len(devices)
    order = ["start", "input chunk", "replica", "activations", "outputs + loss"]
    for previous, stage in zip(order, order[1:]):
        report.parts[stage] = [max(0, stages[stage][n] - stages[previous][n]) for n in names]
    static = {
        "parameters": _nbytes(model.parameters()) + _nbytes(model.buffers()),
        "optimizer state": _nbytes(v for state in (optimizer.state.values() if optimizer else ())
                                   for v in state.values()),
        "batch": _nbytes([inputs, target]),
        "gradients": _nbytes(p.grad for p in model.parameters()),
    }
    for part, nbytes in static.items():
        report.parts[part] = list(zeros)
        report.parts[part][index[str(src)]] = nbytes
    report.parts = {part: report.parts[part] for part in PARTS}
    resident = [report.parts["parameters"][i] + report.parts["optimizer state"][i] + report.parts["batch"][i]
                for i in range(len(devices))]
    if src.type == "cuda":           # the allocator's numbers already include what was resident
        report.peak = [torch.cuda.max_memory_allocated(d) for d in devices]
    else:
        report.peak = [resident[i] + peak[n] for i, n in enumerate(names)]
    return report


