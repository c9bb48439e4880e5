"""How virtual devices run work: one persistent worker thread per device, and a timeline of it.

A real multi-GPU machine runs one replica per GPU at the same time because every GPU is its own
processor. On a CPU laptop the course stands in for GPUs with *virtual devices* ``cpu:0, cpu:1, …``
(:func:`~gpucourse.virtual_devices`). A label does not compute anything, so this module gives each
virtual device what a GPU has:

* **its own worker thread** (persistent: created on first use and reused, like the per-GPU threads
  of PyTorch's autograd engine), running with one intra-op thread — one virtual device ≈ one core;
* **a current device** for the thread, like ``torch.cuda.current_device()``: work submitted to
  ``cpu:1`` runs with ``current_device_index() == 1``, which is how :mod:`gpucourse.memory` knows
  which device an allocation belongs to;
* the caller's **thread-local state** carried into the worker (grad mode, inference mode, autocast
  and the course's trackers), as ``torch.nn.parallel.parallel_apply`` does for its threads.

Compute in PyTorch ops releases the GIL, so two workers really run at the same time on two cores;
the Python glue between ops does not, which is why tiny models gain nothing (chapter 02 measures it).

:func:`record_timeline` records what each worker ran and when; :func:`plot_timeline` draws it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

__all__ = ["as_device", "as_devices", "current_device_index", "device_context", "run_on_devices"]

_local = threading.local()          # .device_index, .hooks, .worker_of (per thread)
_pool_lock = threading.Lock()
_workers: dict = {}       # "cpu:1" -> its single-thread pool; "pid" -> the process that owns them


# --- device names ------------------------------------------------------------------------------

def as_device(device: int | str | torch.device, *, what: str = "device") -> torch.device:
    """Normalise a device spec: ``1`` / ``"cuda:1"`` / ``torch.device("cpu", 1)`` → ``torch.device``.

    An int means ``cuda:<int>`` when CUDA is available and the virtual device ``cpu:<int>``
    otherwise, so ``device_ids=[0, 1]`` works on both kinds of machine. A bare ``"cpu"`` is
    ``cpu:0``.

    Example::

        >>> as_device("cpu:1")
        device(type='cpu', index=1)
        >>> as_device("cpu")
        device(type='cpu', index=0)
        >>> as_device("mps:0")
        Traceback (most recent call last):
        ...
        ValueError: device 'mps:0' has type 'mps'; only 'cuda' devices and CPU virtual devices 'cpu:<i>' are supported
    """
    if isinstance(device, torch.device) and device.index is not None and device.type in ("cpu", "cuda"):
        return device                                   # the common case, kept cheap
    if isinstance(device, bool):
        raise TypeError(f"{what} must be an int, a str or a torch.device, got bool {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{what} index must be >= 0, got {device}")
        kind = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.device(kind, device)
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            raise ValueError(
                f"{what} {device!r} is not a device name such as 'cpu:1' or 'cuda:0'") from None
    if not isinstance(device, torch.device):
        raise TypeError(
            f"{what} must be an int, a str or a torch.device, got {type(device).__name__} {device!r}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} {str(device)!r} has type {device.type!r}; only 'cuda' devices and "
                         "CPU virtual devices 'cpu:<i>' are supported")
    if device.type == "cpu":
        return torch.device("cpu", device.index or 0)
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def as_devices(devices: Sequence[int | str | torch.device], *,
               what: str = "device_ids") -> list[torch.device]:
    """Normalise and validate a device list: not empty, one kind, no repeats, every device exists.

    Example::

        >>> as_devices(["cpu:0", "cpu:1"])
        [device(type='cpu', index=0), device(type='cpu', index=1)]
        >>> as_devices([])
        Traceback (most recent call last):
        ...
        ValueError: device_ids is empty; pass at least one device, e.g. gc.virtual_devices(2)
    """
    if isinstance(devices, (str, int, torch.device)) or not isinstance(devices, Sequence):
        raise TypeError(f"{what} must be a list of devices, got {type(devices).__name__} {devices!r}")
    if len(devices) == 0:
        raise ValueError(f"{what} is empty; pass at least one device, e.g. gc.virtual_devices(2)")
    out = [as_device(d, what=f"{what}[{i}]") for i, d in enumerate(devices)]
    kinds = {d.type for d in out}
    if len(kinds) > 1:
        raise ValueError(f"{what} mixes CUDA devices and CPU virtual devices: {[str(d) for d in out]}; "
                         "use one kind")
    seen = set()
    for i, d in enumerate(out):
        if d in seen:
            raise ValueError(f"{what} lists {d} twice: {[str(x) for x in out]}")
        seen.add(d)
        if d.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if d.index >= count:
                raise ValueError(
                    f"{what}[{i}] = {d} does not exist: this process sees {count} CUDA device(s)"
                    + (f" (cuda:0 … cuda:{count - 1})" if count else "")
                    + "; CUDA_VISIBLE_DEVICES renumbers the visible GPUs from 0")
    return out


# --- the current device of a thread ------------------------------------------------------------

def current_device_index() -> int:
    """The virtual device the calling thread works for (0 unless set, like ``cuda.current_device``).

    Example::

        >>> current_device_index()
        0
        >>> with device_context("cpu:2"):
        ...     current_device_index()
        2
    """
    return getattr(_local, "device_index", 0)


@contextlib.contextmanager
def device_context(device: int | str | torch.device):
    """Make ``device`` the current device of this thread (``torch.cuda.device`` for CUDA).

    Work done inside counts as done *on* that device, e.g. a CPU copy made inside
    ``device_context("cpu:1")`` is memory of virtual device 1 for :class:`gpucourse.MemoryTracker`.
    """
    device = as_device(device)
    previous = current_device_index()
    _local.device_index = device.index
    try:
        if device.type == "cuda":
            with torch.cuda.device(device):
                yield device
        else:
            yield device
    finally:
        _local.device_index = previous


# --- hooks: objects that follow work into the worker threads (trackers, timelines) -------------

def _hooks() -> tuple:
    return getattr(_local, "hooks", ())


@contextlib.contextmanager
def _push_hook(hook):
    """Activate ``hook`` on this thread; tasks submitted from here carry it into their worker."""
    previous = _hooks()
    _local.hooks = previous + (hook,)
    try:
        yield hook
    finally:
        _local.hooks = previous


@contextlib.contextmanager
def span(label: str, device: torch.device | None = None):
    """Mark a piece of work on the current thread for every active hook (e.g. a timeline row)."""
    with contextlib.ExitStack() as stack:
        for hook in _hooks():
            stack.enter_context(hook.thread_context(device, label))
        yield


# --- the workers --------------------------------------------------------------------------------

def _init_worker(device: torch.device) -> None:
    _local.device_index = device.index
    _local.worker_of = str(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)          # one virtual device = one core (per-thread setting)


def _worker(device: torch.device) -> ThreadPoolExecutor:
    key = str(device)
    with _pool_lock:
        if _workers.get("pid") != os.getpid():   # a forked child has none of the parent's threads
            _workers.clear()
            _workers["pid"] = os.getpid()
        pool = _workers.get(key)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"gpucourse-{key}",
                                      initializer=_init_worker, initargs=(device,))
            _workers[key] = pool
        return pool


@dataclass
class _Context:
    """Thread-local state of the submitting thread, re-created in the worker."""

    grad: bool
    inference: bool
    autocast: dict[str, tuple[bool, torch.dtype]]
    hooks: tuple

    @classmethod
    def capture(cls) -> "_Context":
        autocast = {}
        for kind in ("cpu", "cuda"):
            if torch.is_autocast_enabled(kind):
                autocast[kind] = (True, torch.get_autocast_dtype(kind))
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, _hooks())

    def applied(self, device: torch.device, label: str):
        if not (self.inference or self.autocast or self.hooks):      # the common case, kept cheap
            return torch.set_grad_enabled(self.grad)
        return self._applied(device, label)

    @contextlib.contextmanager
    def _applied(self, device: torch.device, label: str):
        with contextlib.ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for kind, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            previous = _hooks()
            _local.hooks = self.hooks
            stack.callback(setattr, _local, "hooks", previous)
            for hook in self.hooks:
                stack.enter_context(hook.thread_context(device, label))
            yield


def _run_task(ctx: _Context, device: torch.device, label: str, fn: Callable, args: tuple) -> Any:
    with ctx.applied(device, label):
        return fn(*args)


def run_on_devices(fn: Callable, args_per_device: Sequence[tuple], devices: Sequence[torch.device],
                   *, label: str = "task") -> list:
    """Run ``fn(*args_per_device[i])`` on the worker thread of ``devices[i]``, all at once.

    Returns the results in device order. The caller's grad mode, inference mode, autocast state and
    active trackers/timelines apply inside the workers. An exception in a worker is re-raised here
    with a note naming the device. A call made from inside a worker for that same device runs
    inline (no deadlock).

    Example::

        >>> run_on_devices(lambda x: (x * 2, current_device_index()), [(1,), (2,)],
        ...                [torch.device("cpu", 0), torch.device("cpu", 1)])
        [(2, 0), (4, 1)]
    """
    if len(args_per_device) != len(devices):
        raise ValueError(f"got {len(args_per_device)} argument tuples for {len(devices)} devices")
    ctx = _Context.capture()
    futures: list[Future | None] = []
    inline: list[Any] = []
    me = getattr(_local, "worker_of", None)
    for device, args in zip(devices, args_per_device):
        if str(device) == me:                      # nested call from this device's own worker
            futures.append(None)
            inline.append((device, args))
        else:
            futures.append(_worker(device).submit(_run_task, ctx, device, label, fn, tuple(args)))
    results, error = [], None
    pending_inline = iter(inline)
    for i, (device, future) in enumerate(zip(devices, futures)):
        try:
            if future is None:
                dev, args = next(pending_inline)
                results.append(_run_task(ctx, dev, label, fn, tuple(args)))
            else:
                results.append(future.result())
        except BaseException as e:            # keep waiting for the others, then raise the first
            if error is None:
                if isinstance(e, Exception):
                    e.add_note(f"(raised in {label} of replica {i} on device {device})")
                error = e
            results.append(None)
    if error is not None:
        raise error
    return results


# --- timeline ----------------------------------------------------------------------------------


