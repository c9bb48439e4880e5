"""The four steps of DataParallel, from scratch: scatter → replicate → parallel_apply → gather.

One training step of ``nn.DataParallel`` on ``device_ids = [0, 1, 2]`` is::

    inputs  = scatter(batch, devices)          # 1) split the batch along dim 0: a chunk per device
    replicas = replicate(module, devices)      # 2) copy the module's parameters to every device
    outputs = parallel_apply(replicas, inputs) # 3) run every replica on its chunk, at the same time
    out     = gather(outputs, devices[0])      # 4) concatenate the outputs on the output device

and in ``backward`` the same steps in reverse: the gradient of ``out`` is split again (gather's
backward is a scatter), every replica back-propagates its chunk concurrently, and the parameter
gradients of the replicas are **summed** into the original module (replicate's backward is a
reduce). PyTorch's own versions of these functions only accept CUDA tensors; these work on CUDA
devices *and* on CPU virtual devices (``gc.virtual_devices(n)``), where each device is served by
its own worker thread (:mod:`gpucourse.data_parallel.device_workers`).

Concurrent backward on virtual devices needs a design, not just threads: PyTorch's autograd engine
runs every CPU backward node on the thread that called ``backward()``, so replica graphs built in
worker threads would still be back-propagated one after another. :func:`parallel_apply` therefore
runs each replica's forward on *detached* copies of its inputs and parameters, and joins the
results to the caller's graph through one autograd node whose backward runs every replica's
backward in that replica's worker thread, at the same time (that machinery is
:mod:`gpucourse.data_parallel.concurrent_replicas`). On CUDA, PyTorch's engine already has a thread
per GPU, so plain threads suffice there.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch
from torch import nn

from .concurrent_replicas import apply_concurrently
from .device_workers import (as_device, as_devices, current_device_index, device_context,
                             run_on_devices)
from ..runtime import check_int

__all__ = ["scatter", "scatter_kwargs", "chunk_sizes_of", "replicate", "parallel_apply", "gather"]


# --- 1) scatter ---------------------------------------------------------------------------------

def chunk_sizes_of(batch_size: int, num_devices: int) -> list[int]:
    """How ``nn.DataParallel`` splits a batch by default — ``torch.chunk``'s rule.

    Every chunk has ``ceil(batch_size / num_devices)`` rows except the last, so the split may use
    *fewer* devices than given: 5 rows on 4 devices are ``[2, 2, 1]`` — the fourth device idles.

    Args:
        batch_size: rows to split (``>= 0``).
        num_devices: devices available (``>= 1``).

    Example::

        >>> chunk_sizes_of(30, 3)       # the seeds' "[30, xxx] -> [10, ...], [10, ...], [10, ...]"
        [10, 10, 10]
        >>> chunk_sizes_of(10, 4)
        [3, 3, 3, 1]
        >>> chunk_sizes_of(5, 4)        # only three devices get work
        [2, 2, 1]
        >>> len(chunk_sizes_of(1869773657305771023, 399))   # integer arithmetic: exact at any size
        399

    .. warning::
        The batch should be larger than the number of devices, and ideally a multiple of it: with
        ``torch.chunk``'s rule an unlucky batch size leaves devices idle.
    """
    check_int("batch_size", batch_size, 0)
    check_int("num_devices", num_devices, 1)
    if batch_size == 0:
        return []
    step = -(-batch_size // num_devices)        # ceil in integers: exact for any batch size
    return [min(step, batch_size - start) for start in range(0, batch_size, step)]


def _check_chunk_sizes(chunk_sizes, size: int, num_devices: int, dim: int) -> list[int]:
    if isinstance(chunk_sizes, (str, bytes)) or not isinstance(chunk_sizes, Sequence):
        raise TypeError(
            f"chunk_sizes must be a list of ints, got {type(chunk_sizes).__name__} {chunk_sizes!r}")
    sizes = list(chunk_sizes)
    if len(sizes) != num_devices:
        raise ValueError(f"chunk_sizes {sizes} has {len(sizes)} entries for {num_devices} devices; "
                         "give one size per device (0 leaves a device out)")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes):
        raise ValueError(f"chunk_sizes must be ints >= 0, got {sizes}")
    if sum(sizes) != size:
        raise ValueError(f"chunk_sizes {sizes} add up to {sum(sizes)}, but the tensor has {size} "
                         f"rows along dim {dim}")
    return sizes


def _copy_to(t: torch.Tensor, device: torch.device, *, detach: bool = False) -> torch.Tensor:
    """``t`` as it lives on ``device``: the same storage if it is already there, else a copy there."""
    src = t.detach() if detach else t
    if device.type == "cuda":
        return src.to(device, non_blocking=True) if t.device != device else src.view_as(src)
    if t.device.type != "cpu":
        raise ValueError(f"cannot move a {t.device} tensor to the CPU virtual device {device}; "
                         "keep model and data on the CPU when using virtual devices")
    if device.index == current_device_index():
        return src.view_as(src)                 # already "on" this virtual device: no copy
    with device_context(device):                # a copy that lives on the other virtual device
        return src.clone(memory_format=torch.contiguous_format)


def _split_tensor(t: torch.Tensor, devices: list[torch.device], chunk_sizes, dim: int):
    if t.dim() == 0:
        raise ValueError("cannot scatter a 0-dim tensor (a scalar has no batch dimension); pass "
                         "it inside a non-tensor object or give it a batch dimension")
    d = dim if dim >= 0 else dim + t.dim()
    if not 0 <= d < t.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(t.shape)}")
    size = t.shape[d]
    if chunk_sizes is None:
        sizes = chunk_sizes_of(size, len(devices))
        targets = devices[:len(sizes)]
    else:
        sizes = _check_chunk_sizes(chunk_sizes, size, len(devices), dim)
        targets = [dev for dev, s in zip(devices, sizes) if s > 0]
        sizes = [s for s in sizes if s > 0]
    pieces = torch.split(t, sizes, dim=d) if sizes else ()
    return [_copy_to(p, dev) for p, dev in zip(pieces, targets)]


def scatter(inputs: Any, devices: Sequence, chunk_sizes: Sequence[int] | None = None,
            dim: int = 0) -> list:
    """Split ``inputs`` along ``dim`` into one chunk per device and put each chunk on its device.

    Tensors are split; tuples, lists, dicts and namedtuples are split element-wise (a list of
    structures comes back); any other object is passed to every device as is (shared, not copied).

    Args:
        inputs: a tensor, or a (nested) tuple/list/dict of tensors and other objects.
        devices: CUDA devices or CPU virtual devices (``gc.virtual_devices(n)``).
        chunk_sizes: rows per device, one entry per device, summing to the size along ``dim``; a
            ``0`` leaves that device out. Default: ``torch.chunk``'s rule (:func:`chunk_sizes_of`).
        dim: the batch dimension.

    Returns:
        A list with one entry per device that received rows (possibly fewer than ``devices``).
        The chunk for the device the data already lives on is a view (no copy); the others are
        copies on their device. The split is differentiable: gradients flow back to ``inputs``.

    Example::

        >>> import torch
        >>> x = torch.arange(10.).reshape(5, 2)
        >>> [tuple(c.shape) for c in scatter(x, ["cpu:0", "cpu:1"])]
        [(3, 2), (2, 2)]
        >>> [c[:, 0].tolist() for c in scatter(x, ["cpu:0", "cpu:1", "cpu:2"], chunk_sizes=[1, 2, 2])]
        [[0.0], [2.0, 4.0], [6.0, 8.0]]
        >>> scatter((x, "label"), ["cpu:0", "cpu:1"])[1][1]      # non-tensors are shared
        'label'

    .. warning::
        The batch should be at least as large as the number of devices: ``scatter`` of 3 rows on 4
        devices returns only 3 chunks, and :class:`~gpucourse.DataParallel` then runs 3 replicas.
    """
    devices = as_devices(devices, what="devices")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"dim must be an int, got {type(dim).__name__} {dim!r}")

    def scatter_map(obj):
        if isinstance(obj, torch.Tensor):
            return _split_tensor(obj, devices, chunk_sizes, dim)
        if isinstance(obj, tuple) and hasattr(obj, "_fields") and len(obj) > 0:   # namedtuple
            return [type(obj)(*parts) for parts in zip(*map(scatter_map, obj))]
        if isinstance(obj, tuple) and len(obj) > 0:
            return [tuple(parts) for parts in zip(*map(scatter_map, obj))]
        if isinstance(obj, list) and len(obj) > 0:
            return [list(parts) for parts in zip(*map(scatter_map, obj))]
        if isinstance(obj, dict) and len(obj) > 0:
            return [type(obj)(zip(obj.keys(), parts)) for parts in zip(*map(scatter_map, obj.values()))]
        return [obj for _ in devices]

    return scatter_map(inputs)


def scatter_kwargs(inputs: tuple, kwargs: dict | None, devices: Sequence,
                   chunk_sizes: Sequence[int] | None = None, dim: int = 0) -> tuple[list, list]:
    """:func:`scatter` positional and keyword arguments together: ``(args per device, kwargs per device)``.

    Both lists have the same length (the number of devices that got rows).

    Example::

        >>> import torch
        >>> args, kw = scatter_kwargs((torch.zeros(4, 1),), {"mask": torch.ones(4)}, ["cpu:0", "cpu:1"])
        >>> len(args), tuple(args[1][0].shape), tuple(kw[1]["mask"].shape)
        (2, (2, 1), (2,))
    """
    inputs = tuple(inputs) if inputs else ()
    scattered_inputs = scatter(inputs, devices, chunk_sizes, dim) if inputs else []
    scattered_kwargs = scatter(kwargs, devices, chunk_sizes, dim) if kwargs else []
    n = max(len(scattered_inputs), len(scattered_kwargs))
    if scattered_inputs and scattered_kwargs and len(scattered_inputs) != len(scattered_kwargs):
        n = min(len(scattered_inputs), len(scattered_kwargs))
        scattered_inputs, scattered_kwargs = scattered_inputs[:n], scattered_kwargs[:n]
    scattered_inputs = list(scattered_inputs) + [() for _ in range(n - len(scattered_inputs))]
    scattered_kwargs = list(scattered_kwargs) + [{} for _ in range(n - len(scattered_kwargs))]
    return scattered_inputs, scattered_kwargs


# --- 2) replicate -------------------------------------------------------------------------------

def replicate(module: nn.Module, devices: Sequence, *, detach: bool | None = None) -> list[nn.Module]:
    """One copy of ``module`` per device, whose parameters are differentiable copies of the original's.

    Like ``torch.nn.parallel.replicate``: a replica is a shallow copy of every submodule whose
    parameters are *not* ``nn.Parameter`` leaves but tensors computed from the original parameters,
    so a gradient that reaches a replica's weight flows on to (and is summed into) the original
    module's ``.grad``. On the device the module lives on, the replica shares the original's
    storage; on every other device it holds a copy (that is the per-step replication cost).

    Buffers (e.g. BatchNorm's running statistics) are copied without gradient; the replica on the
    module's own device shares them, so only *its* in-place updates reach the original module.

    Args:
        module: the module to copy, on ``devices[0]`` (for CPU virtual devices: on the CPU).
        devices: CUDA devices or CPU virtual devices.
        detach: copy without autograd history (default: when grad mode is off, as in PyTorch).

    Example::

        >>> import torch
        >>> net = torch.nn.Linear(3, 2)
        >>> r0, r1 = replicate(net, ["cpu:0", "cpu:1"])
        >>> r1.weight.data_ptr() != net.weight.data_ptr(), r0.weight.data_ptr() == net.weight.data_ptr()
        (True, True)
        >>> (r0(torch.ones(1, 3)).sum() + r1(torch.ones(1, 3)).sum()).backward()
        >>> net.weight.grad                         # both replicas' gradients, summed
        tensor([[2., 2., 2.],
                [2., 2., 2.]])

    .. warning::
        A replica has no ``parameters()`` (they are plain tensor attributes), and replicas are
        thrown away after the step: state a ``forward`` writes to ``self`` (a counter, a cache) is
        lost, except in-place buffer updates made by the replica on the module's own device.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    devices = as_devices(devices, what="devices")
    if detach is None:
        detach = not torch.is_grad_enabled()
    modules = list(module.modules())
    index = {m: i for i, m in enumerate(modules)}
    copies: list[list[nn.Module]] = []
    for device in devices:
        replicas = [_shallow_copy(m) for m in modules]
        slots = []                              # where the replica's weights that need grad sit
        for m, r in zip(modules, replicas):
            r.__dict__["_gc_device"] = device
            for key, child in m._modules.items():
                r._modules[key] = None if child is None else replicas[index[child]]
            for key, p in m._parameters.items():
                # parameters of a replica are plain attributes (replica._parameters is empty)
                copy = None if p is None else _copy_to(p, device, detach=detach or not p.requires_grad)
                r.__dict__[key] = copy          # what setattr would do, without its checks
                if copy is not None and copy.requires_grad:
                    slots.append((r.__dict__, key, copy))
            for key, b in m._buffers.items():
                if b is None:
                    r._buffers[key] = None
                elif device.type == "cpu" and device.index == current_device_index() or b.device == device:
                    r._buffers[key] = b                 # shared: in-place updates reach the original
                else:
                    r._buffers[key] = _copy_to(b, device, detach=True)
        replicas[0].__dict__["_gc_slots"] = (slots, replicas)
        copies.append(replicas[0])
    return copies


def _shallow_copy(module: nn.Module) -> nn.Module:
    """``module._replicate_for_data_parallel()``, without ``Module.__setattr__``'s checks (faster)."""
    replica = module.__new__(type(module))
    state = module.__dict__.copy()
    state.update(_parameters={}, _buffers=state["_buffers"].copy(), _modules=state["_modules"].copy(),
                 _is_replica=True)
    object.__setattr__(replica, "__dict__", state)
    return replica


# --- 3) parallel_apply --------------------------------------------------------------------------

def _apply_cuda(module, args, kwargs, device):
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.current_stream(device)):
        return module(*args, **kwargs)


