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

Not done here (DDP does): ``find_unused_parameters``, ``static_graph``, gradient-as-bucket-view,
communication hooks, mixed devices. Every parameter must receive a gradient in every backward.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .collectives import _same_on_every_rank
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
    buffer: torch.Tensor                       # flat, the concatenated gradients
    ready: int = 0                             # how many of params have reported a gradient
    work: object = None                        # the async all-reduce, once launched
    traced: object = None                      # future that records the finish time (trace=True)


class MiniDDP(nn.Module):
    """A data-parallel wrapper small enough to read: its parameters after N steps equal PyTorch DDP's.

    Args:
        module: the model, already on this process's device (move it *before* wrapping).
        bucket_cap_mb: ``None``: one blocking all-reduce per gradient, inside its hook (simple, no
            overlap). A number: gradients are packed, in reverse registration order (roughly the
            order backward produces them), into buckets of at most this many MB, each all-reduced
            asynchronously as soon as all its gradients are ready.
        forward_sync_buffers: broadcast rank 0's buffers (e.g. BatchNorm running statistics) at
            the start of every forward, like DDP's default (called ``broadcast_buffers`` before
            PyTorch 2.13).
        process_group: the group to average over (default: the default group).
        trace: record a :class:`StepTrace` per synced backward in ``self.traces`` (timeline plots).

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

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | None = None,
                 forward_sync_buffers: bool = True, process_group=None, trace: bool = False):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool)
                                          or not isinstance(bucket_cap_mb, (int, float))
                                          or not bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be None or a number > 0, got {bucket_cap_mb!r}")
        _require_group(process_group)
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.bucket_cap_mb = bucket_cap_mb
        self.forward_sync_buffers = forward_sync_buffers
        self.require_backward_grad_sync = True
        self.trace = trace
        self.traces: list[StepTrace] = []
        self._root = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        self._params = [p for p in module.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("module has no parameter that requires a gradient: nothing to average")
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device (one device per process), got "
                             f"{sorted(map(str, devices))}")
        # 0) the same model everywhere (torch's DDP checks it too): tensors whose shapes differ
        #    between ranks would make the broadcasts below wait forever
        _same_on_every_rank("MiniDDP: the model's parameters and buffers (name, shape)",
                            [(n, tuple(t.shape)) for n, t in [*module.named_parameters(),
                                                              *module.named_buffers()]], process_group)
        # 1) same start everywhere: rank 0's parameters and buffers overwrite everyone's
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=self._root, group=process_group)
        # 2) + 3) buckets and hooks
        self._buckets = self._make_buckets() if bucket_cap_mb is not None else []
        self._where = {}                                # id(param) -> (bucket index, position)
        for b, bucket in enumerate(self._buckets):
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (b, i)
        self._next_bucket = 0                           # buckets are launched in this order
        self._ready: set[int] = set()                   # ids of params whose gradient is ready
        self._sync_buffers_next = True
        self._callback_queued = False
        self._step: StepTrace | None = None
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    # --- construction ------------------------------------------------------------------------

    def _make_buckets(self) -> list[_Bucket]:
        cap = self.bucket_cap_mb * 2**20
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
            buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
            out.append(_Bucket(params, offsets, buffer))
        return out

    # --- forward -------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        # buffers: like DDP, broadcast before a forward that follows a synchronised training
        # forward — so once per step, or once per accumulation cycle (at its first micro-batch)
        if self.forward_sync_buffers and self._sync_buffers_next:
            with torch.no_grad():
                for buf in self.module.buffers():
                    dist.broadcast(buf, src=self._root, group=self.process_group)
        out = self.module(*args, **kwargs)
        self._sync_buffers_next = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self.trace and self.require_backward_grad_sync and isinstance(out, torch.Tensor) \
                and out.requires_grad:
            self._step = StepTrace()
            out.register_hook(self._mark_backward_start)
        return out

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

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Runs inside autograd when ``param.grad`` has received this backward's contribution."""
        if not self.require_backward_grad_sync:
            return
        if not self._callback_queued:                  # once per backward: finish at its end
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if not self._buckets:                          # no buckets: average this one now
            start = time.perf_counter()
            dist.all_reduce(param.grad, group=self.process_group)
            param.grad.div_(self.world_size)
            if self._step is not None:
                self._step.comms.append(("1 param", param.grad.numel() * param.grad.element_size(),
                                         start, time.perf_counter()))
            return
        b, i = self._where[id(param)]
        bucket = self._buckets[b]
        n = param.numel()
        # divide first (as DDP does): the sum of averages cannot overflow where the sum could
        torch.div(param.grad.reshape(-1), self.world_size,
                  out=bucket.buffer[bucket.offsets[i]: bucket.offsets[i] + n])
        bucket.ready += 1
        self._ready.add(id(param))
        # launch full buckets strictly in order, so that all ranks issue the same collectives
        while (self._next_bucket < len(self._buckets)
               and self._buckets[self._next_bucket].ready == len(self._buckets[self._next_bucket].params)):
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        if self._step is not None:
            entry = (f"bucket {b}", bucket.buffer.numel() * bucket.buffer.element_size(),
                     time.perf_counter(), None)
            self._step.comms.append(entry)              # finished time filled in by the future
            index = len(self._step.comms) - 1
            step = self._step

            def finished(_fut, step=step, index=index):
                label, nbytes, launched, _ = step.comms[index]
                step.comms[index] = (label, nbytes, launched, time.perf_counter())

            bucket.traced = bucket.work.get_future().then(finished)

    def _finish_backward(self) -> None:
        """End of backward: wait for every bucket and copy the averages into ``param.grad``."""
        self._callback_queued = False
        step, self._step = self._step, None
        if step is not None:
            step.backward_end = time.perf_counter()
        if self._buckets:
            if self._next_bucket < len(self._buckets):
                names = {id(p): n for n, p in self.module.named_parameters()}
                unused = [names.get(id(p), "?") for b in self._buckets for p in b.params
                          if id(p) not in self._ready]
                for bucket in self._buckets[: self._next_bucket]:
                    bucket.work.wait()                 # leave no collective half-done
                self._reset_buckets()
                raise RuntimeError(
                    f"MiniDDP: backward finished but parameter(s) {unused} received no gradient, so "
                    "their bucket was never all-reduced. Every parameter must take part in the loss "
                    "on every rank (remove unused parameters, or use torch DDP with "
                    "find_unused_parameters=True).")
            for bucket in self._buckets:
                bucket.work.wait()
                if bucket.traced is not None:
                    bucket.traced.wait()                # its finish time is recorded
                for p, offset in zip(bucket.params, bucket.offsets):
                    p.grad.copy_(bucket.buffer[offset: offset + p.numel()].view_as(p.grad))
            self._reset_buckets()
        if step is not None:
            step.synced = time.perf_counter()
            self.traces.append(step)

    def _reset_buckets(self) -> None:
        for bucket in self._buckets:
            bucket.ready = 0
            bucket.work = bucket.traced = None
        self._next_bucket = 0
        self._ready.clear()

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, bucket_cap_mb={self.bucket_cap_mb}, "
                f"buckets={len(self._buckets)}")


