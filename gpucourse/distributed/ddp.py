"""A minimal DistributedDataParallel from scratch: same start, averaged gradients, buckets, no_sync.

Data parallelism keeps one full copy of the model per process and gives each process different
data. The copies stay identical if (1) they start identical and (2) every optimizer step uses the
same gradient — the *average* over all processes. That is all
``torch.nn.parallel.DistributedDataParallel`` guarantees, and all :class:`MiniDDP` does:

1) **same start**: at construction, rank 0's parameters and buffers are broadcast to every rank;
2) **average after backward**: a hook on every parameter fires when its gradient is ready
   (``register_post_accumulate_grad_hook``) and takes part in an all-reduce; divided by the world
   size this is the gradient of the mean loss over the global batch;
3) **buckets** (``bucket_cap_mb``): instead of one small all-reduce per parameter, gradients are
   copied into flat buffers of about ``bucket_cap_mb`` MB, each all-reduced *asynchronously* as
   soon as it is full — while autograd is still computing the gradients of earlier layers. That
   overlap of communication with computation is where DDP's speed comes from;
4) **no_sync()**: for gradient accumulation, micro-batches inside ``with model.no_sync():`` only
   accumulate locally; the next backward outside it all-reduces the accumulated sum once.

:func:`average_gradients` is step 2 in its simplest form: called after ``loss.backward()``, one
blocking all-reduce per gradient, no overlap.

PyTorch DDP's arguments are accepted with PyTorch's meaning (``device_ids``, ``output_device``,
``broadcast_buffers``, ``find_unused_parameters``, ``gradient_as_bucket_view``, ``static_graph``,
``register_comm_hook``); the few it does not implement (``mixed_precision``, ``device_mesh``,
``Join``, ...) are refused with a message saying what to do instead.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from ..runtime import EndOfBackward, graph_nodes, output_tensors, same_on_every_rank
from .ddp_trace import StepTrace

__all__ = ["MiniDDP", "average_gradients"]


def _require_group(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("no process group: call torch.distributed.init_process_group() before "
                           "wrapping the model (torchrun or gc.launch do it for you)")
    if dist.get_rank(group) < 0:
        raise RuntimeError("this process is not a member of the given process group")


def average_gradients(module: nn.Module, group=None) -> None:
    """Replace every ``param.grad`` of ``module`` by its average over the ranks of ``group``.

    Call it after ``loss.backward()`` and before ``optimizer.step()``. Parameters without a gradient
    are skipped — on every rank alike, or the all-reduces pair up wrongly.

    Args:
        module: the local model replica.
        group: the process group (default: the default group).

    Example::

        >>> import torch, gpucourse as gc
        >>> def step(rank, world_size):
        ...     model = torch.nn.Linear(2, 1, bias=False)
        ...     torch.nn.init.ones_(model.weight)
        ...     x = torch.tensor([[float(rank), 1.0]])      # each rank: its own sample
        ...     model(x).sum().backward()                   # local gradient = x
        ...     gc.average_gradients(model)
        ...     return model.weight.grad.tolist()
        >>> gc.launch(step, 2)                              # mean of [0, 1] and [1, 1]
        [[[0.5, 1.0]], [[0.5, 1.0]]]

    .. warning::
        Averaging only works if every replica *started* with the same parameters. With a
        different random initialisation per process the replicas drift apart silently: broadcast
        rank 0's parameters first (``MiniDDP`` and DDP do it in their constructor).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    _require_group(group)
    world_size = dist.get_world_size(group)
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad.div_(world_size)


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor                       # flat: the concatenated gradients, then one
    #                                            "used here" flag per parameter (summed by the
    #                                            same all-reduce: how many ranks used it)
    numel: int = 0                             # gradient elements (the flags follow)
    ready: int = 0                             # how many of params have reported a gradient
    work: object = None                        # the async all-reduce, once launched
    traced: object = None                      # future that records the finish time (trace=True)
    future: object = None                      # the comm hook's future (register_comm_hook)