def parallel_apply(modules: Sequence[nn.Module], inputs: Sequence[Any], devices: Sequence | None = None,
                   *, kwargs_tup: Sequence[dict] | None = None) -> list:
    """Run ``modules[i](*inputs[i], **kwargs_tup[i])`` on ``devices[i]``, all replicas at the same time.

    On CPU virtual devices every replica's forward runs in its device's worker thread, and so does
    its backward: the returned outputs are joined to the caller's autograd graph by one node whose
    backward runs each replica's backward concurrently in the workers, then hands
    the gradients of the replica inputs and parameters back to the caller's graph (where
    :func:`replicate`'s copies sum them into the original parameters). On CUDA devices the
    replicas run in worker threads with their device and stream set, as in PyTorch.

    Args:
        modules: one module per device, normally from :func:`replicate`.
        inputs: per device, a tuple of positional arguments (a single object is one argument).
        devices: where each replica runs (default: the devices :func:`replicate` recorded, else
            ``cpu:0 … cpu:{n-1}``).
        kwargs_tup: per device, a dict of keyword arguments.

    Returns:
        The outputs, one per replica, in order.

    Example::

        >>> import torch
        >>> net = torch.nn.Linear(3, 2)
        >>> devs = ["cpu:0", "cpu:1"]
        >>> outs = parallel_apply(replicate(net, devs), scatter(torch.ones(4, 3), devs), devs)
        >>> [tuple(o.shape) for o in outs]
        [(2, 2), (2, 2)]

    .. warning::
        Python code in ``forward`` holds the GIL, so only the work inside PyTorch ops runs truly in
        parallel: a model made of many tiny ops gains nothing from more devices (chapter 02
        measures it). Pass distinct modules (replicas): the same module object given twice is run
        one replica at a time.
    """
    modules = list(modules)
    inputs = list(inputs)
    if len(modules) != len(inputs):
        raise ValueError(f"got {len(modules)} modules but {len(inputs)} inputs; give one input per module")
    if kwargs_tup is None:
        kwargs_tup = [{} for _ in modules]
    elif len(kwargs_tup) != len(modules):
        raise ValueError(f"got {len(modules)} modules but {len(kwargs_tup)} kwargs dicts")
    if devices is None:
        devices = [getattr(m, "_gc_device", None) or torch.device("cpu", i) for i, m in enumerate(modules)]
    devices = as_devices(devices, what="devices")
    if len(devices) != len(modules):
        raise ValueError(f"got {len(modules)} modules but {len(devices)} devices")
    inputs = [x if isinstance(x, (tuple, list)) else (x,) for x in inputs]
    if not modules:
        return []

    if devices[0].type == "cuda":
        return run_on_devices(_apply_cuda, [(m, tuple(a), dict(k), d) for m, a, k, d
                                            in zip(modules, inputs, kwargs_tup, devices)],
                              devices, label="forward")

    # CPU virtual devices: forwards in the device threads, and a backward that runs there too
    return apply_concurrently(modules, inputs, kwargs_tup, devices)


# --- 4) gather ----------------------------------------------------------------------------------

def _gather_tensors(tensors: list[torch.Tensor], target: torch.device, dim: int) -> torch.Tensor:
    if all(t.dim() == 0 for t in tensors):
        warnings.warn("gather got scalars (0-dim tensors), one per replica; returning them as a vector "
                      "of length {} (a loss computed inside the model comes back per replica: take "
                      ".mean() or .sum())".format(len(tensors)), stacklevel=4)
        tensors = [t.reshape(1) for t in tensors]
        dim = 0
    if target.type == "cuda":
        return torch.cat([t.to(target, non_blocking=True) for t in tensors], dim=dim)
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"cannot gather {tensors[0].device} tensors onto the CPU virtual device {target}")
    if len(tensors) == 1 and target.index == current_device_index():
        return tensors[0]
    with device_context(target):
        return torch.cat(tensors, dim=dim)


def gather(outputs: Sequence[Any], target_device, dim: int = 0) -> Any:
    """Concatenate the replicas' outputs along ``dim`` on ``target_device`` (the output device).

    Works element-wise on tuples, lists, dicts and namedtuples; ``None`` stays ``None``. The
    concatenation is differentiable: in backward, the gradient is split back to the replicas.

    Args:
        outputs: one output per replica, all of the same structure.
        target_device: where the result lives (DataParallel's ``output_device``).
        dim: the dimension to concatenate along.

    Example::

        >>> import torch
        >>> gather([torch.zeros(2, 3), torch.ones(1, 3)], "cpu:0").shape
        torch.Size([3, 3])
        >>> out = gather([(torch.zeros(2), {"n": torch.ones(2)}), (torch.zeros(1), {"n": torch.ones(1)})], "cpu:0")
        >>> tuple(out[0].shape), tuple(out[1]["n"].shape)
        ((3,), (3,))

    .. warning::
        Everything is gathered on **one** device — with ``nn.DataParallel`` that is GPU 0, which
        also holds the model, its gradients and the optimizer state. This is one reason why GPU 0
        fills up first. Scalars (0-dim) cannot be concatenated: they come back as a vector with a
        warning.
    """
    target = as_device(target_device, what="target_device")
    outputs = list(outputs)
    if not outputs:
        raise ValueError("gather needs at least one output")

    def gather_map(items):
        first = items[0]
        if isinstance(first, torch.Tensor):
            return _gather_tensors(list(items), target, dim)
        if first is None:
            return None
        if isinstance(first, dict):
            if any(set(d) != set(first) for d in items):
                raise ValueError("every replica must return a dict with the same keys")
            return type(first)((k, gather_map([d[k] for d in items])) for k in first)
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)._make(map(gather_map, zip(*items)))
        if isinstance(first, (tuple, list)):
            return type(first)(map(gather_map, zip(*items)))
        raise TypeError(f"cannot gather outputs of type {type(first).__name__}; return tensors, or "
                        "tuples/lists/dicts of tensors")

    return gather_map(outputs)