class GradBucket:
    """What a communication hook receives: like ``torch.distributed.GradBucket``.

    ``buffer()`` is the bucket's flat gradient buffer (this rank's gradients, *not* yet averaged:
    the hook averages, as with torch DDP); ``gradients()`` its per-parameter views, shaped like
    ``parameters()``; ``index()`` the bucket's position (0 = launched first), ``is_last()``.
    """

    def __init__(self, index, buffer, params, offsets, last):
        self._index, self._buffer, self._params, self._offsets, self._last = \
            index, buffer, params, offsets, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer[o: o + p.numel()].view_as(p) for p, o in zip(self._params, self._offsets)]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._last


# torch DDP arguments MiniDDP does not implement: what to do instead
_REFUSED = {
    "delay_all_reduce_named_params": "MiniDDP all-reduces every parameter in backward",
    "param_to_hook_all_reduce": "MiniDDP all-reduces every parameter in backward",
    "mixed_precision": "cast the model (module.to(torch.bfloat16)) or use torch.autocast in the "
                       "training loop",
    "device_mesh": "pass the mesh's group: process_group=mesh.get_group()",
    "skip_all_reduce_unused_params": "use find_unused_parameters=True (unused gradients count as "
                                     "zeros)",
    "bucket_cap_mb_list": "use one bucket_cap_mb for every bucket",
    "batched_grad_copy": "MiniDDP copies gradients one parameter at a time",
}


def _reached_params(outputs) -> set[int]:
    """ids of the leaf tensors (parameters) the autograd graph of ``outputs`` reaches."""
    return {id(node.variable) for node in graph_nodes(outputs) if getattr(node, "variable", None) is not None}


class MiniDDP(nn.Module):
    """A data-parallel wrapper small enough to read: its parameters after N steps equal PyTorch DDP's.

    It takes PyTorch DDP's arguments, in DDP's order: positional ``MiniDDP(model, [rank])`` works as
    with DDP.

    Args:
        module: the model, already on this process's device (move it *before* wrapping).
        device_ids: ``None``, ``[]``, or ``[the CUDA device of a CUDA module]``: inputs are then
            moved to that device in ``forward``. A CPU module takes ``None``/``[]`` only — the
            same ``ValueError`` as torch DDP (write ``MiniDDP(model)`` on CPU).
        output_device: stored; outputs stay where the module puts them (as with DDP on one device).
        dim: stored for compatibility (DDP only used it to scatter over several devices).
        broadcast_buffers: deprecated name of ``forward_sync_buffers`` (``FutureWarning``, as
            in PyTorch 2.13+); ``False`` also leaves the buffers out of the initial broadcast.
        init_sync: broadcast rank 0's parameters and buffers at construction (default ``True``).
        process_group: the group to average over (default: the default group).
        bucket_cap_mb: ``None``: one blocking all-reduce per gradient, inside its hook (simple, no
            overlap — *unlike* DDP, whose ``None`` means 25 MB). A number: gradients are packed, in
            reverse registration order (roughly the order backward produces them), into buckets of
            at most this many MB, each all-reduced asynchronously as soon as all its gradients
            are ready.
        find_unused_parameters: allow parameters that get no gradient on some or all ranks. As in
            DDP, a missing gradient counts as zeros in the average; a parameter unused on *every*
            rank keeps its ``.grad`` untouched. Without it such a parameter raises a
            ``RuntimeError`` naming it, on every rank (never a hang).
        check_reduction: deprecated in DDP, ignored (``FutureWarning``).
        gradient_as_bucket_view: after the first synced backward each ``.grad`` is a view into its
            bucket (no second copy of the gradients), as in DDP; needs ``bucket_cap_mb``.
        static_graph: accepted: a promise that the graph is the same every step. MiniDDP
            optimises nothing for it; unused parameters are handled as with
            ``find_unused_parameters=True`` (DDP finds them in the first step).
        forward_sync_buffers: broadcast rank 0's buffers (e.g. BatchNorm running statistics) at
            the start of every forward (default, as DDP's).
        trace: record a :class:`StepTrace` per synced backward in ``self.traces`` (timeline plots).

    Other DDP arguments (``mixed_precision``, ``device_mesh``, ...) raise ``NotImplementedError``
    saying what to do instead; :meth:`register_comm_hook` takes DDP's hooks; ``Join`` is refused
    (give every rank the same number of batches).

    **Averaging order.** Without buckets each gradient is all-reduced (summed) and then divided by
    the world size N once; with buckets it is divided first, as torch's DDP does (measured: it
    multiplies by ``1/N`` before its all-reduce — in fp16 the sum of averages cannot overflow where
    the sum could). With 2 ranks — any power of two — dividing is exact, so both orders give the
    same bits, and the parameters equal torch DDP's bit for bit, tied weights, frozen parameters and
    uneven buckets included (tested). With 3 ranks they differ by up to a rounding of the gradient
    per step. Neither equals one process on the whole batch bit for bit: there one matmul sums the
    batch, here each rank's partial sums are added (``rtol=1e-5, atol=1e-6`` after a few steps).

    Example::

        >>> import torch, gpucourse as gc
        >>> def train(rank, world_size):
        ...     torch.manual_seed(rank)                       # different init per rank ...
        ...     model = gc.MiniDDP(torch.nn.Linear(4, 2), bucket_cap_mb=1)
        ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     x = torch.randn(8, 4)                         # ... and different data
        ...     model(x).square().mean().backward()           # gradients averaged here
        ...     opt.step()
        ...     return model.module.weight.detach()
        >>> w0, w1 = gc.launch(train, 2)
        >>> torch.equal(w0, w1)                              # ... yet identical replicas
        True

    .. warning::
        Every rank must run the same number of synced backward passes: the all-reduces inside
        backward are collectives. A rank that skips a step (uneven data per rank, an
        ``if rank == 0:`` around the backward) leaves the others waiting — with a
        ``DistributedSampler`` every rank gets the same number of batches.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True, process_group=None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, *, forward_sync_buffers: bool | None = None,
                 trace: bool = False, **torch_only):
        super().__init__()
        for name, value in torch_only.items():
            if name not in _REFUSED:
                raise TypeError(f"MiniDDP got an unexpected keyword argument {name!r}")
            if value not in (None, False):
                raise NotImplementedError(f"MiniDDP does not implement torch DDP's {name}={value!r}: "
                                          f"{_REFUSED[name]}")
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool)
                                          or not isinstance(bucket_cap_mb, (int, float))
                                          or not bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be None or a number > 0, got {bucket_cap_mb!r}")
        if gradient_as_bucket_view and bucket_cap_mb is None:
            raise ValueError("gradient_as_bucket_view=True makes each .grad a view into its bucket: "
                             "give MiniDDP buckets, e.g. bucket_cap_mb=25 (torch DDP's default)")
        _require_group(process_group)
        self._params = [p for p in module.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("module has no parameter that requires a gradient: nothing to average")
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device (one device per process), got "
                             f"{sorted(map(str, devices))}")
        # device_ids / output_device: PyTorch DDP's rules and messages
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element.")
        device = next(iter(devices))
        if not device_ids or device.type == "cpu":
            if device_ids or output_device:
                raise ValueError(
                    "DistributedDataParallel device_ids and output_device arguments only work with "
                    "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                    f"{device_ids}, output_device {output_device}, and module parameters {devices}. "
                    "(MiniDDP as torch DDP: a CPU module takes device_ids=None.)")
            self.device_ids, self.output_device = None, None
        else:
            self.device_ids = [torch.device(device.type, d) if isinstance(d, int) else torch.device(d)
                               for d in device_ids]
            self.output_device = self.device_ids[0] if output_device is None else output_device
        self.dim = dim
        if check_reduction:
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is "
                          "deprecated. Please avoid using it.", FutureWarning, stacklevel=2)
        # broadcast_buffers (deprecated) / forward_sync_buffers: PyTorch 2.13+'s rules
        if broadcast_buffers is not None:
            warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead."
                          if forward_sync_buffers is None else
                          "Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                          "`broadcast_buffers` is deprecated and its value is ignored when "
                          "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=2)
        if forward_sync_buffers is not None:
            init_sync_buffers = True
        else:
            forward_sync_buffers = init_sync_buffers = (True if broadcast_buffers is None
                                                        else bool(broadcast_buffers))
        self.module = module
        self.device = device
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.bucket_cap_mb = bucket_cap_mb
        self.forward_sync_buffers = forward_sync_buffers
        self.find_unused_parameters = bool(find_unused_parameters)
        self.static_graph = bool(static_graph)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.require_backward_grad_sync = True
        self.trace = trace
        self.traces: list[StepTrace] = []
        self._root = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        self._names = {id(p): n for n, p in module.named_parameters()}
        if init_sync:
            # 0) the same model everywhere (torch's DDP checks it too): tensors whose shapes differ
            #    between ranks would make the broadcasts below wait forever
            same_on_every_rank("MiniDDP: the model's parameters and buffers (name, shape)",
                                [(n, tuple(t.shape)) for n, t in [*module.named_parameters(),
                                                                  *module.named_buffers()]],
                                process_group)
            # 1) same start everywhere: rank 0's parameters and buffers overwrite everyone's
            with torch.no_grad():
                for tensor in [*module.parameters(), *(module.buffers() if init_sync_buffers else ())]:
                    dist.broadcast(tensor, src=self._root, group=process_group)
        # 2) + 3) buckets and hooks; unused parameters need buckets (their flags travel with the
        #    gradients): without bucket_cap_mb, one bucket per parameter
        self._allow_unused = self.find_unused_parameters or self.static_graph
        if bucket_cap_mb is not None:
            self._buckets = self._make_buckets(bucket_cap_mb * 2**20)
        elif self._allow_unused:
            self._buckets = self._make_buckets(0)
        else:
            self._buckets = []
        self._where = {}                                # id(param) -> (bucket index, position)
        for b, bucket in enumerate(self._buckets):
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (b, i)
        self._next_bucket = 0                           # buckets are launched in this order
        self._ready: set[int] = set()                   # ids of params whose gradient is ready
        self._unreached: list[nn.Parameter] = []        # no buckets: params no rank's forward used
        self._used_unsynced: set[int] = set()           # ids of params used in no_sync() micro-batches
        self._sync_buffers_next = True
        self._finish = EndOfBackward(self._finish_backward)   # at the end of each synchronised backward
        self._comm_hook = None                          # (state, hook) from register_comm_hook
        self._step: StepTrace | None = None
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    # --- construction ------------------------------------------------------------------------

    def _make_buckets(self, cap: float) -> list[_Bucket]:
        buckets, current, size = [], [], 0
        for p in reversed(self._params):               # the last layer's gradients come first
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > cap or p.dtype != current[0].dtype):
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        buckets.append(current)
        out = []
        for params in buckets:
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += p.numel()
            buffer = torch.zeros(total + len(params), dtype=params[0].dtype, device=params[0].device)
            out.append(_Bucket(params, offsets, buffer, numel=total))
        return out

    def register_comm_hook(self, state: object, hook) -> None:
        """Replace the bucket's all-reduce by ``hook(state, bucket) -> torch.futures.Future``.

        As with torch DDP: the hook gets a :class:`GradBucket` whose ``buffer()`` holds this rank's
        *un-averaged* gradients, must return a future whose value (a tensor, or a list holding
        one) is the reduced buffer, copied back into the gradients. Call it once, before
        training. Needs buckets (``bucket_cap_mb``; torch DDP always has them).

        Example::

            >>> import torch, torch.distributed as dist, gpucourse as gc
            >>> def mean_hook(state, bucket):
            ...     buf = bucket.buffer().div_(dist.get_world_size())
            ...     return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
            >>> def train(rank, world_size):
            ...     model = gc.MiniDDP(torch.nn.Linear(3, 1), bucket_cap_mb=25)
            ...     model.register_comm_hook(None, mean_hook)
            ...     model(torch.full((2, 3), float(rank))).sum().backward()
            ...     return model.module.weight.grad
            >>> gc.launch(train, 2)
            [tensor([[1., 1., 1.]]), tensor([[1., 1., 1.]])]
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if not self._buckets:
            raise RuntimeError("register_comm_hook needs buckets: wrap with MiniDDP(..., bucket_cap_mb=25) "
                               "(torch DDP's default); without buckets MiniDDP all-reduces each "
                               "gradient itself")
        self._comm_hook = (state, hook)

    # --- Join (uneven inputs): refused -------------------------------------------------------

    def join_hook(self, **kwargs):
        raise NotImplementedError(
            "MiniDDP does not support torch.distributed.algorithms.Join (uneven inputs per rank): "
            "give every rank the same number of batches (DistributedSampler(..., drop_last=True), or "
            "the minimum count agreed with an all_reduce(MIN)), or use torch DDP for Join")

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return self.process_group

    # --- forward -------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._finish.pending and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self._abandon_unfinished()                  # the last backward never reached its end
        # buffers: like DDP, broadcast before a forward that follows a synchronised training
        # forward — so once per step, or once per accumulation cycle (at its first micro-batch)
        if self.forward_sync_buffers and self._sync_buffers_next:
            with torch.no_grad():
                for buf in self.module.buffers():
                    dist.broadcast(buf, src=self._root, group=self.process_group)
        if self.device_ids:                             # DDP moves the inputs to its device
            to = self.device_ids[0]
            args, kwargs = tree_map(lambda t: t.to(to) if isinstance(t, torch.Tensor) else t,
                                    (args, kwargs))
        out = self.module(*args, **kwargs)
        syncing = torch.is_grad_enabled() and self.require_backward_grad_sync
        self._sync_buffers_next = syncing
        outputs = [t for t in output_tensors(out) if t.requires_grad]
        if syncing and outputs:
            if not self._buckets:
                self._check_same_params_used(out)
            if self._buckets or self._unreached:        # finish even where no parameter is used
                for t in outputs:
                    t.register_hook(self._queue_finish)
        if self.trace and self.require_backward_grad_sync and isinstance(out, torch.Tensor) \
                and out.requires_grad:
            self._step = StepTrace()
            out.register_hook(self._mark_backward_start)
        return out

    def _check_same_params_used(self, out) -> None:
        """No buckets: each gradient is all-reduced alone, so every rank must produce the same
        gradients. One small all-reduce per forward checks it (no hang, no mismatched pairs)."""
        reached = _reached_params(out)
        used = torch.tensor([id(p) in reached for p in self._params], dtype=torch.int32,
                            device=self.device)
        counts = used.clone()
        dist.all_reduce(counts, group=self.process_group)
        differ = [self._names.get(id(p), "?") for p, c in zip(self._params, counts.tolist())
                  if 0 < c < self.world_size]
        # used by no rank's forward: checked at the end of backward, where a gradient may still
        # arrive (a weight read outside forward, e.g. in the loss); DDP, too, refuses one that never does
        self._unreached = [p for p, c in zip(self._params, counts.tolist()) if c == 0]
        if differ:
            raise RuntimeError(
                f"MiniDDP: parameter(s) {differ} take part in this forward on some ranks only "
                f"(on this rank: {[bool(u) for u in used.tolist()]}); their gradients cannot be "
                "averaged. Pass find_unused_parameters=True (missing gradients count as zeros, as "
                "in torch DDP) or use every parameter on every rank.")

    def _mark_backward_start(self, grad):
        if self._step is not None and self._step.backward_start is None:
            self._step.backward_start = time.perf_counter()

    # --- backward: hooks -----------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Inside this context, backward only accumulates gradients locally (no communication).

        The first backward *after* the context all-reduces the accumulated gradients.

        Example::

            >>> import torch, gpucourse as gc
            >>> def accumulate(rank, world_size):
            ...     model = gc.MiniDDP(torch.nn.Linear(3, 1))
            ...     x = torch.randn(4, 3)
            ...     with model.no_sync():
            ...         model(x[:2]).sum().backward()        # local only
            ...     model(x[2:]).sum().backward()            # sum of both, averaged once
            ...     return model.module.weight.grad
            >>> g0, g1 = gc.launch(accumulate, 2)
            >>> torch.equal(g0, g1)
            True
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _queue_finish(self, grad=None):
        if self.require_backward_grad_sync:
            self._finish.arm()                         # once per backward, at the outermost one's end

    def _abandon_unfinished(self) -> None:
        """The last backward raised halfway (an error in autograd, a KeyboardInterrupt), so its
        finish never ran. Wait for the buckets it launched (every rank that failed alike launched the
        same ones), then start clean, so that the next backward's gradients are not mixed with the
        dead one's slots. torch DDP refuses the next forward instead ("Expected to have finished
        reduction in the prior iteration")."""
        try:
            for bucket in self._buckets[: self._next_bucket]:
                (bucket.future or bucket.work).wait()   # one that failed raises here, once
        finally:
            self._reset_buckets()
            self._finish.forget()

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Runs inside autograd when ``param.grad`` has received this backward's contribution."""
        if not self.require_backward_grad_sync:
            self._used_unsynced.add(id(param))         # its local sum goes into the next sync
            return
        self._queue_finish()
        if not self._buckets:                          # no buckets: average this one now
            self._ready.add(id(param))
            start = time.perf_counter()
            dist.all_reduce(param.grad, group=self.process_group)
            param.grad.div_(self.world_size)
            if self._step is not None:
                self._step.comms.append(("1 param", param.grad.numel() * param.grad.element_size(),
                                         start, time.perf_counter()))
            return
        if id(param) in self._ready:
            return
        self._fill_slot(param)
        self._launch_full()

    def _fill_slot(self, param: nn.Parameter) -> None:
        """Put this rank's gradient of ``param`` into its bucket, flagged as used here."""
        b, i = self._where[id(param)]
        bucket = self._buckets[b]
        n = param.numel()
        slot = bucket.buffer[bucket.offsets[i]: bucket.offsets[i] + n]
        if self._comm_hook is not None:                # the hook averages (as with torch DDP)
            slot.copy_(param.grad.reshape(-1))
        else:   # divide first (as DDP does): the sum of averages cannot overflow where the sum could
            torch.div(param.grad.reshape(-1), self.world_size, out=slot)
        bucket.buffer[bucket.numel + i] = 1            # used on this rank
        bucket.ready += 1
        self._ready.add(id(param))

    def _launch_full(self) -> None:
        # launch full buckets strictly in order, so that all ranks issue the same collectives
        while (self._next_bucket < len(self._buckets)
               and self._buckets[self._next_bucket].ready == len(self._buckets[self._next_bucket].params)):
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        if self._comm_hook is not None:
            state, hook = self._comm_hook
            grads = GradBucket(b, bucket.buffer[: bucket.numel], bucket.params, bucket.offsets,
                               b == len(self._buckets) - 1)
            bucket.future = hook(state, grads)
            done = bucket.future
        else:
            bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
            done = bucket.work.get_future()
        if self._step is not None:
            entry = (f"bucket {b}", bucket.numel * bucket.buffer.element_size(),
                     time.perf_counter(), None)
            self._step.comms.append(entry)              # finished time filled in by the future
            index = len(self._step.comms) - 1
            step = self._step

            def finished(_fut, step=step, index=index):
                label, nbytes, launched, _ = step.comms[index]
                step.comms[index] = (label, nbytes, launched, time.perf_counter())

            bucket.traced = done.then(finished)

    def _finish_backward(self) -> None:
        """End of backward: wait for every bucket and copy the averages into ``param.grad``."""
        step, self._step = self._step, None
        if step is not None:
            step.backward_end = time.perf_counter()
        if self._buckets:
            try:
                counts = self._reduce_all_buckets()
            finally:
                self._reset_buckets()
            partly = [self._names.get(id(p), "?") for p, c in counts if 0 < c < self.world_size]
            nowhere = [self._names.get(id(p), "?") for p, c in counts if c == 0]
        else:   # no buckets: the forward's check refused "some ranks"; here "no rank", if still so
            partly = []
            nowhere = [self._names.get(id(p), "?") for p in self._unreached if id(p) not in self._ready]
            self._ready.clear()
            self._used_unsynced.clear()
            self._unreached = []
        if not self._allow_unused and (partly or nowhere):
            where = (f"{partly} received no gradient on some ranks" if partly else "") + \
                    ("; " if partly and nowhere else "") + \
                    (f"{nowhere} received no gradient on any rank" if nowhere else "")
            raise RuntimeError(
                f"MiniDDP: backward finished but parameter(s) {where}. Every parameter must "
                "take part in the loss on every rank, or pass find_unused_parameters=True "
                "(missing gradients count as zeros, as in torch DDP).")
        if step is not None:
            step.synced = time.perf_counter()
            self.traces.append(step)

    def _reduce_all_buckets(self) -> list[tuple[nn.Parameter, int]]:
        """Launch what is left (unused parameters' slots as zeros), wait, copy back; returns
        (param, number of ranks that used it) for every parameter."""
        for bucket in self._buckets[self._next_bucket:]:
            for i, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
                if id(p) in self._ready:
                    continue
                if id(p) in self._used_unsynced and p.grad is not None:
                    self._fill_slot(p)                 # used in a no_sync() micro-batch only: its
                else:                                  # local sum counts, as with DDP
                    bucket.buffer[offset: offset + p.numel()].zero_()      # unused here: zeros, flag 0
                    bucket.ready += 1
        self._used_unsynced.clear()
        self._launch_full()
        if self._comm_hook is not None:                # the flags travel in one extra all-reduce
            flags = torch.cat([b.buffer[b.numel:] for b in self._buckets])
            dist.all_reduce(flags, group=self.process_group)
            at = 0
            for b in self._buckets:
                k = len(b.params)
                b.buffer[b.numel:].copy_(flags[at: at + k])
                at += k
        counts = []
        for bucket in self._buckets:
            if bucket.future is not None:
                value = bucket.future.wait()
                value = value[0] if isinstance(value, (list, tuple)) else value
                if value.data_ptr() != bucket.buffer.data_ptr():
                    bucket.buffer[: bucket.numel].copy_(value.reshape(-1))
            else:
                bucket.work.wait()
            if bucket.traced is not None:
                bucket.traced.wait()                    # its finish time is recorded
            used = bucket.buffer[bucket.numel:].tolist()
            for i, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
                c = round(used[i])
                counts.append((p, c))
                if c == 0:                             # unused everywhere: .grad untouched (DDP)
                    continue
                view = bucket.buffer[offset: offset + p.numel()].view_as(p)
                if self.gradient_as_bucket_view:
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view                   # from now on .grad lives in the bucket
                elif p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
        return counts

    def _reset_buckets(self) -> None:
        for bucket in self._buckets:
            bucket.ready = 0
            bucket.work = bucket.traced = bucket.future = None
            bucket.buffer[bucket.numel:].zero_()
        self._next_bucket = 0
        self._ready.clear()

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, bucket_cap_mb={self.bucket_cap_mb}, "
                f"buckets={len(self._buckets)}")
